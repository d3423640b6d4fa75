"""The thinking budget on the server: `serve --reasoning-budget N --reasoning-budget-message TEXT`, a
request's reasoning_budget_tokens / thinking_budget_tokens / reasoning_budget_message (llama-server's) and
Anthropic's thinking.budget_tokens; and a JSON schema answered after a DeepSeek-R1-like template's thinking
instead of inside it. The real process, the official clients, raw HTTP for the errors."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from serverproc import serving
from test_server_reasoning import HI, OPENS_THINKING, reasoner

MESSAGE = "Enough."
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    target = reasoner(tmp_path_factory.mktemp("r1-like"), OPENS_THINKING)
    with serving(tmp_path_factory.mktemp("budget"), "-m", str(target), "--lookup", "-c", "512",
                 "--reasoning-budget", "3", "--reasoning-budget-message", " " + MESSAGE) as running:
        yield running


def ask(server, **fields):
    body = {"messages": HI, "max_tokens": 48, **fields}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]


def thought(message) -> str:
    """The model's own thinking: what comes before the forced message (the tiny vocabulary spells its
    spaces as ▁)."""
    return message["reasoning_content"].split(MESSAGE)[0].rstrip("▁ ")


def test_the_servers_budget_ends_the_thinking_and_the_answer_follows(server):
    budgeted = ask(server)
    assert MESSAGE in budgeted["reasoning_content"] and budgeted["content"]
    assert ask(server, reasoning_budget_tokens=-1) == budgeted  # -1: the server's budget, as llama-server
    assert ask(server, draft=0) == budgeted  # the same answer without drafts
    unlimited = ask(server, reasoning_budget_tokens=1000)  # the tiny model never ends its thinking itself
    assert MESSAGE not in unlimited["reasoning_content"] and not unlimited.get("content")
    assert unlimited["reasoning_content"].startswith(thought(budgeted)) and thought(budgeted)
    longer = ask(server, thinking_budget_tokens=6)
    assert len(thought(longer)) > len(thought(budgeted)) and longer["content"]
    assert ask(server, reasoning_budget_tokens=0)["reasoning_content"].strip("▁ ") == MESSAGE
    assert "Stop." in ask(server, reasoning_budget_message=" Stop.")["reasoning_content"]


def test_streamed_equals_whole_and_anthropic_budget_tokens_is_the_budget(server):
    whole = ask(server, reasoning_budget_tokens=2)
    stream = server.client().chat.completions.create(model="reasoner", messages=HI, max_tokens=48, stream=True,
                                                     extra_body={"reasoning_budget_tokens": 2})
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == whole["reasoning_content"]
    assert "".join(d.content or "" for d in deltas) == whole["content"]
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    answer = claude.messages.create(model="m", max_tokens=48, messages=HI,
                                    thinking={"type": "enabled", "budget_tokens": 2})
    kinds = [block.type for block in answer.content]
    assert kinds == ["thinking", "text"], kinds
    assert answer.content[0].thinking == whole["reasoning_content"] and answer.content[1].text == whole["content"]


def test_a_schema_shapes_the_answer_after_the_thinking(server):
    form = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    message = ask(server, response_format=form, max_tokens=64)
    assert MESSAGE in message["reasoning_content"]
    assert isinstance(json.loads(message["content"])["n"], int), message
    assert ask(server, response_format=form, max_tokens=64, draft=0) == message


@pytest.mark.parametrize("fields, words", [
    ({"reasoning_budget_tokens": -2}, "reasoning_budget_tokens"),
    ({"reasoning_budget_tokens": "3"}, "reasoning_budget_tokens"),
    ({"thinking_budget_tokens": 1.5}, "thinking_budget_tokens"),
    ({"reasoning_budget_message": 5}, "reasoning_budget_message"),
])
def test_bad_budgets_are_one_line_400s(server, fields, words):
    response = httpx.post(server.url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 2, **fields},
                          timeout=30)
    error = response.json()["error"]
    assert response.status_code == 400 and words in error["message"] and "\n" not in error["message"], error


def test_a_bad_anthropic_budget_names_its_field(server):
    response = httpx.post(server.url + "/v1/messages", timeout=30, json={
        "model": "m", "max_tokens": 4, "messages": HI, "thinking": {"type": "enabled", "budget_tokens": "lots"}})
    error = response.json()["error"]
    assert response.status_code == 400 and error["type"] == "invalid_request_error", error
    assert "thinking.budget_tokens" in error["message"] and "\n" not in error["message"], error


def test_qwen3_like_thinks_before_a_schema_when_it_opens_the_block_itself(tmp_path):
    """Qwen3's template leaves the block to the model: a schema lets <think> be its first token, then
    shapes what follows </think> (<think> made likely, or banned, by a bias; the budget ends the block)."""
    from ggufspec.tinymodels import Shape, make_weights, write_model
    from test_server_reasoning import QWEN3_LIKE
    shape = Shape(eos_bias=4.0, thinking=True)
    target = write_model(tmp_path / "qwen3-like.gguf", shape, make_weights(shape, 0), QWEN3_LIKE)
    form = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    with serving(tmp_path, "-m", str(target), "--lookup", "-c", "512") as server:
        thinking = ask(server, response_format=form, max_tokens=64, logit_bias={"<think>": 30},
                       reasoning_budget_tokens=3)
        assert thinking["reasoning_content"] and isinstance(json.loads(thinking["content"])["n"], int), thinking
        plain = ask(server, response_format=form, max_tokens=64, logit_bias={"<think>": False})  # never opened
        assert "reasoning_content" not in plain and isinstance(json.loads(plain["content"])["n"], int), plain
