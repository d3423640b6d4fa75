"""The llama.cpp calls the engine makes, wrapped once (as llama-cpp-python's `_internals.py` does).

`Context` drives one `llama_cpp.Llama` through the public low-level API: its own `llama_batch`,
`llama_decode` with logits requested only where the caller reads them, `llama_get_logits_ith`, and
`llama_memory_seq_rm` to cut the KV cache back. It tracks `tokens`, exactly the tokens the KV cache
holds, so callers never compute positions themselves and a new prompt can reuse the cached prefix.
"""
from __future__ import annotations

import ctypes
import os
import sys
from typing import Sequence

import llama_cpp
import numpy as np

from .errors import DecodeError

_SEQ = 0  # one sequence per context


VERBOSE = os.environ.get("GGUFSPEC_VERBOSE", "") not in ("", "0")


@llama_cpp.llama_log_callback
def _log_to_stderr_if_verbose(level, text, user_data):
    # llama.cpp logs model loading at length; keep stderr for our own messages unless asked
    if VERBOSE:
        sys.stderr.write(text.decode("utf-8", errors="replace"))


def quiet_llama_logs() -> None:
    """Route llama.cpp's log through our callback (call after llama-cpp-python installed its own)."""
    llama_cpp.llama_log_set(_log_to_stderr_if_verbose, ctypes.c_void_p(0))


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Context:
    def __init__(self, llm: llama_cpp.Llama, name: str):
        self.llm = llm
        self.name = name
        self.ctx = llm._ctx.ctx
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_ctx = llama_cpp.llama_n_ctx(self.ctx)
        self.n_batch = llama_cpp.llama_n_batch(self.ctx)
        self.tokens: list[int] = []  # what the KV cache holds, in order
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self._logit_rows = 0
        self._pieces: dict[int, bytes] = {}
        self._logit_views: dict[int, np.ndarray] = {}

    def decode(self, tokens: Sequence[int], n_logits: int = 1) -> None:
        """Append `tokens` to the cache; keep logits for the last `n_logits` of them.

        Long inputs go in chunks of n_batch; only the final chunk's tail gets logits.
        """
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            is_last = start + self.n_batch >= len(tokens)
            self._decode_chunk(chunk, n_logits if is_last else 0)

    def _decode_chunk(self, tokens: Sequence[int], n_logits: int) -> None:
        batch = self._batch
        n = len(tokens)
        first_logit = n - n_logits
        start = len(self.tokens)
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = start + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = _SEQ
            batch.logits[i] = i >= first_logit
        batch.n_tokens = n
        rc = llama_cpp.llama_decode(self.ctx, batch)
        if rc != 0:
            # 1: no KV slot (context full); 2: aborted; < 0: error. The cache may hold part of
            # the batch: cut it back so the caller's view stays true.
            llama_cpp.llama_memory_seq_rm(self.memory, _SEQ, start, -1)
            raise DecodeError(f"llama_decode failed on the {self.name} model (code {rc})")
        self.tokens.extend(tokens)
        self._logit_rows = n_logits

    def logits(self, row: int) -> np.ndarray:
        """Logits of the row-th of the last decode's logit positions (a view, valid until the next decode)."""
        index = row - self._logit_rows  # llama_get_logits_ith takes negatives from the end
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

    def keep(self, n_tokens: int) -> None:
        """Cut the KV cache back to its first n_tokens (the only way the engine rewinds)."""
        if n_tokens >= len(self.tokens):
            return
        if not llama_cpp.llama_memory_seq_rm(self.memory, _SEQ, n_tokens, -1):
            # some caches (recurrent, sliding-window) cannot drop a suffix: start again empty
            llama_cpp.llama_memory_clear(self.memory, True)
            n_tokens = 0
        del self.tokens[n_tokens:]

    def reuse_prefix(self, tokens: Sequence[int]) -> int:
        """Keep the longest prefix the cache shares with `tokens`; returns its length."""
        self.keep(common_prefix_length(self.tokens, tokens))
        return len(self.tokens)

    def is_end_of_generation(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def token_text(self, token: int) -> bytes:
        """The vocabulary entry as stored (what the compatibility check compares)."""
        return llama_cpp.llama_vocab_get_text(self.vocab, token) or b""

    def piece(self, token: int) -> bytes:
        """The bytes a token prints as (control tokens print nothing)."""
        cached = self._pieces.get(token)
        if cached is None:
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
            cached = self._pieces[token] = buf.raw[:n]
        return cached

    def close(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
