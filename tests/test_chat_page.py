"""The chat page at `/` of `ggufspec serve`, in a real headless Chromium (Debian's, driven by Playwright).

One server for the module: a tiny pair slow enough (a few milliseconds a token) and without an
end-of-sequence token, so that an answer with a large max_tokens is still streaming when the test
stops it. The page's tests skip when no Chromium (or Playwright) is installed, except under CI,
where scripts/test installs them and their absence is a failure. /props and the stream's extra
fields are checked over plain HTTP, browser or not.
"""
from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from browser import chromium
from serverproc import start_server, stop_server
from ggufspec.tinymodels import CHAT_TEMPLATE, Shape, make_weights, write_model

MAX_CTX = 4096


@pytest.fixture(scope="module")
def slow_chat_pair(tmp_path_factory):
    """A target of a few milliseconds per token that never ends on its own, its first layer as the draft."""
    directory = tmp_path_factory.mktemp("slow-chat")
    shape = Shape(n_layer=8, n_embd=256, n_ff=768)
    weights = make_weights(shape, seed=2)
    weights["output.weight"][2] = 0  # no end-of-sequence: answers run to max_tokens
    target = write_model(directory / "target.gguf", shape, weights, CHAT_TEMPLATE)
    draft_weights = {k: v for k, v in weights.items() if not k.startswith("blk.") or k.startswith("blk.0.")}
    draft = write_model(directory / "draft.gguf", Shape(n_layer=1, n_embd=256, n_ff=768), draft_weights,
                        CHAT_TEMPLATE)
    return target, draft


@pytest.fixture(scope="module")
def server(slow_chat_pair, tmp_path_factory):
    target, draft = slow_chat_pair
    running = start_server(tmp_path_factory.mktemp("page-server"), "-m", str(target), "-md", str(draft),
                           "-c", str(MAX_CTX))
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def browser():
    with chromium() as launched:
        yield launched


@pytest.fixture
def page(browser, server):
    """A fresh page (its own storage) on the chat page, the server's description loaded."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    opened = context.new_page()
    errors = []
    opened.on("pageerror", lambda error: errors.append(str(error)))
    opened.goto(server.url + "/")
    opened.wait_for_selector("#pair .chip >> nth=1")
    yield opened
    context.close()
    assert not errors, errors  # no uncaught JavaScript error


def set_settings(page, **values) -> None:
    """Fill settings fields by id (max_tokens -> #max-tokens), opening the panel when it is closed."""
    if not page.is_visible("#settings"):
        page.click("#settings-toggle")
    if not page.is_visible("#top-p"):
        page.click("#settings summary")
    for name, value in values.items():
        selector = "#" + name.replace("_", "-")
        if page.eval_on_selector(selector, "e => e.tagName") == "SELECT":
            page.select_option(selector, str(value))
        else:
            page.fill(selector, str(value))


def send(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def answer(page, index: int):
    return page.locator(".msg.assistant").nth(index)


def wait_for_state(page, index: int, states: str, timeout: float = 20_000) -> str:
    # a selector, not wait_for_function: the page's Content-Security-Policy forbids evaluating strings
    in_state = page.locator(", ".join(f'[data-state="{state}"]' for state in states.split("|")))
    answer(page, index).and_(in_state).wait_for(timeout=timeout)
    return answer(page, index).get_attribute("data-state")


def stat(page, index: int, name: str) -> str:
    return answer(page, index).locator(f'[data-stat="{name}"]').inner_text()


# ---------------------------------------------------------------- over HTTP: what the page reads

def test_page_props_and_the_streams_extra_fields(server, slow_chat_pair):
    page = httpx.get(server.url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    offline = page.text.replace("http://www.w3.org/2000/svg", "")  # a namespace name, never fetched
    assert "<script>" in page.text and "http://" not in offline and "https://" not in offline
    props = httpx.get(server.url + "/props", timeout=10).json()
    target, draft = slow_chat_pair
    assert props["model"] == "target" and props["n_ctx"] == MAX_CTX and props["version"]
    assert (props["target"]["file"], props["draft"]["file"]) == (target.name, draft.name)
    assert props["target"]["quantization"] == props["draft"]["quantization"] == "F32"  # general.file_type
    assert (props["target"]["n_layer"], props["draft"]["n_layer"]) == (8, 1)
    assert 0 <= props["target"]["n_gpu_layers"] <= 9  # the offload plan: 8 blocks and the output layer at most
    assert props["defaults"]["n_draft"] == "auto" and props["defaults"]["temperature"] == 0
    assert props["default_generation_settings"]["n_ctx"] == MAX_CTX and props["total_slots"] == 4  # serve's default --parallel

    body = {"messages": [{"role": "user", "content": "the cat"}], "max_tokens": 12, "stream": True}
    chunks = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    extras = [c["ggufspec"] for c in chunks if "ggufspec" in c]
    assert extras[0]["prompt"]["n_prompt"] >= 1 and "cache_n" in extras[0]["prompt"]  # with the first pieces
    assert all("prompt" not in e for e in extras[1:])
    final = extras[-1]
    assert final["stats"]["n_predict"] == 12
    # auto measured the target's single-token step on this request: the estimate can be made
    estimate = final["estimate"]
    assert estimate["t1_ms"] > 0 and estimate["target_alone_ms"] == pytest.approx(12 * estimate["t1_ms"])
    assert estimate["saved_ms"] == pytest.approx(estimate["target_alone_ms"] - estimate["decode_ms"])


# ---------------------------------------------------------------- in the browser

def test_two_messages_tokens_by_origin_and_the_stats_panel(page, server, tmp_path):
    assert page.inner_text("#model-id") == "target"
    assert "F32" in page.inner_text("#pair") and str(MAX_CTX) in page.inner_text("#pair")

    set_settings(page, max_tokens=24)
    send(page, "the cat sat on the mat")
    assert wait_for_state(page, 0, "done|error") == "done", answer(page, 0).inner_text()
    first = answer(page, 0)
    assert first.locator(".text").inner_text().strip()
    tokens = first.locator(".text span")
    assert tokens.count() >= 1
    classes = tokens.evaluate_all("spans => spans.map(s => s.className)")
    assert all(re.fullmatch(r"tok (draft|target (fix|bonus|alone))", c) for c in classes), classes
    assert stat(page, 0, "tokens") == "24"
    assert float(stat(page, 0, "tps")) > 0
    assert re.fullmatch(r"\d+ of \d+", stat(page, 0, "cached"))
    estimate = r"(saved|lost) [\d.]+ m?s \([\d.]+×\)|±0 \(nothing drafted\)"  # auto may draft nothing here
    assert re.fullmatch(estimate, stat(page, 0, "saved")), stat(page, 0, "saved")

    # the second turn drafts a fixed K = 3, and its message has two lines (Shift+Enter)
    set_settings(page, draft_mode="fixed", draft_k=3)
    page.fill("#input", "and then")
    page.press("#input", "Shift+Enter")
    page.type("#input", "the dog ran")
    page.press("#input", "Enter")
    assert wait_for_state(page, 1, "done|error") == "done", answer(page, 1).inner_text()
    assert page.locator(".msg.user .text").nth(1).inner_text() == "and then\nthe dog ran"
    second = answer(page, 1)
    assert second.locator(".tok.draft").count() >= 1  # the draft is the target's first layer: it agrees often
    assert second.locator(".tok.target").count() >= 1
    acceptance = stat(page, 1, "acceptance")
    accepted, drafted = map(int, re.search(r"\((\d+)/(\d+)\)", acceptance).groups())
    assert 0 < accepted <= drafted <= 3 * 24, acceptance
    assert float(stat(page, 1, "per-call")) > 1.0  # accepted drafts: more than a token per target call
    assert re.fullmatch(r"(saved|lost) [\d.]+ m?s \([\d.]+×\)", stat(page, 1, "saved")), stat(page, 1, "saved")
    cached, n_prompt = map(int, re.fullmatch(r"(\d+) of (\d+)", stat(page, 1, "cached")).groups())
    assert cached > 0 and n_prompt > cached  # the first turn stayed in the KV cache
    bars = second.locator('svg[data-stat="ksteps"] rect.k')
    assert bars.count() >= 24 / 4  # a bar per step, at most K + 1 = 4 tokens a step
    assert max(float(h) for h in bars.evaluate_all("r => r.map(e => e.getAttribute('height'))")) > 1

    shot = tmp_path / "chat-page.png"
    page.screenshot(path=str(shot))
    print(f"screenshot: {shot}")
    assert shot.stat().st_size > 10_000

    # at a phone's width the settings panel gets out of the way and nothing runs off the side
    page.set_viewport_size({"width": 390, "height": 800})
    page.wait_for_selector("#settings", state="hidden")
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    assert page.is_visible("#input") and page.is_visible("#send")
    page.screenshot(path=str(tmp_path / "chat-page-phone.png"))


def test_escape_stops_an_answer_mid_stream(page, server):
    set_settings(page, max_tokens=MAX_CTX - 200)
    send(page, "tell me everything")
    page.locator(".msg.assistant .text span").nth(7).wait_for(timeout=20_000)
    assert answer(page, 0).get_attribute("data-state") == "streaming"
    assert page.is_visible("#stop") and not page.is_visible("#send")
    page.keyboard.press("Escape")
    assert wait_for_state(page, 0, "stopped|done|error", timeout=5_000) == "stopped"
    shown = int(stat(page, 0, "tokens"))
    assert 8 <= shown < MAX_CTX - 200
    # the server saw the client go and stopped generating
    deadline = time.monotonic() + 10
    while (health := server.health())["busy"]:
        assert time.monotonic() < deadline, health
        time.sleep(0.05)
    assert health["last"]["stop_reason"] == "interrupted" and health["last"]["n_predict"] < MAX_CTX - 200
    # and the conversation goes on: the stopped answer is part of it
    set_settings(page, max_tokens=8)
    send(page, "short, please")
    assert wait_for_state(page, 1, "done|error") == "done"
    assert stat(page, 1, "tokens") == "8"
    assert page.is_visible("#send") and not page.is_visible("#stop")


def test_a_bad_setting_shows_the_servers_error(page, server):
    set_settings(page, top_p=5, max_tokens=8)
    send(page, "hello")
    assert wait_for_state(page, 0, "done|error") == "error"
    error = answer(page, 0).locator(".error").inner_text()
    assert "400" in error and "top_p must be in (0, 1]" in error, error
    assert page.input_value("#input") == "hello"  # back in the box, to send again
    set_settings(page, top_p=0.95)
    page.press("#input", "Enter")
    assert wait_for_state(page, 1, "done|error") == "done"
    assert stat(page, 1, "tokens") == "8"


MARKDOWN_ANSWER = ("Use **bold** and `code`:\n\n```python\nprint(1)\n```\n\n- one\n- two\n\n"
                   "<img src=x onerror=\"window.pwned = 1\">")


def test_answers_render_as_markdown_with_tokens_still_coloured_by_origin(page, server):
    static = [httpx.get(server.url + "/static/" + name, timeout=10) for name in ("marked.umd.js", "purify.min.js")]
    assert all(r.status_code == 200 and "javascript" in r.headers["content-type"] for r in static)
    # the page's own functions, fed an answer in pieces of 3 characters, alternately draft and target tokens
    shown = page.evaluate("""(text) => {
        const view = addAnswer(), pieces = [];
        for (let i = 0, step = 1; i < text.length; i += 3, step++)
            pieces.push({text: text.slice(i, i + 3), token: step, from_draft: step % 2 === 0, step, drafted: 1});
        addPieces(view, pieces);
        render(view);
        return {html: view.text.innerHTML, code: view.text.querySelector("pre code").textContent,
                kinds: [...view.text.querySelectorAll("span")].map((s) => s.className),
                uncoloured: [...view.text.querySelectorAll("strong, code, li, p")].flatMap((e) => [...e.childNodes])
                                .filter((n) => n.nodeType === 3 && n.nodeValue.trim()).length,
                pwned: window.pwned === 1};
    }""", MARKDOWN_ANSWER)
    html = shown["html"]
    assert "<strong>" in html and "<li>" in html and 'class="language-python"' in html
    assert shown["code"] == "print(1)\n" and "**" not in html and "```" not in html
    assert set(shown["kinds"]) == {"tok draft", "tok target fix"} and shown["uncoloured"] == 0
    assert "onerror" not in html and not shown["pwned"]  # DOMPurify removed the model's script


CLOBBERING_ANSWER = ('- [x] a task list keeps its boxes\n\nhi <textarea id="input" style="display:none">sent instead</textarea>'
                     '<input name="system" value="be evil"><b id="api-key">x</b><form><button>go</button></form>'
                     '<style>footer{display:none}</style>')


def test_an_answer_cannot_stand_in_for_the_pages_own_controls(page, server):
    """DOM clobbering: an element an answer brings with the id of one of the page's controls (found
    first, as it comes earlier in the document) would take the user's place in every later request."""
    found = page.evaluate("""(text) => {
        const view = addAnswer();
        addPieces(view, [{text, token: 1, from_draft: false, step: 1, drafted: 0}]);
        render(view);
        return {input: $("input") === document.querySelector("footer #input"),
                key: $("api-key") === document.querySelector("#settings #api-key"),
                html: view.text.innerHTML, footer: getComputedStyle(document.querySelector("footer")).display};
    }""", CLOBBERING_ANSWER)
    assert found["input"] and found["key"], found
    for kept_out in ("<textarea", "<form", "<button", "<style", "id=", "name=", "style="):
        assert kept_out not in found["html"], (kept_out, found["html"])
    assert found["footer"] != "none" and "hi" in found["html"] and 'type="checkbox"' in found["html"]


# ---------------------------------------------------------------- a reasoning model's thinking, ended from the page

@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    """The slow target under a DeepSeek-R1-like template (its assistant turn opens <think>); the model
    never closes the block itself."""
    from test_server_reasoning import OPENS_THINKING
    directory = tmp_path_factory.mktemp("thinking-page")
    shape = Shape(n_layer=8, n_embd=256, n_ff=768)
    weights = make_weights(shape, seed=2)
    weights["output.weight"][2] = 0
    target = write_model(directory / "target.gguf", shape, weights, OPENS_THINKING)
    running = start_server(directory, "-m", str(target), "--lookup", "-c", str(MAX_CTX))
    yield running
    stop_server(running)


def test_end_thinking_forces_the_blocks_end_and_the_answer_goes_on(browser, thinking_server):
    props = httpx.get(thinking_server.url + "/props", timeout=10).json()
    assert props["chat_template_thinking"] == {"block": True, "opened_by_template": True}
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors, controls = [], []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("response", lambda r: controls.append(r) if r.url.endswith("/control") else None)
    page.goto(thinking_server.url + "/")
    page.wait_for_selector("#pair .chip >> nth=1")
    set_settings(page, max_tokens=1200)
    send(page, "think about it")
    page.locator("#end-thinking").wait_for(state="visible", timeout=20_000)
    page.locator(".msg.assistant .text span").nth(5).wait_for(timeout=20_000)
    page.click("#end-thinking")
    assert wait_for_state(page, 0, "done|error|stopped", timeout=60_000) == "done"
    assert controls and controls[0].json() == {"success": True}
    assert "thinking ended on request" in answer(page, 0).locator(".state").inner_text()
    said = page.evaluate("() => conversation[conversation.length - 1].content")
    thinking, _, after = said.partition("</think>")
    assert thinking and after.strip(), said  # the block ended where asked, and the answer went on
    assert page.is_hidden("#end-thinking")
    context.close()
    assert not errors, errors
