"""The reference every identity test compares with: the target alone through plain llama-cpp-python,
one token per eval, with each step's top-2 margin so that near-ties can be told from real differences."""
import numpy as np
from llama_cpp import Llama

NEAR_TIE = 1e-3  # batched vs single-token F32 logits differ by ~1e-4; closer calls are not decidable


def target_alone(path, prompt, n_predict, n_ctx, flash_attn="off"):
    """Greedy continuation with the plain Llama API, one token per eval, and each step's top-2 margin."""
    llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=1, logits_all=True, verbose=False,
                flash_attn=flash_attn == "on")
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
