"""Several sequences decoded together: one llama_decode per model per round, holding every slot's tokens.

Each slot runs its generation (`speculate`'s loop, unchanged) in a thread of its own, over Contexts
with a sequence id of their own. A Context that has a `Lockstep` does not call llama_decode itself:
it hands its tokens here and waits. A round runs when every slot that is generating waits on a
decode; then each model (target, draft) decodes one batch that holds all its waiting sequences'
tokens, each with its slot's sequence id (llama-server's continuous batching), and every slot goes on
with its own rows of logits. So N slots verifying their drafts cost one target batch per step, and
their draft models' proposals one draft batch per drafted position.

Slots take turns: one baton, and only its holder runs engine code; the others wait for it or for a
round. llama.cpp, which is not thread-safe, is thus called by one thread at a time (cuts, state
saves and logits reads included) without a lock around each call, and the turns follow the order of
the batch, so the same arrivals give the same batches. The turns cost no parallelism: the per-token
Python work holds the GIL anyway, and the models run in llama.cpp's own threads during the round.

Each thread waits on a condition of its own (one lock for all), and a change wakes only the thread
it concerns: the next in turn, the round thread, a slot sitting a round out. One condition notified
all woke every waiting slot at each of a round's N handoffs, to take the lock and the GIL and sleep
again: on the tiny models 0.19-0.32 ms a slot a round, now about 0.1 (`benchmarks/slots_overhead.py`).

A thread that is not a member (the main thread timing step costs, a decoder used alone) decodes
directly, as without a Lockstep.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

import llama_cpp

from .errors import Interrupted


class _Request:
    __slots__ = ("ctx", "tokens", "n_logits", "thread", "rc", "first_logit", "done")

    def __init__(self, ctx, tokens, n_logits: int, thread: int):
        self.ctx, self.tokens, self.n_logits, self.thread = ctx, list(tokens), n_logits, thread
        self.rc, self.first_logit, self.done = 0, 0, False


class DecodeCounts:
    """llama-server's `n_decode` and `n_busy_slots` (its /metrics): the target's llama_decode calls made
    for the slots' generations, and the slots generating at each call, summed. Counted once per call
    (a step), never per token; the draft model's calls are left out, as llama-server leaves out its
    speculative ones."""
    __slots__ = ("n_decode", "n_busy_slots")

    def __init__(self):
        self.n_decode = self.n_busy_slots = 0

    def add(self, n_busy: int) -> None:
        self.n_decode += 1
        self.n_busy_slots += n_busy


TARGET = "target"  # the target model's Context name: its decodes are the ones llama-server counts


class Lockstep:
    def __init__(self):
        self._lock = threading.Lock()
        self._wakers: dict[int, threading.Condition] = {}  # each waiting thread's own, over _lock
        self._round_waker = threading.Condition(self._lock)
        self._sitting: set[int] = set()  # members sitting a round out (`sit_out`)
        self._members: set[int] = set()   # threads of the slots generating
        self._turns: deque[int] = deque()  # members waiting for the baton, in order
        self._holder: int | None = None    # the member running engine code
        self._waiting: list[_Request] = []  # decodes waiting for a round, oldest first
        self._batches: dict[int, object] = {}  # a llama_batch per model (per llama context)
        # called with the Context whose batch found no room in the cache: frees the cached sequences
        # of idle slots (their conversations) and says whether it freed any
        self.make_room: Callable[[object], bool] | None = None
        self.rounds = 0
        self._round_due, self._closing = False, False
        self._round_thread: threading.Thread | None = None  # where every round runs (`_run_rounds`)
        self.n_requests = self.n_batches = 0  # decodes asked for by slots, llama_decode calls made for them
        self.counts = DecodeCounts()  # the target's calls and the slots generating at each (/metrics)
        self.seconds: dict[str, float] = {}     # in llama_decode, per model (by context name)
        self.tokens: dict[str, int] = {}        # decoded, per model
        # the latest round of each model (by context name): tokens per member thread
        self.last_round: dict[str, dict[int, int]] = {}

    @property
    def members(self) -> int:
        return len(self._members)

    def join(self) -> None:
        """The calling thread starts generating: it runs when its turn comes."""
        me = threading.get_ident()
        with self._lock:
            self._members.add(me)
            self._turns.append(me)
            self._take_turn(me)

    def leave(self) -> None:
        """The calling thread is done: the others no longer wait for it."""
        me = threading.get_ident()
        with self._lock:
            self._members.discard(me)
            self._wakers.pop(me, None)
            if me in self._turns:
                self._turns.remove(me)
            if self._holder == me:
                self._holder = None
            self._pass_baton()

    def others(self, name: str) -> tuple[int, int]:
        """(tokens, members) of the other slots in the latest round of model `name`."""
        me = threading.get_ident()
        latest = {thread: n for thread, n in self.last_round.get(name, {}).items() if thread != me}
        return sum(latest.values()), len(latest)

    def is_member(self) -> bool:
        return threading.get_ident() in self._members

    def decode(self, ctx, tokens, n_logits: int) -> tuple[int, int]:
        """Decode `tokens` after what ctx's sequence holds, in the next round; returns llama_decode's
        code and the batch index of the first of the last `n_logits` tokens (its logits row 0)."""
        me = threading.get_ident()
        request = _Request(ctx, tokens, n_logits, me)
        with self._lock:
            self._waiting.append(request)
            self._holder = None
            self._pass_baton()
            # (a round holds the lock while it decodes: only a request carried over for want of room
            # in the cache, between rounds, looks at its caller's should_stop)
            while not self._waker(me).wait_for(lambda: request.done or self._closing, timeout=0.25):
                if ctx.should_stop is not None and ctx.should_stop():  # its client left meanwhile
                    self._waiting.remove(request)
                    self._turns.append(me)
                    self._take_turn(me)
                    raise Interrupted(f"stopped while {len(tokens)} tokens waited for room in the cache")
            if not request.done:  # closed while it waited (carried round after round for want of room)
                self._waiting.remove(request)
                return -1, 0
            self._take_turn(me)
        return request.rc, request.first_logit

    def pending(self, ctx) -> _Request | None:
        """The decode `ctx`'s sequence waits on, if any (its tokens follow what ctx.tokens holds)."""
        return next((request for request in self._waiting if request.ctx is ctx), None)

    def sit_out(self, request: _Request) -> None:
        """The caller, holding the baton, gives it up until another slot's `request` has been decoded
        (to take the cells it fills: `Context.reuse_prefix`), then waits for its turn again."""
        me = threading.get_ident()
        with self._lock:
            self._holder = None
            self._sitting.add(me)
            self._pass_baton()
            self._waker(me).wait_for(lambda: request.done or self._closing)
            self._sitting.discard(me)
            self._turns.append(me)
            self._take_turn(me)

    def _waker(self, me: int) -> threading.Condition:
        waker = self._wakers.get(me)
        if waker is None:
            waker = self._wakers[me] = threading.Condition(self._lock)
        return waker

    def _take_turn(self, me: int) -> None:
        self._waker(me).wait_for(lambda: self._holder is None and self._turns and self._turns[0] == me)
        self._turns.popleft()
        self._holder = me

    def _pass_baton(self) -> None:
        """Under the lock, the baton free: to the next in turn (only that thread woken), or else, where
        every member waits on a decode, a round."""
        if self._holder is not None:
            return
        if self._turns:
            self._waker(self._turns[0]).notify()
        else:
            self._round_if_all_wait()

    def _round_if_all_wait(self) -> None:
        """Under the lock: a round is due when every member waits on a decode (nobody holds the baton)."""
        # a member holds the baton, waits for it, or waits here: with no holder and no turn to give,
        # every member waits on a decode
        if self._holder is not None or self._turns or not self._waiting:
            return
        self._round_due = True
        self._round_waker.notify()
        if self._round_thread is None:
            self._round_thread = threading.Thread(target=self._run_rounds, name="ggufspec-rounds", daemon=True)
            self._round_thread.start()

    def _run_rounds(self) -> None:
        """Every round's llama_decode from this one thread, not from whichever slot waited last:
        llama.cpp's OpenMP build keeps a team of worker threads per calling thread, so one team
        serves every round. Two teams outnumber 2 cores, and libgomp then stops spinning at its
        barriers (one per graph node) and sleeps: a slot alone decoding in its own thread (round 30,
        to save two thread switches a step) made the demo target's steps 1.5-2x slower, its cores
        idle half the time. Even a slot alone has its rounds run here."""
        with self._lock:
            while True:
                self._round_waker.wait_for(lambda: self._round_due or self._closing)
                if self._closing:
                    return
                self._round_due = False
                # still due? a slot that joined meanwhile took the baton: its next decode makes it due again
                if self._holder is None and not self._turns and self._waiting:
                    self._round()
                    for thread in self._sitting:  # each waits for another's request: done, perhaps
                        self._waker(thread).notify()
                    self._pass_baton()

    def _round(self) -> None:
        groups: dict[int, list[_Request]] = {}
        room: dict[int, int] = {}
        for request in self._waiting:  # oldest first; what does not fit this round goes first in the next
            key = id(request.ctx.llm)
            if room.setdefault(key, request.ctx.n_batch) >= len(request.tokens):
                room[key] -= len(request.tokens)
                groups.setdefault(key, []).append(request)
        self.rounds += 1
        for key, group in groups.items():
            try:
                group = self._decode_group(key, group)
            except Exception:  # never leave every slot waiting: each raises DecodeError in its own thread
                for request in group:
                    request.rc = -1
            self.n_requests += len(group)
            self.last_round[group[0].ctx.name] = {r.thread: len(r.tokens) for r in group}
            for request in group:
                request.done = True
                self._waiting.remove(request)
                self._turns.append(request.thread)

    def _decode_group(self, key: int, group: list[_Request]) -> list[_Request]:
        """Decode the group in one batch; the requests done (the others wait for the next round)."""
        rc = self._decode_batch(key, group)
        if rc == 1 and self.make_room is not None and self.make_room(group[0].ctx):
            rc = self._decode_batch(key, group)  # idle slots' cached conversations made room
        if rc == 1 and len(group) > 1:
            return self._one_that_fits(key, group)
        for request in group:
            request.rc = rc
        return group

    def _one_that_fits(self, key: int, group: list[_Request]) -> list[_Request]:
        """No room for the whole batch, even with what idle slots held: the oldest request that fits
        alone is decoded and the others wait, round after round, until a slot that ends frees its cells
        (`make_room`); where none fits, the newest gives up (its generation ends as at the context's
        end) so that the others go on. Never two decoded in a round: llama.cpp keeps the logits of its
        last decode only, so a slot decoded before another would read that one's rows."""
        for request in group:
            request.rc = self._decode_batch(key, [request])
            if request.rc == 0:
                return [request]
        return [group[-1]]

    def _decode_batch(self, key: int, group: list[_Request]) -> int:
        ctx0 = group[0].ctx
        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = llama_cpp.llama_batch_init(ctx0.n_batch, 0, 1)
        if llama_cpp.llama_n_ubatch(ctx0.ctx) == 1:
            # --strict, every row alone. With a cache per sequence llama.cpp splits a batch "equally",
            # taking sequences of increasing ids into a micro-batch and stopping only once it holds
            # one more than n_ubatch: two rows, which round otherwise. In decreasing order it takes one.
            group = sorted(group, key=lambda request: -request.ctx.seq)
        j = 0
        for request in group:
            ctx, n = request.ctx, len(request.tokens)
            start, first_logit = len(ctx.tokens), n - request.n_logits
            request.first_logit = j + first_logit
            for i, token in enumerate(request.tokens):
                batch.token[j] = token
                batch.pos[j] = start + i
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = ctx.seq
                batch.logits[j] = i >= first_logit
                j += 1
        batch.n_tokens = j
        self.n_batches += 1
        if ctx0.name == TARGET:  # every member generates (its thread waits on a round or for its turn)
            self.counts.add(len(self._members))
        started = time.perf_counter()
        rc = llama_cpp.llama_decode(ctx0.ctx, batch)
        self.seconds[ctx0.name] = self.seconds.get(ctx0.name, 0.0) + time.perf_counter() - started
        self.tokens[ctx0.name] = self.tokens.get(ctx0.name, 0) + j
        if rc != 0:  # the cache may hold part of the batch: each sequence is cut back to what it held
            for request in group:
                llama_cpp.llama_memory_seq_rm(request.ctx.memory, request.ctx.seq, len(request.ctx.tokens), -1)
        return rc

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._round_waker.notify_all()
            for waker in self._wakers.values():
                waker.notify_all()
        if self._round_thread is not None:
            self._round_thread.join()
        for batch in self._batches.values():
            llama_cpp.llama_batch_free(batch)
        self._batches = {}
