"""Turning logits into choices: greedy, the filtered sampling distribution, and the acceptance rule.

The filters run in llama.cpp's default chain order: top-n-sigma, top-k, locally typical, top-p, min-p
(on the untempered distribution), XTC, then temperature over the survivors. Target and draft go through
the same filters, so p and q in the acceptance rule are the distributions each model would actually
sample from. XTC is random in llama.cpp (it cuts the likeliest tokens with probability xtc_probability);
here its distribution is that mixture, drawn from as any other, so the tokens are distributed as
llama.cpp's and still one seeded draw per position.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import GgufspecError

GREEDY_TEMPERATURES = (0.0, -1.0)  # llama.cpp's convention: 0 (and -1) mean greedy
INTEGERS = (int, np.integer)
REALS = (int, float, np.integer, np.floating)

# llama.cpp's sampler chain by name (common/sampling.cpp: common_sampler_type_to_chr, and the canonical
# names of common_sampler_types_from_names), for the requests and flags that set its order
SAMPLER_LETTERS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
                   "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p"}
# ...and their other spellings: kebab-case, without the underscore, and three of their own
SAMPLER_NAMES = {**{name: name for name in SAMPLER_LETTERS.values()},
                 **{name.replace("_", "-"): name for name in SAMPLER_LETTERS.values() if "_" in name},
                 **{name.replace("_", ""): name for name in SAMPLER_LETTERS.values() if "_" in name},
                 "nucleus": "top_p", "temp": "temperature", "typ": "typ_p"}
# ggufspec's samplers, in the order it applies them (llama.cpp's default order; the penalties and DRY
# act on the logits, `processing`, the others here)
CHAIN = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    typical_p: float = 1.0         # llama.cpp's --typical (1: off)
    top_n_sigma: float = -1.0      # --top-nsigma (<= 0: off)
    xtc_probability: float = 0.0   # --xtc-probability (0: off)
    xtc_threshold: float = 0.1     # --xtc-threshold (above 0.5: off)
    dynatemp_range: float = 0.0    # --dynatemp-range: the temperature in [temp - range, temp + range] (0: off)
    dynatemp_exponent: float = 1.0  # --dynatemp-exp: how the entropy maps into that range
    adaptive_target: float = -1.0  # llama.cpp's adaptive-p after the chain: the probability it steers to (< 0: off)
    adaptive_decay: float = 0.9    # ...and its moving average's decay
    min_keep: int = 0              # --min-keep: the fewest tokens typical, top-p, min-p and XTC leave
    mirostat: int = 0              # --mirostat: llama.cpp's Mirostat 1 or 2 in place of the chain (0: off)
    mirostat_tau: float = 5.0      # --mirostat-ent: the surprise it steers towards
    mirostat_eta: float = 0.1      # --mirostat-lr: how fast

    def __post_init__(self):
        for name, value, kinds in (("temperature (--temp)", self.temperature, REALS), ("top_k", self.top_k, INTEGERS),
                                   ("top_p", self.top_p, REALS), ("min_p", self.min_p, REALS),
                                   ("seed", 0 if self.seed is None else self.seed, INTEGERS),
                                   *((name, getattr(self, name), INTEGERS if name in ("mirostat", "min_keep") else REALS)
                                     for name in LLAMACPP_FILTERS)):
            if isinstance(value, bool) or not isinstance(value, kinds):
                kind = "a whole number" if kinds is INTEGERS else "a number"
                raise GgufspecError(f"{name} must be {kind}, got {value!r}")
        for name in LLAMACPP_FILTERS:  # a whole number is finite (and may be past a float's range)
            if not isinstance(getattr(self, name), INTEGERS) and not math.isfinite(getattr(self, name)):
                raise GgufspecError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.adaptive_target > 1:
            raise GgufspecError(f"adaptive_target must be at most 1 (< 0: off), got {self.adaptive_target}")
        if not 0 <= self.adaptive_decay <= 0.99:
            raise GgufspecError(f"adaptive_decay must be in [0, 0.99], got {self.adaptive_decay}")
        if self.adaptive_target >= 0 and self.xtc_probability > 0 and not self.mirostat:
            raise GgufspecError("adaptive-p with XTC is not supported (XTC's random cut leaves the probabilities "
                                "adaptive-p averages unknown): turn one off")
        if self.min_keep < 0:
            raise GgufspecError(f"--min-keep must be >= 0, got {self.min_keep}")
        if self.mirostat not in (0, 1, 2):
            raise GgufspecError(f"--mirostat must be 0 (off), 1 or 2, got {self.mirostat}")
        if self.dynatemp_exponent < 0:
            raise GgufspecError(f"--dynatemp-exp must be >= 0, got {self.dynatemp_exponent}")
        if self.typical_p < 0:
            raise GgufspecError(f"--typical must be >= 0 (1: off), got {self.typical_p}")
        if not 0 <= self.xtc_probability <= 1:
            raise GgufspecError(f"--xtc-probability must be in [0, 1] (0: off), got {self.xtc_probability}")
        if self.seed is not None and self.seed < -1:
            raise GgufspecError(f"seed must be >= 0 (or -1 for a random one), got {self.seed}")
        if self.seed == -1:  # llama.cpp's (and the CLI's and the server's) "random": a seed drawn per generation
            object.__setattr__(self, "seed", None)
        if not np.isfinite(self.temperature):
            raise GgufspecError(f"--temp must be a number >= 0 (0 or -1 mean greedy), got {self.temperature}")
        if self.temperature < 0 and self.temperature not in GREEDY_TEMPERATURES:
            raise GgufspecError(f"--temp must be >= 0 (0 or -1 mean greedy), got {self.temperature}")
        if self.top_k < 0:
            raise GgufspecError(f"--top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise GgufspecError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise GgufspecError(f"--min-p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature, self.dynatemp_range, self.mirostat)


def is_greedy(temperature: float, dynatemp_range: float = 0.0, mirostat: int = 0) -> bool:
    """No temperature above 0 is possible (llama.cpp's temp_ext: dynamic ones up to temp + range;
    Mirostat's chain has the plain temperature)."""
    return temperature + (0.0 if mirostat else max(dynatemp_range, 0.0)) <= 0


LLAMACPP_FILTERS = ("typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold", "dynatemp_range", "dynatemp_exponent",
                    "adaptive_target", "adaptive_decay", "min_keep", "mirostat", "mirostat_tau", "mirostat_eta")
# llama.cpp's filters ggufspec took on later, by their chain names: (their setting, whether a value leaves them off)
FILTERS_OFF = {"top_n_sigma": ("top_n_sigma", lambda v: v <= 0), "typ_p": ("typical_p", lambda v: v >= 1),
               "xtc": ("xtc_probability", lambda v: v <= 0)}


def greedy_token(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The probability vector the sampler draws from (zeros for filtered-out tokens). With Mirostat, the
    tempered distribution it cuts (its cut needs the sequence's state: `mirostat.Mirostat`, the target's
    judge's)."""
    if params.mirostat:  # no sort: every token keeps its probability
        logits = logits.astype(np.float64)
        weights = np.exp((logits - logits.max()) / params.temperature)
        return weights / weights.sum()
    ids, probs = chain(logits, params)
    result = np.zeros(logits.shape[0])
    result[ids] = probs
    return result


def sample(logits: np.ndarray, params: SamplingParams, draws: "Draws", position: int) -> tuple[int, float]:
    """The token `draws` picks at this position from the chain's distribution over `logits`, and its
    probability there: `draws.pick(distribution(...))` without a vector over the whole vocabulary (a row of
    151k tokens: 0.8 ms that way, per token of a sampled generation). Under Mirostat, a draft's proposal
    (`_mirostat_proposal`): the cut itself needs the target's state."""
    if params.mirostat:  # a draft's proposal: the target's judge cuts with its state (`mirostat.Mirostat`)
        return _mirostat_proposal(logits, params.temperature, draws, position)
    ids, probs = chain(logits, params)
    index = draws.pick_among(ids, probs, position)
    return int(ids[index]), float(probs[index])


MIROSTAT_HEAD = 100  # a draft's proposal under Mirostat: among its likeliest tokens


def _mirostat_proposal(logits: np.ndarray, temperature: float, draws: "Draws", position: int) -> tuple[int, float]:
    """Under Mirostat, whose cut needs the target's state, a draft proposes the position's draw among its
    MIROSTAT_HEAD likeliest tokens at the temperature (llama.cpp's drafts draw from their top k too), and
    gives its probability over the whole row (for p_min). Any proposal is lossless (the judge decides);
    the cut keeps a few of the likeliest (surprise at most mu, 2 tau at first), and the race over 151k
    tokens took 12 ms a draft token."""
    head = top_k_ids(logits, min(MIROSTAT_HEAD, len(logits)))
    scaled = tempered_row(logits, temperature)
    probs = np.exp(scaled[head].astype(np.float64)) / float(np.exp(scaled).sum())  # a pairwise sum: to 1e-7
    index = draws.pick_among(head, probs, position)
    return int(head[index]), float(probs[index])


def tempered_row(logits: np.ndarray, temperature: float) -> np.ndarray:
    """(l - max) / T over the row: in float32 where 1/T is a float32 (0.2 ms over 151k tokens, float64's exp
    takes 2.5), else in float64 (0 * inf would be NaN at the best token)."""
    inverse = 1.0 / temperature
    if 1e-30 < inverse < 1e30:
        return (logits - logits.max()) * np.float32(inverse)
    return (logits.astype(np.float64) - float(logits.max())) * inverse


def chain(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The tokens llama.cpp's chain leaves (best first; in id order where no filter reads the order: top-k 0
    without top-p, min-p, typical or XTC) and their probabilities (some may be 0: a temperature of 0 keeps the
    best alone). The filters select on the row as it comes (float32, not copied: the same
    order as in float64, whose values these are); the probabilities are float64 over the tokens left."""
    pool = _top_n_sigma(logits.astype(np.float64), params.top_n_sigma) if params.top_n_sigma > 0 else None
    values = logits if pool is None else logits[pool]
    total = None  # the softmax's normaliser where more tokens are ranked than `chosen` holds
    if 0 < params.top_k < len(values):
        chosen = top_k_ids(values, params.top_k)
    elif params.typical_p >= 1.0 and (params.top_p < 1.0 or params.min_p > 0.0):
        chosen, total = _head(values, params)
    elif params.typical_p < 1.0 or params.xtc_probability > 0:  # filters that read the order
        chosen = np.argsort(-values, kind="stable")
    else:  # the whole row unsorted: the draw does not read the order (`Draws.pick_among` races tokens by id)
        chosen = np.arange(len(values))
    candidates = chosen if pool is None else pool[chosen]
    kept = logits[candidates].astype(np.float64)
    if params.typical_p < 1.0 or params.top_p < 1.0 or params.min_p > 0.0:  # the filters' probabilities
        probs = _softmax(kept, total)
    if params.typical_p < 1.0:
        typical = _typical(probs, params.typical_p, params.min_keep)
        candidates, kept = candidates[typical], kept[typical]
        probs = _softmax(kept)
    n_keep, least = len(candidates), params.min_keep  # llama.cpp's min_keep: top-p and min-p leave that many
    if params.top_p < 1.0:
        # smallest prefix whose mass reaches top_p (at least one token)
        n_keep = min(n_keep, max(int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1, least))
    if params.min_p > 0.0:
        n_keep = min(n_keep, max(int(np.count_nonzero(probs >= params.min_p * probs[0])), least))
    candidates, kept = candidates[:n_keep], kept[:n_keep]
    probs = _tempered(kept, params)
    cut = _xtc_cut(kept, params) if params.xtc_probability > 0 else 0
    if cut:  # llama.cpp's XTC, which happens with probability P: the mixture (1 - P) p + P p_cut
        chance = min(params.xtc_probability, 1.0)
        probs *= 1 - chance
        probs[cut:] += chance * _tempered(kept[cut:], params)
    return candidates, probs


def top_k_ids(values: np.ndarray, k: int) -> np.ndarray:
    """The indices of the k largest values, largest first (ties: the lower index first). An argpartition of
    a 151k-token row takes 0.6 ms; instead, the k-th largest of the maxima of BLOCKS groups of values bounds
    the k-th largest value from below (k groups each hold a value at least that large), so only the few values
    at or above it are sorted (0.1 ms). Banned tokens (-inf) come last, as many as the k need (a grammar may
    leave fewer finite ones)."""
    n_blocks = max(BLOCKS, 4 * k)
    if len(values) < 16 * n_blocks:
        return np.argsort(-values, kind="stable")[:k]
    width = len(values) // n_blocks  # group j: values j, j + n_blocks, j + 2 n_blocks... (a fast reduction)
    maxima = values[:width * n_blocks].reshape(width, n_blocks).max(axis=0)
    bound = np.partition(maxima, n_blocks - k)[n_blocks - k]
    shortlist = np.flatnonzero(values >= bound) if bound > -np.inf else np.flatnonzero(values > -np.inf)
    if len(shortlist) < k:  # fewer finite values than k: the banned ones fill in, lowest ids first
        shortlist = np.union1d(shortlist, np.flatnonzero(values == -np.inf)[:k - len(shortlist)])
    return shortlist[np.argsort(-values[shortlist], kind="stable")[:k]]


BLOCKS = 1024  # `top_k_ids`'s groups: their maxima bound the k-th largest value


def _head(values: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, float | None]:
    """Without top-k: the best tokens, best first, as many as top-p or min-p can keep (a prefix of the whole
    row sorted, which over 151k tokens takes 30 ms), and the softmax's normaliser over the whole row (the
    cut's reference, to 1e-7; the probabilities kept are normalised over those kept). The prefix grows until
    top-p's mass or min-p's cut lies inside it (a margin of 1e-9 against the cumulative sum's rounding)."""
    top = values.max()
    total = float(np.exp(values - top).sum(dtype=np.float64))  # exp in the row's float32: 0.3 ms, not 1.8
    size = max(HEAD, params.min_keep)
    while 64 * size <= len(values):  # where `top_k_ids` is quick
        head = top_k_ids(values, size)
        weights = np.exp(values[head].astype(np.float64) - top)
        if (params.top_p < 1.0 and weights.sum() > (params.top_p + 1e-9) * total) or \
                (params.min_p > 0.0 and weights[-1] < params.min_p * weights[0] * (1 - 1e-9)):
            return head, total
        size *= 4
    return np.argsort(-values, kind="stable"), None


HEAD = 256  # `_head`'s first prefix


def _tempered(kept: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The probabilities of the tokens left (logits best first) at the temperature: the fixed one, or
    llama.cpp's dynamic one (temp_ext): T = T_min + (T_max - T_min) (H / log n)^exponent, with H the
    entropy of the tokens left at temperature 1, n how many they are, [T_min, T_max] = [max(0, temp -
    range), temp + range]. A temperature of 0 leaves the best token alone."""
    temperature = params.temperature
    if params.dynatemp_range > 0 and len(kept) > 1:
        probs = _softmax(kept)
        entropy = -float(np.sum(probs[probs > 0] * np.log(probs[probs > 0])))
        low, high = max(0.0, temperature - params.dynatemp_range), temperature + params.dynatemp_range
        temperature = low + (high - low) * (entropy / math.log(len(kept))) ** params.dynatemp_exponent
    if temperature <= 0:  # the best alone (the first of the best where they tie: kept's order is by id or best first)
        return np.eye(1, len(kept), int(np.argmax(kept)))[0]
    return _softmax(kept / temperature)


def _softmax(logits: np.ndarray, total: float | None = None) -> np.ndarray:
    """Over logits; `total`: the sum of exp(l - max) over a whole row these are the best of (None: over these)."""
    weights = np.exp(logits - logits.max())
    return weights / (weights.sum() if total is None else total)


def _top_n_sigma(logits: np.ndarray, n: float) -> np.ndarray:
    """The ids whose logit is within n standard deviations of the best (llama.cpp's top-n-sigma: the
    mean and deviation over every finite logit, a banned token's -inf left out)."""
    finite = logits[np.isfinite(logits)]
    return np.flatnonzero(logits >= finite.max() - n * finite.std())


def _typical(probs: np.ndarray, p: float, min_keep: int = 0) -> np.ndarray:
    """llama.cpp's locally typical sampling over `probs`: tokens taken by how close their information
    (-log p) is to the entropy, until their mass exceeds p (one, or min_keep, at least). A mask of those kept."""
    with np.errstate(divide="ignore"):  # a banned token (p 0: its information infinite) is never taken
        information = -np.log(probs)
    entropy = float(np.sum(probs[probs > 0] * information[probs > 0]))
    order = np.argsort(np.abs(information - entropy), kind="stable")
    n_keep = min(len(order), max(int(np.searchsorted(np.cumsum(probs[order]), p, side="right")) + 1, min_keep))
    kept = np.zeros(len(probs), dtype=bool)
    kept[order[:n_keep]] = True
    return kept


def _xtc_cut(kept: np.ndarray, params: SamplingParams) -> int:
    """How many of the likeliest tokens XTC removes when it acts: every one at or above the threshold but
    the last of them (none where fewer than two are, or the threshold is above 0.5: off)."""
    if params.xtc_threshold > 0.5 or len(kept) < 2:
        return 0
    cut = max(0, int(np.count_nonzero(_softmax(kept) >= params.xtc_threshold)) - 1)
    return cut if len(kept) - cut >= params.min_keep else 0  # it leaves min_keep tokens, or none is cut


# ---------------------------------------------------------------- a draw tied to each position
# Same request, same answer: the sampled token at position t is a function of (seed, t) and the
# target's distribution there, never of how many random numbers the drafts consumed before it. So
# the target alone, any K, any drafter, streamed or not, all pick the same token at every position.
#
# The draw is the exponential race (the Gumbel-max trick): every token x gets E_x = -log U_x with
# U_x uniform, from a counter-based hash of (seed, t, x), and the token picked from p is
# argmin_x E_x / p_x, which is distributed exactly as p (P(x wins) = p_x / sum p). A draft model
# samples its proposal with the same E at the same position, so where its q is close to p it picks
# the same token: P(same) >= (1 - TV(p, q)) / (1 + TV(p, q)), close to the best any coupling gets
# (1 - TV, what the rejection rule of `accept_or_resample` keeps), without drawing anything itself.
# A proposal is then kept exactly when it is the target's own pick: lossless by construction.

_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment
_MASK = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finaliser on a Python int (a 64-bit bijection with full avalanche)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def _mix64_array(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)  # uint64 arrays wrap around, as the hash wants
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Draws:
    """The random numbers of one generation, keyed by position (see the note above). `seed` None: a
    random seed, drawn once (so the run is still reproducible from `Draws.seed`)."""

    def __init__(self, seed: int | None):
        self.seed = int(np.random.SeedSequence().entropy) & _MASK if seed is None else int(seed) & _MASK
        self._key = _mix64(self.seed ^ 0x5851F42D4C957F2D)

    def uniforms(self, position: int, ids: np.ndarray) -> np.ndarray:
        """U_x in (0, 1) for each token id at this position: SplitMix64's stream from the
        position's own state, indexed by the token id."""
        state = _mix64((self._key + position * _GOLDEN) & _MASK)
        with np.errstate(over="ignore"):
            x = _mix64_array(np.uint64(state) + (ids.astype(np.uint64) + np.uint64(1)) * np.uint64(_GOLDEN))
        return ((x >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53

    def pick(self, probs: np.ndarray, position: int) -> int:
        """The token that position's draw picks from `probs` (exactly distributed as probs)."""
        support = np.flatnonzero(probs)
        return int(support[self.pick_among(support, probs[support], position)])

    def pick_among(self, ids: np.ndarray, probs: np.ndarray, position: int) -> int:
        """The index in `ids` of the token that position's draw picks, token ids[i] having probability
        probs[i] (the others none): the same token as `pick` over the whole vector."""
        live = np.flatnonzero(probs)
        if len(live) == 1:
            return int(live[0])
        with np.errstate(over="ignore"):  # p near the smallest double: that token's time is inf (it never wins)
            race = -np.log(self.uniforms(position, ids[live])) / probs[live]
        return int(live[np.argmin(race)])
