"""A chat's last assistant message continued on /v1/chat/completions (llama-server's --prefill-assistant,
vLLM's and transformers' `continue_final_message` and `add_generation_prompt`), serve's --skip-chat-parsing
and --reasoning-preserve, and llama-server's request fields that ggufspec now honours or refuses in one
line (parse_tool_calls, post_sampling_probs, n_probs, n_cmpl, reasoning_budget_*_tag, n_cache_reuse...).

A prefill's answer is what the target alone continues from the same text (the /apply-template prompt,
through /v1/completions with the draft off): greedy, drafted (K=3, auto, lookup) and with --no-draft, whole
and streamed. Real servers on loopback: the tiny chat pair (its template knows no <think>), and one tiny
reasoning model under a Qwen3-like template that also shows the variables --reasoning-preserve sets."""
from __future__ import annotations

import inspect
import json
import math

import httpx
import pytest

from ggufspec.server.app import create_app
from ggufspec.server.chatturn import AnswerStart
from serverproc import pair_server_fixture, serving
from test_server_reasoning import OPENED_GRAMMAR, QWEN3_LIKE, THINK_GRAMMAR, reasoner

HI = [{"role": "user", "content": "hi"}]
PREFILLED = [*HI, {"role": "assistant", "content": " the cat"}]
SCHEMA = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"],
          "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "set_unit", "description": "choose the unit", "parameters": SCHEMA}}
# what --reasoning-preserve and reasoning_effort set, shown in front of the conversation
SHOWN = ("{% if preserve_thinking is defined %}{{ '[keep]' if preserve_thinking and not clear_thinking and not "
         "drop_thinking and not truncate_history_thinking else '[drop]' }}{% endif %}"
         "{% if reasoning_strength is defined %}[{{ reasoning_strength }}]{% endif %}")
WIRED = "chat" in inspect.signature(create_app).parameters  # serve_flags' ChatSettings passed on to Serving


server = pair_server_fixture("-c", "2048")


@pytest.fixture(scope="module")
def thinker_model(tmp_path_factory):
    return reasoner(tmp_path_factory.mktemp("thinker"), SHOWN + QWEN3_LIKE)


@pytest.fixture(scope="module")
def thinker(thinker_model, tmp_path_factory):
    with serving(tmp_path_factory.mktemp("thinking"), "-m", str(thinker_model), "--no-draft", "-c", "512") as running:
        yield running


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def ok(server, path: str, body: dict) -> dict:
    response = post(server, path, body)
    assert response.status_code == 200, response.text
    return response.json()


def refused(server, body: dict, param: str, path: str = "/v1/chat/completions") -> str:
    response = post(server, path, {"max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "\n" not in error["message"], error
    return error["message"]


def prompt_of(server, **body) -> str:
    return ok(server, "/apply-template", body)["prompt"]


def alone(server, prompt: str, **fields) -> dict:
    """What the target alone continues from `prompt` (greedy, no draft): /v1/completions' choice."""
    body = {"prompt": prompt, "temperature": 0, "draft": 0, **fields}
    return ok(server, "/v1/completions", body)


def streamed(server, body: dict) -> tuple[str, str, list]:
    """A streamed chat answer: (content, reasoning_content, the chunks)."""
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    return ("".join(d.get("content") or "" for d in deltas), "".join(d.get("reasoning_content") or "" for d in deltas),
            chunks)


# ---------------------------------------------------------------- the prefill: the target's own continuation

@pytest.mark.parametrize("drafting", [{"draft": 3}, {"draft": "auto"}, {"lookup": True}, {"draft": 0}])
def test_a_last_assistant_message_is_continued_as_the_target_alone_continues_it(server, drafting):
    """llama-server's default (--prefill-assistant): the conversation before the message, the template's
    assistant turn, the message; the answer is what follows it, drafted (K=3, auto, n-gram lookup) or
    not, whole and streamed."""
    prompt = prompt_of(server, messages=PREFILLED)
    assert prompt == "<s>user: hi\n<s>assistant: the cat"  # CHAT_TEMPLATE's turn, then the message as it is
    expected = alone(server, prompt, max_tokens=16)
    body = {"messages": PREFILLED, "max_tokens": 16, "temperature": 0, **drafting}
    answer = ok(server, "/v1/chat/completions", body)
    assert answer["choices"][0]["message"]["content"] == expected["choices"][0]["text"]
    assert answer["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]
    assert streamed(server, body)[0] == expected["choices"][0]["text"]
    if drafting == {"draft": 3}:  # drafted indeed
        assert answer["ggufspec"]["stats"]["n_drafted"] > 0


def test_continue_final_message_and_add_generation_prompt_as_vllm_and_llama_server_take_them(server):
    explicit = {"continue_final_message": True, "add_generation_prompt": False}
    prompt = prompt_of(server, messages=PREFILLED)
    assert prompt_of(server, messages=PREFILLED, **explicit) == prompt
    named = {"continue_final_message": "content", "add_generation_prompt": False}
    assert prompt_of(server, messages=PREFILLED, **named) == prompt
    answer = server.client().chat.completions.create(model="target", messages=PREFILLED, max_tokens=8, temperature=0,
                                                     extra_body=explicit)
    assert answer.choices[0].message.content == alone(server, prompt, max_tokens=8)["choices"][0]["text"]
    # no continuation: the conversation closed, no assistant turn opened (the model goes on from there)
    closed = prompt_of(server, messages=HI, add_generation_prompt=False)
    assert closed == "<s>user: hi\n"
    body = {"messages": HI, "add_generation_prompt": False, "max_tokens": 8, "temperature": 0}
    assert ok(server, "/v1/chat/completions", body)["choices"][0]["message"]["content"] == \
        alone(server, closed, max_tokens=8)["choices"][0]["text"]
    # llama-server writes a continued message's text parts with blank lines between them
    parts = [*HI, {"role": "assistant", "content": [{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]}]
    assert prompt_of(server, messages=parts).endswith("<s>assistant:Wh\n\nill")
    tokens = ok(server, "/v1/chat/completions/input_tokens", {"messages": PREFILLED})
    assert tokens == {"input_tokens": alone(server, prompt, max_tokens=1)["usage"]["prompt_tokens"],
                      "object": "response.input_tokens"}


@pytest.mark.parametrize("body, param, says", [
    ({"messages": PREFILLED, "continue_final_message": True}, "add_generation_prompt", "both true"),
    ({"messages": [*PREFILLED, {"role": "assistant", "content": "x"}]}, "messages", "both the assistant's"),
    ({"messages": [*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "set_unit", "arguments": "{}"}}]}]}, "messages",
     "tool_calls cannot be continued"),
    ({"messages": HI, "continue_final_message": True, "add_generation_prompt": False}, "continue_final_message",
     "must be the assistant's"),
    ({"messages": PREFILLED[1:], "continue_final_message": True, "add_generation_prompt": False}, "messages",
     "only the assistant's message"),
    ({"messages": PREFILLED, "continue_final_message": "reasoning_content", "add_generation_prompt": False},
     "continue_final_message", "no <think> block"),
    ({"messages": PREFILLED, "continue_final_message": "everything"}, "continue_final_message",
     "must be a boolean or 'content' or 'reasoning_content'"),
    ({"messages": PREFILLED, "echo": True}, "echo", "echo is not supported on chat"),
])
def test_what_cannot_be_continued_is_a_400(server, body, param, says):
    for path in ("/v1/chat/completions", "/apply-template"):
        assert says in refused(server, body, param, path)


# ---------------------------------------------------------------- a template that knows <think>

def test_a_continued_message_goes_in_the_thinking_tags_as_llama_server_writes_it(thinker):
    """Content: an empty (or the message's own) thinking block closed before it, so the answer is content;
    reasoning_content alone (or continue_final_message "reasoning_content"): the block left open, so the
    answer goes on thinking, then answers. The same whole and streamed, and the target's own text."""
    answer = [*HI, {"role": "assistant", "content": "so"}]
    prompt = prompt_of(thinker, messages=answer)
    assert prompt.endswith("<s>assistant:<think></think>so")
    grammar = 'root ::= [a-z]{2,6}'
    expected = alone(thinker, prompt, max_tokens=8, grammar=grammar)["choices"][0]["text"]
    body = {"messages": answer, "max_tokens": 8, "temperature": 0, "grammar": grammar}
    message = ok(thinker, "/v1/chat/completions", body)["choices"][0]["message"]
    assert message["content"] == expected and "reasoning_content" not in message
    assert streamed(thinker, body)[:2] == (expected, "")

    thinking = [*HI, {"role": "assistant", "content": "", "reasoning_content": "let me"}]
    prompt = prompt_of(thinker, messages=thinking)
    assert prompt.endswith("<s>assistant:<think>let me")
    assert prompt_of(thinker, messages=[*HI, {"role": "assistant", "content": "so", "reasoning_content": "let me"}],
                     continue_final_message="reasoning_content", add_generation_prompt=False) == prompt
    raw = alone(thinker, prompt, max_tokens=24, grammar=OPENED_GRAMMAR)["choices"][0]["text"]
    thought, said = raw.split("</think>")
    body = {"messages": thinking, "max_tokens": 24, "temperature": 0, "grammar": OPENED_GRAMMAR}
    message = ok(thinker, "/v1/chat/completions", body)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (thought, said)
    assert streamed(thinker, body)[:2] == (said, thought)


def test_the_assistant_turn_is_cut_at_a_think_it_opens():
    """DeepSeek-R1's assistant turn opens <think> itself: the message's own block replaces it."""
    turn = "<s>assistant:<think>\n"
    assert AnswerStart("content", "Sure", thinks=True).after(turn) == ("<s>assistant:", "<think></think>Sure")
    assert AnswerStart("reasoning_content", "", "hm", thinks=True).after(turn) == ("<s>assistant:", "<think>hm")
    assert AnswerStart("content", "Sure").after(turn) == (turn, "Sure")


def test_preserve_reasoning_is_on_by_default_and_a_request_may_turn_it_off(thinker):
    """llama-server sets the template's preserve_reasoning (and what its jinja derives from it:
    preserve_thinking, clear_thinking, truncate_history_thinking, drop_thinking) unless told otherwise;
    reasoning_effort also reaches it as reasoning_strength."""
    assert prompt_of(thinker, messages=HI).startswith("[keep]<s>user")
    assert prompt_of(thinker, messages=HI, chat_template_kwargs={"preserve_reasoning": False}).startswith("[drop]")
    assert prompt_of(thinker, messages=HI, reasoning_effort="high").startswith("[keep][high]<s>user")


# ---------------------------------------------------------------- llama-server's other fields

def test_parse_tool_calls_false_leaves_the_call_in_the_content(server):
    body = {"messages": HI, "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 128,
            "temperature": 0}
    parsed = ok(server, "/v1/chat/completions", body)["choices"][0]
    assert parsed["finish_reason"] == "tool_calls"
    assert parsed["message"]["tool_calls"][0]["function"]["name"] == "set_unit"
    left = ok(server, "/v1/chat/completions", {**body, "parse_tool_calls": False})["choices"][0]
    assert left["finish_reason"] == "stop" and not left["message"].get("tool_calls")
    assert left["message"]["content"].lstrip().startswith("<tool_call>") and '"set_unit"' in left["message"]["content"]
    assert streamed(server, {**body, "parse_tool_calls": False})[0] == left["message"]["content"]


def test_post_sampling_probs_and_n_probs_on_chat(server):
    """llama-server's: the entries as probabilities (prob, top_probs); n_probs asks for them without logprobs."""
    body = {"messages": HI, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    logs = ok(server, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    post_sampling = {**body, "post_sampling_probs": True}
    probs = ok(server, "/v1/chat/completions", post_sampling)["choices"][0]["logprobs"]["content"]
    assert [p["token"] for p in probs] == [e["token"] for e in logs] and len(probs) == 4
    for entry, prob in zip(logs, probs):
        assert prob["prob"] == pytest.approx(math.exp(entry["logprob"]), rel=1e-3) and "logprob" not in prob
        tops = [math.exp(top["logprob"]) for top in entry["top_logprobs"]]
        assert [top["prob"] for top in prob["top_probs"]] == pytest.approx(tops, rel=1e-3)  # two runs: float noise
    chunks = [c["choices"][0] for c in streamed(server, post_sampling)[2] if c["choices"]]
    streamed_probs = [entry for c in chunks if c["logprobs"] for entry in c["logprobs"]["content"]]
    assert [e["token"] for e in streamed_probs] == [e["token"] for e in probs]
    assert [e["prob"] for e in streamed_probs] == pytest.approx([e["prob"] for e in probs], rel=1e-3)
    by_n_probs = ok(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 4, "temperature": 0, "n_probs": 2})
    asked = by_n_probs["choices"][0]["logprobs"]["content"]
    assert [[top["token"] for top in entry["top_logprobs"]] for entry in asked] == \
        [[top["token"] for top in entry["top_logprobs"]] for entry in logs]
    assert [entry["logprob"] for entry in asked] == pytest.approx([entry["logprob"] for entry in logs], rel=1e-3)
    legacy = {"prompt": "hi", "post_sampling_probs": True}
    assert "post_sampling_probs" in refused(server, legacy, "post_sampling_probs", "/v1/completions")


def test_n_cmpl_line_limits_and_the_budgets_tags(server):
    """n_cmpl (llama-server's `n`), n_indent and t_max_predict_ms on chat as on /completion; the thinking
    budget's tags taken where they are ggufspec's own, refused otherwise; n_cache_reuse only at 0."""
    assert len(ok(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "n_cmpl": 2})["choices"]) == 2
    prompt = prompt_of(server, messages=HI)
    limited = {"max_tokens": 24, "temperature": 0, "n_indent": 2, "t_max_predict_ms": 60_000}
    native = ok(server, "/completion", {"prompt": prompt, "draft": 0, **limited})["content"]
    assert ok(server, "/v1/chat/completions", {"messages": HI, **limited})["choices"][0]["message"]["content"] == native
    tags = {"reasoning_budget_tokens": 4, "reasoning_budget_start_tag": "<think>",
            "reasoning_budget_end_tags": ["</think>"]}
    ok(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, **tags, "reasoning_budget_end_tag": "x"})
    assert "'<seed:think>' is not supported" in refused(
        server, {"messages": HI, "reasoning_budget_start_tag": "<seed:think>"}, "reasoning_budget_start_tag")
    assert "</seed:think>" in refused(server, {"prompt": "hi", "reasoning_budget_end_tag": "</seed:think>"},
                                      "reasoning_budget_end_tags", "/completion")
    ok(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "n_cache_reuse": 0})
    assert "KV shifting" in refused(server, {"messages": HI, "n_cache_reuse": 256}, "n_cache_reuse")


# ---------------------------------------------------------------- serve's flags

def test_the_flags_are_llama_servers_and_give_the_chat_settings():
    from ggufspec.cli.generate import serve
    from ggufspec.cli.serve_flags import server_flags
    from ggufspec.server.chatturn import ChatSettings

    def settings(*flags):
        return server_flags(dict(serve.make_context("serve", ["-m", "x.gguf", *flags]).params))["chat"]
    assert settings() == ChatSettings(prefill_assistant=True, skip_chat_parsing=False, preserve_reasoning=None)
    assert settings("--no-prefill-assistant", "--skip-chat-parsing", "--no-reasoning-preserve") == \
        ChatSettings(prefill_assistant=False, skip_chat_parsing=True, preserve_reasoning=False)
    assert settings("--prefill-assistant", "--no-skip-chat-parsing", "--reasoning-preserve").preserve_reasoning is True
    # preserve_reasoning: on unless --chat-template-kwargs set it; the flag over them
    assert ChatSettings().template_defaults({"a": 1}) == {"preserve_reasoning": True, "a": 1}
    assert ChatSettings().template_defaults({"preserve_reasoning": False}) == {"preserve_reasoning": False}
    assert ChatSettings(preserve_reasoning=True).template_defaults({"preserve_reasoning": False}) == \
        {"preserve_reasoning": True}


@pytest.mark.skipif(not WIRED, reason="serve_flags' `chat` settings reach the app once generate.py passes them to "
                                      "create_app (and app.py to Serving)")
def test_the_serve_flags(thinker_model, tmp_path):
    """--no-prefill-assistant: the last assistant message a whole turn, on /v1/messages too
    (continue_final_message still continues it); --skip-chat-parsing: thinking and calls left in the content, on every API;
    --no-reasoning-preserve: the template's preserve_reasoning false (a request's kwargs over it)."""
    with serving(tmp_path, "-m", str(thinker_model), "--no-draft", "-c", "1024", "--no-prefill-assistant",
                 "--skip-chat-parsing", "--no-reasoning-preserve") as flags:
        answer = [*HI, {"role": "assistant", "content": "so"}]
        assert prompt_of(flags, messages=answer) == "[drop]<s>user: hi\n<s>assistant: so\n<s>assistant:"
        assert prompt_of(flags, messages=answer, continue_final_message=True,
                         add_generation_prompt=False).endswith("<s>assistant:<think></think>so")
        assert prompt_of(flags, messages=HI, chat_template_kwargs={"preserve_reasoning": True}).startswith("[keep]")
        # /v1/messages as well (llama-server's is its chat path): the same whole turn, counted alike
        whole = ok(flags, "/v1/chat/completions/input_tokens", {"messages": answer})["input_tokens"]
        assert ok(flags, "/v1/messages/count_tokens", {"messages": answer})["input_tokens"] == whole
        assert whole > ok(flags, "/v1/messages/count_tokens", {"messages": HI})["input_tokens"] + 2
        body = {"messages": HI, "max_tokens": 24, "temperature": 0, "grammar": THINK_GRAMMAR}
        message = ok(flags, "/v1/chat/completions", body)["choices"][0]["message"]
        assert message["content"].startswith("<think>") and "</think>" in message["content"]
        assert "reasoning_content" not in message
        claude = ok(flags, "/v1/messages", {"messages": HI, "max_tokens": 24, "temperature": 0,
                                            "grammar": THINK_GRAMMAR})
        assert [block["type"] for block in claude["content"]] == ["text"]
        assert claude["content"][0]["text"] == message["content"]
        tools = {"messages": HI, "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False,
                 "max_tokens": 128, "temperature": 0}
        called = ok(flags, "/v1/chat/completions", tools)["choices"][0]
        assert not called["message"].get("tool_calls") and '"set_unit"' in called["message"]["content"]


def test_special_shows_control_tokens_in_answers(chat_pair, tmp_path):
    """serve -sp (llama-server's): a control token (<s>, forced by a logit bias) is its text in the answer,
    whole and streamed, on completions and chat alike; without it the same tokens print nothing."""
    target, draft = chat_pair
    body = {"prompt": "the cat", "max_tokens": 3, "temperature": 0, "logit_bias": {"1": 100}, "return_tokens": True}
    chat = {"messages": HI, "max_tokens": 3, "temperature": 0, "logit_bias": {"1": 100}}
    (tmp_path / "plain").mkdir(), (tmp_path / "special").mkdir()
    with serving(tmp_path / "plain", "-m", str(target), "-md", str(draft), "-c", "512") as plain, \
            serving(tmp_path / "special", "-m", str(target), "-md", str(draft), "-c", "512", "-sp") as special:
        hidden, shown = ok(plain, "/v1/completions", body)["choices"][0], ok(special, "/v1/completions", body)["choices"][0]
        assert hidden["text"] == "" and shown["text"] == "<s>" * 3
        assert ok(special, "/v1/chat/completions", chat)["choices"][0]["message"]["content"] == "<s>" * 3
        assert streamed(special, chat)[0] == "<s>" * 3
        assert ok(plain, "/v1/chat/completions", chat)["choices"][0]["message"]["content"] == ""
