"""`ggufspec serve` times `--draft auto`'s step costs before it serves (issue 29): the first request of a
new server does not wait for them, and the next server reads them from costs.json."""
import json

import httpx

from serverproc import serving

TIMED = "ggufspec: timed the step costs"


def ask(server) -> dict:
    body = {"messages": [{"role": "user", "content": "count: 1 2 3 4 5 6 7 8"}], "max_tokens": 24, "temperature": 0}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_costs_are_timed_before_serving_and_remembered(tmp_path, chat_pair):
    target, draft = chat_pair
    with serving(tmp_path, "-m", str(target), "-md", str(draft)) as server:
        log = server.log.read_text()
        assert TIMED in log and log.index(TIMED) < log.index("ggufspec: serving"), log
        first = ask(server)
    # the first answer priced its drafts with the costs timed at startup (their sizes reach 64, which
    # a request's own measuring never times), and it measured nothing itself: one line in the log
    target_ms = first["ggufspec"]["stats"]["costs"]["target_ms"]
    assert {"1", "16", "64"} <= set(target_ms), target_ms
    assert server.log.read_text().count(TIMED) == 1
    remembered = json.loads((tmp_path / "home" / "costs.json").read_text())
    entry = next(iter(remembered.values()))
    assert {"model", "lookup", "hybrid"} <= set(entry), entry  # the target's T(n) serve every drafter
    # the next server on this machine starts from costs.json: nothing to time
    with serving(tmp_path, "-m", str(target), "-md", str(draft)) as again:
        assert TIMED not in again.log.read_text()
        assert ask(again)["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


def test_nothing_is_timed_for_the_target_alone(tmp_path, chat_pair):
    target, _ = chat_pair
    with serving(tmp_path, "-m", str(target), "--no-draft", "--draft", "0") as server:
        ask(server)
        assert TIMED not in server.log.read_text()
