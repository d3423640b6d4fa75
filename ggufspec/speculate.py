"""The speculative decoding loop: prefill, draft, verify, rewind.

Invariant between steps: `tokens` is the whole sequence; its last token has not been evaluated by
the target yet, everything before it has (target.n_past == len(tokens) - 1). The prefill evaluates
the whole prompt and its last row decides the first token, which sets the invariant up. The draft may lag
behind; it evaluates `tokens[draft.n_past:]` before proposing, so it never re-evaluates a token.

Cache reuse lives in `_prefill`, and only there: each context keeps the longest prefix its KV cache
shares with the new prompt and evaluates the rest (the draft lazily, when it next drafts), so a
conversation that grows turn by turn is never evaluated twice.

Layers, as in mlx-lm: `speculative_steps` yields `Step`s (token, from_draft, logprobs); `SpeculativeDecoder.stream`
turns them into `Piece` records; `SpeculativeDecoder.generate` collects a `Generation`.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Iterator, Sequence

import llama_cpp

from .checks import check_generation_args, check_options, check_token_ids, check_whole_numbers
from .errors import CacheFullError, GgufspecError, Interrupted
from .native import Context
from .stats import Stats
from .stepcosts import measure_step_costs
from .costs import Costs
from .drafting import AdaptiveK, AutoDrafting, FixedK, HybridDrafter, LookupDrafter, ModelDrafter, VocabBridge
from .processing import MAX_TOP_LOGPROBS, Constraints, TargetJudge
from .sampling import SamplingParams
from .costmemory import COSTS_FILE, _costs_key, _load_costs, _save_costs, offload_as_applied  # noqa: F401
from .generation import Generation, Piece, Step, one_thread_at_a_time, pieces, stop_strings, until_stop  # noqa: F401


def speculative_steps(target: Context, drafter, prompt: Sequence[int], *, controller, judge: TargetJudge,
                      max_tokens: int, stats: Stats, reuse_cache: bool = True) -> Iterator[Step]:
    """Yield a `Step` for each generated token, the target's choice every time.

    `drafter` proposes (see `drafting`; None: the target alone), `controller` says how many, `judge`
    turns the target's logits into its decisions (sampling, constraints, logprobs). `reuse_cache`
    False: the prompt is evaluated whole, whatever the caches hold (llama-server's cache_prompt).
    """
    tokens = list(prompt)
    mine = target.generation = object()  # a later generation on this sequence takes it over
    draft_ctx = drafter.context if drafter is not None else None
    guide = judge.draft_guide()  # the request's constraints over the proposals too (more of them kept)
    try:
        first_row = _prefill(target, draft_ctx, tokens, stats, reuse_cache)
    except Interrupted:  # the caller stopped a long prompt (`Context.should_stop`): nothing generated
        stats.stop_reason = "interrupted"
        judge.close()
        return
    target.should_stop = None  # only a prompt stops between its chunks: a step's decodes end as they are
    if max_tokens == 0:  # the prompt alone, into the caches (an editor warming them): nothing decided
        stats.stop_reason = "n_predict"
        judge.close()
        return
    started = time.perf_counter()
    n_generated = 0
    try:
        # the prompt's last row decides the first token (as llama-server samples it from the prompt's
        # batch): it comes without waiting for a verification, which with other slots is one more round
        first, score = judge.decide(first_row, tokens, len(tokens))
        kept, scores, n_accepted = [first], [score], 0
        while True:
            for i, token in enumerate(kept):
                _check_current(target, mine)
                stats.decode_seconds = time.perf_counter() - started
                if target.is_end_of_generation(token):  # the end marker itself is not output
                    stats.stop_reason = "eos"
                    if target.n_past > len(tokens):  # drop what was verified past the end while that is cheap
                        _rewind(target, draft_ctx, len(tokens))
                    return
                tokens.append(token)
                n_generated += 1
                stats.n_predict = n_generated
                yield Step(token, i < n_accepted, *scores[i])
            room = min(target.n_ctx - len(tokens), max_tokens - n_generated)
            if room <= 0:
                stats.stop_reason = "n_predict" if n_generated >= max_tokens else "context"
                return
            _check_current(target, mine)
            kept, scores, n_accepted = _step(target, drafter, tokens, room, controller, judge, guide, stats)
    except GeneratorExit:
        stats.stop_reason = stats.stop_reason or "interrupted"
        raise
    except CacheFullError:  # other slots' sequences took the cells: ended as at the context's end
        stats.stop_reason = "context"
    except Exception:  # a failed decode (a lost RPC worker...): the statistics say how it ended too
        stats.stop_reason = stats.stop_reason or "error"
        raise
    finally:
        judge.close()


def _check_current(target: Context, mine: object) -> None:
    if target.generation is not mine:  # the cache is another generation's now (or freed): never wrong tokens
        raise GgufspecError("this stream was left behind: another generation began on its decoder (one at a "
                            "time; generate_many for several), or the decoder was closed")


def _step(target: Context, drafter, tokens: list[int], room: int, controller, judge: TargetJudge, guide,
          stats: Stats) -> tuple[list[int], list[tuple], int]:
    """Draft, verify, rewind: returns the tokens the step keeps (the accepted proposals, the target's
    own token, and one more where a replay decides it), their scores, and how many were proposals."""
    draft_ctx = drafter.context if drafter is not None else None
    # a step adds up to k + 1 tokens, verified in one batch (logits for every row: within n_batch)
    k = controller.choose(min(room, target.n_batch) - 1) if drafter is not None else 0
    t0 = time.perf_counter()
    proposals = drafter.propose(tokens, k, judge.params, judge.draws, guide) if k > 0 else []
    t1 = time.perf_counter()
    n_accepted, own_token, scores = _verify(target, tokens, proposals, judge)
    t2 = time.perf_counter()
    kept = proposals[:n_accepted] + [own_token]
    target_rewind = draft_rewind = 0.0
    if proposals and _replay_decides_one_more(target, tokens, kept, len(proposals), room):
        target_rewind, draft_rewind, token, score = _replay_and_decide(target, draft_ctx, tokens, kept, judge)
        kept, scores = kept + [token], scores + [score]
    elif proposals:
        target_rewind, draft_rewind = _rewind(target, draft_ctx, len(tokens) + n_accepted)
    if drafter is not None:  # a catch-up after the draft sat idle is not a per-token cost
        # restoring a state and re-evaluating the kept tokens is part of what a step costs
        controller.observe(len(proposals), n_accepted, t1 - t0 - drafter.catch_up_seconds + draft_rewind,
                           t2 - t1 + target_rewind)
    stats.add_step(len(proposals), n_accepted, t1 - t0, t2 - t1)
    return kept, scores, n_accepted


def _prefill(target: Context, draft: Context | None, tokens: list[int], stats: Stats, reuse: bool = True):
    """Evaluate the prompt on the target, reusing what its cache already holds (with `reuse` False,
    nothing: the caches are emptied first). Returns the logits of its last token.

    The last token is evaluated even where the cache holds it (fresh logits). The draft only drops what
    no longer matches: it catches up when it next drafts (a run where auto drafts nothing never does).
    """
    kept = tokens[:-1] if reuse else []
    stats.n_prompt = len(tokens)
    stats.n_prompt_cached = target.reuse_prefix(kept)
    t0 = time.perf_counter()
    if target.rollback == "snapshot" and len(tokens) - stats.n_prompt_cached > 1:
        # a state that cannot be cut back: kept one token short too, where the same prompt asked again
        # (or a next turn, going on past it) resumes, re-evaluating the last token: one checkpoint
        target.decode(tokens[stats.n_prompt_cached:-1], n_logits=0)
        target.checkpoint(upcoming=0, persistent=True)
        target.decode(tokens[-1:], n_logits=1)
    else:
        target.decode(tokens[stats.n_prompt_cached:], n_logits=1)
        target.checkpoint(upcoming=0, persistent=True)  # where the next turn of a conversation starts from
    stats.prompt_seconds = time.perf_counter() - t0
    first_row = target.logits(0) if draft is None else target.logits(0).copy()  # a copy: the draft's taking
    if draft is not None:  # of another slot's cells may let rounds run, whose decodes replace the logits
        draft.reuse_prefix(kept)
    return first_row


def _verify(target: Context, tokens: list[int], proposals: list[int], judge: TargetJudge) -> tuple[int, int, list[tuple]]:
    """One target batch over [last token] + proposals. Returns (accepted count, the target's own
    token, the scores of the accepted proposals and of the own token).

    Row i of the batch is the target's view after tokens + proposals[:i]; the judge decides there in
    order (greedy: its argmax; sampling: that position's draw) and the step stops at the first
    decision that differs from the proposal, or takes the bonus token after the last. A proposal the
    target's vocabulary lacks cannot be evaluated: the batch stops before it, and it is never the
    target's choice, so it is rejected there like any other.
    """
    n_valid = next((i for i, t in enumerate(proposals) if t >= target.n_vocab), len(proposals))
    target.checkpoint(upcoming=n_valid)  # memory that cannot drop a suffix saves its state first
    target.decode(tokens[target.n_past:] + proposals[:n_valid], n_logits=n_valid + 1)
    scores = []
    for i in range(n_valid + 1):
        proposed = proposals[i] if i < len(proposals) else None
        history = tokens + proposals[:i] if judge.needs_history and i else tokens
        token, score = judge.decide(target.logits(i), history, len(tokens) + i)
        scores.append(score)
        if token != proposed or target.is_end_of_generation(token):  # an accepted end is the last (own) one
            return i, token, scores
    raise AssertionError("unreachable: the last row has no proposal, so its token differs")


def _rewind(target: Context, draft: Context | None, n_keep: int) -> tuple[float, float]:
    """Cut both caches back to the sequence's first n_keep tokens (all it holds that was kept).
    Returns the seconds each took (a restore and re-evaluation where the memory cannot cut)."""
    t0 = time.perf_counter()
    target.keep(n_keep)
    t1 = time.perf_counter()
    if draft is not None:
        draft.keep(n_keep)
    return t1 - t0, time.perf_counter() - t1


def _replay_decides_one_more(target: Context, tokens: list[int], kept: list[int], n_proposed: int, room: int) -> bool:
    """Whether the rejected proposals are dropped by re-evaluating the kept ones (memory that cannot cut),
    and the sequence may go on past the target's own token."""
    n_accepted = len(kept) - 1
    return (n_accepted < n_proposed and len(kept) < room and not target.is_end_of_generation(kept[-1])
            and target.keep_reevaluates(len(tokens) + n_accepted))


def _replay_and_decide(target: Context, draft: Context | None, tokens: list[int], kept: list[int],
                       judge: TargetJudge) -> tuple[float, float, int, tuple]:
    """Drop the rejected proposals where the target's memory must re-evaluate what it keeps: the kept
    tokens go in one batch with the target's own token, whose row then decides the next token (as
    llama-server replays after restoring a checkpoint). The re-evaluation is paid for once either
    way; this way it also yields a token. Returns the rewind times and the new (token, score)."""
    t0 = time.perf_counter()
    n_keep = len(tokens) + len(kept) - 1
    target.keep_and_decode(n_keep, kept[-1:], n_logits=1)
    # decided before the draft rewinds: with other slots (`lockstep`) the draft's re-evaluation waits
    # for a round, in which their target tokens replace these logits
    token, score = judge.decide(target.logits(0), tokens + kept, len(tokens) + len(kept))
    t1 = time.perf_counter()
    if draft is not None:
        draft.keep(n_keep)
    return t1 - t0, time.perf_counter() - t1, token, score


MTP = "mtp"  # as the draft: the target's own MTP (nextn) blocks, where its GGUF has them


class SpeculativeDecoder:
    """A target and (optionally) a draft model, ready to generate.

    >>> with SpeculativeDecoder("target.gguf", "draft.gguf", n_ctx=2048) as dec:
    ...     out = dec.generate("def quicksort(arr):", n_predict=64, n_draft=3)
    ...     print(out.text, out.stats.acceptance)

    `target`/`draft` are GGUF paths or `llama_cpp.Llama` objects (left open by `close()` when given
    as objects). With no draft, generation is the target alone through the same code path. `draft="mtp"`:
    the target's own MTP blocks draft (`ggufspec.mtp`; the target must be a path). `lora`: LoRA adapters on
    the target, paths or (path, scale) pairs (`ggufspec.lora`; the target must be a path).
    """

    def __init__(self, target, draft=None, *, n_ctx: int = 4096, n_threads: int | None = None,
                 n_gpu_layers: int = 0, n_gpu_layers_draft: int | None = None, strict: bool = False,
                 check_vocab: bool = True, flash_attn: str = "auto", devices: Sequence | None = None,
                 tensor_split: Sequence[float] | None = None, costs_tag: str = "", swa_full: bool = False,
                 exact: bool = False, n_parallel: int = 1, load_flags: dict | None = None, lora: Sequence = ()):
        from .load import LoadParams, check_compatible, check_gguf_file, flags_tag, flash_attn_type, with_flags
        self._owned: list = []
        self._closed, self._busy = False, threading.RLock()  # llama.cpp's calls, one thread at a time (`steps`)
        mtp = isinstance(draft, str) and draft == MTP
        for model, role in ((target, "target"), (None if mtp else draft, "draft")):  # fail before loading anything
            if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
                check_gguf_file(model, role)
        flash_attn_type(flash_attn)  # a bad setting fails before loading anything
        check_whole_numbers(n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers, n_parallel=n_parallel,
                            n_gpu_layers_draft=n_gpu_layers_draft)
        if n_parallel < 1 or (n_parallel > 1 and mtp):
            raise GgufspecError(f"--parallel must be >= 1, got {n_parallel}" if n_parallel < 1 else
                                "--parallel: MTP drafting runs one sequence at a time; give -md or --parallel 1")
        self.last_stats: Stats | None = None
        self._said_no_rollback = False  # a memory that cannot roll back is reported once, not every call
        self.placement: dict[str, int] | None = None  # target layers per host, when placed across RPC workers
        self.verification = "strict" if strict else "exact" if exact else "batch"  # what rounding answers have
        self.n_gpu_layers = n_gpu_layers  # as loaded, for reports (bench passes them to llama.cpp's tools)
        self.n_gpu_layers_draft = n_gpu_layers if n_gpu_layers_draft is None else n_gpu_layers_draft
        target_params = LoadParams(n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers, strict=strict,
                                   flash_attn=flash_attn, devices=devices, swa_full=swa_full, load_mtp=mtp, exact=exact,
                                   tensor_split=tuple(tensor_split) if tensor_split else None, n_seq=n_parallel, lora=lora)
        draft_params = LoadParams(n_ctx=n_ctx, n_threads=n_threads, flash_attn=flash_attn, swa_full=swa_full, n_seq=n_parallel,
                                  kv_unified=not (strict or exact),  # per slot, as the target (rollbacks never lack cells)
                                  n_gpu_layers=n_gpu_layers if n_gpu_layers_draft is None else n_gpu_layers_draft)
        # llama.cpp's load flags (-b, -ub, -ctk, -td...: LoadParams fields by role, session.load_flags_by_role)
        target_params, draft_params = with_flags(target_params, draft_params, load_flags)
        try:
            self.target_llm = self._open(target, "target", target_params, strict)
            self.target = Context(self.target_llm, "target")
            self.draft_llm = self.draft = None
            if mtp:  # the target's own MTP blocks draft: same vocabulary, no second model
                from .mtp import open_mtp
                self.draft = open_mtp(self.target, draft_params.type_k, draft_params.type_v)
            elif draft is not None:
                self.draft_llm = self._open(draft, "draft", draft_params, False)
                self.draft = Context(self.draft_llm, "draft")
                if check_vocab:
                    check_compatible(self.target, self.draft)
                if self.draft.n_vocab < self.target.n_vocab:  # the text may hold ids the draft lacks
                    self.draft = VocabBridge(self.draft, self.target)
            from .slots import Slots
            self.slots = Slots(self, n_parallel)  # sequence 0 is this decoder's own
        except BaseException:
            self.close()
            raise
        self.costs_offload = offload_as_applied(self)
        self._costs_key = _costs_key(target, None if mtp else draft, n_threads, *self.costs_offload,
                                     costs_tag + ("mtp" if mtp else "") + flags_tag(load_flags))
        # what `--draft auto` has learned of this machine's step costs, per drafter (remembered on
        # close); a benchmark sets one set per condition it varies
        self.costs: dict[str, Costs] = _load_costs(self._costs_key)

    default_drafter = "model"  # a session without a draft model sets "lookup" (`session.open_session`)

    def _open(self, model, role, params, strict):
        from .load import open_model
        if model is None:
            raise GgufspecError(f"no {role} model: give a GGUF path (or a loaded llama_cpp.Llama)")
        if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
            llm = open_model(model, role, params, strict=strict)
            self._owned.append(llm)
            return llm
        if not isinstance(model, llama_cpp.Llama):
            raise GgufspecError(f"the {role} model must be a GGUF path or a llama_cpp.Llama, got {type(model).__name__}")
        if strict or params.exact or params.lora or params.tensor_overrides:  # set as it loads (batches, adapters...)
            raise GgufspecError(f"strict, exact, lora and -ot load the {role} model themselves: give its path, not a Llama")
        return model

    def _check_open(self) -> None:
        if self._closed:  # its llama.cpp contexts are freed: using them would crash the process
            raise GgufspecError("this SpeculativeDecoder is closed")

    @property
    def n_layer(self) -> int:
        """The target's repeating layers (blocks); the output layer is one more when offloading."""
        self._check_open()
        return llama_cpp.llama_model_n_layer(self.target_llm._model.model)

    @property
    def n_ctx(self) -> int:
        return self.target.n_ctx

    def tokenize(self, prompt: str | Sequence[int], *, chat: bool = False, system: str | None = None) -> list[int]:
        from .load import chat_prompt, tokenize
        self._check_open()
        if isinstance(prompt, (bytes, bytearray, dict)) or not hasattr(prompt, "__iter__"):
            raise GgufspecError(f"a prompt is a text or a list of token ids, got {type(prompt).__name__}")
        if system is not None and not chat:
            raise GgufspecError("system= is the chat template's system message: give chat=True too")
        if not isinstance(prompt, str):  # token ids are the prompt as it is: no template to render them through
            if chat:
                raise GgufspecError("chat=True renders a text through the chat template: give the text, or drop chat=True")
            return list(prompt)
        return tokenize(self.target_llm, chat_prompt(self.target_llm, prompt, system) if chat else prompt)

    def render_chat(self, messages: list[dict], **variables) -> str:
        """The target's chat template over [{"role": ..., "content": ...}, ...], the assistant's turn opened
        (`variables`: the template's, e.g. enable_thinking=False)."""
        from .load import render_chat
        self._check_open()
        return render_chat(self.target_llm, messages, warn=True, **variables)

    def chat(self, messages: list[dict], template_variables: dict | None = None, **options) -> Generation:
        """The assistant's next message (`template_variables`: the chat template's, e.g. enable_thinking). A
        conversation that grows call by call reuses the KV cache: only what is new since the last call is evaluated."""
        from .load import check_messages
        check_messages(messages)
        if options.pop("chat", False):
            raise GgufspecError("chat() renders the messages through the chat template already: drop chat=True")
        if "system" in options:  # the system message, as generate(..., chat=True, system=...) takes it
            if messages[0]["role"] == "system":
                raise GgufspecError("system= and a first message with role system: give one of them")
            messages = [{"role": "system", "content": options.pop("system")}, *messages]
        return self.generate(self.render_chat(messages, **(template_variables or {})), **options)

    def steps(self, prompt: str | Sequence[int], *, n_predict: int = 128, n_draft: int | str = 3,
              temperature: float = SamplingParams.temperature, top_k: int = SamplingParams.top_k,
              top_p: float = SamplingParams.top_p, min_p: float = SamplingParams.min_p,
              seed: int | None = None, chat: bool = False, system: str | None = None,
              drafter: str | None = None, draft_p_min: float = 0.0,
              draft_max: int = 8, draft_min: int = 0, constraints: Constraints | None = None,
              logprobs: int | None = None, cache_prompt: bool = True, **filters: float) -> Iterator[Step]:
        """The step generator: a `Step` per token (id, from_draft, logprobs). Statistics land in `last_stats`.

        n_draft: K (0: the target alone), or "auto" (K chosen at every step, up to draft_max, 0 included).
        drafter: "model" (the draft model), "lookup" (n-gram prompt lookup, no draft model needed)
        or "hybrid" (a lookup match when there is one, else the draft model); None: `default_drafter`.
        draft_p_min / draft_min: as llama.cpp's --draft-p-min / --draft-min, a draft model stops
        when unsure of its next token, and a draft shorter than draft_min is not verified.
        constraints: logit bias, penalties and a grammar over the target's logits (`processing`).
        logprobs: None (none), 0 (the chosen token's) or n <= 20 (and the n most likely). filters: llama.cpp's
        typical_p, top_n_sigma, xtc_*, dynatemp_*, mirostat, mirostat_tau, mirostat_eta (`SamplingParams`; off).
        cache_prompt: False evaluates the whole prompt again instead of reusing what the caches hold
        (llama-server's field: the same batches, so the same rounding, whatever came before).
        """
        self._check_open()
        drafter = drafter or self.default_drafter
        if isinstance(prompt, str) and not prompt:
            raise GgufspecError("the prompt is empty")
        check_options(filters, SamplingParams, self.steps, self.stream)
        params = SamplingParams(temperature, top_k, top_p, min_p, seed, **filters)
        if logprobs is not None and (type(logprobs) is not int or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise GgufspecError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {logprobs}")
        tokens = self.tokenize(prompt, chat=chat, system=system)
        if not isinstance(prompt, str):
            check_token_ids(tokens, self.target.n_vocab)
        adaptive = n_draft == "auto"
        check_generation_args(len(tokens), self.n_ctx, draft_max if adaptive else n_draft, n_predict)
        wants_draft = n_draft != 0 and (self.draft is not None or drafter != "model")
        chosen = self._drafter(drafter, draft_p_min, draft_min) if wants_draft else None
        if chosen is not None and not self._can_roll_back(chosen):
            chosen = None  # the target alone, said once
        if adaptive:  # the machine's costs outlive a generation
            costs = self.costs.setdefault(drafter, Costs())
            if chosen is not None and not costs.warm:  # a fraction of a second, once per pair and machine
                with self._busy:
                    measure_step_costs(self.target, chosen.context, costs, sizes=(1, 2, 4, 8, 16), token=tokens[0])
            if self.target.lockstep is not None:  # a slot: drafts priced in the batch it shares (`slots`)
                from .slots import BatchCosts, BatchGate
                costs = BatchCosts(costs, self.target.lockstep)
            if chosen is not None:  # n-gram proposals where they pay, the draft model's (if any) otherwise
                chosen = controller = AutoDrafting.over(chosen, self._drafter("lookup", 0.0), costs, draft_max)
            else:
                controller = AdaptiveK(draft_max, costs=costs)
            if self.target.lockstep is not None:
                controller = BatchGate(controller, costs)
        else:
            controller = FixedK(n_draft)
        self.last_stats = Stats(n_draft=0 if chosen is None else (draft_max if adaptive else n_draft),
                                drafter="none" if chosen is None else drafter + ("+auto" if adaptive else ""),
                                placement=dict(self.placement or {}), id_slot=getattr(self, "id_slot", 0))
        if adaptive and chosen is not None:
            self.last_stats.costs = costs.summary()
        max_tokens = n_predict if n_predict >= 0 else self.n_ctx
        judge = TargetJudge(self.target, params, constraints, logprobs, prompt=tokens)
        return one_thread_at_a_time(self._busy, speculative_steps(
            self.target, chosen, tokens, controller=controller, judge=judge, max_tokens=max_tokens,
            stats=self.last_stats, reuse_cache=cache_prompt))

    def _can_roll_back(self, drafter) -> bool:
        contexts = [self.target] + ([drafter.context] if getattr(drafter, "context", None) is not None else [])
        for ctx in contexts:
            inner = getattr(ctx, "inner", ctx)
            if not inner.can_roll_back():
                if not self._said_no_rollback:
                    sys.stderr.write(f"ggufspec: the {inner.name} model's memory can neither drop tokens nor save "
                                     f"its state; running the target alone\n")
                    self._said_no_rollback = True
                return False
        return True

    def _drafter(self, kind: str, p_min: float, n_min: int = 0):
        if kind not in ("model", "lookup", "hybrid"):
            raise GgufspecError(f"unknown drafter {kind!r}: use model, lookup or hybrid")
        if not 0.0 <= p_min < 1.0:
            raise GgufspecError(f"--spec-draft-p-min must be in [0, 1), got {p_min}")
        if n_min < 0:
            raise GgufspecError(f"--spec-draft-n-min must be >= 0, got {n_min}")
        if kind == "lookup":  # n-grams of this sequence, and the pool every request of this decoder adds to
            owner = getattr(self, "root", self)  # a slot's view (`Slots._view`): the decoder all slots share
            if getattr(owner, "ngram_pool", None) is None:
                from .ngram import NgramPool
                owner.ngram_pool = NgramPool()  # the default size; a session sets its own (--lookup-pool)
            return LookupDrafter(self.target.n_vocab, owner.ngram_pool, is_end=self.target.is_end_of_generation)
        if self.draft is None:
            raise GgufspecError(f"the {kind} drafter needs a draft model: give -md, or use --lookup alone")
        from .mtp import MtpContext, MtpDrafter
        model = (MtpDrafter if isinstance(self.draft, MtpContext) else ModelDrafter)(self.draft, p_min, n_min)
        if kind == "model":
            return model
        return HybridDrafter(self._drafter("lookup", p_min), model)

    def stream(self, prompt: str | Sequence[int], *, stop: str | Sequence[str] = (), **options) -> Iterator[Piece]:
        """Yield a `Piece` per generated token, as soon as the target has decided it. stop: the text ends before
        the first of these strings (llama-cpp-python's `stop`; `Stats.stop_reason` "stop")."""
        stops = stop_strings(stop)  # checked before anything runs; the statistics are the ones `steps` sets
        generated = pieces(self.target, self.steps(prompt, **options))
        return until_stop(generated, stops, self.last_stats) if stops else generated

    def generate(self, prompt: str | Sequence[int], **options) -> Generation:
        with self._busy:  # the statistics this generation fills (`steps` sets them), not another thread's
            stream, stats = self.stream(prompt, **options), self.last_stats
        collected = list(stream)  # the text as streamed and served
        return Generation("".join(p.text for p in collected), [p.token for p in collected], stats)

    def generate_many(self, prompts: Sequence, **options) -> list[Generation]:
        """Each prompt's Generation, in order, up to n_parallel at a time in one batch (`slots`)."""
        self._check_open()
        return self.slots.generate_many(prompts, **options)

    def close(self) -> None:
        if getattr(self, "is_slot", False):
            return  # a slot's view (`slots`): its decoder closes what it shares
        with self._busy:  # after the step another thread is running: its next one finds the decoder closed
            self._closed = True
            if getattr(self, "slots", None) is not None:
                self.slots.close()
            if getattr(self, "costs", None):
                _save_costs(self._costs_key, self.costs)
                self.costs = {}
            for ctx in (getattr(self, "target", None), getattr(self, "draft", None)):
                if ctx is not None:
                    ctx.close()
            for llm in self._owned:
                llm.close()
            self._owned = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
