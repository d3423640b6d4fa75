"""Who may use `ggufspec serve`, and how much one request may cost it: Host names (DNS rebinding),
origins (CORS, and a POST from another origin refused), the key (Bearer or x-api-key), the body cap,
prompts longer than the context, and a stop signal whatever a request is doing. Raw HTTP against the
real process (a Host header, a Content-Length that lies, a chunked body, a client that stops sending),
then the same origins in Chromium: a page of another origin (a name mapped to 127.0.0.1 by
--host-resolver-rules) cannot use the API, one named by --cors-origins can, the server's own page can,
and the server under a rebound name answers nothing."""
from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import signal
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from browser import chromium
from serverproc import pair_server_fixture, serving, start_server

KEY = "sesame"
MIB = 1 << 20
DEFAULT_CAP = 4 * MIB
ALLOWED_ORIGIN = "http://allowed.test:8000"
PROXY_NAME = "llm.example.com"
EVIL = "http://evil.example"
COMPLETION = {"prompt": "the cat", "max_tokens": 2}


server = pair_server_fixture("-c", "512")  # defaults: loopback, no key
# a key, one more origin and one more Host name
keyed = pair_server_fixture("-c", "512", "--api-key", KEY, "--cors-origins", ALLOWED_ORIGIN, "--allowed-hosts",
                            PROXY_NAME, name="keyed")


def address(server) -> tuple[str, int]:
    parts = urlsplit(server.url)
    return parts.hostname, parts.port


def port_of(server) -> int:
    return address(server)[1]


class Answer:
    def __init__(self, response: http.client.HTTPResponse, seconds: float):
        self.status, self.headers, self.seconds = response.status, response.headers, seconds
        self.body = response.read()

    def json(self):
        return json.loads(self.body)


def raw(server, method: str, path: str, headers: dict, body: bytes = b"", timeout: float = 10) -> Answer:
    """One request written byte for byte (any Host, any Content-Length), and its response, timed from
    the end of the sending to the status line."""
    with socket.create_connection(address(server), timeout=timeout) as sock:
        head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        sock.sendall(head.encode() + body)
        started = time.monotonic()
        response = http.client.HTTPResponse(sock)
        response.begin()
        return Answer(response, time.monotonic() - started)


def host_of(server) -> str:
    return f"127.0.0.1:{port_of(server)}"


def post(server, path: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30)


def error_of(response) -> dict:
    body = response.json()
    assert set(body) == {"error"}, body  # OpenAI's shape
    assert {"message", "type", "code"} <= set(body["error"]), body
    return body["error"]


# ---------------------------------------------------------------- Host names

def test_a_host_that_is_not_loopback_is_refused_on_every_path(server):
    for method, path in (("GET", "/health"), ("GET", "/"), ("GET", "/v1/models"), ("POST", "/v1/completions")):
        body = json.dumps(COMPLETION).encode() if method == "POST" else b""
        answer = raw(server, method, path, {"Host": "evil.example:8080", "Content-Length": str(len(body)),
                                            "Content-Type": "application/json"}, body)
        assert answer.status == 403, (path, answer.body)
        error = answer.json()["error"]
        assert error["code"] == "host_not_allowed" and "evil.example" in error["message"]
        assert "--allowed-hosts" in error["message"]
    for host in (host_of(server), f"localhost:{port_of(server)}", f"[::1]:{port_of(server)}", "LocalHost",
                 "app.localhost:1234", "127.0.0.2"):
        assert raw(server, "GET", "/health", {"Host": host}).status == 200, host
    assert raw(server, "GET", "/health", {"Host": PROXY_NAME}).status == 403


def test_allowed_hosts_adds_names(keyed):
    assert raw(keyed, "GET", "/health", {"Host": PROXY_NAME}).status == 200
    assert raw(keyed, "GET", "/health", {"Host": f"{PROXY_NAME.upper()}:443"}).status == 200
    assert raw(keyed, "GET", "/health", {"Host": "evil.example"}).status == 403


def test_the_start_line_says_the_policy(server, keyed):
    line = next(l for l in server.log.read_text().splitlines() if l.startswith("ggufspec: serving"))
    assert "no key; web pages: loopback; Host: loopback; bodies up to 4 MiB" in line, line
    line = next(l for l in keyed.log.read_text().splitlines() if l.startswith("ggufspec: serving"))
    assert (f"key required; web pages: loopback, {ALLOWED_ORIGIN}; Host: loopback, {PROXY_NAME}; bodies up to "
            f"4 MiB") in line, line
    assert "warning" not in server.log.read_text() + keyed.log.read_text()


# ---------------------------------------------------------------- origins

def preflight(server, origin: str) -> httpx.Response:
    return httpx.options(server.url + "/v1/chat/completions", timeout=10, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, authorization"})


def test_cors_for_loopback_origins_only(server):
    assert "access-control-allow-origin" not in preflight(server, EVIL).headers
    for origin in ("http://localhost:5173", "https://127.0.0.1", "http://[::1]:3000", f"http://{host_of(server)}"):
        allowed = preflight(server, origin)
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == origin, origin
    # a GET from elsewhere is answered, but without CORS headers the page cannot read it
    models = httpx.get(server.url + "/v1/models", headers={"Origin": EVIL}, timeout=10)
    assert models.status_code == 200 and "access-control-allow-origin" not in models.headers


def test_a_post_from_another_origin_is_refused_before_the_model_runs(server):
    before = server.health()["last"]
    # what a page may send without any preflight: a form-like content type
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "application/json"):
        refused = httpx.post(server.url + "/v1/completions", content=json.dumps({"prompt": "the", "max_tokens": 7}),
                             headers={"Origin": EVIL, "Content-Type": content_type}, timeout=30)
        assert refused.status_code == 403, refused.text
        error = error_of(refused)
        assert error["code"] == "origin_not_allowed" and EVIL in error["message"] and "--cors-origins" in error["message"]
        assert "access-control-allow-origin" not in refused.headers
    assert server.health()["last"] == before  # nothing was generated
    loopback = post(server, "/v1/completions", COMPLETION, Origin="http://localhost:5173")
    assert loopback.status_code == 200 and loopback.headers["access-control-allow-origin"] == "http://localhost:5173"
    own = post(server, "/v1/completions", COMPLETION, Origin=f"http://{host_of(server)}")  # the chat page's
    assert own.status_code == 200


def test_cors_origins_allows_more(keyed):
    assert preflight(keyed, ALLOWED_ORIGIN).headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "access-control-allow-origin" not in preflight(keyed, EVIL).headers
    allowed = post(keyed, "/v1/completions", COMPLETION, Origin=ALLOWED_ORIGIN, Authorization=f"Bearer {KEY}")
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert post(keyed, "/v1/completions", COMPLETION, Origin=EVIL, Authorization=f"Bearer {KEY}").status_code == 403
    # a page reverse-proxied under an allowed name is the server's own page there
    payload = json.dumps(COMPLETION).encode()
    own = raw(keyed, "POST", "/v1/completions", {"Host": PROXY_NAME, "Origin": f"https://{PROXY_NAME}",
                                                 "Authorization": f"Bearer {KEY}", "Content-Length": str(len(payload))},
              payload)
    assert own.status == 200, own.body
    # an allowed page learns why it was refused: a 401 it can read
    unkeyed = post(keyed, "/v1/completions", COMPLETION, Origin=ALLOWED_ORIGIN)
    assert unkeyed.status_code == 401 and unkeyed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN


def test_any_origin_with_a_star_warns_without_a_key(chat_pair, tmp_path):
    target, draft = chat_pair
    with serving(tmp_path, "-m", str(target), "--no-draft", "-c", "256", "--cors-origins", "*") as running:
        assert preflight(running, EVIL).headers["access-control-allow-origin"] == "*"
        assert post(running, "/v1/completions", COMPLETION, Origin=EVIL).status_code == 200
        log = running.log.read_text()
        assert "warning: --cors-origins * without --api-key" in log and "web pages: any origin" in log


# ---------------------------------------------------------------- the key

def test_x_api_key_is_accepted_like_the_bearer_header(keyed):
    for headers, status in (({"x-api-key": KEY}, 200), ({"X-Api-Key": KEY}, 200), ({"Authorization": f"Bearer {KEY}"}, 200),
                            ({"x-api-key": "wrong"}, 401), ({"x-api-key": ""}, 401), ({}, 401),
                            ({"x-api-key": KEY[:-1]}, 401), ({"Authorization": f"Bearer {KEY}x"}, 401)):
        response = post(keyed, "/v1/completions", COMPLETION, **headers)
        assert response.status_code == status, (headers, response.text)
        if status == 401:
            error = error_of(response)
            assert error["code"] == "invalid_api_key" and "x-api-key" in error["message"]
    # a route added since (one model, by name) is behind the same key
    one_model = httpx.get(keyed.url + "/v1/models/nope", timeout=10)
    assert one_model.status_code == 401 and error_of(one_model)["code"] == "invalid_api_key"
    assert httpx.get(keyed.url + "/v1/models/nope", headers={"x-api-key": KEY}, timeout=10).status_code == 404
    assert httpx.get(keyed.url + "/props", headers={"x-api-key": KEY}, timeout=10).status_code == 200
    # and llama-server's own generation routes
    for path in ("/completion", "/completions", "/infill"):
        unkeyed = post(keyed, path, {"prompt": "the", "n_predict": 1})
        assert unkeyed.status_code == 401 and error_of(unkeyed)["code"] == "invalid_api_key", path
    assert post(keyed, "/completion", {"prompt": "the", "n_predict": 1}, **{"x-api-key": KEY}).status_code == 200


def test_refusals_under_v1_messages_have_anthropics_shape(keyed, server):
    """/v1/messages is Anthropic's API: the middleware's own errors take its shape there."""
    unkeyed = post(keyed, "/v1/messages", {"model": "target", "max_tokens": 2, "messages": []}, **{"x-api-key": "no"})
    assert unkeyed.status_code == 401
    assert unkeyed.json()["type"] == "error" and unkeyed.json()["error"]["type"] == "authentication_error"
    foreign = post(server, "/v1/messages", {}, Origin=EVIL)
    assert foreign.status_code == 403 and foreign.json()["error"]["type"] == "permission_error"
    large = raw(server, "POST", "/v1/messages", {"Host": host_of(server), "Content-Length": str(DEFAULT_CAP + 1)})
    assert large.status == 413 and large.json() == {"type": "error", "error": {
        "type": "request_too_large", "message": large.json()["error"]["message"]}}


def test_error_bodies_by_path():
    from ggufspec.server.errors import error_body
    assert error_body("/v1/chat/completions", 401, "no", "authentication_error", "invalid_api_key") == {
        "error": {"message": "no", "type": "authentication_error", "param": None, "code": "invalid_api_key"}}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        assert error_body(path, 413, "big") == {"type": "error", "error": {"type": "request_too_large",
                                                                          "message": "big"}}
    assert "type" not in error_body("/v1/messagesx", 400, "x")


AGENT_POSTS = (("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
               ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
               ("/v1/responses", {"input": "hi", "max_output_tokens": 2}))


def test_the_agents_apis_and_the_pages_scripts_are_behind_the_same_guard(server, keyed):
    """/v1/messages, /v1/messages/count_tokens and /v1/responses: the Host check, the origin check, the
    key and the cap as on the chat API; /static (the chat page's scripts): the Host check, no key."""
    for path, body in AGENT_POSTS:
        payload = json.dumps(body).encode()
        rebound = raw(server, "POST", path, {"Host": "evil.example", "Content-Length": str(len(payload))}, payload)
        assert rebound.status == 403 and "is not served here" in rebound.body.decode(), (path, rebound.body)
        assert post(server, path, body, Origin=EVIL).status_code == 403, path
        assert post(server, path, body, Origin="http://localhost:5173").status_code == 200, path
        large = raw(server, "POST", path, {"Host": host_of(server), "Content-Length": str(DEFAULT_CAP + 1)})
        assert large.status == 413, (path, large.body)
        assert post(keyed, path, body).status_code == 401, path
        for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
            assert post(keyed, path, body, **headers).status_code == 200, (path, headers)
    script = "/static/marked.umd.js"
    assert raw(server, "GET", script, {"Host": "evil.example"}).status == 403
    assert raw(server, "GET", script, {"Host": host_of(server)}).status == 200
    assert httpx.get(keyed.url + script, timeout=10).status_code == 200  # like the page: no key


def test_every_path_but_the_page_and_health_needs_the_key(keyed):
    """Deny by default: llama-server's other names for the APIs (/chat/completions, /apply-template)
    and paths no route has are behind the key, not only /v1 and a list that a new route could miss."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path in ("/chat/completions", "/apply-template", "/v1/chat/completions/", "/no-such-path"):
        assert post(keyed, path, chat).status_code == 401, path
    for path in ("/chat/completions", "/apply-template"):
        assert post(keyed, path, chat, Authorization=f"Bearer {KEY}").status_code == 200, path
    for path in ("/", "/health", "/static/marked.umd.js"):
        assert httpx.get(keyed.url + path, timeout=10).status_code == 200, path


def test_an_options_request_that_is_no_preflight_needs_the_key(keyed):
    host = {"Host": host_of(keyed)}
    assert raw(keyed, "OPTIONS", "/slots", host).status == 401  # was 405 with Allow: which routes exist
    assert raw(keyed, "OPTIONS", "/slots", {**host, "Authorization": f"Bearer {KEY}"}).status == 405
    preflight = raw(keyed, "OPTIONS", "/v1/chat/completions", {**host, "Origin": "http://localhost:3000",
                                                               "Access-Control-Request-Method": "POST"})
    assert preflight.status == 200  # a browser's preflight carries no key


def test_the_chat_page_loads_nothing_from_elsewhere_and_is_framed_nowhere(server):
    headers = httpx.get(server.url + "/", timeout=10).headers
    policy = headers["content-security-policy"]
    assert "img-src 'self' data:" in policy and "frame-ancestors 'none'" in policy and "connect-src 'self'" in policy
    assert headers["x-frame-options"] == "DENY"


# ---------------------------------------------------------------- bodies

def test_a_body_on_a_get_is_capped_too(server):
    """A GET (on /health: no key needed) streaming a body of megabytes is cut off at the cap, as a POST
    is (under --rpc the front's proxy would otherwise have held it all)."""
    chunk = b"x" * MIB
    with socket.create_connection(address(server), timeout=10) as sock:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host_of(server)}\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        with contextlib.suppress(OSError):
            for _ in range(5):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.status == 413
    announced = raw(server, "GET", "/health", {"Host": host_of(server), "Content-Length": str(50_000_000)})
    assert announced.status == 413 and announced.seconds < 0.5
    assert server.health()["status"] == "ok"


def test_a_body_over_the_cap_is_413_at_once_and_the_next_request_is_answered(server):
    # 50 MB announced, a few bytes sent: refused from the header, nothing waited for
    answer = raw(server, "POST", "/v1/completions", {"Host": host_of(server), "Content-Type": "application/json",
                                                     "Content-Length": str(50_000_000)}, b'{"prompt": "')
    assert answer.status == 413 and answer.seconds < 0.5, answer.seconds
    error = answer.json()["error"]
    assert error["code"] == "request_too_large" and "4 MiB" in error["message"] and "--max-body" in error["message"]
    assert answer.headers["connection"] == "close"
    started = time.monotonic()
    assert post(server, "/v1/completions", COMPLETION).status_code == 200
    assert time.monotonic() - started < 2


def test_a_chunked_body_over_the_cap_is_413_as_it_passes_it(server):
    chunk = b"x" * MIB
    with socket.create_connection(address(server), timeout=10) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host_of(server)}\r\nTransfer-Encoding: chunked\r\n"
                     f"Content-Type: application/json\r\n\r\n".encode())
        with contextlib.suppress(OSError):  # the server may close while the rest is still on its way
            for _ in range(5):  # 5 MiB, never finished: the answer cannot wait for the end
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        started = time.monotonic()
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.status == 413 and time.monotonic() - started < 0.5
        assert json.loads(response.read())["error"]["code"] == "request_too_large"
    # under the cap, chunked is fine
    small = httpx.post(server.url + "/v1/completions", content=iter([json.dumps(COMPLETION).encode()]), timeout=30)
    assert small.status_code == 200, small.text
    assert server.health()["status"] == "ok"


def test_max_body_sets_the_cap(chat_pair, tmp_path):
    target, _ = chat_pair
    with serving(tmp_path, "-m", str(target), "--no-draft", "-c", "256", "--max-body", "1K") as running:
        assert "bodies up to 1 KiB" in running.log.read_text()
        assert post(running, "/v1/completions", {**COMPLETION, "padding": "x" * 900}).status_code == 200
        too_large = post(running, "/v1/completions", {**COMPLETION, "padding": "x" * 1000})
        assert too_large.status_code == 413 and "1 KiB" in error_of(too_large)["message"]


def sent_while_others_are_answered(server, path: str, body: dict) -> tuple[httpx.Response, float]:
    """`body` posted (it must be under the cap), /health asked meanwhile: answered within 1 s each
    time. The response and how long it took."""
    payload = json.dumps(body).encode()
    assert len(payload) < DEFAULT_CAP
    result = {}

    def send():
        result["response"] = httpx.post(server.url + path, content=payload, timeout=60)
    sender = threading.Thread(target=send)
    started = time.monotonic()
    sender.start()
    while sender.is_alive():
        asked = time.monotonic()
        assert server.health()["status"] == "ok" and time.monotonic() - asked < 1.0
        time.sleep(0.02)
    sender.join()
    return result["response"], time.monotonic() - started


def test_a_prompt_of_megabytes_is_refused_without_tokenizing_it_all(server):
    """A prompt just under the cap, much longer than the context: refused quickly, and nobody waits."""
    text = "the cat sat on the mat. " * ((DEFAULT_CAP - 1000) // 24)
    for path, body in (("/v1/completions", {"prompt": text, "max_tokens": 4}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 4})):
        response, seconds = sent_while_others_are_answered(server, path, body)
        assert response.status_code == 400 and seconds < 3, (response.text, seconds)
        error = error_of(response)
        assert error["code"] == "context_length_exceeded" and "512" in error["message"], error
    assert post(server, "/v1/completions", COMPLETION).status_code == 200


def test_a_long_prompt_is_refused_from_a_prefix():
    """What tokenize_within reads of a prompt: prefixes growing fourfold from 8 characters per token
    of the context, never the whole of a prompt that does not fit."""
    from ggufspec.errors import ContextFullError
    from ggufspec.server.jobs import tokenize_within

    class Tokenizer:  # four characters a token
        n_ctx = 1024

        def __init__(self):
            self.read = []

        def tokenize(self, text):
            self.read.append(len(text))
            return [0] * (len(text) // 4)
    long = Tokenizer()
    with pytest.raises(ContextFullError, match="more than 2040 tokens .* context holds 1024"):
        tokenize_within(long, "x" * DEFAULT_CAP, -1)
    assert long.read == [8 * 1024]
    sparse = Tokenizer()
    sparse.tokenize = lambda text: sparse.read.append(len(text)) or [0] * (len(text) // 40)  # 40 characters a token
    with pytest.raises(ContextFullError, match="1024"):
        tokenize_within(sparse, "x" * DEFAULT_CAP, 200)
    assert sparse.read == [8 * 1024, 32 * 1024, 128 * 1024]  # 204, 819 and 3276 tokens: past 1024 - 200
    fits = Tokenizer()
    assert len(tokenize_within(fits, "x" * 3000, 10)) == 750 and fits.read == [3000]


def test_a_huge_conversation_or_token_list_does_not_stall_others(server):
    many = {"messages": [{"role": "user", "content": "hi"}] * 100_000, "max_tokens": 2}
    ids = {"prompt": [5] * 500_000, "max_tokens": 2}
    items = {"input": [{"role": "user", "content": "hi"}] * 100_000, "max_output_tokens": 2}
    for path, body in (("/v1/chat/completions", many), ("/v1/completions", ids), ("/v1/messages", many),
                       ("/v1/responses", items)):
        response, seconds = sent_while_others_are_answered(server, path, body)
        assert response.status_code == 400 and "512" in response.json()["error"]["message"], response.text
        assert seconds < 10, (path, seconds)
    assert post(server, "/v1/completions", COMPLETION).status_code == 200


# ---------------------------------------------------------------- stopping

def post_quietly(url: str, body: dict) -> None:
    try:
        httpx.post(url, content=json.dumps(body), timeout=60)
    except httpx.HTTPError:  # the server stopped meanwhile
        pass


def stopped_within(server, seconds: float) -> float:
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(timeout=seconds + 5)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    took = time.monotonic() - started
    print(f"stopped in {took:.2f} s")
    assert code == 0 and took < seconds, (code, took, server.log.read_text())
    assert "Traceback" not in server.log.read_text(), server.log.read_text()
    return took


def test_sigterm_during_the_largest_allowed_requests_ends_the_process_within_5_s(slow_target, tmp_path):
    """Busy every way at once: generating for a body at the cap, a prompt at the cap being read and
    refused, and a client that stopped sending its body halfway."""
    running = start_server(tmp_path, "-m", str(slow_target), "--no-draft", "-c", "2048")
    generating = {"prompt": "the cat", "max_tokens": 2000, "padding": ""}
    generating["padding"] = "x" * (DEFAULT_CAP - len(json.dumps(generating)) - 16)
    prompt = {"prompt": "the cat sat on the mat. " * ((DEFAULT_CAP - 1000) // 24)}
    threads = [threading.Thread(target=post_quietly, args=(running.url + "/v1/completions", body), daemon=True)
               for body in (generating, prompt)]
    stalled = socket.create_connection(address(running), timeout=10)
    try:
        threads[0].start()
        deadline = time.monotonic() + 20
        while not running.health()["busy"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        stalled.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host_of(running)}\r\nContent-Length: {MIB}\r\n"
                        f"\r\n{{\"prompt\": \"".encode())
        threads[1].start()
        time.sleep(0.05)
        stopped_within(running, 5)
    finally:
        stalled.close()


def test_sigterm_while_a_stream_is_open_and_another_waits(slow_target, tmp_path):
    running = start_server(tmp_path, "-m", str(slow_target), "--no-draft", "-c", "2048")
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", running.url + "/v1/completions",
                           json={"prompt": "x", "max_tokens": 2000, "stream": True}) as stream:
            assert next(stream.iter_lines()).startswith("data:")
            waiting = threading.Thread(target=post_quietly, daemon=True,
                                       args=(running.url + "/v1/completions", {"prompt": "x", "max_tokens": 5}))
            waiting.start()
            stopped_within(running, 5)


# ---------------------------------------------------------------- the command line

@pytest.mark.parametrize("flag, value, message", [
    ("--cors-origins", "evil.example", "is not an origin"),
    ("--allowed-hosts", "a b", "is not a host name"),
    ("--max-body", "lots", "is not a size"),
    ("--max-body", "0", "is not a size"),
    ("--api-key", "sesame ", "whitespace"),
    ("--api-key", "one,,two", "an empty key between commas"),
    ("--api-key-file", "/nonexistent/keys.txt", "No such file"),
])
def test_bad_values_are_one_line_before_anything_loads(chat_pair, tmp_path, flag, value, message):
    import subprocess

    from serverproc import GGUFSPEC
    done = subprocess.run([GGUFSPEC, "serve", "-m", str(chat_pair[0]), "--port", "0", flag, value],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert flag in done.stderr


def test_sizes_hosts_and_origins_parsed():
    from ggufspec.server.guard import Exposure, host_name, parse_hosts, parse_origins, parse_size
    assert [parse_size(s) for s in ("4096", "512K", "4M", "8MiB", "1.5M", "1G", "2 MB")] == [
        4096, 512 << 10, 4 << 20, 8 << 20, int(1.5 * MIB), 1 << 30, 2_000_000]
    assert parse_origins("https://A.example/, http://localhost:3000,*") == ("https://a.example",
                                                                            "http://localhost:3000", "*")
    assert parse_hosts("Example.com:8080, *.internal") == ("example.com", "*.internal")
    assert [host_name(h) for h in ("[::1]:80", "LOCALHOST.", "a.b:1", "::1")] == ["::1", "localhost", "a.b", "::1"]
    loopback = Exposure.listening("127.0.0.1", allowed_hosts=("*.internal",))
    assert loopback.check_host and loopback.host_allowed("x.internal:1") and not loopback.host_allowed("internal.evil")
    assert not Exposure.listening("0.0.0.0").check_host
    assert Exposure.listening("0.0.0.0", allowed_hosts=("box",)).check_host
    assert not Exposure.listening("127.0.0.1", allowed_hosts=("*",)).check_host
    assert not loopback.origin_allowed("http://localhost.evil.example", "127.0.0.1:8080")
    assert not loopback.origin_allowed("null", "127.0.0.1:8080")
    # every spelling that binds to loopback checks Host names as loopback does (DNS rebinding)
    for host in ("LOCALHOST", "127.1", "0x7f000001", "::1"):
        assert Exposure.listening(host).check_host, host
    assert not Exposure.listening("10.0.0.1").check_host
    from ggufspec.netaddr import is_loopback
    assert not is_loopback("127.0.0.1 evil.example") and not is_loopback(" 127.0.0.1")


# ---------------------------------------------------------------- in the browser

class Pages(http.server.ThreadingHTTPServer):
    """Another site on 127.0.0.1: an empty page at /, for a browser that knows it as evil.test."""
    daemon_threads = True

    def __init__(self):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                page = b"<!doctype html><title>another site</title><p>nothing here</p>"
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)

            def log_message(self, *args):
                pass
        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def site():
    pages = Pages()
    yield pages
    pages.shutdown()


@pytest.fixture(scope="module")
def opened_to_evil(chat_pair, site, tmp_path_factory):
    """A server that lets the evil.test site in (--cors-origins), besides the `server` fixture that does not."""
    target, draft = chat_pair
    origin = f"http://evil.test:{site.server_address[1]}"
    with serving(tmp_path_factory.mktemp("opened"), "-m", str(target), "-md", str(draft), "-c", "512",
                 "--cors-origins", origin) as running:
        yield running


@pytest.fixture(scope="module")
def browser():
    with chromium("--host-resolver-rules=MAP evil.test 127.0.0.1") as launched:
        yield launched


@pytest.fixture
def page(browser):
    context = browser.new_context()
    yield context.new_page()
    context.close()


FETCH = """async ([url, mode]) => {
  try {
    const options = {method: "POST", body: JSON.stringify({prompt: "the cat", max_tokens: 3})};
    if (mode === "simple") Object.assign(options, {mode: "no-cors", headers: {"Content-Type": "text/plain"}});
    else options.headers = {"Content-Type": "application/json"};
    const response = await fetch(url, options);
    if (response.type === "opaque") return "opaque";
    const body = await response.json();
    return response.status + " " + (body.choices ? "answer" : body.error.code);
  } catch (error) {
    return "failed: " + error;
  }
}"""


def test_a_page_of_another_origin_cannot_use_the_api(page, server, site):
    page.goto(f"http://evil.test:{site.server_address[1]}/")
    assert page.evaluate("location.hostname") == "evil.test"
    before = server.health()["last"]
    api = server.url + "/v1/completions"
    assert page.evaluate(FETCH, [api, "cors"]).startswith("failed: TypeError")
    assert page.evaluate(FETCH, [api, "simple"]) == "opaque"  # sent, unread, and refused by the server:
    assert server.health()["last"] == before  # nothing was generated
    models = page.evaluate("url => fetch(url).then(r => r.status, e => 'failed: ' + e)", server.url + "/v1/models")
    assert str(models).startswith("failed: TypeError")


def test_a_page_named_by_cors_origins_can(page, opened_to_evil, site):
    page.goto(f"http://evil.test:{site.server_address[1]}/")
    assert page.evaluate(FETCH, [opened_to_evil.url + "/v1/completions", "cors"]) == "200 answer"


def test_the_servers_own_page_can(page, server):
    page.goto(server.url + "/")
    assert page.evaluate(FETCH, ["v1/completions", "cors"]) == "200 answer"
    localhost = server.url.replace("127.0.0.1", "localhost")
    page.goto(localhost + "/")
    assert page.evaluate(FETCH, ["v1/completions", "cors"]) == "200 answer"


def test_the_server_under_a_rebound_name_answers_nothing(page, server):
    """DNS rebinding: evil.test resolves to 127.0.0.1, so the server's port under that name is the
    attacker's own origin; the Host check is what refuses it."""
    rebound = f"http://evil.test:{port_of(server)}"
    response = page.goto(rebound + "/")
    assert response.status == 403 and "host_not_allowed" in page.content()
    assert page.evaluate(FETCH, ["/v1/completions", "cors"]) == "403 host_not_allowed"
    assert page.evaluate("fetch('/props').then(r => r.status)") == 403


def test_several_keys_each_open_the_api_and_no_other_does(chat_pair, tmp_path):
    """llama-server's comma-separated --api-key and its --api-key-file (one key a line): any of them, as a
    Bearer token or x-api-key, and under `serve --rpc`'s front alike (its Guard is the same)."""
    from serverproc import serving
    keys = tmp_path / "keys.txt"
    keys.write_text("\nteam-b\n  team-c  \n\n")
    with serving(tmp_path, "-m", str(chat_pair[0]), "--no-draft", "--api-key", "team-a, team-z",
                 "--api-key-file", str(keys)) as running:
        for key in ("team-a", "team-z", "team-b", "team-c"):
            for headers in ({"x-api-key": key}, {"Authorization": f"Bearer {key}"}):
                assert httpx.get(running.url + "/v1/models", headers=headers, timeout=10).status_code == 200
        for key in ("team-a,team-z", "team", "team-d", ""):
            response = httpx.get(running.url + "/v1/models", headers={"x-api-key": key}, timeout=10)
            assert response.status_code == 401, key
    assert "key required" in running.log.read_text()


def test_an_api_key_file_without_keys_is_one_line(chat_pair, tmp_path):
    import subprocess

    from serverproc import GGUFSPEC
    for text, says in (("\n\n", "it holds none"), ("a,b\n", "a line with a comma")):
        keys = tmp_path / "keys.txt"
        keys.write_text(text)
        done = subprocess.run([GGUFSPEC, "serve", "-m", str(chat_pair[0]), "--port", "0", "--api-key-file", str(keys)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and says in done.stderr, done.stderr
