"""A reasoning model's thinking in OpenAI chat answers (llama-server's `reasoning_content`, its
`reasoning_format` and `--reasoning-format`), and the chat template's variables (`chat_template_kwargs`,
`--chat-template-kwargs`, `reasoning_effort`, `--reasoning-budget 0`, Anthropic's `thinking`, the Responses
API's `reasoning.effort`) that turn thinking off the way Qwen3's template does."""
from __future__ import annotations

import anthropic
import httpx
import pytest
from click.testing import CliRunner

from ggufspec import tools as toolkit
from ggufspec.cli import main
from ggufspec.server.choices import ChoiceState
from ggufspec.server.constraints import Shaping
from ggufspec.server.protocols.reasoning import ReasoningContent
from ggufspec.tinymodels import Shape, make_weights, write_model
from serverproc import serving

HI = [{"role": "user", "content": "hi"}]
# Qwen3's switch: with enable_thinking false the template writes an empty thinking block itself
QWEN3_LIKE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
              "{% if add_generation_prompt %}<s>assistant:{% if enable_thinking is defined and not enable_thinking %}"
              "<think>\n\n</think>\n\n{% endif %}{% endif %}{# reasons in <think>...</think> #}")
# DeepSeek-R1's: the assistant's turn opens the block, so the answer starts inside it
OPENS_THINKING = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<s>assistant:{% if enable_thinking is defined and not enable_thinking %}"
                  "<think></think>{% else %}<think>\n{% endif %}{% endif %}")
THINK_GRAMMAR = 'root ::= "<think>" [a-z]{2,6} "</think>" [a-z]{2,6}'
OPENED_GRAMMAR = 'root ::= [a-z]{2,6} "</think>" [a-z]{2,6}'


def reasoner(directory, template):
    shape = Shape(eos_bias=4.0)
    return write_model(directory / "reasoner.gguf", shape, make_weights(shape, 0), template)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    target = reasoner(tmp_path_factory.mktemp("qwen3-like"), QWEN3_LIKE)
    with serving(tmp_path_factory.mktemp("reasoning"), "-m", str(target), "--no-draft", "-c", "512") as running:
        yield running


def ask(server, **fields):
    body = {"messages": HI, "max_tokens": 24, "grammar": THINK_GRAMMAR, **fields}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]


def test_thinking_is_reasoning_content_whole_and_streamed_as_llama_server_gives_it(server):
    raw = ask(server, reasoning_format="none")["content"]
    thinking, answer = raw.removeprefix("<think>").split("</think>")
    assert thinking.isalpha() and answer.isalpha()
    message = ask(server)
    assert (message["reasoning_content"], message["content"]) == (thinking, answer)
    assert ask(server, reasoning_format="deepseek-legacy") == {**message, "content": raw}
    stream = server.client().chat.completions.create(model="reasoner", messages=HI, max_tokens=24, stream=True,
                                                     extra_body={"grammar": THINK_GRAMMAR})
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thinking
    assert "".join(d.content or "" for d in deltas) == answer


def test_enable_thinking_false_reaches_the_template_from_every_protocol(server):
    def prompt(**fields):
        return httpx.post(server.url + "/apply-template", json={"messages": HI, **fields}, timeout=30).json()["prompt"]
    assert not prompt().endswith("</think>\n\n")
    closed = prompt(chat_template_kwargs={"enable_thinking": False})
    assert closed.endswith("<s>assistant:<think>\n\n</think>\n\n")
    assert prompt(reasoning_effort="none") == closed
    assert prompt(chat_template_kwargs={"enable_thinking": True}) == prompt()
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    count = lambda **kw: claude.messages.count_tokens(model="m", messages=HI, **kw).input_tokens  # noqa: E731
    assert count(thinking={"type": "disabled"}) > count() == count(thinking={"type": "enabled", "budget_tokens": 1024})
    responses = server.client().responses
    tokens = lambda **kw: responses.create(model="reasoner", input="hi", max_output_tokens=1, **kw).usage.input_tokens  # noqa: E731
    assert tokens(reasoning={"effort": "none"}) == count(thinking={"type": "disabled"}) > tokens()


def test_a_template_that_opens_thinking_is_followed_per_request(tmp_path):
    target = reasoner(tmp_path, OPENS_THINKING)
    with serving(tmp_path, "-m", str(target), "--no-draft", "-c", "512") as server:
        message = ask(server, grammar=OPENED_GRAMMAR)
        thinking, answer = message["reasoning_content"], message["content"]
        assert thinking.isalpha() and answer.isalpha()
        off = ask(server, grammar='root ::= [a-z]{2,6}', chat_template_kwargs={"enable_thinking": False})
        assert "reasoning_content" not in off and off["content"].isalpha()  # the block was closed by the prompt


def test_server_flags_set_every_requests_variables(tmp_path):
    target = reasoner(tmp_path, QWEN3_LIKE)
    for flags in (["--reasoning-budget", "0"], ["--chat-template-kwargs", '{"enable_thinking": false}'], ["-rea", "off"]):
        with serving(tmp_path, "-m", str(target), "--no-draft", "-c", "512", "--reasoning-format", "none",
                     *flags) as server:
            prompt = httpx.post(server.url + "/apply-template", json={"messages": HI}, timeout=30).json()["prompt"]
            assert prompt.endswith("<think>\n\n</think>\n\n")
            reopened = httpx.post(server.url + "/apply-template", timeout=30, json={
                "messages": HI, "chat_template_kwargs": {"enable_thinking": True}}).json()["prompt"]
            assert reopened.endswith("assistant:")
            assert "<think>" in ask(server)["content"]  # --reasoning-format none: left in content


@pytest.mark.parametrize("fields, words", [
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, "enable_thinking must be true or false"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages is set by the server"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"reasoning_format": "verbose"}, "reasoning_format"),
])
def test_bad_template_variables_are_one_line_400s(server, fields, words):
    response = httpx.post(server.url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 2, **fields},
                          timeout=30)
    error = response.json()["error"]
    assert response.status_code == 400 and words in error["message"] and "\n" not in error["message"], error


@pytest.mark.parametrize("flags, words", [
    (["--chat-template-kwargs", "{enable"], "--chat-template-kwargs is no JSON"),
    (["--chat-template-kwargs", "[1]"], "must be a JSON object"),
    (["--chat-template-kwargs", '{"tools": 1}'], "tools is set by the renderer"),
    (["--reasoning-budget", "-2"], "--reasoning-budget must be >= -1"),
    (["--reasoning-budget-message", "Enough."], "give --reasoning-budget N too"),
])
def test_bad_server_flags_are_one_line(flags, words):
    result = CliRunner().invoke(main, ["serve", "-m", "/nonexistent.gguf", *flags])
    line = result.stderr.strip()
    assert result.exit_code == 2 and words in line and "\n" not in line, result.stderr


def test_a_call_after_thinking_is_parsed_from_the_answer_not_the_thinking():
    """Qwen3 thinks, then calls: the thinking is reasoning_content, the call a tool call, no content."""
    fmt = toolkit.detect_format("{{ tools }} <tool_call>")
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    shape = Shaping(plan=toolkit.plan_tools(tools, "auto", None, fmt), fmt=fmt)
    text = '<think>I should read it</think>\n\n<tool_call>\n{"name": "read_file", "arguments": {}}\n</tool_call>'
    streamed = ChoiceState(0, shape, chat=True, new_reasoning=lambda: ReasoningContent(False))
    released = streamed.push([{"text": c} for c in text])
    assert streamed.take_thinking() == "I should read it" and "".join(p["text"] for p in released).strip() == ""
    _, content, calls = streamed.end()
    assert content is None and [c["function"]["name"] for c in calls] == ["read_file"]
    whole = ChoiceState(0, shape, chat=True, new_reasoning=lambda: ReasoningContent(False))
    whole.pieces = [{"text": text[:9]}, {"text": text[9:]}]
    message, called = whole.message()
    assert called and message["reasoning_content"] == "I should read it" and message["content"] is None


def test_a_prefill_that_opens_or_closes_thinking_decides_where_the_answer_starts():
    from ggufspec.server.chatturn import opens_thinking
    assert opens_thinking("<s>assistant:<think>\n", "")
    assert not opens_thinking("<s>assistant:<think>\n", "plan</think>\n")
    assert opens_thinking("<s>assistant:<think>\n", "plan")  # still thinking
    assert opens_thinking("<s>assistant:", "<think>let me")
    assert not opens_thinking("<s>assistant:", "Sure")
    assert not opens_thinking("<s>assistant:<think></think>", "")


# ---------------------------------------------------------------- the same variables on run --chat and chat

def test_run_chat_and_the_terminal_chat_take_the_template_variables(tmp_path, monkeypatch):
    """llama-cli's --chat-template-kwargs and --reasoning-budget 0: Qwen3's empty thinking block written by
    the template itself, one prompt token count longer than without."""
    import json

    from ggufspec.speculate import SpeculativeDecoder
    target = reasoner(tmp_path, QWEN3_LIKE)
    base = ["run", "-m", str(target), "--no-draft", "-p", "hi", "--chat", "-n", "2", "-t", "1", "-c", "256", "--json"]
    n_prompt = lambda *flags: json.loads(CliRunner().invoke(main, [*base, *flags]).stdout)["stats"]["n_prompt"]  # noqa: E731
    alone = n_prompt()
    closed = n_prompt("--chat-template-kwargs", '{"enable_thinking": false}')
    assert closed > alone and n_prompt("--reasoning-budget", "0") == closed
    assert n_prompt("--chat-template-kwargs", '{"enable_thinking": true}') == alone
    assert n_prompt("-rea", "off") == n_prompt("--reasoning", "false") == closed and n_prompt("-rea", "on") == alone
    for flags in (["--chat-template-kwargs", "{}"], ["-rea", "off"], ["--reasoning-effort", "low"]):
        refused = CliRunner().invoke(main, ["run", "-m", str(target), "-p", "hi", *flags])
        assert refused.exit_code == 2 and "give --chat too" in refused.stderr, flags
    clash = CliRunner().invoke(main, [*base, "-rea", "on", "--chat-template-kwargs", '{"enable_thinking": false}'])
    assert clash.exit_code == 2 and "contradict each other" in clash.stderr
    rendered = []
    original = SpeculativeDecoder.render_chat
    monkeypatch.setattr(SpeculativeDecoder, "render_chat",
                        lambda self, messages, **variables: rendered.append(variables) or original(self, messages, **variables))
    result = CliRunner().invoke(main, ["chat", "-m", str(target), "--no-draft", "-n", "2", "-t", "1", "-c", "256",
                                       "--reasoning-budget", "0", "--reasoning-effort", "high"], input="hi\n")
    assert result.exit_code == 0, result.output
    # and llama-cli's --reasoning-preserve, on by default in chat (the template's preserve_reasoning)
    assert rendered == [{"enable_thinking": False, "reasoning_effort": "high", "preserve_reasoning": True}]
