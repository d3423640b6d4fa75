"""Where proposals come from (a draft model, n-gram lookup, or both) and how many to ask for.

Drafters only propose tokens; the target's verification in `speculate` keeps a proposal only where it
is the target's own choice, so every drafter here leaves the output lossless.
"""
from __future__ import annotations

import contextlib
import math
import time

import numpy as np

from .costmodel import expected_tokens, tokens_per_second
from .costs import Costs
from .errors import DecodeError, Interrupted
from .native import Context
from .bridge import VocabBridge  # noqa: F401  (drafting.VocabBridge)
from .ngram import HybridDrafter, NgramDrafter, bucket_of  # noqa: F401  (drafting.HybridDrafter)
from .processing import DraftGuide
from .sampling import Draws, SamplingParams, greedy_token, sample

LookupDrafter = NgramDrafter  # the name it had when it looked in the sequence only


class ModelDrafter:
    """The draft model, one token at a time, stopping early when it is unsure of its own next token
    (llama.cpp's --draft-p-min: its probability of the token it proposes below p_min)."""

    CATCH_UP = 2  # a step leaves the draft this many tokens behind; more means it sat idle

    def __init__(self, context: Context, p_min: float = 0.0, n_min: int = 0):
        self.context = context
        self.p_min, self.n_min = p_min, n_min
        self.catch_up_seconds = 0.0  # of the last proposal: evaluating what the draft skipped while idle

    def propose(self, tokens: list[int], k: int, params: SamplingParams, draws: Draws,
                guide: DraftGuide | None = None) -> list[int]:
        """Up to k proposals after `tokens`. Sampling, each
        proposal is drawn with the target's draw for its position (`sampling.Draws`), so that it is the
        target's own pick wherever q is close to p. `guide`: the request's constraints over the
        draft's rows (see `processing.DraftGuide`)."""
        if k <= 0:
            return []
        ctx = self.context
        lag = len(tokens) - ctx.n_past
        self.catch_up_seconds = 0.0
        t0 = time.perf_counter()
        try:
            ctx.decode(tokens[ctx.n_past:], n_logits=1)  # catch up on what the draft has not seen
            ctx.synchronize()
        except DecodeError:  # the draft's context is full (a bridged vocabulary takes more tokens)
            return []     # the target goes on alone
        except Interrupted:  # a long catch-up its caller stopped (`Context.should_stop`): the chunks
            return []        # evaluated stay, the rest is caught up at the next proposal
        # the catch-up after sitting idle is not a per-token cost, but its last token is the one every
        # step evaluates (the first proposal comes from it): only the rest is left out of the draft's time
        self.catch_up_seconds = (time.perf_counter() - t0) * (lag - 1) / lag if lag > self.CATCH_UP else 0.0
        ctx.checkpoint(upcoming=k - 1)  # memory that cannot drop a suffix saves its state first
        guide = guide if guide is not None and guide.fits(ctx.n_vocab) else None
        with guide if guide is not None else contextlib.nullcontext():
            proposals = self._draft(tokens, k, params, draws, guide)
        if len(proposals) < min(self.n_min, k):  # too short to be worth a verification, so no rejection
            # cuts it: dropped here, or the draft's cache would hold the sequence's next token (or another
            # one) and the next catch-up evaluate nothing, its first proposal read from stale logits
            ctx.keep(len(tokens))
            return []
        return proposals

    def _draft(self, tokens, k, params, draws, guide) -> list[int]:
        """One token at a time from the draft's own (guided) row, until k, or unsure (p_min)."""
        ctx, proposals = self.context, []
        while True:
            raw = ctx.logits(0)
            if guide is not None:  # the sequence is copied only where the penalties read it
                logits = guide.apply(raw, tokens + proposals if guide.needs_history else tokens)
            else:
                logits = raw
            if logits is None:  # the grammar allows none of the draft's tokens here
                break
            if params.greedy:
                token = greedy_token(logits)
                if self.p_min > 0 and _softmax_at(raw, token) < self.p_min and proposals:
                    break  # unsure by its own (unguided) distribution
            else:
                token, q = sample(logits, params, draws, len(tokens) + len(proposals))
                if self.p_min > 0 and q < self.p_min and proposals:
                    break
            proposals.append(token)
            # nothing after an end of generation is output: the draft stops there (a guide says so too)
            ends = not guide.accept(token) if guide is not None else ctx.is_end_of_generation(token)
            if len(proposals) == k or ctx.n_past + 1 >= ctx.n_ctx or ends:
                break
            try:
                ctx.decode([token], n_logits=1)
            except (DecodeError, Interrupted):  # no room, or its client left while it waited for some
                break
        return proposals


def _softmax_at(logits: np.ndarray, token: int) -> float:
    top = float(logits.max())
    return float(math.exp(float(logits[token]) - top) / np.exp(logits - top, dtype=np.float64).sum())


# ---------------------------------------------------------------- how many tokens to draft

class FixedK:
    def __init__(self, k: int):
        self.k = k

    def choose(self, max_k: int) -> int:
        return min(self.k, max_k)

    def observe(self, k: int, n_accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        pass


def copy_limit(match_length: int) -> int:
    """The most n-gram tokens worth risking on a match of this length: 2m + 4. A copy's evidence is how
    much of it already agrees; a bucket's acceptance is an average over its matches, and one that
    learned high on long copies (6 agreeing tokens are often the restart of a copied file after an
    edit) otherwise proposed 64 tokens where the text went elsewhere: T(65), 11 T(1), for nothing.
    Doubling as the agreement grows reaches 64 tokens a few steps into a copy (a TCP-like slow start).
    `AutoDrafting.evidence` also starts it again after a loss: a rejected copy."""
    return 2 * match_length + 4


class AdaptiveK:
    """Chooses K at every step, 0 included, to maximise expected tokens per second.

    Model (Leviathan et al. 2023): with per-token acceptance a, a step drafting k tokens yields
    E(k) = (1 - a^(k+1)) / (1 - a) tokens and costs k * t_draft + T(k + 1), where T(n) is the
    target's time for a batch of n. Rate(k) = E(k) / (k t_draft + T(k+1)); Rate(0) = 1 / T(1).
    a is a decaying count of this generation's acceptances and rejections; the costs come from
    `Costs`, shared across generations. When K=0 wins, a probe (K = k_first) now and then keeps
    the estimates fresh, less and less often while K=0 keeps winning, and never once the costs say
    no draft could pay; when some K > 0 wins, K + 1 is tried now and then until its cost is known.
    A generation starts probing where the last one left off, less CARRY: on an H200 a probe of a
    never-agreeing draft took about 7 ms where a token took 1.9, and a fresh start's probes (steps 2,
    7, 16, 33, 66, 131) took 8% of each 256-token answer; a new prompt may still suit the draft better.
    """

    DECAY = 0.95  # about the last 20 steps count
    K_FIRST = 3
    IDLE_WHEN_NO_DRAFT_PAYS = 1024
    PROBE_FIRST, PROBE_LONGEST, CARRY = 2, 128, 4

    def __init__(self, k_max: int = 8, k_first: int = K_FIRST, costs: Costs | None = None):
        self.k_max, self.k_first = k_max, k_first
        self.costs = costs if costs is not None else Costs()
        self.accepted = 0.0
        self.rejected = 0.0
        self.steps = 0
        # the first probe comes soon (the first runs' timings are the noisiest), unless the last
        # generation's probes kept failing
        self.probe_interval = max(self.PROBE_FIRST, self.costs.probe_interval // self.CARRY)
        self.since_probe = 0
        self.probe_due = False
        self.idle = 0  # steps left to run the target alone without reconsidering

    @property
    def acceptance(self) -> float:
        # a beta(1, 1) prior keeps the estimate off 0 and 1
        return (self.accepted + 1) / (self.accepted + self.rejected + 2)

    def observe(self, k, n_accepted, draft_seconds, verify_seconds):
        self.steps += 1
        self.costs.observe(k, draft_seconds, verify_seconds)
        if k > 0:
            self.accepted = self.DECAY * self.accepted + n_accepted
            self.rejected = self.DECAY * self.rejected + (1 if n_accepted < k else 0)

    def rates(self, max_k: int) -> list[float]:
        """Expected tokens per second for k = 0..max_k."""
        batch = self.costs.batch_model()
        a = min(self.acceptance, 0.999)
        t_draft = self.costs.t_draft
        return [tokens_per_second(k, a, t_draft, batch(k + 1)) for k in range(max_k + 1)]  # k = 0: 1 / T(1)

    def choose(self, max_k: int) -> int:
        if self.idle:  # the target alone for a while: no arithmetic on these steps
            self.idle -= 1
            return 0
        limit = min(self.k_max, max_k)
        if limit < 1:
            return 0
        if self.costs.warm and not self.costs.could_pay(limit):
            # not even a draft that is always right would beat the target alone here: look again
            # only after many steps (the costs keep learning T(1) meanwhile)
            self.idle = self.IDLE_WHEN_NO_DRAFT_PAYS
            return 0
        if not self.costs.batch_times:
            return min(self.k_first, limit)
        if 1 not in self.costs.batch_times:
            return 0  # measure the target alone once
        rates = self.rates(limit)
        best = max(range(limit + 1), key=rates.__getitem__)
        if best > 0:
            self._next_probe_after(self.PROBE_FIRST)
            # now and then try one more, where that batch size has few measurements: a line through
            # noisy early timings must not pin K low
            self.since_probe += 1
            up = best + 1
            if up <= limit and len(self.costs.batch_times.get(up + 1, ())) < 3 and self.since_probe >= 4:
                self.since_probe = 0
                return up
            return best
        if self.probe_due:
            self.probe_due = False
            self._next_probe_after(min(self.probe_interval * 2, self.PROBE_LONGEST))
            return min(self.k_first, limit)
        self.idle = self.probe_interval - 1  # then a probe, if K=0 still wins
        self.probe_due = True
        return 0

    def _next_probe_after(self, steps: int) -> None:
        self.probe_interval = self.costs.probe_interval = steps  # the costs outlive the generation


class AutoDrafting:
    """`--draft auto`: n-gram proposals where they pay, else the draft model's (if any), else none.

    It is both the loop's drafter and its controller. `choose` only bounds K (and lets the draft
    model's controller decide its own K); `propose` looks for an n-gram candidate and prices it.
    A candidate costs no drafting: proposing k of its tokens turns the step's target call into a
    batch of k + 1, so it pays when E(a, k) / T(k + 1) beats the alternative, 1 / T(1) (the target
    alone) or the draft model's expected rate. a, the chance each proposed token is kept, is
    estimated per bucket of how long the candidate's context agrees with the sequence
    (`NgramTallies`: a long copied stretch is kept far more often than a 2-token coincidence),
    starting from what earlier generations on this machine saw. A bucket that does not pay is
    still probed now and then with a single token, the cheapest verification (T(2) - T(1)), less
    often after each probe that fails.
    """

    PROBE_FIRST, PROBE_LONGEST = 4, 64  # candidates between probes of a bucket that does not pay
    # n-gram proposals are free to draft, and on a CPU a batch of 17 cost about 5 single tokens
    # (T(n) flattens where llama.cpp's batched kernels take over): a long copy is proposed in long
    # steps, up to this many tokens even where --draft-max (the draft model's K) is lower. 64, as
    # llama.cpp's ngram-mod (ngram-simple: 48): on an agent's whole-file rewrite, replayed with the
    # demo pair's T(n), 16 gave 2.75x the target alone and 64 3.24x (fewer, longer verifications)
    NGRAM_K_MAX = 64
    PROBE_MAX_LAG = 8  # tokens the draft model may have to catch up for a probe of it
    LONG_PROBE_MATCH, LONG_PROBE_ACCEPTANCE, LONG_PROBE_K = 16, 0.8, 16  # see long_copy_probe

    def __init__(self, ngram: NgramDrafter, model: ModelDrafter | None, costs: Costs, k_max: int):
        self.ngram, self.model, self.costs = ngram, model, costs
        self.k_max = max(k_max, self.NGRAM_K_MAX)
        self.context = model.context if model is not None else None
        self.model_k = AdaptiveK(k_max, costs=costs) if model is not None else None
        self.tallies = costs.ngram
        self.catch_up_seconds = 0.0
        self._model_choice = 0
        self._alone_steps = 0     # steps the target made alone since the draft last caught up
        self._source = None       # of the current step: a bucket name, "model" or None
        self._probe_wait: dict[str, list[int]] = {}  # bucket -> [candidates since its last probe, interval]
        self._since_rejection = 1 << 30  # tokens since this generation's last rejected n-gram proposal

    @classmethod
    def over(cls, chosen, ngram: NgramDrafter, costs: Costs, k_max: int) -> "AutoDrafting":
        """Around what `SpeculativeDecoder._drafter` chose: a model, a lookup or a hybrid drafter."""
        model = chosen if isinstance(chosen, ModelDrafter) else getattr(chosen, "model", None)
        ngram = chosen if isinstance(chosen, NgramDrafter) else getattr(chosen, "lookup", ngram)
        return cls(ngram, model, costs, k_max)

    def choose(self, max_k: int) -> int:
        self._model_choice = self.model_k.choose(max_k) if self.model_k is not None else 0
        return min(max(self.k_max, self._model_choice), max_k)

    def alternative_rate(self, model_ready: bool = True) -> float:
        """Tokens per second without an n-gram draft this step: the draft model's K where it may draft
        now (`model_ready`), else the target alone."""
        alone = 1.0 / self.costs.batch_model()(1)
        if self._model_choice > 0 and model_ready:
            return max(alone, self.model_k.rates(self._model_choice)[self._model_choice])
        return alone

    def ngram_k(self, candidate, bucket: str, model_ready: bool = True) -> int:
        """How many of the candidate's tokens to propose: the K with the best expected rate, 0 when
        none beats the alternative (then 1 now and then, as a probe)."""
        batch = self.costs.batch_model()
        a = min(self.tallies.acceptance(bucket), 0.999)
        alternative = self.alternative_rate(model_ready)
        best_k, best_rate = 0, alternative
        for k in range(1, min(len(candidate.tokens), copy_limit(self.evidence(candidate))) + 1):
            rate = expected_tokens(a, k) / batch(k + 1)
            if rate > best_rate:
                best_k, best_rate = k, rate
        wait = self._probe_wait.setdefault(bucket, [0, self.PROBE_FIRST])
        if best_k:
            wait[:] = [0, self.PROBE_FIRST]
            return best_k
        long_probe = self.long_copy_probe(candidate, a)
        if not long_probe and not self.right_guess_pays(len(candidate.tokens), alternative):
            return 0  # no probe where none could pay
        wait[0] += 1
        if wait[0] < wait[1]:
            return 0
        wait[:] = [0, min(2 * wait[1], self.PROBE_LONGEST)]  # reset to the first interval if it is kept
        return long_probe or 1

    def long_copy_probe(self, candidate, acceptance: float) -> int:
        """Tokens for a probe of a long copy (0: none). A batch of n never costs more than n single
        tokens, so a copy kept in full costs no more than the target alone would for its tokens: such a
        probe risks little even where no K seems to pay, and it times the long batches again. Timed
        once at the start of a busy moment they can shut copying out for good (T(1), timed at every
        step, falls back while T(17) does not: on a shared machine a whole file was then written by
        the target alone, 150 steps, its copy in the prompt)."""
        if acceptance < self.LONG_PROBE_ACCEPTANCE or candidate.match_length < self.LONG_PROBE_MATCH:
            return 0
        return min(len(candidate.tokens), copy_limit(self.evidence(candidate)), self.LONG_PROBE_K)

    def evidence(self, candidate) -> int:
        """Agreeing tokens behind a copy: its context's agreement, but none from before the last copy
        that broke. An agent's session holds the file it read and each rewrite of it, so where this
        answer leaves one copy (an edit, the end of the file) another often agrees for 64 tokens and
        goes on elsewhere: replayed, 47 tokens of the previous answer's closing words were proposed
        and all rejected, T(48) = 12.6 T(1) for nothing."""
        return min(candidate.match_length, self._since_rejection)

    def right_guess_pays(self, k_max: int, alternative: float) -> bool:
        """Whether k <= k_max n-gram tokens, every one kept, would beat `alternative` (tokens/s). On a
        CPU where a batch of n costs n tokens none does: then no probe, but of a long copy."""
        return self.costs.best_batch_rate(k_max) > alternative

    def propose(self, tokens: list[int], k: int, params: SamplingParams, draws: Draws,
                guide: DraftGuide | None = None) -> list[int]:
        self.catch_up_seconds = 0.0
        k_max = min(k, self.k_max)
        # searched even where no K seems to pay (a long copy is still probed): replayed over an agent's
        # 1,000-token session, the whole search and indexing took 0.1 s
        candidate = self.ngram.candidate(tokens, k_max)
        # a copy competes with the draft model only where the model may draft now: one that lags far
        # behind (a new prompt it has not seen, its catch-up not yet bought) leaves the target alone as
        # the alternative (a code completion's copies from the suffix, priced against a model that then
        # did not draft either, were never proposed: nothing was drafted at all)
        model_ready = self._model_choice > 0 and self._model_may_draft(tokens)
        if candidate is not None and candidate.tokens:
            bucket = bucket_of(candidate)
            k_ngram = self.ngram_k(candidate, bucket, model_ready)
            if k_ngram:
                self._source = bucket
                proposals = candidate.tokens[:k_ngram]
                if guide is not None:
                    proposals = proposals[:guide.allowed_prefix(proposals)]
                return proposals
        self._source = "model" if model_ready else None
        if self._source is None:
            # rent is paid only where the draft model was expected to pay (its K > 0): a step where
            # the target alone was the best choice anyway costs nothing the catch-up would save
            self._alone_steps += self._model_choice > 0
            return []
        if len(tokens) - self.context.n_past > self.PROBE_MAX_LAG:
            self._alone_steps = 0  # caught up: the rent starts again
        proposals = self.model.propose(tokens, min(k, self._model_choice), params, draws, guide)
        self.catch_up_seconds = self.model.catch_up_seconds
        return proposals

    def _model_may_draft(self, tokens: list[int]) -> bool:
        """The draft model's K stands where it expects to pay; a probe (K > 0 though K = 0 has the
        best expected rate) only while the draft is nearly caught up: after the n-gram source or
        the target alone made the text, the draft would first evaluate all it skipped (on a CPU,
        the first probe of a generation evaluated a 163-token prompt: 11 target tokens' time).

        A catch-up is bought as skis are (rent until the rent paid equals the price, then buy: never
        more than twice the best choice in hindsight): the draft catches up once the steps the target
        made alone, each `saving` slower than with the draft, have cost as much as the catch-up would.
        The answer's length is not known: an agent's one-line reply after three whole-file rewrites
        that n-gram copies drafted (1,500 tokens the draft had not seen) took 25 s instead of 2.6."""
        lag = len(tokens) - self.context.n_past
        if lag <= self.PROBE_MAX_LAG:
            return True
        if getattr(self.costs, "shared", False):  # a slot (`slots`): every slot would wait for the catch-up
            return False
        t_alone = self.costs.batch_model()(1)
        saving = t_alone - 1.0 / self.model_k.rates(self._model_choice)[self._model_choice]
        return saving > 0 and self._alone_steps * saving >= self.catch_up_estimate(lag)

    def catch_up_estimate(self, lag: int) -> float:
        """Seconds for the draft to evaluate `lag` tokens in one batch: a draft token's time, scaled as
        the target's batches scale (T(n) / T(1))."""
        batch, n = self.costs.batch_model(), min(lag, 512)
        return self.costs.t_draft * batch(n) / batch(1) * lag / n

    def observe(self, k, n_accepted, draft_seconds, verify_seconds) -> None:
        source = self._source if k > 0 else None
        copy_broke = source not in (None, "model") and n_accepted < k
        self._since_rejection = 1 if copy_broke else self._since_rejection + n_accepted + 1
        if source is None or source == "model":
            if self.model_k is not None:
                self.model_k.observe(k, n_accepted, draft_seconds, verify_seconds)
            else:
                self.costs.observe(k, draft_seconds, verify_seconds)
            return
        self.costs.add_batch(k + 1, verify_seconds)  # no draft time: an n-gram proposal is free
        self.tallies.observe(source, k, n_accepted)
        if k == 1 and n_accepted == 1:  # a probe kept: probe this bucket soon again
            self._probe_wait[source] = [0, self.PROBE_FIRST]
