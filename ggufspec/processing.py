"""The target's decision at each position (`TargetJudge`): what its logits go through before a choice,
the choice (greedy, or speculative sampling's rejection rule), and the log-probabilities reported.

    raw logits --logit_bias--> --penalties--> --DRY--> --grammar--> processed logits
        processed --filters (top-k, top-p, min-p, temperature: `sampling`)--> the sampling distribution
        processed --log-softmax--> the logprobs reported (OpenAI reports the model's, not the filtered)

The order is llama.cpp's sampler chain (logit bias, penalties, DRY, then the grammar masks what it forbids).

Why speculation stays lossless: the processed logits at a position depend on the sequence before it
(penalties count it, DRY scans it, the grammar has walked it). In a verification batch the target's row
i was computed after the accepted draft tokens 0..i-1; the penalties and DRY are given that history, and
`TargetProcessor` is advanced by exactly those tokens, in order, before it processes row i (it never
sees a rejected one: `accept` is only called for tokens that are kept). So row i is processed exactly
as it would be by the target alone with that history, and a draft token the grammar forbids has
probability 0 there: it is rejected.
"""
from __future__ import annotations

import math
import numbers
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import numpy as np

from .adaptivep import AdaptiveP
from .dry import DEFAULT_BREAKERS, Dry
from .errors import GgufspecError
from .grammar import Grammar, check_trigger_pattern
from .mirostat import Mirostat
from .sampling import Draws, SamplingParams, greedy_token, sample, top_k_ids
from .thinking import ReasoningControl, ThinkingBlock, ThinkingTags

MAX_TOP_LOGPROBS = 20  # OpenAI's limit


@dataclass(frozen=True)
class Constraints:
    """Per-request processing of the target's logits (all off by default)."""

    logit_bias: Mapping[int, float] = field(default_factory=dict)  # token id -> added to its logit
    frequency_penalty: float = 0.0   # minus count * this, for each token in the window
    presence_penalty: float = 0.0    # minus this, once, for each token in the window
    repeat_penalty: float = 1.0      # llama.cpp's: positive logits divided by it, negative multiplied
    repeat_last_n: int = 64          # the penalties' window over the sequence, prompt included (-1: all)
    dry_multiplier: float = 0.0      # llama.cpp's DRY (`dry`): multiplier * base^(repeat - allowed) off a
    dry_base: float = 1.75           # logit that would extend a repeat longer than dry_allowed_length (0: off)
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64     # the window DRY scans, prompt included (-1: the whole context, 0: off)
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_BREAKERS  # a repeat across one of these is no repeat
    grammar: str | None = None       # GBNF text
    grammar_root: str = "root"
    grammar_patterns: tuple[str, ...] = ()      # lazy grammar: regexes over the output that switch it on
    grammar_trigger_tokens: tuple[int, ...] = ()  # ...or token ids; with neither, it is on from the start
    ignore_eos: bool = False         # llama.cpp's: the end-of-generation tokens get a bias of -inf (TargetJudge)
    reasoning_budget: int = -1       # llama.cpp's: the most tokens in a <think> block, then </think> forced (-1: any)
    reasoning_budget_message: str = ""  # ...and this text before the forced </think>
    grammar_outside_thinking: bool = False  # the grammar shapes the answer after a <think> block, not the block
    thinking_opened: bool | None = None  # the answer starts inside a block (None: read from the prompt's tail)
    reasoning_control: ReasoningControl | None = field(default=None, compare=False)  # the block ended from outside

    def __post_init__(self):
        self._check_types()
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not -2.0 <= value <= 2.0:
                raise GgufspecError(f"{name} must be in [-2, 2], got {value}")
        if not math.isfinite(self.repeat_penalty) or self.repeat_penalty <= 0:
            raise GgufspecError(f"repeat_penalty must be > 0 (1 disables it), got {self.repeat_penalty}")
        if self.repeat_last_n < -1:
            raise GgufspecError(f"repeat_last_n must be >= -1 (-1: the whole sequence, 0: off), got {self.repeat_last_n}")
        self._check_dry()
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or token < 0:
                raise GgufspecError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not (math.isfinite(bias) or bias == -math.inf):
                raise GgufspecError(f"logit_bias values must be numbers, got {bias!r} for token {token}")

    def _check_types(self) -> None:
        real = lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)
        whole = lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool)
        for name in ("frequency_penalty", "presence_penalty", "repeat_penalty", "dry_multiplier", "dry_base"):
            if not real(getattr(self, name)):
                raise GgufspecError(f"{name} must be a number, got {getattr(self, name)!r}")
        for name in ("repeat_last_n", "dry_allowed_length", "dry_penalty_last_n"):
            if not whole(getattr(self, name)):
                raise GgufspecError(f"{name} must be a whole number, got {getattr(self, name)!r}")
        if not isinstance(self.logit_bias, Mapping) or not all(real(v) for v in self.logit_bias.values()):
            raise GgufspecError("logit_bias must map token ids to numbers ({id: bias}), got "
                                f"{self.logit_bias!r:.80}")
        if not (self.grammar is None or isinstance(self.grammar, str)) or not isinstance(self.grammar_root, str):
            raise GgufspecError("grammar and grammar_root must be texts (GBNF and a rule's name)")
        if isinstance(self.grammar_patterns, str) or not all(isinstance(p, str) for p in self.grammar_patterns):
            raise GgufspecError("grammar_patterns must be a sequence of regular expressions (texts)")
        for pattern in self.grammar_patterns:
            check_trigger_pattern(pattern)
        if not whole(self.reasoning_budget) or self.reasoning_budget < -1:
            raise GgufspecError(f"reasoning_budget must be a whole number >= -1 (-1: no limit, 0: no thinking), "
                                f"got {self.reasoning_budget!r}")
        if not isinstance(self.reasoning_budget_message, str):
            raise GgufspecError("reasoning_budget_message must be a text")
        if not all(whole(t) and t >= 0 for t in self.grammar_trigger_tokens):
            raise GgufspecError(f"grammar_trigger_tokens must be token ids, got {self.grammar_trigger_tokens!r}")

    def _check_dry(self) -> None:
        if not math.isfinite(self.dry_multiplier):
            raise GgufspecError(f"dry_multiplier must be a finite number (0: off), got {self.dry_multiplier}")
        if not (math.isfinite(self.dry_base) and self.dry_base >= 1):
            raise GgufspecError(f"dry_base must be a number >= 1, got {self.dry_base}")
        if self.dry_allowed_length < 0:
            raise GgufspecError(f"dry_allowed_length must be >= 0, got {self.dry_allowed_length}")
        if self.dry_penalty_last_n < -1:
            raise GgufspecError(f"dry_penalty_last_n must be >= -1 (-1: the whole context, 0: off), got "
                                f"{self.dry_penalty_last_n}")
        breakers = self.dry_sequence_breakers
        if isinstance(breakers, str) or not all(isinstance(b, str) for b in breakers):
            raise GgufspecError(f"dry_sequence_breakers must be a list of texts, got {breakers!r:.80}")
        object.__setattr__(self, "dry_sequence_breakers", tuple(breakers))

    @property
    def drys(self) -> bool:
        """Whether DRY is on (llama.cpp's: a multiplier other than 0 and a window)."""
        return self.dry_multiplier != 0 and self.dry_penalty_last_n != 0

    @property
    def penalises(self) -> bool:
        return self.repeat_last_n != 0 and (self.frequency_penalty != 0 or self.presence_penalty != 0
                                            or self.repeat_penalty != 1.0)

    @property
    def active(self) -> bool:
        return (bool(self.logit_bias) or self.penalises or self.drys or self.grammar is not None or self.ignore_eos
                or self.tracks_thinking)

    @property
    def reads_history(self) -> bool:
        """Whether processing a row reads the sequence before it (the penalties count it, DRY scans it)."""
        return self.penalises or self.drys

    @property
    def tracks_thinking(self) -> bool:
        return (self.reasoning_budget >= 0 or (self.grammar_outside_thinking and self.grammar is not None)
                or self.reasoning_control is not None)


def log_normaliser(row: np.ndarray) -> float:
    """log sum exp(row): a token's logprob is its logit less this. The exp in the row's float32, summed in
    float64 (0.3 ms over 151k tokens, where float64's exp takes 1.8: per token of a logprobs request)."""
    top = float(row.max())
    return top + math.log(float(np.exp(row - top).sum(dtype=np.float64)))


def top_logprobs(row: np.ndarray, n: int, log_total: float) -> tuple[tuple[int, float], ...]:
    """The n most likely (token id, logprob) of a row of logits whose `log_normaliser` is log_total, most
    likely first (ties: the lower id first). Tokens a grammar or a bias of -inf rules out are left out
    (-inf is no JSON number; OpenAI omits them too)."""
    if n <= 0:
        return ()
    best = top_k_ids(row, min(n, len(row)))
    return tuple((int(t), float(row[t]) - log_total) for t in best if row[t] > -math.inf)


class TargetProcessor:
    """One generation's processing of the target's logits: `apply(row, history)` for the position after
    `history`, then `accept(token)` for the token kept there (see the module's note on order)."""

    def __init__(self, constraints: Constraints, vocab, n_vocab: int, thinking: ThinkingBlock | None = None,
                 dry: Dry | None = None):
        self.constraints = constraints
        self.n_vocab = n_vocab
        self.dry = dry  # the target's sequence's DRY sampler, where DRY is on
        self._bias = _bias_vector(constraints.logit_bias, n_vocab)
        self._grammar = Grammar(vocab, constraints) if constraints.grammar is not None else None
        self.thinking = thinking  # the <think> block's state: its budget, where the grammar applies
        self._at_start = True  # no token of the answer kept yet

    def biased(self, logits: np.ndarray, history: Sequence[int], dry: Dry | None = None) -> np.ndarray:
        """A copy of the row (of up to n_vocab entries) with the logit bias, penalties and DRY applied
        (`dry`: another sequence's sampler than the target's, a draft's walk ahead)."""
        out = logits.astype(np.float32, copy=True)
        if self._bias is not None:
            out += self._bias[:len(out)]
        if self.constraints.penalises:
            _penalise(out, history, self.constraints)
        if self.dry is not None:
            (dry or self.dry).apply(out, history)
        return out

    def forbids(self, token: int) -> bool:
        """Whether a -inf logit bias bans the token outright."""
        return self._bias is not None and token < len(self._bias) and self._bias[token] == -np.inf

    def apply(self, logits: np.ndarray, history: Sequence[int], top_n: int = 0) -> np.ndarray:
        """The processed row. top_n > 0: only the top_n best tokens the grammar allows need their
        exact logits (greedy needs 1, top-k sampling k), the others may come back as -inf; 0: all."""
        out = self.biased(logits, history)
        control = self.constraints.reasoning_control
        if control is not None and self.thinking is not None and control.take_end_request():
            self.thinking.end_now()  # from this position on, as the target alone would have it
        if self.thinking is not None and self.thinking.forced_token() is not None:
            self._check_grammar_allows(self.thinking.forced_token())
            self.thinking.restrict(out)  # the one token left: no mask needed
        elif self._grammar is not None and self.grammar_applies(self.thinking):
            opening = self._opening_tag()
            opening_logit = out[opening] if opening is not None else None
            if top_n > 0:
                self._grammar.mask_all_but_best(out, top_n)
            else:
                self._grammar.mask(out)
            if opening is not None:  # the grammar's choices, and <think>
                out[opening] = opening_logit
        if not np.isfinite(out.max()):
            raise GgufspecError("the grammar allows no token here (it may need an end the model cannot reach)"
                                if self._grammar is not None else "logit_bias bans every token: none is left to choose")
        return out

    def _check_grammar_allows(self, forced: int) -> None:
        """A token the budget forces must be one the grammar takes (llama.cpp's aborts on any other)."""
        if self._grammar is not None and self.grammar_applies(self.thinking) and \
                not self._grammar.allows(np.array([forced]), np.zeros(1, np.float32))[0]:
            raise GgufspecError("the grammar forbids the </think> that the reasoning budget forces: let the "
                                "grammar allow it, or give no budget")

    def grammar_applies(self, thinking: ThinkingBlock | None) -> bool:
        """Whether the grammar shapes the next token: not inside a thinking block, where it shapes only
        the answer (llama.cpp: a lazy grammar's triggers are not looked for there either)."""
        outside_only = self.constraints.grammar_outside_thinking or bool(self.constraints.grammar_patterns)
        return thinking is None or not (outside_only and thinking.inside)

    def _opening_tag(self) -> int | None:
        """The <think> token, where a format that shapes only the answer lets the model open a block
        first: at the answer's start, outside a block, the tag one token (Qwen3's templates leave
        thinking to the model, which opens it with its first token)."""
        block = self.thinking
        if not (self._at_start and self.constraints.grammar_outside_thinking and block is not None
                and block.state == "outside" and len(block.tags.open) == 1):
            return None
        return block.tags.open[0]

    def accept(self, token: int) -> None:
        # before the token moves the block: </think> is no answer; the <think> let through is none either
        grammar_applies = self.grammar_applies(self.thinking) and token != self._opening_tag()
        self._at_start = False
        if self.thinking is not None:
            self.thinking.accept(token)
        if self._grammar is not None and grammar_applies and not self._grammar.accept(token):
            # the token fired a lazy grammar's trigger onto text the grammar rejects: what follows is no
            # call the grammar could shape, so the rest of the answer is not constrained (llama.cpp aborts)
            print("ggufspec: the grammar's trigger appeared in the output followed by text the grammar "
                  "rejects; the rest of the answer is not constrained", file=sys.stderr)
            self._drop_grammar()  # the grammar alone: the bias, penalties and DRY go on

    def grammar_copy(self) -> Grammar | None:
        """The grammar in its current state, to walk ahead of it (None: no grammar)."""
        return self._grammar.clone() if self._grammar is not None else None

    def close(self) -> None:
        self._drop_grammar()
        if self.dry is not None:
            self.dry.close()

    def _drop_grammar(self) -> None:
        if self._grammar is not None:
            self._grammar.close()
            self._grammar = None


def _bias_vector(logit_bias: Mapping[int, float], n_vocab: int) -> np.ndarray | None:
    if not logit_bias:
        return None
    bias = np.zeros(n_vocab, dtype=np.float32)
    for token, value in logit_bias.items():
        if token >= n_vocab:
            raise GgufspecError(f"logit_bias names token {token}, but the model's vocabulary has {n_vocab}")
        bias[token] = value
    return bias


def _penalise(logits: np.ndarray, history: Sequence[int], c: Constraints) -> None:
    """llama.cpp's penalties sampler over the last repeat_last_n tokens of the sequence: a repeated
    token's logit l becomes l / r (l > 0) or l * r (l <= 0), then l - count * frequency - presence."""
    window = history if c.repeat_last_n == -1 else history[max(0, len(history) - c.repeat_last_n):]
    counts = Counter(window)
    if not counts:
        return
    ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
    ids_ok = ids < len(logits)
    ids = ids[ids_ok]
    n = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))[ids_ok]
    seen = logits[ids]
    seen = np.where(seen <= 0, seen * c.repeat_penalty, seen / c.repeat_penalty)
    logits[ids] = seen - n * c.frequency_penalty - c.presence_penalty


class TargetJudge:
    """The target's decision at each position, as the target alone would make it: its logits through
    the request's constraints (`processing`), then greedy, or the position's draw (`sampling.Draws`).

    A proposal is kept exactly when it is the token the target picks there; the target picks the same
    token whatever was proposed, so the text is the target alone's, token for token, with any drafter."""

    def __init__(self, target, params: SamplingParams, constraints: Constraints | None = None,
                 n_logprobs: int | None = None, prompt: Sequence[int] = ()):
        self.params = params
        self.draws = Draws(params.seed)
        self.n_logprobs = n_logprobs
        self._is_end = target.is_end_of_generation
        if constraints is not None and not isinstance(constraints, Constraints):
            raise GgufspecError(f"constraints must be a ggufspec.Constraints, got {type(constraints).__name__}")
        if constraints is not None and params.mirostat:  # llama.cpp's chain is temperature, Mirostat: no penalties
            constraints = replace(constraints, repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                                  dry_multiplier=0.0)
        self.steering = _steering(params, target.n_vocab)  # Mirostat or adaptive-p: a state the tokens move
        if constraints is not None and constraints.ignore_eos:  # the model's own end tokens, known here
            ended = dict.fromkeys(target.end_of_generation_ids, -math.inf)
            constraints = replace(constraints, logit_bias={**constraints.logit_bias, **ended}, ignore_eos=False)
        active = constraints is not None and constraints.active
        thinking = thinking_block(target, constraints, prompt) if active else None
        dry = _dry_sampler(target, constraints) if active and constraints.drys else None
        self.processor = TargetProcessor(constraints, target.vocab, target.n_vocab, thinking, dry) if active else None
        self.needs_history = active and constraints.reads_history
        # how many of the best tokens must be exact: all for logprobs and unfiltered sampling
        self._top_n = 0 if n_logprobs is not None or params.mirostat else 1 if params.greedy else params.top_k

    def decide(self, logits: np.ndarray, history: Sequence[int], position: int) -> tuple[int, tuple]:
        """The token at this position of the sequence (after `history`, which may be shortened where
        the penalties do not read it) and its score."""
        row = self.processor.apply(logits, history, self._top_n) if self.processor is not None else logits
        if self.params.greedy:
            token = greedy_token(row)
        elif self.steering is not None:  # its state moves with each token decided (all are kept)
            ids, probs = self.steering.cut(row)
            index = self.draws.pick_among(ids, probs, position)
            token = int(ids[index])
            self.steering.observe(token, float(probs[index]))
        else:
            token, _ = sample(row, self.params, self.draws, position)
        if self.processor is not None and not self._is_end(token):  # every token decided here is kept
            self.processor.accept(token)
        return token, self._score(row, token)

    def _score(self, row: np.ndarray, token: int) -> tuple:
        if self.n_logprobs is None:
            return ()
        log_total = log_normaliser(row)
        return float(row[token]) - log_total, top_logprobs(row, self.n_logprobs, log_total)

    def draft_guide(self) -> DraftGuide | None:
        """The same constraints for the drafter's proposals (None: there are none)."""
        return DraftGuide(self.processor, self.params, self._is_end) if self.processor is not None else None

    def close(self) -> None:
        if self.processor is not None:
            self.processor.close()


def _steering(params: SamplingParams, n_vocab: int) -> Mirostat | AdaptiveP | None:
    """The generation's Mirostat (in place of the chain) or adaptive-p (after it), where one is on."""
    if params.greedy:
        return None
    if params.mirostat:
        return Mirostat(params.mirostat, params.mirostat_tau, params.mirostat_eta, params.temperature, n_vocab)
    return AdaptiveP(params) if params.adaptive_target >= 0 else None


def _dry_sampler(target, c: Constraints) -> Dry:
    """The generation's DRY sampler over the target's vocabulary (a window of -1: the whole context)."""
    window = target.n_ctx if c.dry_penalty_last_n == -1 else c.dry_penalty_last_n
    return Dry.for_model(target.llm, target.vocab, c.dry_multiplier, c.dry_base, c.dry_allowed_length, window,
                         c.dry_sequence_breakers)


def thinking_block(target, c: Constraints, prompt: Sequence[int]) -> ThinkingBlock | None:
    """The request's <think> block, tracked from where the prompt leaves it (None: it asks for none)."""
    if not c.tracks_thinking:
        return None
    tags = ThinkingTags.of(lambda text: target.llm.tokenize(text.encode(), add_bos=False, special=True),
                           c.reasoning_budget_message)
    block = ThinkingBlock(tags, c.reasoning_budget if c.reasoning_budget >= 0 else None, target.piece)
    if c.thinking_opened is None:
        block.read_prompt(prompt)
    elif c.thinking_opened:
        block.open_block()
    return block


class DraftGuide:
    """The request's constraints over a drafter's proposals, so that it proposes what the target can
    keep. A draft model's row gets the same logit bias and penalties as the target's, and the grammar's
    mask from a copy of the grammar's state walked along the step's proposals (dropped after the step);
    an n-gram proposal is cut before the first token the grammar or a -inf bias forbids. Where the
    thinking budget forces a token, the guided row is that token (and an n-gram proposal stops before
    any other).

    Losslessness does not depend on it: the target's rule is unchanged, and a sampled draft token's q
    is the guided distribution it was drawn from. It only raises how many proposals are kept (a draft
    token the grammar forbids is certain to be rejected). The grammar checks only the best token
    (greedy) or the top-k (sampling): with top-k off, a full-vocabulary check (tens of ms) would cost
    more than a draft token, so there the draft is not masked by the grammar.
    """

    def __init__(self, processor: TargetProcessor, params: SamplingParams, is_end):
        self.processor, self._is_end = processor, is_end
        self._top_n = 1 if params.greedy else params.top_k
        self._grammar: Grammar | None = None
        self._thinking: ThinkingBlock | None = None
        self._dry = processor.dry.clone() if processor.dry is not None else None  # the draft's sequence's

    def fits(self, n_vocab: int) -> bool:
        """Whether a drafter with this vocabulary shares the target's ids (a bridged draft's is smaller)."""
        return n_vocab <= self.processor.n_vocab

    @property
    def needs_history(self) -> bool:
        """Whether `apply` reads the sequence (the penalties count it, DRY scans it); else any history will do."""
        return self.processor.constraints.reads_history

    def __enter__(self) -> DraftGuide:
        self._grammar = self.processor.grammar_copy()
        thinking = self.processor.thinking
        self._thinking = thinking.clone() if thinking is not None else None
        return self

    def __exit__(self, *exc) -> None:
        if self._grammar is not None:
            self._grammar.close()
            self._grammar = None

    def apply(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray | None:
        """The draft's guided row, or None where the grammar allows none of its tokens."""
        out = self.processor.biased(logits, history, self._dry)
        if self._thinking is not None and self._thinking.forced_token() is not None:
            self._thinking.restrict(out)  # (`accept` stops there if the grammar forbids it)
        elif self._grammar is not None and self._top_n > 0 and self.processor.grammar_applies(self._thinking):
            self._grammar.mask_all_but_best(out, self._top_n)
        return out if np.isfinite(out.max()) else None

    def accept(self, token: int) -> bool:
        """Walk the copy past a proposed token; False at an end of generation (nothing follows it), or
        at a token the grammar forbids (an unmasked row's, with top-k off: llama.cpp's grammar aborts
        the process when it is made to accept one; the target rejects the token anyway)."""
        if self._is_end(token) or not self._allows(token):
            return False
        grammar_applies = self.processor.grammar_applies(self._thinking)  # as the target's (`accept` there)
        if self._thinking is not None:
            self._thinking.accept(token)
        return self._grammar.accept(token) if self._grammar is not None and grammar_applies else True

    def _allows(self, token: int) -> bool:
        """Whether the grammar, where it applies now, and the thinking block's budget allow the token."""
        if self._thinking is not None and not self._thinking.allows(token):
            return False
        if self._grammar is None or not self.processor.grammar_applies(self._thinking):
            return True
        return bool(self._grammar.allows(np.array([token]), np.zeros(1, np.float32))[0])

    def allowed_prefix(self, proposals: Sequence[int]) -> int:
        """How many leading proposals (an n-gram match) the grammar and -inf biases allow."""
        with self:
            for i, token in enumerate(proposals):
                if self.processor.forbids(token) or not self._allows(token):
                    return i
                if not self.accept(token):
                    return i + 1
        return len(proposals)
