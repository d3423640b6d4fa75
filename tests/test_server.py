"""`ggufspec serve` as a real process on loopback, spoken to with the official openai client and httpx.

Two servers per module: `server` (the tiny pair, defaults) for answers, usage and errors, and
`busy_server` (a slower target with no end-of-sequence, --max-queue 0, --api-key) for the queue,
disconnects and authentication. References come from an in-process SpeculativeDecoder on the same files.
"""
from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time

import httpx
import openai
import pytest

from ggufspec import SpeculativeDecoder
from serverproc import pair_server_fixture, start_server, stop_server, wait_idle

API_KEY = "sesame"


server = pair_server_fixture("-c", "512")


@pytest.fixture(scope="module")
def busy_server(slow_target, tmp_path_factory):
    running = start_server(tmp_path_factory.mktemp("busy"), "-m", str(slow_target), "--no-draft", "-c", "2048",
                           "--parallel", "1", "--max-queue", "0", "--api-key", API_KEY)
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def reference(chat_pair):
    """The same files in this process: what the server must answer."""
    target, draft = chat_pair
    with SpeculativeDecoder(target, draft, n_ctx=512, n_threads=1) as decoder:
        yield decoder


def chunks_of(stream) -> tuple[str, list[int], list]:
    """Text, token ids (from the ggufspec extension) and the chunks of a streamed answer."""
    chunks = list(stream)
    text, tokens = "", []
    for chunk in chunks:
        if chunk.choices:
            choice = chunk.choices[0]
            text += (choice.delta.content or "") if hasattr(choice, "delta") else choice.text
        pieces = (getattr(chunk, "ggufspec", None) or {}).get("pieces", [])
        tokens += [p["token"] for p in pieces]
        assert "".join(p["text"] for p in pieces) == (
            (chunk.choices[0].delta.content or "") if chunk.choices and hasattr(chunk.choices[0], "delta")
            else chunk.choices[0].text if chunk.choices else "")
    return text, tokens, chunks


# ---------------------------------------------------------------- answers

def test_models_and_health(server):
    assert [m.id for m in server.client().models.list()] == ["target"]
    health = server.health()
    assert health["status"] == "ok" and health["busy"] is False


def test_greedy_completion_is_what_run_gives(server, chat_pair):
    from click.testing import CliRunner

    from ggufspec.cli import main
    target, draft = chat_pair
    result = CliRunner().invoke(main, ["run", "-m", str(target), "-md", str(draft), "-p", "the cat", "-n", "24",
                                       "-c", "512", "-t", "1", "--json"])
    assert result.exit_code == 0, result.output
    expected = json.loads(result.output.splitlines()[-1])
    client = server.client()
    whole = client.completions.create(model="target", prompt="the cat", max_tokens=24, temperature=0)
    assert whole.choices[0].text == expected["text"]
    assert whole.choices[0].finish_reason == "length"
    text, tokens, _ = chunks_of(client.completions.create(model="target", prompt="the cat", max_tokens=24,
                                                          temperature=0, stream=True))
    assert (text, tokens) == (expected["text"], expected["tokens"])


def test_greedy_chat_streamed_and_not(server, reference):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the dog sat on the mat"}]
    expected = reference.chat(messages, n_predict=20)
    client = server.client()
    whole = client.chat.completions.create(model="target", messages=messages, max_tokens=20, temperature=0)
    assert whole.choices[0].message.content == expected.text
    assert whole.choices[0].message.role == "assistant"
    text, tokens, chunks = chunks_of(client.chat.completions.create(model="target", messages=messages,
                                                                    max_tokens=20, stream=True))
    assert (text, tokens) == (expected.text, expected.tokens)
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [p for c in chunks for p in (getattr(c, "ggufspec", None) or {}).get("pieces", [])]
    assert all(isinstance(p["from_draft"], bool) and p["step"] >= 1 and p["drafted"] >= 0 for p in pieces[1:])
    assert (pieces[0]["step"], pieces[0]["from_draft"]) == (0, False)  # the prompt's own batch decides it
    assert [p["step"] for p in pieces] == sorted(p["step"] for p in pieces)


def test_seeded_sampling_reproduces(server, reference):
    options = {"temperature": 0.9, "seed": 42, "max_tokens": 24, "extra_body": {"draft": 3}}
    client = server.client()
    first = client.completions.create(model="target", prompt="the cat", **options).choices[0].text
    client.completions.create(model="target", prompt="a dog ran", max_tokens=8)  # something else in between
    second = client.completions.create(model="target", prompt="the cat", **options).choices[0].text
    assert first == second
    expected = reference.generate("the cat", n_predict=24, n_draft=3, temperature=0.9, seed=42)
    assert first == expected.text


def test_usage_and_timings_and_the_cache(server):
    client = server.client()
    conversation = [{"role": "user", "content": "hi"}]
    one = client.chat.completions.create(model="target", messages=conversation, max_tokens=16)
    conversation += [{"role": "assistant", "content": one.choices[0].message.content},
                     {"role": "user", "content": "hello there"}]
    two = client.chat.completions.create(model="target", messages=conversation, max_tokens=16)
    for answer in (one, two):
        usage, timings = answer.usage, answer.timings
        assert usage.completion_tokens == timings["predicted_n"]
        assert (usage.completion_tokens == 16) == (answer.choices[0].finish_reason == "length")
        assert usage.prompt_tokens == timings["cache_n"] + timings["prompt_n"]
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert 0 <= timings["draft_n_accepted"] <= timings["draft_n"]
        assert timings["predicted_per_second"] > 0
        assert usage.prompt_tokens_details.cached_tokens == timings["cache_n"]
    # turn two evaluates only what is new: turn one's prompt is in the cache
    assert two.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens - 1
    stream = client.chat.completions.create(model="target", messages=conversation, max_tokens=16, stream=True,
                                            stream_options={"include_usage": True})
    _, tokens, chunks = chunks_of(stream)
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == two.choices[0].finish_reason
    assert finish[0].timings["predicted_n"] == len(tokens) == two.usage.completion_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == two.usage.prompt_tokens - 1  # the same prompt


def test_cache_prompt_false_evaluates_the_whole_prompt_again(server):
    """llama-server's `cache_prompt`: false evaluates the prompt whole, whatever the cache holds, and
    the answer is the same; the next request reuses the cache again."""
    client = server.client()
    messages = [{"role": "user", "content": "tell me about cats and dogs"}]
    first = client.chat.completions.create(model="target", messages=messages, max_tokens=12)
    again = client.chat.completions.create(model="target", messages=messages, max_tokens=12,
                                           extra_body={"cache_prompt": False})
    assert again.timings["cache_n"] == 0 and again.timings["prompt_n"] == again.usage.prompt_tokens
    assert again.choices[0].message.content == first.choices[0].message.content
    cached = client.chat.completions.create(model="target", messages=messages, max_tokens=12)
    assert cached.timings["cache_n"] == cached.usage.prompt_tokens - 1
    # passed through by the other protocols too, as their other llama.cpp fields
    body = {"model": "target", "max_tokens": 12, "messages": messages, "cache_prompt": False}
    answer = httpx.post(server.url + "/v1/messages", json=body, timeout=60).json()
    assert answer["timings"]["cache_n"] == 0 and answer["content"][0]["text"] == first.choices[0].message.content


def test_stop_strings(server, reference):
    expected = reference.generate("the cat", n_predict=40).text
    stop = next(expected[i:i + 2] for i in range(8, len(expected) - 2) if expected.find(expected[i:i + 2]) == i
                and expected[i:i + 2].isprintable())
    cut = expected.find(stop)
    client = server.client()
    for stops in (stop, [stop, "never in there \u2603"]):
        whole = client.completions.create(model="target", prompt="the cat", max_tokens=40, stop=stops)
        assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected[:cut], "stop")
        text, _, chunks = chunks_of(client.completions.create(model="target", prompt="the cat", max_tokens=40,
                                                              stop=stops, stream=True))
        assert text == expected[:cut]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_stop_filter_holds_pieces_back_and_trims_the_one_a_stop_starts_in():
    from ggufspec.stops import StopFilter, cut_at_stop

    def run(pieces, stops):
        stop_filter = StopFilter(stops)
        out = []
        for i, text in enumerate(pieces):
            out.append([p["text"] for p in stop_filter.push({"text": text, "token": i})])
            if stop_filter.stopped:
                break
        else:
            out.append([p["text"] for p in stop_filter.flush()])
        return out, stop_filter.stopped
    # "at s" waits: its "s" may begin "sat on"; once it does, the piece goes out cut before it
    pieces = ["the c", "at s", "at on", " the mat"]
    assert run(pieces, ["sat on", "never"]) == ([["the c"], [], ["at "]], True)
    assert cut_at_stop("".join(pieces), ["sat on", "never"]) == "the cat "
    # no stop string after all: the held piece goes out whole, with the next
    assert run(["a sa", "t by", "e"], ["sat on"]) == ([[], ["a sa", "t by"], ["e"], []], False)


def test_eight_concurrent_clients(server, reference):
    prompts = ["the cat", "a dog", "the mat", "def x", "if y", "the dog sat", "for x in", "return x"]
    expected = [reference.generate(p, n_predict=16).text for p in prompts]

    def ask(i):
        client = server.client()
        if i % 2:
            return chunks_of(client.completions.create(model="target", prompt=prompts[i], max_tokens=16,
                                                       stream=True))[0]
        return client.completions.create(model="target", prompt=prompts[i], max_tokens=16).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    assert answers == expected


# ---------------------------------------------------------------- errors: status, OpenAI's shape, still serving

def post(server, path, body, **kwargs):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=30, **kwargs)


@pytest.mark.parametrize("path, body, status, message", [
    ("/v1/completions", '{"prompt": "the cat", "max_tokens": ', 400, "malformed JSON"),
    ("/v1/completions", "[1, 2]", 400, ""),
    ("/v1/completions", {"prompt": "the cat", "model": "gpt-4o"}, 404, "gpt-4o"),
    ("/v1/completions", {"prompt": "the cat " * 300}, 400, "512"),
    ("/v1/completions", {"prompt": "the cat", "top_p": 5}, 400, "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": "the cat", "temperature": -2}, 400, "temperature must be >= 0"),
    ("/v1/completions", {"prompt": "the cat", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "the cat", "min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {"prompt": "the cat", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "the cat", "seed": -5}, 400, "seed"),
    ("/v1/completions", {"prompt": "the cat", "n": 0}, 400, "n: "),
    ("/v1/completions", {"prompt": "the cat", "n": 17}, 400, "n: "),
    ("/v1/completions", {"prompt": "the cat", "draft": -1}, 400, "draft"),
    ("/v1/completions", {"prompt": "the cat", "speculative": {"p_min": 2}}, 400, "speculative.p_min"),
    ("/v1/completions", {"prompt": "the cat", "lookup": True, "hybrid": True}, 400, "lookup"),
    ("/v1/completions", {"prompt": "the cat", "cache_prompt": "perhaps"}, 400, "cache_prompt"),
    ("/v1/completions", {"prompt": [5, 99999999]}, 400, "token ids"),
    ("/v1/completions", {"prompt": []}, 400, "empty"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text"),
    ("/v1/nothing-here", {}, 404, ""),
])
def test_bad_requests_get_openai_errors_and_the_server_stays_up(server, reference, path, body, status, message):
    for stream in (False, True):
        sent = dict(body, stream=True) if stream and isinstance(body, dict) else body
        response = post(server, path, sent)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert message in error["message"] and error["type"] and "code" in error
    assert server.health()["status"] == "ok"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "the cat", "top_p": 5}, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "min_p": 1.5}, "min_p"),
    ("/v1/completions", {"prompt": "the cat", "speculative": {"p_min": 2}}, "speculative.p_min"),
    ("/v1/responses", {"input": "hi", "top_p": 5}, "top_p"),
])
def test_a_value_out_of_range_names_its_field_in_param_as_the_readme_says(server, path, body, param):
    """The message named the field, `param` was null (README audit); a type error already filled it."""
    error = post(server, path, body).json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error


def test_after_errors_answers_are_still_exact(server, reference):
    post(server, "/v1/completions", {"prompt": "the dog", "top_p": 5})
    post(server, "/v1/completions", {"prompt": "the dog " * 300})
    expected = reference.generate("the dog sat", n_predict=12).text
    assert server.client().completions.create(model="target", prompt="the dog sat",
                                              max_tokens=12).choices[0].text == expected


def test_lenient_about_content_type_and_model_names(server):
    plain = httpx.post(server.url + "/v1/completions", content='{"prompt": "x", "max_tokens": 2}', timeout=30)
    assert plain.status_code == 200  # curl -d sends a form type; llama.cpp's server reads JSON anyway
    for model in (None, "target", "target.gguf"):
        body = {"prompt": "x", "max_tokens": 2, **({"model": model} if model else {})}
        assert post(server, "/v1/completions", body).status_code == 200


# ---------------------------------------------------------------- queue, disconnects, API key

def auth(key=API_KEY):
    return {"Authorization": f"Bearer {key}"}


def test_api_key(busy_server):
    assert busy_server.health()["status"] == "ok"  # /health needs no key
    body = json.dumps({"prompt": "x", "max_tokens": 2})
    for headers in ({}, auth("wrong"), {"Authorization": API_KEY}):
        response = httpx.post(busy_server.url + "/v1/completions", content=body, headers=headers, timeout=30)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(busy_server.url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(busy_server.url + "/props", timeout=10).status_code == 401  # it names the files
    assert httpx.get(busy_server.url + "/props", headers=auth(), timeout=10).json()["model"] == "slow"
    assert httpx.get(busy_server.url + "/slots", timeout=10).status_code == 401  # what each slot holds
    assert len(httpx.get(busy_server.url + "/slots", headers=auth(), timeout=10).json()) == 1
    assert httpx.get(busy_server.url + "/", timeout=10).status_code == 200  # the chat page asks for the key itself
    with pytest.raises(openai.AuthenticationError):
        busy_server.client(api_key="wrong").models.list()
    answer = busy_server.client(api_key=API_KEY).completions.create(model="slow", prompt="x", max_tokens=3)
    assert answer.usage.completion_tokens == 3


def test_queue_full_is_429_and_a_closed_stream_frees_the_server(busy_server):
    body = {"prompt": "x", "max_tokens": 2000, "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", busy_server.url + "/v1/completions", json=body, headers=auth()) as stream:
            assert stream.status_code == 200, stream.read()
            lines = stream.iter_lines()  # kept: dropping a half-read iterator closes the connection
            assert next(lines).startswith("data:")  # generating now
            busy = httpx.post(busy_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                              headers=auth(), timeout=30)
            assert busy.status_code == 429 and int(busy.headers["Retry-After"]) >= 1
            assert busy.json()["error"]["type"] == "rate_limit_error"
    health = wait_idle(busy_server)  # closing the stream stopped the generation
    assert health["last"]["stop_reason"] == "interrupted" and health["last"]["n_predict"] < 2000


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_killed_mid_answer_leaves_the_server_serving(busy_server, slow_target, stream):
    script = (f"import httpx\n"
              f"with httpx.stream('POST', '{busy_server.url}/v1/completions', timeout=60,\n"
              f"                  headers={{'Authorization': 'Bearer {API_KEY}'}},\n"
              f"                  json={{'prompt': 'x', 'max_tokens': 2000, 'stream': {stream}}}) as r:\n"
              f"    print('sent', flush=True)\n"
              f"    for line in r.iter_lines():\n"
              f"        print(line, flush=True)\n")
    client = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        if stream:
            assert client.stdout.readline().strip() == "sent"  # the headers came: generating
        else:
            deadline = time.monotonic() + 10
            while not busy_server.health()["busy"]:
                assert time.monotonic() < deadline
                time.sleep(0.01)
    finally:
        client.kill()
        client.wait()
    health = wait_idle(busy_server)
    assert health["last"]["stop_reason"] == "interrupted" and health["last"]["n_predict"] < 2000
    with SpeculativeDecoder(slow_target, n_ctx=2048, n_threads=1) as decoder:
        expected = decoder.generate("the cat", n_predict=6).text
    answer = busy_server.client(api_key=API_KEY).completions.create(model="slow", prompt="the cat", max_tokens=6)
    assert answer.choices[0].text == expected


def test_loopback_hosts():
    from ggufspec.netaddr import is_loopback
    assert all(map(is_loopback, ["127.0.0.1", "localhost", "::1", "127.0.0.2"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.168.1.4", "example.com"]))


def test_lookup_on_a_server_without_a_draft_model(chat_pair):
    """`serve --no-draft` loads no draft model, yet a request may still ask for lookup drafting (the
    command line's K stays the request's default); without it the target runs alone."""
    from fastapi.testclient import TestClient

    from ggufspec.server import create_app
    with SpeculativeDecoder(chat_pair[0], None, n_ctx=256, n_threads=1) as decoder:
        app = create_app(decoder, model_name="tiny", defaults={"n_draft": 3, "n_predict": 16})
        with TestClient(app) as client:
            answer = client.post("/v1/completions", json={"prompt": "the cat the cat the cat", "lookup": True})
            assert answer.status_code == 200, answer.text
            assert decoder.last_stats.drafter == "lookup" and decoder.last_stats.n_draft == 3
            plain = client.post("/v1/completions", json={"prompt": "the cat the cat the cat"})
            assert plain.status_code == 200, plain.text
            assert decoder.last_stats.drafter == "none"  # no draft model: the target alone
