"""llama-server's request fields that change an answer, done as there or refused in one line: `samplers`
(the chain's order, names or letters: what it leaves out is not applied, an order that gives another
distribution than ggufspec's is a 400), adaptive-p where it lists it, `min_keep`,
`n_cmpl` on /completion (several completions, a list of answers), and the stream's `timings_per_token`
and `return_progress`. One real server on loopback, raw HTTP: --strict (so a seeded answer is a
function of its distribution alone), -b 16 (a prompt goes in chunks of 16), --repeat-penalty 1.3 (the
server's own penalties, which a chain without them turns off too)."""
from __future__ import annotations

import json

import httpx
import pytest

from serverproc import pair_server_fixture

# hot enough that each of the server's samplers changes these 16 tokens (the tiny target is sure of itself)
SAMPLED = {"prompt": "the cat", "n_predict": 16, "temperature": 2.5, "seed": 3, "ignore_eos": True,
           "return_tokens": True}
HI = {"role": "user", "content": "the cat sat"}
LONG = "the cat sat on the mat and " * 4  # over a hundred of the tiny vocabulary's tokens: chunks of -b 16
LLAMA_DEFAULT_NAMES = ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]


server = pair_server_fixture("-c", "1024", "-np", "2", "--strict", "-b", "16", "--repeat-penalty", "1.3")


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def tokens(server, **fields) -> list[int]:
    response = post(server, "/completion", {**SAMPLED, **fields})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def refusal(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and "\n" not in error["message"]
    return error["message"]


def stream(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        return [json.loads(line[6:]) for line in response.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


# ---------------------------------------------------------------- samplers

@pytest.mark.parametrize("samplers", ["edkypmxt", LLAMA_DEFAULT_NAMES,
                                      ["Penalties", "top-k", "nucleus", "minp", "temp"]])
def test_the_default_order_in_any_spelling_changes_nothing(server, samplers):
    """The llama.cpp web UI sends its order with every request: ggufspec's own, with samplers it lacks
    (off) between them."""
    assert tokens(server, samplers=samplers) == tokens(server)
    chat = {"messages": [HI], "max_tokens": 6, "temperature": SAMPLED["temperature"], "seed": 3}
    answers = [post(server, "/v1/chat/completions", {**chat, **extra}).json()["choices"][0]["message"]["content"]
               for extra in ({}, {"samplers": samplers})]
    assert answers[0] == answers[1]


def test_a_sampler_left_out_is_not_applied(server):
    """As llama.cpp builds its chain from the list: a sampler it leaves out is off (the server's penalties
    too), and without temperature the final draw is from the untempered distribution, even for a
    request that asked for greedy."""
    neutral = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "temperature": 1.0, "repeat_penalty": 1.0}
    assert tokens(server, samplers="kpmt") == tokens(server, repeat_penalty=1.0) != tokens(server)
    assert tokens(server, samplers="ekt") == tokens(server, top_p=1.0, min_p=0.0) != tokens(server)
    greedy = tokens(server, temperature=0)
    assert tokens(server, samplers="ekpm", temperature=0) == tokens(server, temperature=1.0) != greedy
    assert tokens(server, samplers="") == tokens(server, **neutral) != tokens(server)
    assert tokens(server, samplers="kk") == tokens(server, samplers="k")  # the same cut twice


@pytest.mark.parametrize("samplers, extra, says", [
    ("pk", {}, "puts top_p before top_k"),             # top_p renormalises over what top_k left
    ("ekmpt", {}, "puts min_p before top_p"),
    ("ektp", {}, "puts temperature before top_p"),      # top_p of the tempered distribution
    ("ketpm", {"temperature": 0}, "puts top_k before penalties"),  # greedy too: the penalties pick another best
    ("eppt", {}, "lists top_p twice"),
    ("dekt", {"dry_multiplier": 0.8}, "puts dry before penalties"),  # both change the logits: not the same
    ("tkpm", {"dynatemp_range": 0.5}, "puts temperature before top_k"),  # its entropy over what is left
    ("ektt", {}, "lists temperature twice"),
])
def test_an_order_that_gives_another_distribution_is_refused(server, samplers, extra, says):
    message = refusal(post(server, "/completion", {**SAMPLED, **extra, "samplers": samplers}), "samplers")
    assert says in message, message
    chat = {"messages": [HI], "max_tokens": 2, "temperature": SAMPLED["temperature"], "samplers": samplers, **extra}
    assert says in refusal(post(server, "/v1/chat/completions", chat), "samplers")


def test_dry_and_dynatemp_follow_the_chain(server):
    """DRY acts where the chain lists it (the default does) and not where it leaves it out; a dynamic
    temperature is the temperature sampler's: left out with it."""
    repeats = {"prompt": "the cat sat on the mat the cat sat on the", "temperature": 0}  # greedy repeats one token
    dry = {**repeats, "dry_multiplier": 3.0, "dry_allowed_length": 1}
    plain = tokens(server, samplers="kpmt", **repeats)  # without the server's penalties either
    assert tokens(server, samplers="dkpmt", **dry) != plain
    assert tokens(server, samplers="kpmt", **dry) == plain
    assert tokens(server, samplers="edkpmt", **dry) == tokens(server, **dry)
    assert tokens(server, dynatemp_range=1.5) != tokens(server)
    assert tokens(server, samplers="ekpm", dynatemp_range=1.5) == tokens(server, samplers="ekpm")


def test_mirostat_replaces_the_chain(server):
    """llama.cpp's chain with Mirostat is temperature, then Mirostat: `samplers` and the server's penalties
    are not read (as there)."""
    mirostat = {"mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.5}
    assert tokens(server, **mirostat) != tokens(server)
    assert tokens(server, samplers="pk", **mirostat) == tokens(server, **mirostat) == \
        tokens(server, repeat_penalty=1.0, **mirostat)


def test_an_order_that_gives_the_same_distribution_passes(server):
    """top_k and min_p cut at a logit whatever came before; temperature keeps top_k's ranking; temperature
    1 changes nothing; greedy picks the best token, which every filter keeps (the penalties still first)."""
    assert tokens(server, samplers="emkt", top_k=3) == tokens(server, top_p=1.0, top_k=3) != tokens(server, top_p=1.0)
    assert tokens(server, samplers="etk", top_k=3) == tokens(server, top_p=1.0, min_p=0.0, top_k=3)
    assert tokens(server, samplers="etkpm", temperature=1.0) == tokens(server, temperature=1.0)
    assert tokens(server, samplers="etmppk", temperature=0) == tokens(server, temperature=0)


@pytest.mark.parametrize("samplers, says", [("ekq", "unknown sampler letter 'q'"), (["top_k", "topk2"], "'topk2'"),
                                            ("ekpmti", "infill is not supported"), (["infill"], "infill")])
def test_an_unknown_sampler_or_infill_is_refused(server, samplers, says):
    assert says in refusal(post(server, "/completion", {**SAMPLED, "samplers": samplers}), "samplers")


# ---------------------------------------------------------------- adaptive_target, min_keep

def test_adaptive_p_acts_only_where_the_chain_lists_it(server):
    """llama.cpp runs adaptive-p only where `samplers` lists it (its default chain does not), after the
    chain wherever it is listed; a negative target leaves it the plain draw (tests/test_stateful_samplers.py)."""
    steered = tokens(server, samplers="ekpmta", adaptive_target=0.05)
    assert steered != tokens(server) and steered == tokens(server, samplers="aekpmt", adaptive_target=0.05)
    assert tokens(server, samplers="ekpmta", adaptive_target=-1) == tokens(server)
    assert tokens(server, adaptive_target=0.05) == tokens(server)
    assert tokens(server, samplers="ekpmta", adaptive_target=0.05, temperature=0) == tokens(server, temperature=0)
    with_xtc = post(server, "/completion", {**SAMPLED, "samplers": "ekpmxta", "adaptive_target": 0.05,
                                            "xtc_probability": 0.5})
    assert with_xtc.status_code == 400 and "adaptive-p with XTC" in with_xtc.json()["error"]["message"], with_xtc.text


def test_min_keep_leaves_that_many_to_top_p_and_min_p(server):
    """llama.cpp's min_keep (tests/test_llamacpp_samplers.py): 0 and 1 change nothing (every filter leaves one
    token), more leaves more to top_p and min_p; a greedy choice is the best token still."""
    assert tokens(server, min_keep=0) == tokens(server, min_keep=1) == tokens(server)
    assert tokens(server, min_keep=40, top_p=0.05, min_p=0.0) != tokens(server, top_p=0.05, min_p=0.0)
    assert tokens(server, min_keep=5, top_p=1.0, min_p=0.0) == tokens(server, top_p=1.0, min_p=0.0)
    assert tokens(server, min_keep=5, temperature=0) == tokens(server, temperature=0)
    assert "min_keep" in refusal(post(server, "/completion", {**SAMPLED, "min_keep": -1}), "min_keep")


# ---------------------------------------------------------------- n_cmpl

def test_n_cmpl_gives_a_list_of_completions_each_its_own_seed(server):
    """As llama-server: index i * n_cmpl + j for prompt i's j-th, completion j seeded with seed + j
    (so it is the answer that seed gives alone); `n` is its other name there."""
    answers = post(server, "/completion", {**SAMPLED, "n_cmpl": 3}).json()
    assert [a["index"] for a in answers] == [0, 1, 2]
    assert [a["tokens"] for a in answers] == [tokens(server, seed=3 + j) for j in range(3)]
    by_n = post(server, "/completion", {**SAMPLED, "n": 3}).json()
    assert [a["tokens"] for a in by_n] == [a["tokens"] for a in answers]
    two = post(server, "/completion", {**SAMPLED, "prompt": ["the cat", "a dog"], "n_cmpl": 2}).json()
    assert [(a["index"], a["prompt"]) for a in two] == [(0, "the cat"), (1, "the cat"), (2, "a dog"), (3, "a dog")]
    chunks = stream(server, "/completion", {**SAMPLED, "n_cmpl": 2})
    assert sorted(c["index"] for c in chunks if c["stop"]) == [0, 1]
    for j in range(2):
        assert [t for c in chunks if c["index"] == j for t in c["tokens"]] == answers[j]["tokens"]
    for bad in (0, 17):
        response = post(server, "/completion", {**SAMPLED, "n_cmpl": bad})
        assert response.status_code == 400 and "n_cmpl" in response.json()["error"]["message"], response.text


# ---------------------------------------------------------------- timings_per_token, return_progress

def test_timings_per_token_puts_the_timings_so_far_in_each_chunk(server):
    chunks = [c for c in stream(server, "/completion", {**SAMPLED, "timings_per_token": True}) if not c["stop"]]
    assert chunks and all(c["timings"]["predicted_n"] == c["tokens_predicted"] for c in chunks)
    assert not any("timings" in c for c in stream(server, "/completion", SAMPLED) if not c["stop"])
    chat = stream(server, "/v1/chat/completions", {"messages": [HI], "max_tokens": 6, "timings_per_token": True})
    counts = [c["timings"]["predicted_n"] for c in chat if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert counts and counts == sorted(counts) and counts[-1] <= 6


def progress_of(chunks: list[dict], first_token: int) -> list[dict]:
    """The prompt_progress blocks, checked to come before the first token's chunk."""
    blocks = [(i, c["prompt_progress"]) for i, c in enumerate(chunks) if "prompt_progress" in c]
    assert blocks and all(i < first_token for i, _ in blocks)
    return [block for _, block in blocks]


def first_token(chunks: list[dict]) -> int:
    return next(i for i, c in enumerate(chunks) if c["tokens"])


def test_return_progress_streams_the_prompts_progress_before_the_first_token(server):
    """As llama-server's: a block of the cache's share as the prompt starts, one after each chunk of -b 16
    tokens, then the whole prompt's; a prompt of one chunk has the first and the last."""
    body = {**SAMPLED, "prompt": LONG, "return_progress": True, "cache_prompt": False}
    chunks = stream(server, "/completion", body)
    blocks = progress_of(chunks, first_token(chunks))
    processed = [b["processed"] for b in blocks]
    assert len(blocks) > 3 and processed == sorted(set(processed)) and processed[:2] == [0, 16]
    assert blocks[-1]["processed"] == blocks[-1]["total"] == chunks[-1]["tokens_evaluated"]
    assert all(b["cache"] == 0 and b["time_ms"] >= 0 for b in blocks)
    for _ in range(2):  # the second time cached but its last token
        short = stream(server, "/completion", {**SAMPLED, "return_progress": True})
        blocks = [(b["cache"], b["processed"]) for b in progress_of(short, first_token(short))]
        cached, n = blocks[0][0], short[-1]["tokens_evaluated"]
        assert blocks == [(cached, cached), (cached, n)]
    assert cached == n - 1
    assert not any("prompt_progress" in c for c in stream(server, "/completion", {**SAMPLED, "prompt": LONG}))

    chat = stream(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}], "max_tokens": 3,
                                                   "return_progress": True})
    first = next(i for i, c in enumerate(chat) if c["choices"] and "content" in c["choices"][0]["delta"]
                 and c["choices"][0]["delta"]["content"] is not None)
    blocks = progress_of(chat, first)
    timings = chat[-1]["timings"]
    assert len(blocks) > 3 and blocks[-1]["processed"] == blocks[-1]["total"]
    assert blocks[-1]["total"] == timings["cache_n"] + timings["prompt_n"]
    role = {"role": "assistant", "content": None}
    assert all(c["choices"][0]["delta"] == role for c in chat if "prompt_progress" in c)


# ---------------------------------------------------------------- the others: what changes nothing, what is refused

def test_grammar_lazy_is_refused_where_it_would_wait_and_n_keep_changes_nothing(server):
    """A lazy grammar waits for grammar_triggers in llama-server; here a grammar applies from the first
    token. n_keep / n_discard act on a context shift, which ggufspec never does."""
    body = {"prompt": "the cat", "n_predict": 12, "grammar": 'root ::= " the" " cat"', "grammar_lazy": True,
            "grammar_triggers": ["x"]}
    for path in ("/completion", "/v1/completions"):
        response = post(server, path, body)
        assert response.status_code == 400 and "grammar_lazy" in response.json()["error"]["message"], response.text
    assert post(server, "/completion", {**body, "grammar_lazy": False}).json()["content"] == " the cat"
    assert tokens(server, n_keep=4, n_discard=8) == tokens(server)
