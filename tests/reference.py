"""The references the lossless tests compare with: the target alone through plain llama-cpp-python, one
token per eval, with each step's top-2 margin (near-ties told from real differences); and a chi-square
test of sampled counts against the target's exact distribution."""
import numpy as np
from llama_cpp import Llama
from scipy import stats as scipy_stats

from ggufspec.sampling import LLAMACPP_FILTERS, distribution

NEAR_TIE = 1e-3  # batched vs single-token F32 logits differ by ~1e-4; closer calls are not decidable


def target_alone(path, prompt, n_predict, n_ctx, flash_attn="off", **llama_options):
    """Greedy continuation with the plain Llama API, one token per eval, and each step's top-2 margin
    (`llama_options`: more of Llama's keywords, e.g. lora_path)."""
    llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=1, logits_all=True, verbose=False,
                flash_attn=flash_attn == "on", **llama_options)
    n_ctx = llm.n_ctx()
    llm.eval(prompt)
    out, margins = [], []
    while True:
        logits = np.array(llm.scores[llm.n_tokens - 1])
        top2 = np.sort(logits)[-2:]
        token = int(np.argmax(logits))
        if token == llm.token_eos():
            return out, margins, "eos"
        out.append(token)
        margins.append(float(top2[1] - top2[0]))
        if len(out) == n_predict:
            return out, margins, "n_predict"
        if len(prompt) + len(out) >= n_ctx:
            return out, margins, "context"
        llm.eval([token])


def prompts(n, seed=1):
    rng = np.random.default_rng(seed)
    words = list(range(259, 281))
    return [[1] + list(rng.choice(words, size=rng.integers(1, 12))) for _ in range(n)]


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def differs_at_near_tie(got: list[int], expected: list[int], margins: list[float], tie: float = NEAR_TIE) -> bool:
    """Whether `got` leaves the target-alone `expected` at a near-tie (a top-2 margin under `tie`:
    undecidable), not at a real difference."""
    diff = first_difference(got, expected)
    return diff is not None and diff < len(margins) and margins[diff] < tie


def chi_square_pvalue(counts: dict, expected_probs: dict, n: int) -> float:
    """Pearson chi-square, cells with an expected count below 5 pooled into one."""
    observed, expected, pooled_o, pooled_e = [], [], 0, 0.0
    for key, prob in expected_probs.items():
        if prob * n >= 5:
            observed.append(counts.get(key, 0)); expected.append(prob * n)
        else:
            pooled_o += counts.get(key, 0); pooled_e += prob * n
    pooled_o += sum(c for k, c in counts.items() if k not in expected_probs)  # impossible outcomes
    if pooled_e > 0 or pooled_o > 0:
        observed.append(pooled_o); expected.append(max(pooled_e, 1e-9))
    return scipy_stats.chisquare(observed, np.array(expected) * sum(observed) / sum(expected)).pvalue


def same_as_target_alone(got, expected: list[int], margins: list[float], label: str) -> bool:
    """True when a generation is the target's own greedy output; False when it leaves it at a near-tie
    (not decidable: the caller counts it); a real difference fails the test."""
    if differs_at_near_tie(got.tokens, expected, margins):
        return False
    assert got.tokens == expected, f"{label}: first difference at {first_difference(got.tokens, expected)}"
    return True


def greedy_every_k_is_target_alone(decoder, path, chosen: list[list[int]], n_predict: int, n_ctx: int,
                                   flash_attn: str = "off") -> tuple[int, int]:
    """Greedy speculation at K = 1 to 5 and auto, for each prompt of `chosen`: the text and stop reason of
    the target alone (`path` through target_alone), but at a near-tie (no verdict: counted, the caller
    says how many it allows). Returns (runs checked, near-ties)."""
    near_ties = checked = 0
    for prompt in chosen:
        expected, margins, reason = target_alone(path, prompt, n_predict, n_ctx, flash_attn)
        for k in [1, 2, 3, 4, 5, "auto"]:
            got = decoder.generate(prompt, n_predict=n_predict, n_draft=k, temperature=0)
            if not same_as_target_alone(got, expected, margins, f"K={k} prompt={prompt}"):
                near_ties += 1
                continue
            assert got.stats.stop_reason == reason
            checked += 1
    print(f"{checked} runs identical, {near_ties} at a near-tie < {NEAR_TIE}")
    return checked, near_ties


# the drafting modes the greedy identity tests run: (drafter, K)
GREEDY_RUNS = [("model", 1), ("model", 3), ("model", "auto"), ("lookup", 3), ("hybrid", 3)]


def greedy_runs_are_target_alone(batch, strict, chosen: list[list[int]], expected_of, runs=GREEDY_RUNS,
                                 n_predict: int = 32) -> None:
    """Greedy speculation at each (drafter, K) of `runs`, for each prompt of `chosen`: `batch`'s text is
    `expected_of(prompt)`'s (a target_alone answer: a near-tie is no verdict, at most a fifth of them),
    `strict`'s its own target alone's, bit for bit; and drafts were kept, not only rejected."""
    decided = near_ties = accepted = 0
    for prompt in chosen:
        expected, margins, _ = expected_of(prompt)
        strict_alone = strict.generate(prompt, n_predict=n_predict, n_draft=0, temperature=0).tokens
        for drafter, k in runs:
            got = batch.generate(prompt, n_predict=n_predict, n_draft=k, drafter=drafter, temperature=0)
            if same_as_target_alone(got, expected, margins, f"{drafter} K={k}"):
                decided += 1
            else:
                near_ties += 1
            exact = strict.generate(prompt, n_predict=n_predict, n_draft=k, drafter=drafter, temperature=0)
            assert exact.tokens == strict_alone, \
                f"--strict {drafter} K={k}: {first_difference(exact.tokens, strict_alone)}"
            accepted += got.stats.n_accept + exact.stats.n_accept
    assert decided >= 0.8 * (decided + near_ties), (decided, near_ties)
    assert accepted > 0  # drafts were kept, not only rejected


def exact_first_and_second(path, prompt: list[int], params, **llama_options) -> tuple[np.ndarray, dict]:
    """p(first token), and p(first, second) for every first token, from the plain Llama API. Each
    prefix is evaluated from an empty state: a recurrent state cannot be cut back."""
    llm = Llama(model_path=str(path), n_ctx=64, n_threads=1, logits_all=True, verbose=False, **llama_options)
    llm.eval(prompt)
    p1 = distribution(np.array(llm.scores[llm.n_tokens - 1]), params)
    joint = {}
    for a in np.flatnonzero(p1):
        llm.n_tokens = 0
        llm.eval(prompt + [int(a)])
        p2 = distribution(np.array(llm.scores[llm.n_tokens - 1]), params)
        for b in np.flatnonzero(p2):
            joint[(int(a), int(b))] = p1[a] * p2[b]
    llm.close()
    return p1, joint


def exact_first_and_next_two(path, prompt: list[int], params, **llama_options) -> tuple[np.ndarray, int, dict]:
    """p(first token); the likeliest first token x; and p(second, third) after the prompt and x.

    The prompt's own batch decides the first token (speculate._prefill), so drafts first meet the
    target after it: a step's rows 0 and 1 are the second and third tokens, tested given x."""
    p1, _ = exact_first_and_second(path, prompt, params, **llama_options)
    x = int(np.argmax(p1))
    _, joint = exact_first_and_second(path, list(prompt) + [x], params, **llama_options)
    return p1, x, joint


def draw_samples(decoder, prompt, params, k, draws) -> list[tuple]:
    """`draws` seeded generations, each long enough for a step of k drafts after the first token."""
    chain = {name: getattr(params, name) for name in ("temperature", "top_k", "top_p", "min_p", *LLAMACPP_FILTERS)}
    return seeded_samples(decoder, prompt, k, draws, **chain)[0]


def seeded_samples(decoder, prompt, k, draws, **options) -> tuple[list[tuple], int]:
    """`draws` generations seeded 0, 1, ... (`sample_of` each), each long enough for a step of k drafts
    after the first token; and how many tokens they drafted in all."""
    samples, drafted = [], 0
    for seed in range(draws):
        generation = decoder.generate(prompt, n_predict=k + 3, n_draft=k, seed=seed, **options)
        samples.append(sample_of(generation))
        drafted += generation.stats.n_drafted
    return samples, drafted


def first_and_second(dist_after) -> tuple[np.ndarray, dict]:
    """p(first) and p(first, second) from `dist_after(prefix)`, a position's distribution after the
    tokens `prefix` (a list)."""
    p1 = dist_after([])
    joint = {}
    for a in np.flatnonzero(p1):
        p2 = dist_after([int(a)])
        for b in np.flatnonzero(p2):
            joint[(int(a), int(b))] = p1[a] * p2[b]
    return p1, joint


def sample_of(generation, end: int = 2) -> tuple:
    """A generation's tokens as an outcome of the exact joint: where it ended at an end-of-generation
    token (left out of its tokens), that token counts too (`end`: the tiny vocabulary's </s>)."""
    return tuple(generation.tokens) + ((end,) if generation.stats.stop_reason == "eos" else ())


def sampling_pvalues(samples: list[tuple], p1: np.ndarray, x: int, joint: dict) -> tuple[float, float]:
    """Chi-square p-values of the first tokens against p1, and of (second, third) where the first is x."""
    joint = _ending(joint)
    first, pairs = {}, {}
    for tokens in samples:
        first[tokens[0]] = first.get(tokens[0], 0) + 1
        if tokens[0] == x:
            pairs[tokens[1:3]] = pairs.get(tokens[1:3], 0) + 1
    expected_first = {int(t): float(p1[t]) for t in np.flatnonzero(p1)}
    return (chi_square_pvalue(first, expected_first, len(samples)),
            chi_square_pvalue(pairs, joint, sum(pairs.values())))


def _ending(joint: dict, end: int = 2) -> dict:
    """The joint with every pair whose first token ends the generation as that token alone (nothing
    follows an end: `sample_of` gives such a generation's outcome as (end,))."""
    collapsed = {}
    for pair, prob in joint.items():
        key = (end,) if pair[0] == end else pair
        collapsed[key] = collapsed.get(key, 0.0) + prob
    return collapsed


def stops_at_call(n: int):
    """A `Context.should_stop` that says stop from its n-th call on (asked before each chunk: 2 stops a
    long decode between its first two chunks)."""
    calls = iter(range(1, 1 << 30))
    return lambda: next(calls) >= n
