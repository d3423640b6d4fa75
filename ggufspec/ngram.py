"""N-gram drafting: proposals copied from text already seen, at no model cost.

Two memories, as in llama.cpp's common/ngram-map.cpp (`ngram-map-k`: the sequence's own n-grams,
by position) and common/ngram-mod.cpp (`ngram-mod`: a fixed-size hash pool shared by every request):

- `SequenceIndex`, over this generation's prompt and output: where each n-gram occurred (the last
  few places, for n = 2, 6 and 16). A lookup takes the place whose context agrees with the
  sequence's end for the most tokens (up to 64: its *match length*) and proposes what followed.
- `NgramPool`, bounded and outliving a request: n-gram -> the token that last followed it, for
  n = 3 and 8, in a direct-mapped table of `size` slots (an older n-gram whose slot is taken is
  forgotten). A conversation or an agent that rewrites the same file drafts from what earlier
  answers said even when they are no longer in the prompt.

Every proposal is verified by the target like any draft, so either memory may be wrong (a stale
pool entry, a hash collision) at the cost of one verification only: the output is the target's.
For sampling, a proposal's q is a point mass (the acceptance rule then keeps x with probability p(x)).
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass

from .errors import GgufspecError

SEQUENCE_ORDERS = (16, 6, 2)  # indexed n-gram sizes, longest first: a long one finds the copied place
PLACES_KEPT = 4               # per n-gram: its latest occurrences, the candidates for the longest match
MAX_MATCH = 64                # how far back a match's agreement is measured
POOL_ORDERS = (8, 3)          # the pool's n-gram sizes, longest first
DEFAULT_POOL_SIZE = 1 << 20   # slots: 12 MiB (an 8-byte key and a 4-byte token each)
EMPTY = -1


@dataclass(frozen=True)
class Candidate:
    """What an n-gram memory would propose now: up to k tokens, how long the context it comes from
    agrees with the sequence's end (more: likelier to be copied on), and which memory it is from."""

    tokens: list[int]
    match_length: int
    source: str  # "sequence" | "pool"


MAX_POOL_SIZE = 1 << 27  # 1.5 GiB of slots: far more n-grams than any session makes


class NgramPool:
    """n-gram -> next token, for every request of a decoder, in `size` slots (12 bytes each).

    A slot holds the full hash of its n-gram (a lookup whose hash differs is a miss, so collisions
    within a slot cost nothing but the forgotten entry) and the token that last followed it."""

    def __init__(self, size: int = DEFAULT_POOL_SIZE, orders: tuple[int, ...] = POOL_ORDERS):
        if not orders or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in orders):
            raise GgufspecError(f"the pool's orders must be n-gram lengths >= 1, got {orders!r}")
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_POOL_SIZE:
            raise GgufspecError(f"--lookup-pool must be 1 to {MAX_POOL_SIZE} (n-grams the pool keeps, 12 bytes "
                                f"each; default {DEFAULT_POOL_SIZE}), got {size}")
        self.size, self.orders = size, tuple(sorted(orders, reverse=True))
        self.keys = array("q", bytes(8 * size))
        self.next_tokens = array("i", [EMPTY]) * size
        self.used = 0

    @property
    def nbytes(self) -> int:
        return self.size * (self.keys.itemsize + self.next_tokens.itemsize)

    def add(self, tokens: list[int], start: int, stop: int) -> None:
        """Remember, for each position `end` in [start, stop), the n-grams ending before it and tokens[end]."""
        keys, nexts, size = self.keys, self.next_tokens, self.size
        for end in range(start, stop):
            follower = tokens[end]
            for n in self.orders:
                if end >= n:
                    key = hash(tuple(tokens[end - n:end]))
                    slot = key % size
                    if nexts[slot] == EMPTY:
                        self.used += 1
                    keys[slot], nexts[slot] = key, follower

    def next_token(self, context: list[int], n: int) -> int | None:
        key = hash(tuple(context[-n:]))
        slot = key % self.size
        token = self.next_tokens[slot]
        return token if token != EMPTY and self.keys[slot] == key else None

    def candidate(self, tokens: list[int], k: int) -> Candidate | None:
        """Chain lookups: the longest order that knows the sequence's end gives the next token, which
        then ends the context of the next lookup, up to k tokens."""
        for n in self.orders:
            if len(tokens) >= n and self.next_token(tokens, n) is not None:
                break
        else:
            return None
        proposals, context = [], list(tokens[-max(self.orders):])
        while len(proposals) < k:
            token = next((t for m in self.orders if len(context) >= m
                          and (t := self.next_token(context, m)) is not None), None)
            if token is None:
                break
            proposals.append(token)
            context.append(token)
        return Candidate(proposals, n, "pool")


class SequenceIndex:
    """Where each n-gram of one sequence occurred (its latest PLACES_KEPT places, by the position of
    the token that followed). The sequence only grows (one index per generation)."""

    def __init__(self, orders: tuple[int, ...] = SEQUENCE_ORDERS):
        self.orders = tuple(sorted(orders, reverse=True))
        self.places: dict[tuple, list[int]] = {}
        self.indexed = 0  # positions below this are indexed as followers

    def extend(self, tokens: list[int]) -> int:
        """Index every n-gram whose follower is known (never the sequence's own end, which would
        match itself). Returns the first newly indexed position."""
        first = max(self.indexed, 1)
        for end in range(first, len(tokens)):
            for n in self.orders:
                if end >= n:
                    places = self.places.setdefault(tuple(tokens[end - n:end]), [])
                    places.append(end)
                    if len(places) > PLACES_KEPT:
                        del places[0]
        self.indexed = max(self.indexed, len(tokens))
        return first

    def candidate(self, tokens: list[int], k: int) -> Candidate | None:
        n_tokens = len(tokens)
        for n in self.orders:
            places = self.places.get(tuple(tokens[-n:])) if n_tokens > n else None
            if places:
                best, length = max(((end, _agreement(tokens, end, n)) for end in reversed(places)),
                                   key=lambda place: place[1])
                return Candidate(_continuation(tokens, best, k), length, "sequence")
        return None


def _agreement(tokens: list[int], end: int, known: int) -> int:
    """How many tokens before `end` agree with the sequence's last tokens (`known` already do)."""
    length, limit = known, min(MAX_MATCH, end)
    last = len(tokens)
    while length < limit and tokens[end - length - 1] == tokens[last - length - 1]:
        length += 1
    return length


def _continuation(tokens: list[int], end: int, k: int) -> list[int]:
    """What followed position `end`, k tokens; past the sequence's end the copy continues from
    itself (a repeating pattern proposes its next period)."""
    out: list[int] = []
    n_tokens = len(tokens)
    for i in range(k):
        j = end + i
        out.append(tokens[j] if j < n_tokens else out[j - n_tokens])
    return out


class NgramDrafter:
    """Proposals from the sequence's own n-grams, else from the pool shared across requests.

    One per generation (its `SequenceIndex` follows one sequence); the pool is the decoder's. The
    sequence's match wins unless the pool knows a longer context (text of an earlier request)."""

    context = None          # no draft model: nothing to catch up or rewind
    catch_up_seconds = 0.0

    def __init__(self, n_vocab: int, pool: NgramPool | None = None, orders: tuple[int, ...] = SEQUENCE_ORDERS,
                 is_end=None):
        self.n_vocab = n_vocab
        self.index = SequenceIndex(orders)
        self.pool = pool
        # The target's end-of-generation test: a copy stops at its source's end of turn, that token
        # included. Nothing past it can be kept: the answer ends there, or it goes on where the copied
        # one ended, so the copy has broken. (In an agent session an answer that added a method where the
        # previous one closed its code block used to verify 33 tokens past that answer's <|im_end|>.)
        self.is_end = is_end
        self._ends: dict[int, bool] = {}  # is_end's answers: a native call once per token id

    def remember(self, tokens: list[int]) -> None:
        """Index what is new in the sequence, and add it to the pool."""
        first = self.index.extend(tokens)
        if self.pool is not None:
            self.pool.add(tokens, first, len(tokens))

    def candidate(self, tokens: list[int], k: int) -> Candidate | None:
        if k <= 0:
            return None
        self.remember(tokens)
        found = self.index.candidate(tokens, k)
        if self.pool is not None and (found is None or found.match_length < self.pool.orders[0]):
            pooled = self._to_the_end(self.pool.candidate(tokens, k))  # cut first: it may end up empty
            if pooled is not None and pooled.tokens and (found is None or pooled.match_length > found.match_length):
                found = pooled
        return self._to_the_end(found)

    def _to_the_end(self, found: Candidate | None) -> Candidate | None:
        """The candidate up to its first end-of-generation token, included, and before any id the
        target's vocabulary lacks (a pool shared with another model's decoder could hold some: no
        grammar may be asked about them)."""
        if found is None:
            return found
        for j, token in enumerate(found.tokens):
            if token >= self.n_vocab:
                return Candidate(found.tokens[:j], found.match_length, found.source)
            end = self._ends.get(token) if self.is_end is not None else False
            if end is None:
                end = self._ends[token] = bool(self.is_end(token))
            if end:
                return Candidate(found.tokens[:j + 1], found.match_length, found.source)
        return found

    def match(self, tokens: list[int], k: int) -> list[int]:
        found = self.candidate(tokens, k)
        return found.tokens if found else []

    def propose(self, tokens: list[int], k: int, params, draws, guide=None) -> list[int]:
        proposals = self.match(tokens, k)
        if guide is not None:  # cut before the first token the request's grammar or bias forbids
            proposals = proposals[:guide.allowed_prefix(proposals)]
        return proposals


class HybridDrafter:
    """A lookup match when there is one (free to draft), the draft model otherwise."""

    def __init__(self, lookup: NgramDrafter, model):
        self.lookup, self.model = lookup, model
        self.context = model.context
        self.catch_up_seconds = 0.0

    def propose(self, tokens, k, params, draws, guide=None) -> list[int]:
        proposals = self.lookup.propose(tokens, k, params, draws, guide)
        if proposals:
            self.catch_up_seconds = 0.0
            return proposals
        proposals = self.model.propose(tokens, k, params, draws, guide)
        self.catch_up_seconds = self.model.catch_up_seconds
        return proposals


# ---------------------------------------------------------------- how often n-gram proposals are kept

BUCKETS = {"sequence": (2, 3, 4, 6, 10, 18), "pool": (3, 8)}  # match-length lower bounds
# Before anything is seen: a longer agreeing context, likelier to be copied on (about what a copying
# answer shows); worth two tokens of evidence, so the first verifications outweigh it.
DEFAULT_ACCEPTANCE = {"sequence": (0.3, 0.4, 0.5, 0.65, 0.8, 0.9), "pool": (0.4, 0.7)}
DEFAULT_WEIGHT = 2.0
PRIOR_WEIGHT = 8.0   # what earlier generations taught counts as this many tokens of evidence at most
LOCAL_DECAY = 0.9    # this generation: about the last 10 drafts of a bucket count
KEPT_DECAY = 0.98    # across generations: about the last 50


def bucket_of(candidate: Candidate) -> str:
    """'sequence:6' for a sequence match of 6 to 9 agreeing tokens, 'pool:8', ..."""
    bounds = BUCKETS[candidate.source]
    low = max((b for b in bounds if b <= candidate.match_length), default=bounds[0])
    return f"{candidate.source}:{low}"


def _default(bucket: str) -> tuple[float, float]:
    source, low = bucket.split(":")
    a = DEFAULT_ACCEPTANCE[source][BUCKETS[source].index(int(low))]
    return a * DEFAULT_WEIGHT, (1 - a) * DEFAULT_WEIGHT


class NgramTallies:
    """Per-token acceptance of n-gram proposals by bucket (`bucket_of`), as (accepted tokens,
    rejections): a step keeping n of k proposals adds n, and 1 if it rejected one (the geometric
    model's estimate a = accepted / (accepted + rejections), as `AdaptiveK`).

    `kept` is what earlier generations saw (remembered with the machine's costs); a generation
    starts from it, scaled down to PRIOR_WEIGHT tokens, instead of an even prior."""

    def __init__(self, kept: dict | None = None):
        self.kept: dict[str, list[float]] = {b: [float(x) for x in v] for b, v in (kept or {}).items()
                                             if isinstance(v, (list, tuple)) and len(v) == 2 and ":" in b}
        self.local: dict[str, list[float]] = {}

    def to_dict(self) -> dict:
        return {b: [round(x, 4) for x in v] for b, v in self.kept.items()}

    def prior(self, bucket: str) -> tuple[float, float]:
        accepted, rejected = self.kept.get(bucket) or _default(bucket)
        scale = min(1.0, PRIOR_WEIGHT / max(accepted + rejected, 1e-9))
        return accepted * scale, rejected * scale

    def acceptance(self, bucket: str) -> float:
        prior = self.prior(bucket)
        local = self.local.get(bucket, (0.0, 0.0))
        accepted, rejected = prior[0] + local[0], prior[1] + local[1]
        return accepted / (accepted + rejected) if accepted + rejected > 0 else 0.5

    def observe(self, bucket: str, k: int, n_accepted: int) -> None:
        rejected = 1.0 if n_accepted < k else 0.0
        for table, decay in ((self.local, LOCAL_DECAY), (self.kept, KEPT_DECAY)):
            tally = table.get(bucket) or table.setdefault(bucket, [0.0, 0.0] if table is self.local
                                                          else list(_default(bucket)))
            tally[0] = decay * tally[0] + n_accepted
            tally[1] = decay * tally[1] + rejected
