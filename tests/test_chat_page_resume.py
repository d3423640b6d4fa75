"""The chat page's conversation across reloads, in a real headless Chromium (as test_chat_page): kept in
localStorage and drawn again; an answer under way when the page reloads read on from the byte it had
reached (X-Conversation-Id, POST /v1/streams/lookup, GET /v1/stream?from=), or, its stream gone,
kept as far as it went and marked as cut off; Stop also stops the server's generation (DELETE
/v1/stream); New chat forgets the stored conversation; storage off or full leaves the page working.

One server for the module: conftest's slow target (a few milliseconds a token, no end-of-sequence),
behind an API key that the page sends on every route.
"""
from __future__ import annotations

import json
from urllib.parse import parse_qs, urlparse

import httpx
import pytest

from browser import chromium
from serverproc import answer_text, replay, slow_server_fixture, wait_idle

KEY = "k-page-resume"
AUTH = {"Authorization": f"Bearer {KEY}"}
STORE_KEY = "ggufspec.chat"


server = slow_server_fixture(KEY, "-c", "2048", name="server")


@pytest.fixture(scope="module")
def browser():
    with chromium() as launched:
        yield launched


class Chat:
    """A page on the chat page, with the requests it sent and any uncaught JavaScript error."""

    def __init__(self, context, url: str):
        self.page, self.url, self.requests, self.errors = context.new_page(), url, [], []
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.on("request", lambda request: self.requests.append(request))

    def open(self, key: bool = True) -> None:
        self.page.goto(self.url + "/")
        if key:  # kept in localStorage by the page (where it can): later loads send it themselves
            self.page.fill("#api-key", KEY)
            self.page.press("#api-key", "Tab")  # its change event: once, now (not when another field takes the focus)
        self.page.wait_for_selector("#pair .chip >> nth=1")

    def reload(self) -> None:
        self.page.reload()
        self.page.wait_for_selector("#pair .chip >> nth=1")

    def send(self, text: str, max_tokens: int) -> None:
        if not self.page.is_visible("#max-tokens"):
            self.page.click("#settings-toggle")
        self.page.fill("#max-tokens", str(max_tokens))
        self.page.fill("#input", text)
        self.page.press("#input", "Enter")

    def answer(self, index: int):
        return self.page.locator(".msg.assistant").nth(index)

    def wait_for_state(self, index: int, states: str, timeout: float = 30_000) -> str:
        # a selector, not wait_for_function: the page's Content-Security-Policy forbids evaluating strings
        in_state = self.page.locator(", ".join(f'[data-state="{state}"]' for state in states.split("|")))
        self.answer(index).and_(in_state).wait_for(timeout=timeout)
        return self.answer(index).get_attribute("data-state")

    def stored(self) -> dict | None:
        return self.page.evaluate(f"() => JSON.parse(localStorage.getItem({STORE_KEY!r}))")

    def conversation(self) -> list[dict]:
        return self.page.evaluate("() => conversation.map(({role, content}) => ({role, content}))")

    def sent(self, method: str, path: str) -> list:
        return [r for r in self.requests if r.method == method and urlparse(r.url).path == path]


@pytest.fixture
def chat(browser, server):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    opened = Chat(context, server.url)
    opened.open()
    yield opened
    context.close()
    assert not opened.errors, opened.errors  # no uncaught JavaScript error


def test_a_conversation_survives_a_reload(chat):
    chat.send("the cat", 6)
    assert chat.wait_for_state(0, "done|error") == "done"
    chat.send("and the dog", 6)
    assert chat.wait_for_state(1, "done|error") == "done"
    before = chat.conversation()
    shown = [chat.answer(i).locator(".text").inner_html() for i in (0, 1)]
    stored = chat.stored()
    assert stored["pending"] is None and [m["role"] for m in stored["messages"]] == ["user", "assistant"] * 2
    posts = chat.sent("POST", "/v1/chat/completions")
    assert {p.headers["x-conversation-id"] for p in posts} == {stored["id"]}  # one id, the conversation's

    chat.reload()
    assert chat.conversation() == before
    assert [chat.answer(i).locator(".text").inner_html() for i in (0, 1)] == shown  # colours by origin too
    assert chat.page.locator(".msg.user .text").all_inner_texts() == ["the cat", "and the dog"]
    assert chat.answer(1).get_attribute("data-state") == "done"
    assert chat.answer(1).locator('[data-stat="tokens"]').inner_text() == "6"
    assert chat.page.is_hidden("#empty") and chat.page.is_visible("#send")

    chat.send("and then", 4)  # the conversation goes on, its earlier turns sent with it
    assert chat.wait_for_state(2, "done|error") == "done"
    last = chat.sent("POST", "/v1/chat/completions")[-1]
    assert last.headers["x-conversation-id"] == stored["id"]
    assert [m["content"] for m in last.post_data_json["messages"]] == [m["content"] for m in before] + ["and then"]


def test_a_reload_mid_answer_resumes_it_to_the_servers_whole_answer(chat, server):
    n = 240  # about 5 s of the slow target: the reload comes well before its end
    chat.send("tell me everything", n)
    chat.answer(0).locator(".text span").nth(10).wait_for(timeout=20_000)
    chat.reload()
    chat.wait_for_state(0, "done|error|cut-off|stopped", timeout=60_000)
    state = chat.answer(0).locator(".state").inner_text()
    assert chat.answer(0).get_attribute("data-state") == "done", state
    assert state.startswith("stopped at max tokens")
    assert chat.answer(0).locator('[data-stat="tokens"]').inner_text() == str(n)

    conversation = chat.stored()["id"]
    [lookup] = chat.sent("POST", "/v1/streams/lookup")
    assert json.loads(lookup.post_data) == {"conversation_ids": [conversation]}
    assert lookup.response().json()[0]["is_done"] is False  # the reload came while the server generated
    [resumed] = chat.sent("GET", "/v1/stream")
    offset = int(parse_qs(urlparse(resumed.url).query)["from"][0])
    assert parse_qs(urlparse(resumed.url).query)["conv_id"] == [conversation] and offset > 0
    assert resumed.headers["authorization"] == f"Bearer {KEY}"
    assert len(chat.sent("POST", "/v1/chat/completions")) == 1  # read on, not asked again

    replayed = replay(server, conversation)  # what the server generated, every byte of it
    assert replayed.status_code == 200, replayed.text
    raw = replayed.content
    said = chat.conversation()[-1]
    assert said["role"] == "assistant" and said["content"] == answer_text(raw)
    assert raw[:offset].endswith(b"\n")  # the page resumed at a line's end, counted in bytes
    head = raw[:offset].decode()
    assert len(head.encode()) != len(head)  # non-ASCII before the offset: characters would have been wrong
    assert chat.stored()["pending"] is None and chat.stored()["messages"][-1]["content"] == said["content"]


def test_stop_deletes_the_stream_and_the_server_goes_idle(chat, server):
    chat.send("go on and on", 1500)
    chat.answer(0).locator(".text span").nth(5).wait_for(timeout=20_000)
    assert chat.page.is_visible("#stop")
    chat.page.click("#stop")
    assert chat.wait_for_state(0, "stopped|done|error", timeout=5_000) == "stopped"
    conversation = chat.stored()["id"]
    [deleted] = chat.sent("DELETE", "/v1/stream")
    assert parse_qs(urlparse(deleted.url).query)["conv_id"] == [conversation]
    assert deleted.headers["authorization"] == f"Bearer {KEY}"
    health = wait_idle(server)  # with the conversation's id, the reader leaving alone would not stop it
    assert health["last"]["n_predict"] < 1500
    assert deleted.response().status == 204
    assert httpx.post(server.url + "/v1/streams/lookup", json={"conversation_ids": [conversation]},
                      headers=AUTH).json() == []

    chat.reload()  # the stopped answer is kept as stopped: nothing to resume
    assert chat.answer(0).get_attribute("data-state") == "stopped"
    assert not chat.sent("POST", "/v1/streams/lookup") and not chat.sent("GET", "/v1/stream")
    assert chat.conversation()[-1]["role"] == "assistant" and chat.conversation()[-1]["content"]


def test_new_chat_forgets_the_stored_conversation(chat):
    chat.send("hello", 3)
    assert chat.wait_for_state(0, "done|error") == "done"
    first = chat.stored()["id"]
    chat.page.click("#new-chat")
    assert chat.stored() is None and chat.conversation() == []
    assert chat.page.locator(".msg").count() == 0 and chat.page.is_visible("#empty")
    assert chat.page.evaluate("() => localStorage.getItem('ggufspec.apiKey')") == KEY  # settings stay
    chat.reload()
    assert chat.page.locator(".msg").count() == 0 and chat.stored() is None
    chat.send("again", 3)
    assert chat.wait_for_state(0, "done|error") == "done"
    assert chat.sent("POST", "/v1/chat/completions")[-1].headers["x-conversation-id"] not in ("", first)
    assert chat.stored()["id"] != first and len(chat.stored()["messages"]) == 2


def reload_with(chat, record: dict, name: str) -> None:
    """Reload the page with `record` stored: written before the page's script runs (the page being left
    saves its own conversation), on this reload only."""
    chat.page.add_init_script(f"if (!sessionStorage.getItem({name!r})) {{ sessionStorage.setItem({name!r}, '1'); "
                              f"localStorage.setItem({STORE_KEY!r}, {json.dumps(json.dumps(record))}); }}")
    chat.reload()


def test_a_stream_gone_leaves_the_partial_answer_marked_as_cut_off(chat):
    # as the page keeps an answer under way; the server never had this conversation (or restarted)
    record = {"id": "chat-gone", "messages": [{"role": "user", "content": "hi"}],
              "pending": {"content": "a partial **answer**", "bytes": 400, "n": 3, "state": "streaming"}}
    reload_with(chat, record, "partial")
    assert chat.wait_for_state(0, "cut-off|done|error") == "cut-off"
    assert "cut off after 3 tokens" in chat.answer(0).locator(".state").inner_text()
    assert chat.answer(0).locator(".text strong").inner_text() == "answer"  # drawn as it was
    assert chat.conversation() == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a partial **answer**"}]
    assert chat.stored()["pending"] is None and chat.stored()["messages"][-1]["shown"]["state"] == "cut-off"
    assert chat.page.is_visible("#send")

    # nothing had come before the reload: the message goes back into the box, as a refused one's
    reload_with(chat, {**record, "pending": {"content": "", "bytes": 0, "state": "waiting"}}, "nothing")
    assert chat.wait_for_state(0, "cut-off|done|error") == "error"
    assert chat.page.input_value("#input") == "hi" and chat.conversation() == []


def test_without_the_markdown_renderer_the_tokens_spans_come_back_too(browser, server):
    context = browser.new_context()
    context.route("**/static/marked.umd.js", lambda route: route.abort())  # answers shown as plain text
    chat = Chat(context, server.url)
    chat.open()
    chat.send("the cat", 5)
    assert chat.wait_for_state(0, "done|error") == "done"
    before = chat.answer(0).locator(".text").inner_html()
    assert 'class="tok target alone"' in before and "md" not in chat.answer(0).locator(".text").get_attribute("class")
    chat.reload()
    assert chat.answer(0).locator(".text").inner_html() == before
    context.close()
    assert not chat.errors, chat.errors


STORAGE = {"full": "Storage.prototype.setItem = function () { throw new DOMException('full', 'QuotaExceededError'); };",
           "off": "Object.defineProperty(window, 'localStorage', {get() { throw new DOMException('no', 'SecurityError'); }});"}


@pytest.mark.parametrize("storage", sorted(STORAGE))
def test_storage_off_or_full_leaves_the_page_working(browser, server, storage):
    context = browser.new_context()
    context.add_init_script(STORAGE[storage])
    chat = Chat(context, server.url)
    chat.open()  # the key typed (where it cannot be kept)
    chat.send("hello", 4)
    assert chat.wait_for_state(0, "done|error") == "done"
    assert chat.answer(0).locator('[data-stat="tokens"]').inner_text() == "4"
    assert "not kept across reloads" in chat.page.inner_text("#storage-note")
    chat.page.click("#new-chat")
    assert chat.page.locator(".msg").count() == 0
    context.close()
    assert not chat.errors, chat.errors
