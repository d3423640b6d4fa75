"""llama-server's serve flags pasted onto `ggufspec serve`: --no-webui, --api-prefix, -to/--timeout,
--slots/--no-slots, --slot-save-path with POST /slots/{id}?action=save|restore|erase, --props,
--threads-http, the accepted -cb/-kvu/--cache-prompt/--no-context-shift, the refused -nocb and
friends, and /metrics' n_decode_total and n_busy_slots_per_decode. The real process on loopback,
raw HTTP; two servers in all (-np 2 with everything on, -np 1 with the endpoints off)."""
from __future__ import annotations

import asyncio
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from click.testing import CliRunner

from ggufspec.cli import main
from ggufspec.server.front import ApiPrefix, Timeouts
from ggufspec.server.slotfiles import pack, unpack, valid_filename
from clierrors import one_line_error
from serverproc import Server, serving, start_server, stop_server

PREFIX = "/llm"
PROMPT = "one two three four five six seven eight nine ten eleven twelve"


def start_prefixed(tmp_path: Path, *args: str) -> Server:
    """`ggufspec serve --port 0 ARGS` under PREFIX: `url` is the origin, without it."""
    return start_server(tmp_path, *args, prefix=PREFIX)


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    return tmp_path_factory.mktemp("slot-saves")


@pytest.fixture(scope="module")
def server(chat_pair, tmp_path_factory, saves):
    """-np 2, everything on, the flags of a pasted llama-server command line among them."""
    target, draft = chat_pair
    running = start_prefixed(tmp_path_factory.mktemp("everything"), "-m", str(target), "-md", str(draft),
                             "--draft", "3", "--temp", "0", "-np", "2", "-c", "1024", "--no-webui",
                             "--api-prefix", PREFIX, "--slot-save-path", str(saves), "--metrics", "--props",
                             "--threads-http", "2", "-to", "2", "-cb", "--cache-prompt", "-kvu",
                             "--no-context-shift", "--jinja", "--no-warmup")
    try:
        yield running
    finally:
        stop_server(running)


@pytest.fixture(scope="module")
def bare(chat_pair, tmp_path_factory):
    """-np 1, the optional endpoints off (the page on, as by default)."""
    target, draft = chat_pair
    with serving(tmp_path_factory.mktemp("bare"), "-m", str(target), "-md", str(draft), "-np", "1",
                 "--no-slots", "--metrics", "-c", "512") as running:
        yield running


def api(server, path: str) -> str:
    return server.url + PREFIX + path


def completion(server, prompt: str = PROMPT, n: int = 6) -> dict:
    answer = httpx.post(api(server, "/completion"), json={"prompt": prompt, "n_predict": n}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def slot_post(server, id_slot, action, body=None) -> httpx.Response:
    query = "" if action is None else f"?action={action}"
    return httpx.post(api(server, f"/slots/{id_slot}{query}"), json=body, timeout=60)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and "\n" not in error["message"]
    return error


# ---------------------------------------------------------------- --api-prefix, --no-webui, --props

def test_every_route_is_under_the_prefix_and_nothing_outside_it(server):
    assert httpx.get(api(server, "/health"), timeout=10).json()["status"] == "ok"
    client = openai.OpenAI(base_url=api(server, "/v1"), api_key="none", max_retries=0, timeout=60)
    answer = client.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=3)
    assert answer.choices[0].message.content is not None
    for outside in ("/health", "/v1/models", "/llmx/v1/models", PREFIX):
        error = error_of(httpx.get(server.url + outside, timeout=10), 404)
        assert f"--api-prefix {PREFIX}" in error["message"]


def test_no_webui_is_a_404_at_the_page_and_its_scripts_and_props_says_so(server):
    for path in ("/", "/static/marked.umd.js"):
        assert httpx.get(api(server, path), timeout=10).status_code == 404
    props = httpx.get(api(server, "/props"), timeout=10).json()
    assert (props["ui"], props["endpoint_slots"], props["endpoint_props"], props["endpoint_metrics"]) == \
        (False, True, True, True)
    assert httpx.post(api(server, "/props"), json={}, timeout=10).json() == {"success": True}


def test_the_page_is_there_by_default_and_the_optional_endpoints_are_501(bare):
    assert httpx.get(bare.url + "/", timeout=10).status_code == 200
    for method, path, flag in (("GET", "/slots", "--no-slots"), ("POST", "/slots/0?action=erase", "--slot-save-path"),
                               ("POST", "/props", "--props")):
        error = error_of(httpx.request(method, bare.url + path, timeout=10), 501)
        assert error["type"] == "not_supported_error" and flag in error["message"]


# ---------------------------------------------------------------- -to/--timeout

def test_a_body_that_stops_coming_is_a_408_after_the_timeout(server):
    check_body_timeout(server, 2)


def check_body_timeout(server, seconds: float) -> None:
    parts = urlsplit(server.url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as conn:
        conn.sendall(f"POST {PREFIX}/completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: 100\r\n\r\n{{\"prompt\":".encode())
        started = time.monotonic()
        reply = b""
        while chunk := conn.recv(65536):  # until the server closes: the 408 says "Connection: close"
            reply += chunk
        reply = reply.decode()
    assert seconds - 0.5 < time.monotonic() - started < seconds + 6
    assert reply.startswith("HTTP/1.1 408") and "--timeout" in reply and "request_timeout" in reply, reply
    assert httpx.get(api(server, "/health"), timeout=10).status_code == 200


def test_a_client_that_reads_nothing_is_cut_off_after_the_timeout():
    """The write side, on the middleware itself: a send that never completes ends within the timeout."""
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"x", "more_body": True})

    async def stuck_send(message):
        if message["type"] == "http.response.body":
            await asyncio.sleep(60)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}
    started = time.monotonic()
    asyncio.run(Timeouts(app, 0.2)({"type": "http", "path": "/", "headers": []}, receive, stuck_send))
    assert time.monotonic() - started < 2


def test_the_prefix_is_taken_off_the_raw_path_too():
    seen = {}

    async def app(scope, receive, send):
        seen.update(path=scope["path"], raw=scope["raw_path"])
    scope = {"type": "http", "path": "/llm/v1/x y", "raw_path": b"/llm/v1/x%20y", "headers": []}
    asyncio.run(ApiPrefix(app, "/llm")(scope, None, None))
    assert seen == {"path": "/v1/x y", "raw": b"/v1/x%20y"}


# ---------------------------------------------------------------- /slots and its actions

def test_save_erase_restore_and_the_restored_slot_is_reused(server, saves):
    first = completion(server)
    slot = first["id_slot"]
    n_cached = next(s["n_cached"] for s in httpx.get(api(server, "/slots"), timeout=10).json() if s["id"] == slot)
    saved = slot_post(server, slot, "save", {"filename": "conversation.bin"}).json()
    assert (saved["id_slot"], saved["filename"], saved["n_saved"]) == (slot, "conversation.bin", n_cached)
    assert saved["n_written"] == (saves / "conversation.bin").stat().st_size and saved["timings"]["save_ms"] >= 0
    assert (saves / "conversation.bin").read_bytes()[12:24] == b"\xff\xff\xff\xff\x01\x00\x00\x00" + \
        n_cached.to_bytes(4, "little")  # llama-server's token layout after llama.cpp's header
    for id_slot in (0, 1):  # nothing cached anywhere: the restore is what the next request finds
        assert slot_post(server, id_slot, "erase").json()["id_slot"] == id_slot
    assert all(s["n_cached"] == 0 for s in httpx.get(api(server, "/slots"), timeout=10).json())
    restored = slot_post(server, 1 - slot, "restore", {"filename": "conversation.bin"}).json()
    assert (restored["id_slot"], restored["n_restored"], restored["n_read"]) == (1 - slot, n_cached, saved["n_written"])
    assert "restore_ms" in restored["timings"]
    again = completion(server)
    assert again["timings"]["cache_n"] >= again["tokens_evaluated"] - 1 > 0 and again["timings"]["prompt_n"] <= 1
    assert again["content"] == first["content"]  # the restored cells are the ones the first answer used
    erased = slot_post(server, again["id_slot"], "erase").json()
    assert erased == {"id_slot": again["id_slot"], "n_erased": n_cached}
    assert completion(server)["timings"]["cache_n"] == 0


def test_the_draft_cache_goes_beside_the_file_and_comes_back_where_it_fits(server, saves):
    """FILENAME.draft holds the draft model's cache (a prefix of the target's tokens): restored with the
    target's, so the restored conversation drafts at once; a draft file of another conversation is passed
    over (the draft catches up) and the answer is the same either way."""
    for id_slot in (0, 1):
        slot_post(server, id_slot, "erase")
    first = completion(server, PROMPT, 8)
    saved = slot_post(server, first["id_slot"], "save", {"filename": "with-draft.bin"}).json()
    assert 0 < saved["n_saved_draft"] <= saved["n_saved"] and (saves / "with-draft.bin.draft").stat().st_size > 0
    for id_slot in (0, 1):
        slot_post(server, id_slot, "erase")
    restored = slot_post(server, 1 - first["id_slot"], "restore", {"filename": "with-draft.bin"}).json()
    assert (restored["n_restored"], restored["n_restored_draft"]) == (saved["n_saved"], saved["n_saved_draft"])
    assert completion(server, PROMPT, 8)["content"] == first["content"]
    other = completion(server, "the cat sat on the mat and", 8)  # another conversation's draft cache
    slot_post(server, other["id_slot"], "save", {"filename": "other.bin"})
    (saves / "with-draft.bin.draft").write_bytes((saves / "other.bin.draft").read_bytes())
    for id_slot in (0, 1):
        slot_post(server, id_slot, "erase")
    mismatched = slot_post(server, 0, "restore", {"filename": "with-draft.bin"}).json()
    assert (mismatched["n_restored"], mismatched["n_restored_draft"]) == (saved["n_saved"], 0)
    assert completion(server, PROMPT, 8)["content"] == first["content"]


@pytest.mark.parametrize("filename", ["../escape.bin", "/etc/passwd", "a/b.bin", "a\\b", "", ".", "x..y", " x",
                                      "x.", "bad\x01name", "a:b", None, 7])
def test_bad_file_names_are_400_before_anything_is_written(server, saves, filename):
    before = sorted(os.listdir(saves))
    body = {} if filename is None else {"filename": filename}
    error = error_of(slot_post(server, 0, "save", body), 400)
    assert "filename" in error["message"].lower() and error["param"] == "filename"
    assert sorted(os.listdir(saves)) == before


@pytest.mark.parametrize("id_slot, action, words", [
    ("2", "erase", "Invalid slot ID"), ("99", "save", "Invalid slot ID"), ("x", "erase", "Invalid slot ID"),
    ("-1", "erase", "Invalid slot ID"), ("0", "load", "Invalid action"), ("0", None, "Invalid action"),
])
def test_bad_slots_and_actions_are_400(server, id_slot, action, words):
    assert words in error_of(slot_post(server, id_slot, action, {"filename": "x.bin"}), 400)["message"]


def test_a_file_that_is_no_slot_state_is_400_and_leaves_the_slot_empty(server, saves):
    (saves / "garbage.bin").write_bytes(b"not a llama.cpp state file" * 10)
    for name, words in (("garbage.bin", "Unable to restore slot"), ("missing.bin", "no file missing.bin")):
        assert words in error_of(slot_post(server, 0, "restore", {"filename": name}), 400)["message"]
    assert httpx.get(api(server, "/slots"), timeout=10).json()[0]["n_cached"] == 0
    assert completion(server, "five six", 2)["tokens_predicted"] == 2  # the server goes on


def test_a_restored_recurrent_slot_is_reused_by_the_next_turn(tmp_path):
    """Mamba: the restored state is reused by a prompt that continues all it saved (no checkpoint inside)."""
    from ggufspec.tinymodels import make_mamba_pair
    target, draft = make_mamba_pair(tmp_path)
    (tmp_path / "saves").mkdir()
    with serving(tmp_path, "-m", str(target), "-md", str(draft), "--temp", "0", "-np", "1", "-c", "512",
                 "--slot-save-path", str(tmp_path / "saves")) as running:
        ask = lambda prompt: httpx.post(running.url + "/completion", timeout=60, json={
            "prompt": prompt, "n_predict": 6, "return_tokens": True}).json()
        first = ask(PROMPT)
        cached = httpx.get(running.url + "/slots", timeout=10).json()[0]["n_cached"]
        assert httpx.post(running.url + "/slots/0?action=save", json={"filename": "m"}, timeout=60).json()["n_saved"] == cached
        httpx.post(running.url + "/slots/0?action=erase", timeout=60)
        assert httpx.post(running.url + "/slots/0?action=restore", json={"filename": "m"},
                          timeout=60).json()["n_restored"] == cached
        prompt_ids = httpx.post(running.url + "/tokenize", json={"content": PROMPT, "add_special": True},
                                timeout=10).json()["tokens"]
        turn = ask(prompt_ids + first["tokens"] + prompt_ids[1:4])
        assert turn["timings"]["cache_n"] == cached and turn["timings"]["prompt_n"] == len(prompt_ids) + 9 - cached


def test_slot_files_while_another_slot_generates_change_nothing_there(server, saves):
    """Save, erase and restore run in an idle slot between the steps of a generation in the other, which
    goes on to its answer alone; a save of the busy slot waits for its answer, then holds all of it."""
    import threading
    for id_slot in (0, 1):
        slot_post(server, id_slot, "erase")
    def long_answer() -> dict:
        return httpx.post(api(server, "/completion"), timeout=120,
                          json={"prompt": "a dog ran", "n_predict": 300, "ignore_eos": True}).json()
    alone = long_answer()
    for id_slot in (0, 1):
        slot_post(server, id_slot, "erase")
    during = {}
    thread = threading.Thread(target=lambda: during.update(long_answer()))
    thread.start()
    busy = None
    while busy is None and thread.is_alive():
        busy = next((s["id"] for s in httpx.get(api(server, "/slots"), timeout=10).json() if s["is_processing"]), None)
    assert busy is not None, "the generation ended before it was seen"
    idle = 1 - busy
    assert slot_post(server, idle, "erase").status_code == 200
    assert slot_post(server, idle, "save", {"filename": "idle.bin"}).json()["n_saved"] == 0
    assert slot_post(server, idle, "restore", {"filename": "idle.bin"}).json()["n_restored"] == 0
    held = slot_post(server, busy, "save", {"filename": "busy.bin"}).json()  # waits for the answer
    thread.join(60)
    assert during["content"] == alone["content"] and during["id_slot"] == busy
    # saved after the answer: its prompt and its tokens (the last one, or an end of generation, not decoded)
    assert held["n_saved"] >= during["tokens_evaluated"] + during["tokens_predicted"] - 1


def test_get_slots_can_fail_when_none_is_free(server):
    assert httpx.get(api(server, "/slots?fail_on_no_slot=1"), timeout=10).status_code == 200


def test_file_names_and_the_token_layout():
    assert valid_filename("slot-0.bin") and valid_filename("ünïcode name.bin")
    assert not any(valid_filename(name) for name in ("", "..", "a/b", "x" * 256, "a\x7fb", "a\u2215b", "\ud800"))
    assert pack([5, 6]) == [-1, 1, 2, 5, 6, 0] and unpack(pack([5, 6])) == [5, 6]
    assert unpack([5, 6, 7]) == [5, 6, 7]  # a plain token list, as older llama-servers wrote
    for bad in ([-1, 2, 1, 5, 0], [-1, 1, 3, 5, 0], [-1, 1, 1, 5, 1]):
        with pytest.raises(ValueError):
            unpack(bad)


# ---------------------------------------------------------------- /metrics: n_decode_total, n_busy_slots_per_decode

def metrics_of(server, base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=10).text
    assert "# TYPE llamacpp:n_decode_total counter" in text and "# TYPE llamacpp:n_busy_slots_per_decode gauge" in text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}


def test_decodes_are_counted_with_the_slots_busy_at_each(server):
    before = metrics_of(server, server.url + PREFIX)["llamacpp:n_decode_total"]
    with ThreadPoolExecutor(2) as pool:  # two at once: some rounds hold both slots
        answers = list(pool.map(lambda p: completion(server, p, 16), ["one two three", "seven eight nine ten"]))
    after = metrics_of(server, server.url + PREFIX)
    steps = sum(answer["timings"]["predicted_n"] for answer in answers)
    assert 2 <= after["llamacpp:n_decode_total"] - before <= steps + 4  # a step or a prompt chunk per call
    assert 1.0 <= after["llamacpp:n_busy_slots_per_decode"] <= 2.0


def test_one_slot_counts_its_decodes_alone(bare):
    answer = httpx.post(bare.url + "/completion", json={"prompt": PROMPT, "n_predict": 8}, timeout=60).json()
    counted = metrics_of(bare, bare.url)
    assert 1 <= counted["llamacpp:n_decode_total"] <= answer["timings"]["predicted_n"] + 2
    assert counted["llamacpp:n_busy_slots_per_decode"] == 1.0


# ---------------------------------------------------------------- refusals, before anything loads

@pytest.mark.parametrize("flags, words", [
    (["-nocb"], "-nocb/--no-cont-batching is not supported: ggufspec's slots always decode together"),
    (["--no-cont-batching"], "for one request at a time give -np 1"),
    (["--no-cache-prompt"], "always reuses the prefix"),
    (["-no-kvu"], "share one unified cache"),
    (["--context-shift"], "ends an answer when the context is full"),
    (["--cache-reuse", "256"], "--cache-reuse 256 is not supported"),
    (["-kvu", "--strict"], "each slot has a cache of its own"),
    (["--api-prefix", "llm"], "leading slash and no trailing one"),
    (["--api-prefix", "/llm/"], "leading slash and no trailing one"),
    (["--api-prefix", "/a//b"], "no empty, . or .. segment"),
    (["--api-prefix", "/a/../b"], "no empty, . or .. segment"),
    (["--slot-save-path", "/nonexistent/folder"], "not a directory"),
    (["-to", "0"], "0 is not in the range 1<=x<=2147483647"),
    (["-sps", "1.5"], "1.5 is not in the range 0<=x<=1"),
])
def test_bad_or_refused_flags_are_one_line(flags, words):
    one_line_error(CliRunner().invoke(main, ["serve", "-m", "/nonexistent.gguf", *flags]), words)


def test_the_prefix_and_the_timeout_at_serve_rpcs_front(needs_rpc, chat_pair, tmp_path):
    """Under --rpc the supervisor faces the clients: it takes the prefix off and keeps the timeout; the
    model process behind it answers the unprefixed routes, slot files included."""
    from rpcworkers import Worker
    target, draft = chat_pair
    (tmp_path / "worker").mkdir()
    (tmp_path / "saves").mkdir()
    worker = Worker(tmp_path / "worker")
    try:
        running = start_prefixed(tmp_path, "-m", str(target), "-md", str(draft), "--rpc", str(worker.endpoint),
                                 "--api-prefix", PREFIX, "-to", "1", "--slot-save-path", str(tmp_path / "saves"))
        try:
            assert httpx.get(api(running, "/health"), timeout=10).json()["status"] == "ok"
            assert httpx.get(running.url + "/health", timeout=10).status_code == 404
            completion(running, "one two", 2)
            assert slot_post(running, 0, "save", {"filename": "s.bin"}).json()["n_saved"] > 0
            check_body_timeout(running, 1)
        finally:
            stop_server(running)
    finally:
        worker.stop()


@pytest.mark.parametrize("flags, words", [
    (["--embeddings"], "--embedding/--embeddings is not supported: ggufspec serves generation"),
    (["--mmproj", "p.gguf"], "images and audio are not supported"),
    (["-cram", "8192"], "-cram/--cache-ram 8192 is not supported: ggufspec keeps each conversation"),
    (["--sleep-idle-seconds", "300"], "keeps the models loaded"),
    (["--models-dir", "m"], "one target (and its draft) per server"),
    (["--tools", "all"], "runs no tools itself"),
    (["--path", "www"], "serves its own chat page"),
    (["--pooling", "mean"], "for embeddings run llama-server"),
    (["--video-fps", "2"], "images and audio are not supported"),
    (["-cms", "512"], "checkpoints sliding-window and recurrent memory itself"),
    (["--kv-unified-per-slot", "4096"], "give -c N times -np"),
    (["--keep", "-1"], "does no context shift"),
    (["-lcs", "corpus.bin"], "reads no llama.cpp n-gram cache files"),
    (["--spec-draft-p-split", "0.2"], "never a tree"),
    (["--spec-synth-len", "3"], "plan --trace"),
    (["--spm-infill"], "prefix-suffix-middle order"),
    (["-cl"], "`ggufspec list`"),
    (["--completion-bash"], "_GGUFSPEC_COMPLETE=bash_source"),
])
def test_llama_servers_flags_for_what_ggufspec_does_not_do_say_why(flags, words):
    one_line_error(CliRunner().invoke(main, ["serve", "-m", "/nonexistent.gguf", *flags]), words)


@pytest.mark.parametrize("flags", [["-cram", "0"], ["--no-mmproj"], ["--sleep-idle-seconds", "-1"], ["-no-ag"],
                                   ["--no-cache-idle-slots"], ["--keep", "0"], ["-cms", "8192"],
                                   ["--spec-draft-p-split", "0.10"], ["--no-spm-infill"]])
def test_their_values_that_ask_for_what_ggufspec_does_are_taken(flags):
    result = CliRunner().invoke(main, ["serve", "-m", "/nonexistent.gguf", *flags])
    assert "target model not found" in result.stderr, result.stderr  # past the flags, to the model


def test_a_streams_keep_alive_pings_follow_the_interval(chat_pair, tmp_path):
    """--sse-ping-interval 1 (llama-server's; default 30): a stream running for seconds carries SSE comment
    pings; a request's sse_ping_interval 0 has none."""
    target, draft = chat_pair
    with serving(tmp_path, "-m", str(target), "-md", str(draft), "-c", "4096", "-np", "1",
                 "--sse-ping-interval", "1") as running:
        def stream_lines(**fields) -> list[str]:
            body = {"prompt": PROMPT, "n_predict": 1200, "ignore_eos": True, "stream": True, "draft": 0, **fields}
            with httpx.stream("POST", running.url + "/completion", json=body, timeout=120) as response:
                started = time.monotonic()
                lines = list(response.iter_lines())
            return lines, time.monotonic() - started
        lines, seconds = stream_lines()
        pings = [line for line in lines if line.startswith(":")]
        assert pings or seconds < 1.5, (seconds, lines[:3])  # (here: about 5 s, 4 or 5 pings)
        lines, _ = stream_lines(sse_ping_interval=0)
        assert not [line for line in lines if line.startswith(":")]
