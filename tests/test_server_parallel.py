"""`serve --parallel N` (issue 30) against the real process: clients served at once, each getting the
answer it gets alone; a client gone mid-answer frees its slot and leaves the others exact; a
conversation goes back to the slot caching it; beyond the slots and the queue, 429; without --strict,
clients arriving with one system prompt evaluate it once.

The target is slow enough (a few milliseconds per token, no end of sequence) for the requests to
overlap; --strict makes every answer bit-identical to the target alone's, whatever the batch.
"""
import contextlib
import json
import threading
import time

import httpx
import pytest

from ggufspec import SpeculativeDecoder
from serverproc import serving, wait_idle

PROMPTS = ["the cat", "a dog sat", "the mat the", "a cat a dog"]
N_TOKENS = 120


@pytest.fixture(scope="module")
def server(slow_target, tmp_path_factory):
    with serving(tmp_path_factory.mktemp("parallel"), "-m", str(slow_target), "--lookup", "--strict", "-c", "1024",
                 "--parallel", "3", "--max-queue", "1") as running:
        yield running


@pytest.fixture(scope="module")
def alone(slow_target):
    """What each prompt gets alone, in this process."""
    with SpeculativeDecoder(slow_target, n_ctx=1024, n_threads=1, strict=True) as decoder:
        yield {p: decoder.generate(p, n_predict=N_TOKENS, n_draft="auto", drafter="lookup").text for p in PROMPTS}


class Stream:
    """One streamed completion read in a thread: its text, when its first and last tokens came."""

    def __init__(self, url: str, prompt: str, max_tokens: int = N_TOKENS, stop_after: int | None = None):
        self.url, self.prompt, self.max_tokens, self.stop_after = url, prompt, max_tokens, stop_after
        self.text, self.first, self.last, self.status, self.tokens = "", None, None, None, []
        self.thread = threading.Thread(target=self._read)

    def _read(self):
        body = {"prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0, "stream": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as response:
            self.status = response.status_code
            if response.status_code != 200:
                response.read()
                return
            n = 0
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                self.text += chunk["choices"][0]["text"]
                self.tokens += [piece["token"] for piece in chunk.get("ggufspec", {}).get("pieces", [])]
                n += 1
                self.first = self.first or time.monotonic()
                self.last = time.monotonic()
                if self.stop_after is not None and n >= self.stop_after:
                    return  # the connection closes: the client is gone


@contextlib.contextmanager
def busy_slots(server, max_tokens: int):
    """Three long answers under way, one in each slot, through the block; after it, their end and an idle server."""
    running = [Stream(server.url, p, max_tokens=max_tokens) for p in PROMPTS[:3]]
    for stream in running:
        stream.thread.start()
    while server.health()["slots_processing"] < 3:
        time.sleep(0.02)
    yield
    for stream in running:
        stream.thread.join()
    wait_idle(server, 20)


def run_together(streams):
    for s in streams:
        s.thread.start()
    for s in streams:
        s.thread.join()
    return streams


def test_three_clients_are_served_at_once_each_with_its_answer_alone(server, alone):
    streams = run_together([Stream(server.url, p) for p in PROMPTS[:3]])
    assert [s.text for s in streams] == [alone[p] for p in PROMPTS[:3]]
    # at once: every client had its first token before any had its last
    assert max(s.first for s in streams) < min(s.last for s in streams)
    slots = httpx.get(server.url + "/slots", timeout=10).json()
    assert len(slots) == 3 and sorted(s["last"]["id_slot"] for s in slots) == [0, 1, 2]
    assert httpx.get(server.url + "/props", timeout=10).json()["total_slots"] == 3


def test_a_client_gone_mid_answer_frees_its_slot_and_the_others_stay_exact(server, alone):
    streams = [Stream(server.url, PROMPTS[0], stop_after=5), Stream(server.url, PROMPTS[1]),
               Stream(server.url, PROMPTS[2])]
    run_together(streams)
    assert streams[1].text == alone[PROMPTS[1]] and streams[2].text == alone[PROMPTS[2]]
    health = wait_idle(server, 20)
    assert health["slots_idle"] == 3
    # the slot that was left serves the next request, exactly
    assert run_together([Stream(server.url, PROMPTS[3])])[0].text == alone[PROMPTS[3]]


def test_a_conversation_goes_back_to_the_slot_caching_it(server):
    turn1 = [1] + [275, 276, 277] * 6  # token ids: the answer's tokens come back exactly
    answer = run_together([Stream(server.url, turn1, max_tokens=8)])[0].tokens
    run_together([Stream(server.url, [1, 260 + i], max_tokens=16) for i in range(2)])  # the other two slots meanwhile
    response = httpx.post(server.url + "/v1/completions", timeout=60,
                          json={"prompt": turn1 + answer + [266, 267], "max_tokens": 8, "temperature": 0})
    timings = response.json()["timings"]  # the first turn was cached: only the new tokens are evaluated
    assert timings["cache_n"] >= len(turn1) + len(answer) - 1 and timings["prompt_n"] <= 3, timings


def test_beyond_the_slots_and_the_queue_429(server):
    streams = [Stream(server.url, p, max_tokens=400) for p in PROMPTS] + [Stream(server.url, "a", max_tokens=4)]
    run_together(streams)
    statuses = sorted(s.status for s in streams)
    assert statuses == [200, 200, 200, 200, 429]  # 3 slots + 1 waiting; the fifth is refused
    wait_idle(server, 20)


def test_a_client_that_leaves_the_queue_gives_its_place_back(server):
    """Three slots busy, the one queue place taken by a client that gives up (a timeout): the next
    client is queued, not refused with 429 until the slots finish (llama-server drops such a task too)."""
    with busy_slots(server, max_tokens=400):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 4}, timeout=0.5)
        deadline = time.monotonic() + 5
        while server.health()["waiting"] and time.monotonic() < deadline:  # noticed within a poll (0.25 s)
            time.sleep(0.05)
        assert server.health()["waiting"] == 0
        queued = run_together([Stream(server.url, "a", max_tokens=4)])[0]
        assert queued.status == 200 and queued.text


@pytest.fixture(scope="module")
def sharing_server(slow_target, tmp_path_factory):
    """Without --strict: one unified cache, whose cells slots share."""
    with serving(tmp_path_factory.mktemp("sharing"), "-m", str(slow_target), "-c", "2048", "--parallel", "3") as running:
        yield running


def test_clients_arriving_with_one_system_prompt_evaluate_it_once(sharing_server):
    """Three clients send one 201-token prefix (an agent's sub-agents) at once: one evaluates it, the
    other two take its cells (`timings.cache_n`) and evaluate only their own tokens."""
    system = [1] + [259 + (5 * i + i // 7) % 22 for i in range(200)]
    results = [None] * 3

    def client(i):
        body = {"prompt": system + [262 + i, 270 - i], "max_tokens": 8, "temperature": 0}
        results[i] = httpx.post(sharing_server.url + "/v1/completions", json=body, timeout=120).json()["timings"]
    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    cached = sorted(t["cache_n"] for t in results)
    assert cached[0] < len(system) and cached[1:] == [len(system)] * 2, results
    assert sorted(t["prompt_n"] for t in results)[:2] == [2, 2], results
    assert sorted(t["id_slot"] for t in results) == [0, 1, 2]


def streamed_choices(url: str, body: dict) -> dict[int, dict]:
    """A streamed /v1/completions of several choices: each index's text and when its first and last
    text came."""
    choices: dict[int, dict] = {}
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                seen = choices.setdefault(choice["index"], {"text": "", "first": None})
                if choice["text"]:
                    seen["text"] += choice["text"]
                    seen["first"] = seen["first"] or time.monotonic()
                    seen["last"] = time.monotonic()
    return choices


def test_a_list_of_prompts_is_answered_in_the_slots_at_once_each_as_alone(server, alone):
    """OpenAI's list of prompts: a choice each (index = the prompt's place), generated in three slots
    at once, each the answer its prompt gets alone; the usage counts every prompt."""
    body = {"prompt": PROMPTS[:3], "max_tokens": N_TOKENS, "temperature": 0}
    choices = streamed_choices(server.url, body)
    assert [choices[i]["text"] for i in range(3)] == [alone[p] for p in PROMPTS[:3]]
    assert max(c["first"] for c in choices.values()) < min(c["last"] for c in choices.values())
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert [c["text"] for c in whole["choices"]] == [alone[p] for p in PROMPTS[:3]]
    singles = [httpx.post(server.url + "/v1/completions", timeout=120, json={**body, "prompt": p, "max_tokens": 1})
               .json()["usage"]["prompt_tokens"] for p in PROMPTS[:3]]
    assert whole["usage"]["prompt_tokens"] == sum(singles)
    assert whole["usage"]["completion_tokens"] == 3 * N_TOKENS


def test_under_strict_logprobs_in_the_batch_are_the_ones_alone_bit_for_bit(server):
    """--strict: every row computed alone, so not only the tokens but their log-probabilities are
    those of the request alone, to the last bit, though three prompts shared each round. (llama.cpp's
    split of a batch of several sequences put two sequences' tokens in one micro-batch of one.)"""
    body = {"prompt": PROMPTS[:3], "max_tokens": 24, "temperature": 0, "logprobs": 2}
    together = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"]
    for i, prompt in enumerate(PROMPTS[:3]):
        alone = httpx.post(server.url + "/v1/completions", json={**body, "prompt": prompt}, timeout=120).json()
        assert together[i]["logprobs"]["token_logprobs"] == alone["choices"][0]["logprobs"]["token_logprobs"]
        assert together[i]["logprobs"]["top_logprobs"] == alone["choices"][0]["logprobs"]["top_logprobs"]


def test_n_choices_run_at_once_and_each_seed_reproduces_alone(server):
    """`n` sampled choices with a seed: choice j is the answer to the same request with seed + j
    and n 1, bit for bit (--strict), though the three ran in one batch."""
    body = {"prompt": PROMPTS[0], "max_tokens": 48, "temperature": 1.0, "seed": 7}
    choices = streamed_choices(server.url, {**body, "n": 3})
    assert max(c["first"] for c in choices.values()) < min(c["last"] for c in choices.values())
    singles = [httpx.post(server.url + "/v1/completions", json={**body, "seed": 7 + j}, timeout=120)
               .json()["choices"][0]["text"] for j in range(3)]
    assert [choices[j]["text"] for j in range(3)] == singles
    assert len(set(singles)) > 1  # the seeds differ, so do the samples


def test_a_list_of_prompts_with_n_and_the_openai_client(server, alone):
    import openai
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    result = client.completions.create(model="slow", prompt=PROMPTS[:2], n=2, max_tokens=24, temperature=0)
    texts = [c.text for c in sorted(result.choices, key=lambda c: c.index)]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # prompt i's choices are indexes 2i and 2i + 1
    for text, prompt in zip(texts[::2], PROMPTS[:2]):  # the start of its prompt's answer alone
        assert alone[prompt].startswith(text.rstrip("\ufffd")), (text, alone[prompt])
    assert texts[0] != texts[2]


@pytest.mark.parametrize("body, message", [
    ({"prompt": ["a", [1, 2]]}, "prompt[1] must be a string"),
    ({"prompt": ["a"] * 65, "n": 2}, "more than the 128 choices"),
    ({"prompt": ["a", "a " * 5000]}, "context holds 1024"),
])
def test_a_list_of_prompts_that_cannot_run_is_one_400_before_any_runs(server, body, message):
    response = httpx.post(server.url + "/v1/completions", json={"max_tokens": 8, **body}, timeout=60)
    assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
    assert server.health()["slots_processing"] == 0


def test_the_system_fingerprint_names_the_backend_and_changes_with_the_rounding(server, sharing_server):
    """OpenAI's system_fingerprint, in every completion object and chunk and in /props: the same for
    every answer of one server, another where the verification rounds otherwise (--strict or not)."""
    seen = set()
    for url in [server.url] * 2:
        body = {"prompt": "the cat", "max_tokens": 2, "temperature": 0}
        seen.add(httpx.post(url + "/v1/completions", json=body, timeout=60).json()["system_fingerprint"])
        seen.add(httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).json()["system_fingerprint"])
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
            seen |= {json.loads(line[6:])["system_fingerprint"] for line in response.iter_lines()
                     if line.startswith("data: {")}
    assert seen == {httpx.get(server.url + "/props", timeout=10).json()["system_fingerprint"]}
    fingerprint = seen.pop()
    assert fingerprint.startswith("fp_") and len(fingerprint) == 15
    assert httpx.get(sharing_server.url + "/props", timeout=10).json()["system_fingerprint"] != fingerprint


def test_several_choices_queue_in_the_room_left_not_a_429(server):
    """Three slots busy and one queue place: a request for 2 choices takes that place as one part
    (its choices one after another) instead of a 429 for wanting two."""
    with busy_slots(server, max_tokens=300):
        body = {"prompt": "a", "max_tokens": 4, "n": 2, "temperature": 0}
        answer = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200 and [c["index"] for c in answer.json()["choices"]] == [0, 1], answer.text


@pytest.fixture(scope="module")
def long_server(slow_target, tmp_path_factory):
    with serving(tmp_path_factory.mktemp("long"), "-m", str(slow_target), "-c", "8192", "--parallel", "1") as running:
        yield running


def test_a_client_gone_during_a_long_prompt_frees_its_slot_within_a_chunk(long_server):
    """A 7,000-token prompt is evaluated in chunks of 512; its client leaving stops it at the next chunk,
    not when the whole prompt is in (QA: a slot stayed busy minutes after its client left)."""
    prompt = [1] + [259 + (7 * i) % 22 for i in range(7000)]
    started = time.monotonic()
    whole = httpx.post(long_server.url + "/v1/completions", timeout=300,
                       json={"prompt": prompt, "max_tokens": 1, "cache_prompt": False})
    full_seconds = time.monotonic() - started
    assert whole.status_code == 200
    with pytest.raises(httpx.TimeoutException):
        httpx.post(long_server.url + "/v1/completions", timeout=1.0,
                   json={"prompt": prompt, "max_tokens": 1, "cache_prompt": False})
    gone = time.monotonic()
    while long_server.health()["busy"]:
        time.sleep(0.05)
    assert time.monotonic() - gone < full_seconds / 2, (time.monotonic() - gone, full_seconds)
    assert long_server.health()["last"]["stop_reason"] == "interrupted"


# ---------------------------------------------------------------- waiting is not hanging

@pytest.fixture(scope="module")
def roomy_server(slow_target, tmp_path_factory):
    """Two slots sharing one unified cache of 8192 cells."""
    with serving(tmp_path_factory.mktemp("roomy"), "-m", str(slow_target), "--no-draft", "-c", "8192",
                 "--parallel", "2") as running:
        yield running


def test_a_long_prefill_is_progress_for_the_hang_watch(roomy_server):
    """`/health`'s stalled_s (what `serve --rpc` compares with --rpc-timeout to find a hung worker)
    counted only tokens: a prompt of thousands of tokens, evaluated chunk by chunk, looked hung and
    had its model process killed (QA)."""
    prompt = [1] + [260 + i % 20 for i in range(7000)]
    answered = {}
    thread = threading.Thread(target=lambda: answered.update(r=httpx.post(
        roomy_server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=120)))
    started = time.monotonic()
    thread.start()
    stalled = []
    while thread.is_alive():
        stalled.append(roomy_server.health()["stalled_s"])
        time.sleep(0.1)
    seconds = time.monotonic() - started
    assert answered["r"].status_code == 200
    assert seconds > 3, "the prompt went too fast to show anything"
    resets = sum(later < earlier for earlier, later in zip(stalled, stalled[1:]))
    assert resets >= 5 and max(stalled) < 0.4 * seconds, (seconds, stalled)  # each chunk counts (512 tokens)


def test_a_client_gone_while_its_prompt_waits_for_room_frees_its_slot(roomy_server):
    """A's prompt and answer hold most of the cells; B's prompt waits for room, carried round after
    round, and its client gives up: its slot must free at once, for C, not when A's answer ends."""
    a = Stream(roomy_server.url, [1] + [260 + i % 20 for i in range(7900)], max_tokens=250)
    a.thread.start()
    while a.first is None:
        time.sleep(0.02)
    with pytest.raises(httpx.TimeoutException):  # B: one chunk of 400 tokens, where fewer than 290 cells are left
        httpx.post(roomy_server.url + "/v1/completions", json={"prompt": [1] + [261] * 399, "max_tokens": 4},
                   timeout=0.7)
    asked = time.monotonic()
    c = httpx.post(roomy_server.url + "/v1/completions", json={"prompt": "the cat", "max_tokens": 2}, timeout=60)
    answered = time.monotonic()
    a.thread.join()
    assert c.status_code == 200 and a.status == 200
    assert answered < a.last, "C waited for A's answer to end"
    assert answered - asked < 2.0
