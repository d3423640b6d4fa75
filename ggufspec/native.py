"""The llama.cpp calls the engine makes, wrapped once (as llama-cpp-python's `_internals.py` does).

`Context` drives one `llama_cpp.Llama` through the public low-level API: its own `llama_batch`,
`llama_decode` with logits requested only where the caller reads them, `llama_get_logits_ith`, and
`llama_memory_seq_rm` to cut the KV cache back. It tracks `tokens`, exactly the tokens the KV cache
holds, so callers never compute positions themselves and a new prompt can reuse the cached prefix.

Memory that cannot drop a suffix (recurrent: Mamba, RWKV; hybrid: recurrent layers beside attention)
rolls back as llama.cpp's server does: `checkpoint()` saves the sequence's small recurrent state
(`llama_state_seq_get_data_ext` with `LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`) before tokens that may be
dropped, and `keep(n)` restores it and re-evaluates only the kept tokens after it. Where the context
has recurrent rollback snapshots (`n_rs_seq`, a few architectures), a cut within the last batch is a
plain `llama_memory_seq_rm`. A sliding-window cache (`swa_full=False`) cuts a suffix like any KV
cache, but going back further than its window needs a checkpoint too. Checkpoints along the
conversation (bounded in count and bytes, like llama-server's `--ctx-checkpoints`) let a new prompt
reuse the cached prefix on every kind of memory: where each prompt ended, where each new prompt
branched off the cache (the end of the previous answer, for a next turn), and the states saved before
the last few steps of an answer (so a next turn that leaves the answer near its end, at a stop string
or a last word tokenized differently, branches there, not where the prompt ended). Callers only ever
call `keep`, `reuse_prefix` and `checkpoint`.
"""
from __future__ import annotations

import ctypes
import functools
import time
from typing import Sequence

import llama_cpp
import numpy as np

from .errors import CacheFullError, DecodeError, GgufspecError, Interrupted

_SEQ = 0  # a context's sequence id, unless it is one of several slots (`slots`)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


MAX_CHECKPOINTS = 8              # conversation checkpoints per context (llama-server: --ctx-checkpoints)
MAX_CHECKPOINT_BYTES = 256 << 20  # and their bytes together
CHECKPOINT_EVERY = 256           # tokens between automatic conversation checkpoints
# States saved before the latest steps: the newest is what a rejection restores; the older ones let a
# next prompt branch off near the end of the answer. A step that drafts saves one anyway (no extra
# copy); where none does (the target alone, n_rs_seq rollback), one every STEP_STATE_EVERY tokens.
STEP_STATES = 4
STEP_STATE_BYTES = 128 << 20     # their bytes together (one is always kept: rollback needs it)
STEP_STATE_EVERY = 8
# A prompt sits out a round for another slot's prompt to fill its cells when they share this many more
# tokens than any cache holds: on a CPU evaluating 32 tokens costs several decode rounds.
WAIT_FOR_SHARED = 32


def token_piece(vocab, token: int, special: bool = False) -> bytes:
    """The bytes a token prints as (llama_token_to_piece): control tokens print nothing unless `special`."""
    buf = ctypes.create_string_buffer(64)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    if n < 0:  # the buffer was too small: llama.cpp says how large it must be
        buf = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    return buf.raw[:max(n, 0)]


class _Snapshot:
    """A sequence's partial state (recurrent state, or the sliding window) after its first `pos` tokens."""

    __slots__ = ("pos", "buffer", "size")

    def __init__(self):
        self.pos, self.buffer, self.size = -1, None, 0


class Context:
    def __init__(self, llm: llama_cpp.Llama, name: str, seq: int = _SEQ, lockstep=None):
        self.llm = llm
        self.name = name
        self.seq = seq            # its sequence id in the llama context (one per slot)
        self.lockstep = lockstep  # where slots' decodes meet in one batch (`lockstep`); None: decode alone
        self.ctx = llm._ctx.ctx
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_ctx = llama_cpp.llama_n_ctx_seq(self.ctx)  # what one sequence may hold (`slots`: several)
        self.n_batch = llama_cpp.llama_n_batch(self.ctx)
        self.tokens: list[int] = []  # what the KV cache holds, in order
        self.generation = None  # the generation under way on this sequence (speculate.speculative_steps)
        self._forget(llm)  # a Llama given already used: its cells would clash with these positions
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self._first_logit = 0  # the batch index of the last decode's logits row 0 (negative: from the end)
        self._pieces: dict[int, bytes] = {}
        self._logit_views: dict[int, np.ndarray] = {}
        model = llm._model.model
        self.recurrent = bool(llama_cpp.llama_model_is_recurrent(model))
        self.hybrid = bool(llama_cpp.llama_model_is_hybrid(model))
        swa_full = bool(getattr(llm.context_params, "swa_full", True))
        self.n_swa = 0 if swa_full else int(llama_cpp.llama_model_n_swa(model))  # 0: the cache holds it all
        self.n_rs_seq = int(llama_cpp.llama_n_rs_seq(self.ctx)) if hasattr(llama_cpp, "llama_n_rs_seq") else 0
        self.n_ubatch = llama_cpp.llama_n_ubatch(self.ctx)
        # what a cut needs: "cut" (seq_rm), "snapshot" (restore a saved state and re-evaluate)
        self.rollback = "snapshot" if (self.recurrent or self.hybrid) else "cut"
        self.n_evaluated = 0   # tokens given to llama_decode, all of them
        self.n_replayed = 0    # of which re-evaluated after restoring a snapshot
        self.n_restores = 0
        self.restore_seconds = 0.0  # restoring and re-evaluating, in total
        self._last_batch = 0   # tokens in the last llama_decode (n_rs_seq rolls back within it)
        self._least_seconds: dict[int, float] = {}  # least time seen for a batch of n <= 8 tokens
        self._steps: list[_Snapshot] = []  # before the latest steps, by position (invalid ones first)
        self._kept: list[_Snapshot] = []  # along the conversation
        # slots: the other sequences' Contexts over the same unified cache, whose prefixes a prompt may
        # take without evaluating them (`reuse_prefix`); None: this sequence reuses only its own
        self.prefix_donors: list[Context] | None = None
        self.n_shared = 0  # prompt tokens taken from another sequence's cells, in total
        self.should_stop = None  # a callable: true where a long decode should stop between its chunks

    def decode(self, tokens: Sequence[int], n_logits: int = 1) -> None:
        """Append `tokens` to the cache; keep logits for the last `n_logits` of them.

        Long inputs go in chunks of n_batch; only the final chunk's tail gets logits. Where
        `should_stop` says so before a chunk (the first too), Interrupted (the cache holds the chunks before it).
        """
        self._check_open()
        for start in range(0, len(tokens), self.n_batch):
            if self.should_stop is not None and self.should_stop():
                raise Interrupted(f"stopped after {start} of {len(tokens)} tokens")
            chunk = tokens[start:start + self.n_batch]
            is_last = start + self.n_batch >= len(tokens)
            self._decode_chunk(chunk, n_logits if is_last else 0)

    def _check_open(self) -> None:
        if self._batch is None:  # closed (a stream made before close() and read after it): freed memory
            raise GgufspecError("this SpeculativeDecoder is closed")

    def _decode_chunk(self, tokens: Sequence[int], n_logits: int) -> None:
        n = len(tokens)
        start = len(self.tokens)
        t0 = time.perf_counter()
        if self.lockstep is not None and self.lockstep.is_member():  # in one batch with the other slots'
            rc, self._first_logit = self.lockstep.decode(self, tokens, n_logits)
        else:
            try:
                rc, self._first_logit = self._decode_alone(tokens, n_logits), -n_logits
            except KeyboardInterrupt:  # Ctrl-C: raised when llama_decode returned, or before it began
                if llama_cpp.llama_memory_seq_pos_max(self.memory, self.seq) >= start + n - 1:
                    self._first_logit = -n_logits  # in the cache: so in the Context too, or the next
                    self._decoded(tokens)          # decode's positions would clash (code -1)
                raise
            if n <= 8 and self.needs_snapshots:  # only a replay after a restore reads these (see _replay)
                self.synchronize()
                seconds = time.perf_counter() - t0
                if seconds < self._least_seconds.get(n, float("inf")):
                    self._least_seconds[n] = seconds
        if rc != 0:
            # 1: no KV slot (context full); 2: aborted; < 0: error. The cache may hold part of
            # the batch: cut it back so the caller's view stays true.
            llama_cpp.llama_memory_seq_rm(self.memory, self.seq, start, -1)
            if rc == 1:
                raise CacheFullError(f"no room in the {self.name} model's KV cache: its {self.n_ctx} cells (-c) "
                                     f"are taken{' by the slots' if self.lockstep is not None else ''}")
            raise DecodeError(f"llama_decode failed on the {self.name} model (code {rc})")
        self._decoded(tokens)

    def _decoded(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)
        self.n_evaluated += len(tokens)
        self._last_batch = len(tokens)

    def _decode_alone(self, tokens: Sequence[int], n_logits: int) -> int:
        batch = self._batch
        first_logit = len(tokens) - n_logits
        start = len(self.tokens)
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = start + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = self.seq
            batch.logits[i] = i >= first_logit
        batch.n_tokens = len(tokens)
        return llama_cpp.llama_decode(self.ctx, batch)

    def synchronize(self) -> None:
        """Wait for the device. On CUDA and Metal llama_decode returns once the work is queued (reading
        logits waits for it), so a timing that ends at the decode must end here instead: on an H100
        an unsynchronised single token timed 0.22 ms where it costs 1.9."""
        llama_cpp.llama_synchronize(self.ctx)

    def logits(self, row: int) -> np.ndarray:
        """Logits of the row-th of the last decode's logit positions (a view, valid until the next decode)."""
        index = self._first_logit + row  # llama_get_logits_ith takes negatives from the end
        address = ctypes.cast(llama_cpp.llama_get_logits_ith(self.ctx, index), ctypes.c_void_p).value
        if not address:
            raise DecodeError(f"no logits for row {row} of the {self.name} model")
        # Building a numpy view costs microseconds, a step on a GPU a few milliseconds: reuse the view
        # of an address already seen (it is the same n_vocab floats whenever llama.cpp returns it).
        view = self._logit_views.get(address)
        if view is None:
            view = np.ctypeslib.as_array((ctypes.c_float * self.n_vocab).from_address(address))
            self._logit_views[address] = view
        return view

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    @property
    def needs_snapshots(self) -> bool:
        return self.rollback == "snapshot" or self.n_swa > 0

    def checkpoint(self, upcoming: int = 1, persistent: bool = False, force: bool = False) -> None:
        """The sequence may be cut back to here after the next `upcoming` tokens: save what a cut
        cannot recover (nothing for a KV cache). `persistent`: also keep it along the conversation,
        so a later prompt sharing this prefix reuses it. `force`: save even where llama.cpp's
        per-token rollback states (n_rs_seq) could cut the next batch once (for two cuts in a row)."""
        if not self.needs_snapshots:
            return
        n = len(self.tokens)
        last_kept = max((c.pos for c in self._kept), default=0)
        if n > 0 and (persistent or n >= last_kept + CHECKPOINT_EVERY) and n != last_kept:
            self._keep_checkpoint(n)
        if self.rollback != "snapshot" or n == 0 or self._latest_step() == n:
            return  # a sliding window drops a suffix by itself
        rollback_needs_it = upcoming > 0 and (force or not (self.n_rs_seq >= upcoming and self.n_ubatch > upcoming))
        if rollback_needs_it or n >= max(self._latest_step(), last_kept) + STEP_STATE_EVERY:
            self._save_step_state()

    def _latest_step(self) -> int:
        return self._steps[-1].pos if self._steps else -1

    def _save_step_state(self) -> None:
        """Save the state before a step, reusing the oldest step state's buffer once there are enough."""
        size = self._steps[-1].size if self._steps else 0
        room = max(1, min(STEP_STATES, STEP_STATE_BYTES // max(size, 1)))
        invalid = self._steps and self._steps[0].pos < 0
        snap = self._steps.pop(0) if invalid or len(self._steps) >= room else _Snapshot()
        if self._save(snap):
            self._steps.append(snap)

    def _save(self, snap: _Snapshot) -> bool:
        flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = llama_cpp.llama_state_seq_get_size_ext(self.ctx, self.seq, flags)
        if snap.buffer is None or len(snap.buffer) < size:
            snap.buffer = (ctypes.c_uint8 * max(size, 1))()
        written = llama_cpp.llama_state_seq_get_data_ext(self.ctx, snap.buffer, size, self.seq, flags) if size else 0
        snap.pos, snap.size = (len(self.tokens), written) if written else (-1, 0)
        return bool(written)

    def _keep_checkpoint(self, n: int) -> None:
        snap = _Snapshot()
        if not self._save(snap):
            return
        self._kept.append(snap)
        self._bound_checkpoints()

    def _bound_checkpoints(self) -> None:
        while self._kept and (len(self._kept) > MAX_CHECKPOINTS
                              or sum(c.size for c in self._kept) > MAX_CHECKPOINT_BYTES):
            self._kept.pop(0)  # the oldest goes first, as in llama-server

    def _restore(self, snap: _Snapshot) -> bool:
        flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        if not llama_cpp.llama_state_seq_set_data_ext(self.ctx, snap.buffer, snap.size, self.seq, flags):
            return False
        # the full-attention part of a hybrid or sliding-window memory is cut as usual
        llama_cpp.llama_memory_seq_rm(self.memory, self.seq, snap.pos, -1)
        del self.tokens[snap.pos:]
        self.n_restores += 1
        return True

    def _window_holds(self, n_tokens: int) -> bool:
        """Whether a sliding-window cache cut back to n_tokens still holds the window before it."""
        if not self.n_swa or n_tokens == 0:
            return True
        pos_min = llama_cpp.llama_memory_seq_pos_min(self.memory, self.seq)
        return 0 <= pos_min <= max(0, n_tokens - self.n_swa)

    def _cuttable(self, n_tokens: int) -> bool:
        """Whether the memory can drop the suffix after n_tokens without re-evaluating anything."""
        if n_tokens == 0:
            return True
        if self.rollback == "snapshot" and not (self.n_rs_seq and len(self.tokens) - n_tokens < self._last_batch
                                                and len(self.tokens) - n_tokens <= self.n_rs_seq):
            return False
        return self._window_holds(n_tokens)

    def keep_reevaluates(self, n_tokens: int) -> bool:
        """Whether keep(n_tokens) would re-evaluate kept tokens (memory that cannot drop this suffix)."""
        return n_tokens < len(self.tokens) and not self._cuttable(n_tokens)

    def _cut(self, n_tokens: int) -> bool:
        """Drop the suffix without re-evaluating anything, where the memory can."""
        if n_tokens == 0:
            llama_cpp.llama_memory_seq_rm(self.memory, self.seq, 0, -1)
            return True
        if not self._cuttable(n_tokens):
            return False
        if not llama_cpp.llama_memory_seq_rm(self.memory, self.seq, n_tokens, -1):
            return False
        self._last_batch = 0  # llama.cpp's rollback snapshots are single-use
        return True

    def _best_snapshot(self, n_tokens: int) -> _Snapshot | None:
        usable = [s for s in (*self._steps, *self._kept) if 0 < s.pos <= n_tokens]
        return max(usable, key=lambda s: s.pos, default=None)

    def _forget_after(self, n_tokens: int) -> None:
        self._kept = [c for c in self._kept if c.pos <= n_tokens]
        for snap in self._steps:
            if snap.pos > n_tokens:
                snap.pos = -1  # its buffer is reused first
        self._steps.sort(key=lambda snap: snap.pos)

    def keep(self, n_tokens: int) -> None:
        """Cut the cache back to its first n_tokens (the only way the engine rewinds).

        A KV cache drops the suffix; other memory restores the latest state saved at or before
        n_tokens and re-evaluates only the tokens between it and n_tokens."""
        t0 = time.perf_counter()
        replay = self._rewind(n_tokens)
        if replay:
            self._replay(replay)
            self.restore_seconds += time.perf_counter() - t0

    def keep_and_decode(self, n_tokens: int, tokens: Sequence[int], n_logits: int = 1) -> None:
        """keep(n_tokens), then decode(tokens); where the kept tokens must be re-evaluated, all in one
        batch, as llama-server replays after restoring a checkpoint: the re-evaluation then also gives
        the logits of new positions instead of costing a call of its own."""
        t0 = time.perf_counter()
        replay = self._rewind(n_tokens)
        self.decode(replay + list(tokens), n_logits)
        if replay:
            self.restore_seconds += time.perf_counter() - t0

    def _rewind(self, n_tokens: int) -> list[int]:
        """Cut back to n_tokens where the memory can; else restore the latest state saved at or before
        n_tokens. Returns the kept tokens past that state, which the caller must evaluate again."""
        if n_tokens >= len(self.tokens):
            return []
        self._forget_after(n_tokens)
        if self._cut(n_tokens):
            del self.tokens[n_tokens:]
            return []
        replay = self.tokens[:n_tokens]
        snap = self._best_snapshot(n_tokens)
        if snap is None or not self._restore(snap):
            llama_cpp.llama_memory_seq_rm(self.memory, self.seq, 0, -1)  # nothing saved: from the start
            del self.tokens[:]
        replay = replay[len(self.tokens):]
        self.n_replayed += len(replay)
        return replay

    def _replay(self, tokens: list[int]) -> None:
        """Re-evaluate kept tokens: one batch, or one token at a time where this machine's measured
        times say that is cheaper (on some CPUs a recurrent batch of 2 costs 4 single tokens)."""
        n = len(tokens)
        single, batch = self._least_seconds.get(1), self._least_seconds.get(n)
        if 1 < n <= 8 and single is not None and batch is not None and n * single < batch:
            for token in tokens:
                self.decode([token], n_logits=0)
        else:
            self.decode(tokens, n_logits=0)

    def reuse_prefix(self, tokens: Sequence[int]) -> int:
        """Keep the longest prefix the cache shares with `tokens` that can be kept without
        re-evaluating anything (up to a checkpoint, for memory that cannot cut); returns its length.
        Where `tokens` go on past it, the state there is kept along the conversation: for a next
        turn, the end of the previous answer. Where another slot's sequence shares more of `tokens`
        (`prefix_donors`), its cells are taken instead."""
        self._check_open()
        self._wait_for_donors(tokens)
        n = common_prefix_length(self.tokens, tokens)
        donor, n_donor = self._best_donor(tokens)
        if n_donor > n:
            return self._take_prefix(donor, n_donor)
        if n < len(self.tokens):
            self._forget_after(n)
            if self._cut(n):
                del self.tokens[n:]
            else:
                snap = self._best_snapshot(n)
                if snap is None or not self._restore(snap):
                    llama_cpp.llama_memory_seq_rm(self.memory, self.seq, 0, -1)
                    del self.tokens[:]
        if len(tokens) > len(self.tokens):
            self._keep_branch_point()
        return len(self.tokens)

    @property
    def can_share_prefixes(self) -> bool:
        """Whether this sequence's cells can also be another sequence's: a KV cache holding every
        position (no recurrent state, no sliding window dropping cells) unified across sequences."""
        unified = bool(getattr(self.llm.context_params, "kv_unified", False))
        return unified and llama_cpp.llama_n_seq_max(self.ctx) > 1 and not self.needs_snapshots

    def _best_donor(self, tokens: Sequence[int]) -> tuple[Context | None, int]:
        """The other sequence sharing the longest prefix with `tokens`, and its length."""
        shared = [(common_prefix_length(c.tokens, tokens), c) for c in self.prefix_donors or ()]
        n, donor = max(shared, key=lambda pair: pair[0], default=(0, None))
        return donor, n

    def _wait_for_donors(self, tokens: Sequence[int]) -> None:
        """Where another slot's prompt, waiting for the next round, shares WAIT_FOR_SHARED or more
        tokens of `tokens` that no cache holds yet (prompts arriving together with one system prompt),
        sit that round out and take them after it: evaluating them twice would cost more on a CPU."""
        if not self.prefix_donors or self.lockstep is None or not self.lockstep.is_member():
            return
        while True:
            held = max(common_prefix_length(c.tokens, tokens) for c in (self, *self.prefix_donors))
            waits = [(self.lockstep.pending(c), c) for c in self.prefix_donors]
            coming = [(common_prefix_length(c.tokens + r.tokens, tokens), r) for r, c in waits if r is not None]
            n_coming, request = max(coming, key=lambda pair: pair[0], default=(0, None))
            if n_coming < held + WAIT_FOR_SHARED:
                return
            self.lockstep.sit_out(request)

    def _take_prefix(self, donor: Context, n_tokens: int) -> int:
        """This sequence becomes the donor's first n_tokens: in a unified cache llama_memory_seq_cp
        only marks the donor's cells as this sequence's as well (no data moves, nothing is evaluated),
        as vLLM and SGLang share cached prefix blocks between requests. A shared system prompt, or a
        conversation another slot cached, is then evaluated once for every slot. The donor's later
        cuts remove only its own sequence id from the cells."""
        llama_cpp.llama_memory_seq_rm(self.memory, self.seq, 0, -1)
        llama_cpp.llama_memory_seq_cp(self.memory, donor.seq, self.seq, 0, n_tokens)
        self.tokens[:] = donor.tokens[:n_tokens]
        self._last_batch = 0
        if llama_cpp.llama_memory_seq_pos_max(self.memory, self.seq) != n_tokens - 1:  # the memory did not share
            llama_cpp.llama_memory_seq_rm(self.memory, self.seq, 0, -1)
            del self.tokens[:]
        self.n_shared += len(self.tokens)
        return len(self.tokens)

    def _keep_branch_point(self) -> None:
        """Keep the state at the cache's end along the conversation: a step state there moves over
        (no copy), else it is saved."""
        n = len(self.tokens)
        if not self.needs_snapshots or n == 0 or any(c.pos == n for c in self._kept):
            return
        step = next((s for s in self._steps if s.pos == n), None)
        if step is None:
            self._keep_checkpoint(n)
            return
        self._steps.remove(step)
        self._kept.append(step)
        self._kept.sort(key=lambda c: c.pos)
        self._bound_checkpoints()

    def can_roll_back(self) -> bool:
        """Whether a suffix can be dropped at all: by a cut, or by saving and restoring state."""
        if self.rollback == "cut":
            return True
        flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        return llama_cpp.llama_state_seq_get_size_ext(self.ctx, self.seq, flags) > 0

    def is_end_of_generation(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    @functools.cached_property
    def end_of_generation_ids(self) -> tuple[int, ...]:
        """Every token that ends a generation (EOS, end of turn...): llama.cpp's C API has no list of them."""
        return tuple(token for token in range(self.n_vocab) if self.is_end_of_generation(token))

    def fim_tokens(self) -> dict[str, int | None]:
        """The vocabulary's fill-in-the-middle control tokens (pre, suf, mid, rep, sep); None where it has none."""
        ids = {name: getattr(llama_cpp, f"llama_vocab_fim_{name}")(self.vocab) for name in ("pre", "suf", "mid", "rep", "sep")}
        return {name: int(token) if token >= 0 else None for name, token in ids.items()}  # LLAMA_TOKEN_NULL: -1

    def token_text(self, token: int) -> bytes:
        """The vocabulary entry as stored (what the compatibility check compares)."""
        return llama_cpp.llama_vocab_get_text(self.vocab, token) or b""

    def piece(self, token: int) -> bytes:
        """The bytes a token prints as (control tokens print nothing)."""
        cached = self._pieces.get(token)
        if cached is None:
            cached = self._pieces[token] = token_piece(self.vocab, token)
        return cached

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        """The tokens' text, control tokens included, in a buffer as large as llama.cpp asks for
        (llama-cpp-python's Llama.detokenize gives 32 bytes a token: a longer one came back empty)."""
        ids, n = (llama_cpp.llama_token * len(tokens))(*tokens), -max(64, 8 * len(tokens))
        while n < 0:  # a first size, then the one llama.cpp asks for
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_detokenize(self.vocab, ids, len(tokens), buf, len(buf), False, True)
        return buf.raw[:n]

    def _forget(self, llm) -> None:
        """This sequence's cells emptied, and llama-cpp-python told (it would reuse what it thinks is there)."""
        if getattr(getattr(llm, "_ctx", None), "ctx", None) is None:
            return  # the caller closed its Llama first: its memory is freed, nothing to empty
        llama_cpp.llama_memory_seq_rm(self.memory, self.seq, 0, -1)
        if hasattr(llm, "reset"):  # a llama_cpp.Llama (MTP's context stands on a namespace)
            llm.reset()

    def close(self) -> None:
        self.generation = None  # a stream still open stops at its next step
        if self._batch is not None:
            self._forget(self.llm)  # the Llama, where the caller gave it, is theirs again, empty
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
