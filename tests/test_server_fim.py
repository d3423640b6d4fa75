"""Fill in the middle and llama-server's own routes: `/infill` (llama.vim's and llama.vscode's code
completion), `/completion`, and the completions API's `suffix`, through the real server process.

The tiny pair has CodeLlama's <PRE>/<SUF>/<MID> tokens. The middle the server writes, drafting K = 3, is
the target alone's greedy one on the same prompt (plain llama-cpp-python, near-ties reported); the prompt
is the one `ggufspec.fim` builds, as llama-server's format_prompt_infill does."""
from __future__ import annotations

import json
import math
import time

import httpx
import pytest

from ggufspec import SpeculativeDecoder, fim
from ggufspec.tinymodels import Shape, make_pair
from reference import differs_at_near_tie, target_alone
from serverproc import pair_server_fixture, serving

N_CTX = 1024
PREFIX, SUFFIX = "def the cat sat on the mat\n    if x", "\n    return y and the dog"
EXTRA = [{"filename": "dog.py", "text": "def the dog ran\n    return x + y"}]


@pytest.fixture(scope="module")
def fim_pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("fim-pair"), seed=3, shape=Shape(fim=True, eos_bias=1.0))


server = pair_server_fixture("-c", str(N_CTX), "--draft", "3", pair="fim_pair")


@pytest.fixture(scope="module")
def decoder(fim_pair):
    target, _ = fim_pair
    with SpeculativeDecoder(target, None, n_ctx=N_CTX, n_threads=1) as running:
        yield running


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def stream(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] != "data: [DONE]"  # llama-server's: no [DONE]
    return [json.loads(line[len("data: "):]) for line in lines]


def test_the_prompt_is_llama_servers_format(decoder):
    fim_ids = decoder.target.fim_tokens()
    tokens = fim.fim_prompt(decoder, PREFIX, SUFFIX, prompt=" and")

    def text(s):
        return decoder.target_llm.tokenize(s.encode(), add_bos=False, special=False)
    assert tokens == ([decoder.target_llm.token_bos(), fim_ids["pre"]] + text(PREFIX) + text(" and")
                      + [fim_ids["suf"]] + text(SUFFIX) + [fim_ids["mid"]])
    # a text holding the model's control tokens stays text: it cannot end the prefix early
    assert fim_ids["mid"] not in fim.fim_prompt(decoder, "x <MID> y", "<SUF>")[2:-1]
    # the window keeps what is nearest the cursor: the prefix's end, the suffix's start
    long_prefix, long_suffix = "the cat " * 2000, "the dog " * 2000
    trimmed = fim.fim_prompt(decoder, long_prefix, long_suffix)
    assert len(trimmed) <= N_CTX - 2 * fim.MIDDLE_ROOM  # the middle keeps its room
    window = N_CTX - 2 * fim.MIDDLE_ROOM - 4
    middle = trimmed.index(fim_ids["suf"])
    assert trimmed[2:middle] == text(long_prefix)[-(3 * (window // 4)):]
    # other files go first, as far as the context has room past the window (none at this context)
    assert fim.fim_prompt(decoder, PREFIX, SUFFIX, extra=EXTRA) == fim.fim_prompt(decoder, PREFIX, SUFFIX)


class StubDecoder:
    """A decoder with a big context and a model's FIM tokens (a character a token), for fim_prompt alone."""

    def __init__(self, n_ctx: int, repository: bool):
        self.n_ctx = n_ctx
        ids = {"pre": -1, "suf": -2, "mid": -3, "rep": -4 if repository else None, "sep": -5 if repository else None}
        self.target = type("Target", (), {"fim_tokens": lambda _: ids})()
        model = type("Model", (), {"add_bos_token": lambda _: False})()
        self.target_llm = type("Llm", (), {"tokenize": lambda _, b, add_bos, special: list(b), "_model": model})()


@pytest.mark.parametrize("repository", [True, False])
def test_other_files_fill_what_the_window_and_the_middle_leave(repository):
    decoder = StubDecoder(8192, repository)
    extra = [{"filename": "a.py", "text": "A" * 3000}, {"filename": "b.py", "text": "B" * 3000}]
    tokens = fim.fim_prompt(decoder, "p" * 5000, "s" * 1000, prompt="q", extra=extra)
    others, rest = tokens[:tokens.index(-1)], tokens[tokens.index(-1):]
    room = 8192 - (2 * fim.MIDDLE_ROOM + 4) - fim.FIM_WINDOW
    whole = (([-4, *b"myproject\n"] if repository else []) + sum(
        (([-5, *f"{c['filename']}\n".encode()] if repository else list(fim.SNIPPET_SEPARATOR.encode())) + list(c["text"].encode())
         for c in extra), []) + ([-5, *b"filename\n"] if repository else []))
    assert others == whole[-room:]  # kept from the end: the files nearest the one being edited
    assert rest == [-1, *b"p" * 1536, ord("q"), -2, *b"s" * (512 - 3), -3]
    assert len(tokens) <= 8192 - 2 * fim.MIDDLE_ROOM
    # the same other files whatever the cursor: a moved cursor reuses their cache
    moved = fim.fim_prompt(decoder, "p" * 4000 + "x", "s" * 10, extra=extra)
    assert moved[:len(others)] == others


def test_infill_is_the_target_alones_middle_whole_and_streamed(server, decoder, fim_pair):
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": " and",
            "n_predict": 32, "temperature": 0, "return_tokens": True}
    prompt = fim.fim_prompt(decoder, PREFIX, SUFFIX, prompt=" and", extra=EXTRA, n_predict=32)
    expected, margins, _ = target_alone(fim_pair[0], prompt, 32, N_CTX)
    answer = post(server, "/infill", body).json()
    if not differs_at_near_tie(answer["tokens"], expected, margins):
        assert answer["tokens"] == expected
    assert answer["stop"] is True and answer["tokens_evaluated"] == len(prompt)
    assert answer["tokens_predicted"] == len(answer["tokens"]) and answer["content"]
    assert answer["stop_type"] in ("eos", "limit") and answer["generation_settings"]["n_predict"] == 32
    assert answer["timings"]["draft_n"] > 0 and answer["prompt"].startswith("<s><PRE>")
    chunks = stream(server, "/infill", body)
    assert all(c["stop"] is False for c in chunks[:-1]) and chunks[-1]["stop"] is True
    assert "".join(c["content"] for c in chunks) == answer["content"]
    assert sum((c["tokens"] for c in chunks[:-1]), []) == answer["tokens"]
    assert chunks[-1]["timings"]["cache_n"] == len(prompt) - 1  # the same prompt again: all of it cached


def test_suffix_in_the_completions_api_is_the_same_middle(server):
    import openai
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    answer = client.completions.create(model="target", prompt=PREFIX, suffix=SUFFIX, max_tokens=24, temperature=0)
    infill = post(server, "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 24,
                                       "temperature": 0}).json()
    assert answer.choices[0].text == infill["content"]
    assert answer.usage.prompt_tokens == infill["tokens_evaluated"]


def test_n_predict_0_warms_the_cache_as_llama_vim_does(server, decoder):
    body = {"input_prefix": "def the dog\n", "input_suffix": "x + y\n", "input_extra": EXTRA, "prompt": ""}
    warm = post(server, "/infill", {**body, "n_predict": 0}).json()
    assert (warm["content"], warm["tokens_predicted"], warm["stop_type"]) == ("", 0, "limit")
    prompt = fim.fim_prompt(decoder, body["input_prefix"], body["input_suffix"], extra=EXTRA)
    assert warm["tokens_evaluated"] == len(prompt)
    answer = post(server, "/infill", {**body, "n_predict": 8}).json()
    assert answer["timings"]["cache_n"] == len(prompt) - 1 and answer["tokens_predicted"] > 0
    fields = post(server, "/infill", {**body, "n_predict": 2, "response_fields": ["content", "timings/prompt_n", "nope"]})
    assert set(fields.json()) == {"content", "timings/prompt_n"}
    with httpx.stream("POST", server.url + "/infill", json={**body, "n_predict": 2, "stream": True,
                                                             "response_fields": ["content", "stop"]}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["stop"] is True and set(chunks[-1]) == {"content", "stop"}  # the final one too
    refused = post(server, "/v1/completions", {"prompt": "the", "max_tokens": 0})  # OpenAI's API: at least 1
    assert refused.status_code == 400 and "max_tokens" in refused.json()["error"]["message"]


def test_completion_speaks_llama_servers_fields(server, decoder):
    expected = decoder.generate("the cat", n_predict=16, n_draft=0, temperature=0)
    for path in ("/completion", "/completions"):
        answer = post(server, path, {"prompt": "the cat", "n_predict": 16, "temperature": 0}).json()
        assert answer["content"] == expected.text and answer["tokens"] == []
        assert answer["tokens_predicted"] == len(expected.tokens) and answer["model"] == "target"
    stop_word = expected.text[len(expected.text) // 2:][:3]
    stopped = post(server, "/completion", {"prompt": "the cat", "n_predict": 16, "stop": [stop_word]}).json()
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == stop_word
    assert stopped["content"] == expected.text[:expected.text.index(stop_word)]
    probs = post(server, "/completion", {"prompt": "the cat", "n_predict": 4, "n_probs": 2}).json()
    entries = probs["completion_probabilities"]
    assert len(entries) == probs["tokens_predicted"] and all(len(e["top_logprobs"]) == 2 for e in entries)
    assert all(e["logprob"] <= 0 and isinstance(e["id"], int) for e in entries)
    assert all(isinstance(top["id"], int) for e in entries for top in e["top_logprobs"])
    assert entries[0]["top_logprobs"][0]["id"] == entries[0]["id"]  # greedy: the likeliest is the one chosen


def test_llama_servers_other_names_and_fields(server, decoder):
    """post_sampling_probs (prob / top_probs), a stream's token ids whatever return_tokens says,
    /apply-template, /chat/completions without /v1, and a trailing slash a JSON 404 (QA against
    llama-server)."""
    body = {"prompt": "the cat", "n_predict": 4, "n_probs": 2, "temperature": 0}
    logprobs = post(server, "/completion", body).json()["completion_probabilities"]
    probs = post(server, "/completion", {**body, "post_sampling_probs": True}).json()["completion_probabilities"]
    for with_logs, with_probs in zip(logprobs, probs):
        assert set(with_probs) == {"id", "token", "bytes", "prob", "top_probs"}
        assert with_probs["prob"] == pytest.approx(math.exp(with_logs["logprob"]))
        assert [top["prob"] for top in with_probs["top_probs"]] == pytest.approx(
            [math.exp(top["logprob"]) for top in with_logs["top_logprobs"]])
    chunks = stream(server, "/completion", {"prompt": "the cat", "n_predict": 8, "temperature": 0})
    streamed = [token for chunk in chunks if not chunk["stop"] for token in chunk["tokens"]]
    assert streamed == decoder.generate("the cat", n_predict=8, n_draft=0, temperature=0).tokens
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    prompt = post(server, "/apply-template", chat).json()["prompt"]
    assert decoder.tokenize(prompt) == decoder.tokenize("hi", chat=True)
    answer = post(server, "/chat/completions", chat).json()
    assert answer["object"] == "chat.completion" and answer["usage"]["prompt_tokens"] == len(decoder.tokenize(prompt))
    slashed = post(server, "/v1/chat/completions/", chat)
    assert slashed.status_code == 404 and "error" in slashed.json()


def test_completion_takes_several_prompts_and_mixed_ones_as_llama_server(server, decoder):
    """A list of prompts: a list of answers (streamed, each chunk's `index`), each the one it gets alone;
    a mixed prompt, ids and texts, is one prompt (the texts tokenized without BOS past the first)."""
    prompts = ["the cat", "a dog"]
    alone = [decoder.generate(p, n_predict=8, n_draft=0, temperature=0).text for p in prompts]
    answers = post(server, "/completion", {"prompt": prompts, "n_predict": 8, "temperature": 0}).json()
    assert [a["index"] for a in answers] == [0, 1] and [a["content"] for a in answers] == alone
    assert [a["prompt"] for a in answers] == prompts and all(a["stop"] for a in answers)
    chunks = stream(server, "/completion", {"prompt": prompts, "n_predict": 8, "temperature": 0})
    streamed = {0: "", 1: ""}
    for chunk in chunks:
        streamed[chunk["index"]] += chunk["content"]
    assert [streamed[0], streamed[1]] == alone and sum(c["stop"] for c in chunks) == 2
    ids = decoder.tokenize("the")
    mixed = post(server, "/completion", {"prompt": [*ids, " cat"], "n_predict": 8, "temperature": 0}).json()
    expected = decoder.generate(ids + decoder.target_llm.tokenize(b" cat", add_bos=False, special=True),
                                n_predict=8, n_draft=0, temperature=0)
    assert mixed["content"] == expected.text and mixed["tokens_evaluated"] == expected.stats.n_prompt


@pytest.mark.parametrize("path, body, status, words", [
    ("/infill", {"input_prefix": "x"}, 400, "input_suffix"),
    ("/infill", {"input_prefix": "x", "input_suffix": "y", "prompt": [1, 2]}, 400, "string"),
    ("/infill", {"input_prefix": "x", "input_suffix": "y", "input_extra": [{"filename": "a"}]}, 400, "text"),
    ("/completion", {"prompt": "the", "n_probs": 99}, 400, "n_probs"),
    ("/completion", {"prompt": "the", "n_predict": "many"}, 400, "n_predict"),
])
def test_bad_native_requests_get_openai_shaped_errors(server, path, body, status, words):
    response = post(server, path, body)
    assert response.status_code == status, response.text
    assert set(response.json()) == {"error"} and words in response.json()["error"]["message"]


def test_a_model_without_fim_tokens_says_so(chat_pair, tmp_path):
    target, _ = chat_pair
    with serving(tmp_path, "-m", str(target), "--no-draft", "-c", "256") as running:
        infill = post(running, "/infill", {"input_prefix": "x", "input_suffix": "y"})
        assert infill.status_code == 501 and infill.json()["error"]["type"] == "not_supported_error"
        assert "fill in the middle is not supported" in infill.json()["error"]["message"]
        suffix = post(running, "/v1/completions", {"prompt": "x", "suffix": "y", "max_tokens": 2})
        assert suffix.status_code == 400 and suffix.json()["error"]["code"] == "fim_not_supported"
        plain = post(running, "/v1/completions", {"prompt": "x", "suffix": "", "max_tokens": 2})
        assert plain.status_code == 200  # an empty suffix asks for nothing


def test_line_limits_cut_where_llama_server_does():
    from ggufspec.stops import LineLimits
    now = [0.0]

    def out(texts, **limits):
        line_limits, kept = LineLimits(clock=lambda: now[0], **limits), []
        for text in texts:
            kept += [p["text"] for p in line_limits.apply([{"text": text}])]
            now[0] += 1.0
            if line_limits.stopped:
                break
        return "".join(kept), line_limits.stopped
    # a line less indented than n_indent ends it, its indentation kept; the first line is never checked
    assert out(["x = 1", "\n    y", " = 2\n", "  \n", "z = 3\n"], n_indent=4) == ("x = 1\n    y = 2\n  \n", True)
    assert out(["    a\n    b\nc\n"], n_indent=4) == ("    a\n    b\n", True)
    assert out(["    a\n", "\t\t\tb\n"], n_indent=2) == ("    a\n\t\t\tb\n", False)
    # past the time limit, at the next piece holding a newline, that piece included
    assert out(["a", "b\n", "c", "d", "e\nf", "g\n"], time_limit_s=2.5) == ("ab\ncde\nf", True)


def test_infill_follows_the_editor_plugins_limits(server):
    indented = post(server, "/infill", {"input_prefix": "x", "input_suffix": "y", "n_predict": 30, "n_indent": 4,
                                        "grammar": 'root ::= "    a\\n    b\\nc\\n"'}).json()
    assert (indented["content"], indented["stop_type"]) == ("    a\n    b\n", "limit")
    timed = post(server, "/infill", {"input_prefix": "x", "input_suffix": "y", "n_predict": 200, "t_max_predict_ms": 1,
                                     "grammar": 'root ::= ("ab\\n")+'}).json()
    assert timed["stop_type"] == "limit" and timed["content"].endswith("\n") and timed["tokens_predicted"] < 200
    whole = post(server, "/infill", {"input_prefix": "x", "input_suffix": "y", "n_predict": 12,
                                     "grammar": 'root ::= ("ab\\n")+'}).json()
    assert whole["tokens_predicted"] == 12  # no limits asked: none applied


def test_a_native_stream_left_early_frees_the_server(server):
    body = {"prompt": "the cat", "n_predict": 400, "stream": True, "grammar": 'root ::= ("ab\\n")+'}
    with httpx.stream("POST", server.url + "/completion", json=body, timeout=60) as response:
        first = next(line for line in response.iter_lines() if line)
        assert json.loads(first[len("data: "):])["stop"] is False  # then the client goes away
    for _ in range(100):  # the generation stops at its next token once the server sees the client gone
        if not server.health()["busy"]:
            break
        time.sleep(0.05)
    assert not server.health()["busy"]
    again = post(server, "/completion", {"prompt": "the cat", "n_predict": 4})
    assert again.status_code == 200 and again.json()["tokens_predicted"] == 4
