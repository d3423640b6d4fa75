"""One decoder, several sequences at once: `serve --parallel N` (llama.cpp's -np) and `generate_many`.

Slot i is the decoder seen over sequence i of its llama contexts: Contexts of its own (`native`), so
its own cached tokens and checkpoints, with everything else shared (the models, the step costs
learned, the n-gram pool). Each generation runs in a slot from a thread of its own, through the
same `speculative_steps` as a decoder used alone; their decodes meet in one batch per model and per
round (`lockstep`). The llama contexts hold N sequences in one unified cache of n_ctx cells, as
llama-server's default: a sequence may grow to n_ctx; when the cells run out, the conversations
cached by idle slots are dropped first.

Where the cells can be shared (a KV cache), a prompt takes the longest prefix that any slot's sequence
holds without evaluating it (`_share_prefixes`), and goes to the free slot whose cached conversation it
cuts least (`_fit_sharing`). Elsewhere it goes to the slot whose conversation it continues, else to
one worth cutting back, else to an empty slot (`_fit`). Either way a conversation's next turn finds its
previous turns cached even with other clients in between.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Sequence

from .bridge import VocabBridge
from .checks import check_generation_args, check_token_ids
from .costs import Costs
from .errors import CacheFullError, GgufspecError
from .lockstep import TARGET, DecodeCounts, Lockstep
from .lora import check_rescale_exact, rescale, scales_of
from .native import Context, common_prefix_length


class Slot:
    """A sequence id, its contexts, and whether a generation runs in it."""

    def __init__(self, index: int, target, draft):
        self.index, self.target, self.draft = index, target, draft
        self.busy = False
        self.last_used = 0.0
        self.last_stats = None  # of its latest generation (`/slots`)

    def contexts(self) -> list:
        return [c for c in (self.target, self.draft) if c is not None]


class Slots:
    def __init__(self, decoder, n: int):
        self.decoder = decoder
        self.lockstep = Lockstep() if n > 1 else None
        self.slots = [Slot(0, decoder.target, decoder.draft)]
        for seq in range(1, n):
            target = Context(decoder.target_llm, "target", seq=seq)
            self.slots.append(Slot(seq, target, _draft_context(decoder.draft, seq, target)))
        if self.lockstep is not None:
            for slot in self.slots:
                for ctx in slot.contexts():
                    getattr(ctx, "inner", ctx).lockstep = self.lockstep
            self.lockstep.make_room = self._make_room
            self._share_prefixes()
        self._free = threading.Condition()
        self._scale_waits: list[list] = []  # [scales] of each generation waiting in `_take_scaled`, in order
        self._counts: DecodeCounts | None = None  # one slot's target decodes, once asked for (`decode_counts`)
        # llama-server's -sps: the share of a prompt a slot's cache must hold to be cut back to it (`_fit`)
        self.prompt_similarity = SLOT_PROMPT_SIMILARITY

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def n_busy(self) -> int:
        return sum(slot.busy for slot in self.slots)

    @contextlib.contextmanager
    def use(self, tokens: Sequence[int], lora: Sequence[float] | None = None) -> Iterator:
        """A slot for a prompt of `tokens` (waiting for one to be free): the decoder over its sequence,
        generating in turn with the other slots'. Close its generators before leaving. `lora`: the target's
        adapter scales it needs (`_take_scaled`), None for those set now."""
        slot = self._take(tokens) if lora is None else self._take_scaled(tokens, tuple(map(float, lora)))
        view = self._view(slot)
        if self.lockstep is not None:
            self.lockstep.join()
        try:
            yield view
        finally:
            slot.last_stats = view.last_stats
            with self._free:
                slot.busy, slot.last_used = False, time.monotonic()
                self._free.notify_all()  # `hold` waits for one slot in particular, `_take` for any
            if self.lockstep is not None:  # after: a round that this lets run may take the slot's cells
                self.lockstep.leave()

    @contextlib.contextmanager
    def hold(self, index: int) -> Iterator[Slot]:
        """Slot `index` for work on its cache between generations (the server's save, restore and erase):
        once no generation runs in it (waiting, as llama-server defers the task), marked busy so that
        none starts there, and in its turn among the slots, so that its llama.cpp calls run alone."""
        slot = self.slots[index]
        with self._free:
            self._free.wait_for(lambda: not slot.busy)
            slot.busy = True
        if self.lockstep is not None:
            self.lockstep.join()
        try:
            yield slot
        finally:
            with self._free:
                slot.busy, slot.last_used = False, time.monotonic()
                self._free.notify_all()
            if self.lockstep is not None:
                self.lockstep.leave()

    def decode_counts(self) -> DecodeCounts:
        """The target's llama_decode calls for generations and the busy slots at each (llama-server's
        n_decode_total and n_busy_slots_per_decode). With several slots the shared rounds count them
        (`Lockstep`); a single slot decodes alone, so its target's calls are counted where they are made,
        from the first call of this on, while a generation runs (not the step costs timed at start)."""
        if self.lockstep is not None:
            return self.lockstep.counts
        if self._counts is None:
            self._counts = DecodeCounts()
            _count_decodes_alone(self.slots[0], self._counts)
        return self._counts

    def _take(self, tokens: Sequence[int]) -> Slot:
        with self._free:
            self._free.wait_for(lambda: self._may_start(None))
            return self._pick(tokens)

    def _pick(self, tokens: Sequence[int]) -> Slot:
        """The free slot that suits the prompt best, marked busy (`_free` held, a slot free)."""
        slot = max((slot for slot in self.slots if not slot.busy), key=lambda s: _fit(s, tokens, self.prompt_similarity))
        slot.busy = True
        return slot

    def _take_scaled(self, tokens: Sequence[int], scales: tuple[float, ...]) -> Slot:
        """`_take` for a generation under other LoRA scales than the context's: the slots share one llama
        context, whose adapters apply to every sequence in it, so (as llama-server batches only slots with
        equal adapters) it waits until no slot runs, sets them (`_rescale`), then runs beside the
        generations under the same scales. Waiting changes go first, in arrival order: a steady stream of
        requests under the scales set now would otherwise hold one off for ever."""
        ticket = [scales]  # its identity marks its place among the waiting
        with self._free:
            self._scale_waits.append(ticket)
            try:
                self._free.wait_for(lambda: self._may_start(ticket))
            finally:
                self._scale_waits.remove(ticket)
                self._free.notify_all()  # the others' turns may have come
            if scales != scales_of(self.decoder.target_llm):
                self._rescale(scales)
            return self._pick(tokens)

    def set_lora(self, scales: Sequence[float]) -> None:
        """The target's LoRA adapters at `scales` (one each, in the order loaded) from now on: once no slot
        runs, with every cached prompt dropped (`_rescale`). The Python API's way; the server's requests
        give theirs to `use`."""
        scales = tuple(map(float, scales))
        check_rescale_exact(self.decoder.target_llm, scales, self.decoder.verification)
        with self._free:
            self._free.wait_for(lambda: not any(slot.busy for slot in self.slots))
            if scales != scales_of(self.decoder.target_llm):
                self._rescale(scales)

    def _may_start(self, ticket: list | None) -> bool:
        if all(slot.busy for slot in self.slots):
            return False
        now = scales_of(self.decoder.target_llm)
        changes = [t for t in self._scale_waits if t[0] != now]
        if ticket is None or ticket[0] == now:
            return not changes
        return changes[0] is ticket and not any(slot.busy for slot in self.slots)

    def _rescale(self, scales: tuple[float, ...]) -> None:
        """The adapters at `scales` on every context over the target's model (its slots' sequences share
        one; an MTP head has its own), their caches dropped: each cell there was computed under the old
        scales. The draft model's contexts keep theirs (it has no adapters). No slot runs meanwhile."""
        llm = self.decoder.target_llm
        adapted = [inner for slot in self.slots for inner in (getattr(c, "inner", c) for c in slot.contexts())
                   if inner.llm._model is llm._model]
        rescale(llm, scales, list({id(c.ctx): c.ctx for c in adapted}.values()))
        for ctx in adapted:
            ctx.keep(0)

    def _share_prefixes(self) -> None:
        """In a unified cache a prompt takes the longest prefix any slot's sequence holds, for each
        model (`Context.reuse_prefix`): four agents with one system prompt evaluate it once. Plain
        Contexts only (a bridged or MTP draft keeps its own), and only where cells can be shared."""
        for model in (lambda slot: slot.target, lambda slot: slot.draft):
            contexts = [model(slot) for slot in self.slots]
            if all(type(ctx) is Context and ctx.can_share_prefixes for ctx in contexts):
                for ctx in contexts:
                    ctx.prefix_donors = [other for other in contexts if other is not ctx]

    def _view(self, slot: Slot):
        """The decoder with the slot's contexts (a shallow copy: the rest is shared), made when used,
        so that it sees what was set on the decoder since (its n-gram pool, its learned costs)."""
        decoder = self.decoder
        if slot.index == 0 and len(self.slots) == 1:
            return decoder
        view = copy.copy(decoder)
        view.target, view.draft, view.last_stats = slot.target, slot.draft, None
        view.is_slot, view.id_slot, view._owned, view.root = True, slot.index, [], decoder
        view._busy = threading.RLock()  # its own: the slots' turns are the lockstep's (one lock would deadlock it)
        return view

    def generate_many(self, prompts, **options) -> list:
        """Every prompt's Generation, in order: up to N at a time, each in a slot, batched together.
        Every prompt is checked first (`_checked`): one that cannot run costs the others nothing."""
        chat, system = options.pop("chat", False), options.pop("system", None)
        every_tokens = self._checked(prompts, chat, system)

        def one(tokens):
            def attempt():
                with self.use(tokens) as view:
                    return view.generate(tokens, **options)
            return self.retrying(attempt)
        # several slots: the decoder held meanwhile (slot 0 is its own sequence; a generate() or close() from
        # another thread waits); one slot is the decoder itself, whose steps hold it
        held = self.decoder._busy if len(self.slots) > 1 else contextlib.nullcontext()
        with held, ThreadPoolExecutor(max_workers=len(self.slots), thread_name_prefix="ggufspec-slot") as pool:
            return list(pool.map(one, every_tokens))

    def retrying(self, attempt, given_up=lambda: False, patience: float | None = 600.0):
        """`attempt()`, again each time its prompt found no room in the unified cache (CacheFullError
        from its prefill) and a busy slot has since ended, whose cells the next round may take
        (`_make_room`). The CacheFullError stands where no slot is busy (nothing would free room),
        after `patience` seconds with none ended (None: no limit), or once `given_up()` (checked
        every second)."""
        while True:
            try:
                return attempt()
            except CacheFullError:
                if not self._a_slot_ended(given_up, patience):
                    raise

    def _a_slot_ended(self, given_up, patience: float | None) -> bool:
        deadline = None if patience is None else time.monotonic() + patience
        with self._free:
            busy = {slot for slot in self.slots if slot.busy}
            while busy and not given_up() and (deadline is None or time.monotonic() < deadline):
                if self._free.wait_for(lambda: any(not slot.busy for slot in busy), 1.0):
                    return True
        return False

    def _checked(self, prompts, chat: bool, system: str | None) -> list[list[int]]:
        """The prompts as tokens, each non-empty, within the context, of the target's ids."""
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__"):
            raise GgufspecError(f"generate_many takes a list of prompts (texts or lists of token ids), got "
                                f"{type(prompts).__name__}: for one prompt, pass [prompt] or call generate")
        decoder, checked = self.decoder, []
        for i, prompt in enumerate(prompts):
            try:
                if isinstance(prompt, (bytes, bytearray, dict)) or not hasattr(prompt, "__iter__"):
                    raise GgufspecError(f"a prompt is a text or a list of token ids, got {type(prompt).__name__}")
                if isinstance(prompt, str) and not prompt:  # as `generate` (not the BOS alone)
                    raise GgufspecError("the prompt is empty")
                tokens = decoder.tokenize(prompt if isinstance(prompt, str) else list(prompt), chat=chat, system=system)
                if not isinstance(prompt, str):
                    check_token_ids(tokens, decoder.target.n_vocab)
                check_generation_args(len(tokens), decoder.n_ctx, 0, -1)
            except GgufspecError as exc:
                raise type(exc)(f"prompts[{i}]: {exc}") from None
            checked.append(tokens)
        return checked

    def _make_room(self, ctx) -> bool:
        """The unified cache is full: drop what idle slots hold in this model's cache (during a round:
        no slot is running). Whether that freed anything."""
        freed = False
        for slot in self.slots:
            for cached in slot.contexts():
                if not slot.busy and getattr(cached, "inner", cached).llm is ctx.llm and cached.n_past:
                    cached.keep(0)
                    freed = True
        return freed

    def describe(self) -> list[dict]:
        """Each slot as llama-server's /slots shows it (the fields ggufspec has). The LoRA scales are the
        context's now, which all slots share (what the slots generate and cache was computed under them)."""
        lora = [{"id": i, "scale": scale} for i, scale in enumerate(scales_of(self.decoder.target_llm))]
        return [{"id": slot.index, "is_processing": slot.busy, "n_ctx": slot.target.n_ctx,
                 "n_cached": slot.target.n_past, "lora": lora,
                 "last": slot.last_stats.to_dict() if slot.last_stats is not None else None}
                for slot in self.slots]

    def close(self) -> None:
        for slot in self.slots[1:]:
            for ctx in slot.contexts():
                getattr(ctx, "inner", ctx).close()
        if self.lockstep is not None:
            self.lockstep.close()


SLOT_PROMPT_SIMILARITY = 0.1  # llama-server's --slot-prompt-similarity


def _fit(slot: Slot, tokens: Sequence[int], similarity: float = SLOT_PROMPT_SIMILARITY) -> tuple:
    """How well a free slot suits a prompt (the greatest is taken). First the slot whose conversation
    the prompt continues (it shares the slot's whole last prompt), then a slot worth cutting back
    (llama-server's rule: the prefix shared is over `similarity` of the prompt, a tenth by default, none
    where 0; and it saves at least as many tokens as it drops), by the tokens shared; then an empty slot,
    then the one used least recently.

    Not llama-server's rule alone, which cuts any conversation back to a shared prefix: an agent's
    sub-agent with its 5,000-token system prompt would cut the agent's 20,000-token conversation to it,
    and two conversations with one system prompt took turns in one slot while others stayed empty
    (llama-server restores a conversation from its RAM prompt cache; here it keeps its slot)."""
    shared = common_prefix_length(slot.target.tokens, tokens)
    if slot.target.prefix_donors is not None:
        return _fit_sharing(slot, shared)
    last = slot.last_stats
    continues = last is not None and shared >= max(2, last.n_prompt)
    worth = (similarity > 0 and shared >= 2 and shared > similarity * len(tokens)
             and shared >= slot.target.n_past - shared)
    return continues, worth, shared if continues or worth else 0, slot.target.n_past == 0, -slot.last_used


def _tokenized_otherwise(n_cached: int) -> int:
    """Cached tokens a conversation's next turn may not share with its slot: its last answer, sent back,
    can tokenize otherwise at its end."""
    return max(16, n_cached // 16)


def _fit_sharing(slot: Slot, shared: int) -> tuple:
    """Where a prompt takes its prefix from any slot (`_share_prefixes`), the slot it runs in only
    decides what cached conversation it overwrites: the one losing the fewest cached tokens, then the
    one sharing the most, then an empty one, then the one used least recently. So an agent's sub-agent
    with the same system prompt goes to an empty slot instead of cutting the agent's conversation back
    to that prompt, and a next turn still goes back to its own slot (its last answer's tail, which may
    tokenize otherwise, not counted as lost; a short conversation an unrelated prompt would drop is)."""
    lost = slot.target.n_past - shared
    if lost <= _tokenized_otherwise(slot.target.n_past) and shared >= lost:  # its next turn: nothing lost
        lost = 0
    return -lost, shared, slot.target.n_past == 0, -slot.last_used


def _count_decodes_alone(slot: Slot, counts: DecodeCounts) -> None:
    """Each llama_decode the slot's target makes alone, counted while the slot generates: the call
    wrapped on this Context instance (as `mtp` records the target's decodes), one increment a call."""
    ctx = getattr(slot.target, "inner", slot.target)
    if getattr(ctx, "name", None) != TARGET:
        return
    decode_alone = ctx._decode_alone

    def counted(tokens, n_logits):
        if slot.busy:
            counts.add(1)
        return decode_alone(tokens, n_logits)
    ctx._decode_alone = counted


def _draft_context(draft, seq: int, target: Context):
    """The draft model's context for sequence `seq`, bridged as the decoder's own is."""
    if draft is None:
        return None
    inner = getattr(draft, "inner", draft)
    ctx = Context(inner.llm, inner.name, seq=seq)
    return VocabBridge(ctx, target) if isinstance(draft, VocabBridge) else ctx


class BatchCosts(Costs):
    """The step costs as a slot sees them in a batch it shares with other slots (`--draft auto`).

    The other slots put B tokens in the latest round and yield Y (one each, at least). A step of this
    slot with k drafts makes the round cost T(B + k + 1), and the round yields E(k) + Y tokens; it beats
    drafting none when (E(k) + Y) / T(B + k + 1) > (1 + Y) / T(B + 1). With t0 = T(B + 1) / (1 + Y),
    that is E(k) / T'(k + 1) > 1 / T'(1) for T'(n) = T(B + n) - Y t0: the controllers' own rule, under
    T'. So a slot's controllers price drafts with T' (B = 0: T itself), and where a batch of n costs
    about n single tokens, the more the others put in, the less any draft pays.

    `could_pay` judges under T' too: where no draft can pay in the shared batch, the slot's controller
    stops probing for the rest of its generation (a draft model's probe makes every slot wait for
    its k draft decodes: measured, 4 clients at 8.6 tok/s against llama-server's 15.3 in the same run,
    about 90 drafts each per 128 tokens). The measurements are the
    shared ones; a step shared with others is not added to them (its time is the whole batch's)."""

    def __init__(self, base: Costs, lockstep: Lockstep):
        self.base, self.lockstep = base, lockstep
        self.draft_times, self.batch_times, self.ngram = base.draft_times, base.batch_times, base.ngram
        self._model, self._best_rates, self._made_for = None, {}, None

    @property
    def probe_interval(self) -> int:
        return self.base.probe_interval

    @probe_interval.setter
    def probe_interval(self, steps: int) -> None:
        self.base.probe_interval = steps

    @property
    def shared(self) -> bool:
        return self.lockstep.members > 1

    def others(self) -> tuple[int, int]:
        """(B, Y): the other slots' tokens in the latest target round, and their number."""
        tokens, n_others = self.lockstep.others("target") if self.shared else (0, 0)
        return max(tokens, n_others), n_others

    def batch_model(self):
        base, (others, n_others) = self.base.batch_model(), self.others()
        if self._made_for != (base, others, n_others):
            self._made_for, self._best_rates = (base, others, n_others), {}
            if others == 0:
                self._model = base
            else:
                t0 = base(others + 1) / (1 + n_others)
                self._model = functools.lru_cache(maxsize=None)(lambda n: base(others + n) - n_others * t0)
        return self._model

    def add_batch(self, n: int, seconds: float | None) -> None:
        if not self.shared:
            self.base.add_batch(n, seconds)

    def best_batch_rate(self, k_max: int) -> float:
        # shared: an n-gram bucket that does not pay is not probed (`AutoDrafting.right_guess_pays`): a
        # probe's extra token slows every slot's round (measured: 4 clients drafting about 40 tokens each
        # per 128, half of them kept, at 0.71x llama-server's target alone in the same run)
        return 0.0 if self.shared else super().best_batch_rate(k_max)

    def worth_drafting(self, max_k: int) -> int:
        return self.base.most_worth_drafting(max_k, *self.others()) if self.shared else max_k


class BatchGate:
    """`--draft auto` in a slot: no more drafts than can pay in the shared batch this step
    (`Costs.most_worth_drafting`), and the step's times learned only when no other slot shared it."""

    def __init__(self, controller, costs: BatchCosts):
        self.controller, self.costs = controller, costs
        self.timed = True

    def choose(self, max_k: int) -> int:
        self.timed = not self.costs.shared
        return self.controller.choose(min(max_k, self.costs.worth_drafting(max_k)))

    def observe(self, k, n_accepted, draft_seconds, verify_seconds) -> None:
        if not self.timed:
            draft_seconds = verify_seconds = None
        self.controller.observe(k, n_accepted, draft_seconds, verify_seconds)
