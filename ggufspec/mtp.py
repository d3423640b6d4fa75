"""Drafting with the target's own MTP (multi-token prediction, "nextn") blocks: no second model.

Qwen3.5/3.6, GLM-4.5, DeepSeek-V3 and others ship a small block after the trunk, trained to predict
one token further. llama.cpp runs it in a context of its own over the same loaded model
(`ctx_type = LLAMA_CONTEXT_TYPE_MTP`; the model loaded with `load_mtp`), as its `--spec-type
draft-mtp` does (common/speculative.cpp, `common_speculative_impl_draft_mtp`).

What the MTP block reads, by position. The target's hidden state at position p, h_p (its
"nextn embedding": the trunk's last hidden state, as the architecture defines it), is what the
target knows after x_0..x_p. The MTP entry at position p + 1 takes the token x_{p+1} and h_p, and
its logits there predict x_{p+2}, the same token as the target's logits at p + 1. So

    MTP entry p = (x_p, h_{p-1})       (h_{-1} = zeros for the first position)

Drafting after `tokens` (n of them; the target has evaluated the first n - 1): the MTP catches up
on entries up to n - 1, the last one (x_{n-1}, h_{n-2}) giving the first proposal; each next entry
pairs the proposal with the MTP's own output hidden state, since the target's is not known yet.

- `HiddenStates` records h_p from every target decode (llama.cpp's unmasked nextn embeddings: one
  row per token of the batch, whatever rows have logits) by position, so the MTP can catch up
  lazily, only when it drafts, like a draft model.
- `MtpContext` is a `native.Context` (its KV cache is a plain attention cache, cut like any) whose
  decode builds the `llama_batch_ext` the MTP graph needs: each token with its state row. Entries
  made with the target's hidden states are "true"; entries drafted on the MTP's own states are
  not, even when the target accepts their tokens, so `keep` and `reuse_prefix` never keep an
  entry past the true ones (`n_true`): the next catch-up redoes them with the target's states.
- `MtpDrafter` is `ModelDrafter` over that context (same p_min, n_min, sampling, `auto`).

The llama.cpp calls that turn the nextn embeddings on and read them are in its staging C++ header
(src/llama-ext.h): exported, but under C++ mangled names only; they are called by those names.
"""
from __future__ import annotations

import ctypes
import os
from types import SimpleNamespace

import llama_cpp
import numpy as np

from .drafting import ModelDrafter
from .errors import DecodeError, ModelFileError
from .ggufheader import local_header
from .load import ROPE_FIELDS, cache_type
from .lora import adapters_of, set_on as set_lora
from .native import _SEQ, Context

# architectures whose llama.cpp graph has an MTP (DECODER_MTP) draft head; gemma4's assistant is a
# separate model sharing the target's cache, not a block inside the target's GGUF
MTP_ARCHITECTURES = frozenset({
    "bailingmoe3", "cohere2moe", "deepseek2", "deepseek32", "deepseek4", "glm-dsa", "glm4moe", "glm5-next",
    "hy_v3", "mimo2", "nemotron_h_moe", "qwen35", "qwen35moe", "qwen3next", "step35"})
# the target context's settings the MTP context takes as they are (besides RoPE/YaRN's)
TARGET_CONTEXT_FIELDS = ("flash_attn_type", "offload_kqv", "op_offload", "no_perf")


# ---------------------------------------------------------------- llama.cpp's staging API (C++ names)

def _cxx_function(mangled: str, argtypes: list, restype):
    """A libllama function the bindings do not wrap (C++ names, and ggml's gguf reader)."""
    function = getattr(llama_cpp.llama_cpp._lib, mangled)
    function.argtypes, function.restype = argtypes, restype
    return function


_float_p = ctypes.POINTER(ctypes.c_float)
# void llama_set_embeddings_nextn(llama_context *, bool value, bool masked)
_set_embeddings_nextn = _cxx_function("_Z26llama_set_embeddings_nextnP13llama_contextbb",
                                      [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None)
# float * llama_get_embeddings_nextn(llama_context *): masked off, one row per token of the last batch
_get_embeddings_nextn = _cxx_function("_Z26llama_get_embeddings_nextnP13llama_context", [ctypes.c_void_p], _float_p)
# float * llama_get_embeddings_nextn_ith(llama_context *, int32_t i): masked, the row of batch index i
_get_embeddings_nextn_ith = _cxx_function("_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
                                          [ctypes.c_void_p, ctypes.c_int32], _float_p)


# ---------------------------------------------------------------- does this model have MTP blocks?

def gguf_has_mtp(path: str | os.PathLike) -> bool:
    """Whether a GGUF file carries MTP blocks llama.cpp can draft with, read from its header only
    (llama.cpp's own test: the last block has `nextn.eh_proj`), before loading it."""
    header = local_header(path)
    if header is None:
        return False
    with header:
        arch, n_layer = header.value("general.architecture"), header.block_count()
        return arch in MTP_ARCHITECTURES and bool(n_layer) and header.has_tensor(f"blk.{n_layer - 1}.nextn.eh_proj.weight")


def has_mtp(llm: llama_cpp.Llama) -> bool:
    """Whether an MTP context can be opened over this loaded model: its file has MTP blocks and it
    was loaded with them (`LoadParams(load_mtp=True)`; without, llama.cpp aborts the process)."""
    return (bool(getattr(llm.model_params, "load_mtp", False))
            and llama_cpp.llama_model_n_layer_nextn(llm._model.model) > 0
            and gguf_has_mtp(llm.model_path))


# ---------------------------------------------------------------- the target's hidden states

class HiddenStates:
    """h_p for every position the target holds, recorded from its decodes.

    Turning nextn embeddings on (unmasked) makes llama.cpp copy one row per batch token after each
    decode; the target's `_decode_chunk` is wrapped to store them by position. A row is known while
    the target still holds its position and no decode left a gap before it: `known()`.
    """

    def __init__(self, target: Context):
        self.target = target
        self.n_embd = llama_cpp.llama_model_n_embd_out(target.llm._model.model)
        self.rows = np.empty((target.n_ctx, self.n_embd), np.float32)  # pages are touched as written
        self._recorded = 0  # rows [0, _recorded) were written by the decodes that made the cache
        target.keep(0)  # whatever the cache held was evaluated unrecorded
        _set_embeddings_nextn(target.ctx, True, False)
        decode_chunk = self._unrecorded = target._decode_chunk

        def decode_and_record(tokens, n_logits):
            start = len(target.tokens)
            decode_chunk(tokens, n_logits)
            self._record(start, len(tokens))
        target._decode_chunk = self._recording = decode_and_record

    def detach(self) -> None:
        """Stop recording (the MTP context is closing; the target goes on alone)."""
        if self.target.__dict__.get("_decode_chunk") is self._recording:
            self.target._decode_chunk = self._unrecorded
            _set_embeddings_nextn(self.target.ctx, False, False)

    def _record(self, start: int, n: int) -> None:
        address = _get_embeddings_nextn(self.target.ctx)
        if not address:
            self._recorded = min(self._recorded, start)
            return
        self.rows[start:start + n] = np.ctypeslib.as_array(address, shape=(n, self.n_embd))
        if start <= self._recorded:  # rows past this batch came from a sequence since cut off
            self._recorded = start + n

    def known(self) -> int:
        """Positions [0, known()) have the target's hidden state for the tokens it holds now."""
        return min(self._recorded, self.target.n_past)

    def before(self, start: int, n: int) -> np.ndarray:
        """The states entries start..start+n-1 take: h_{p-1}, zeros before position 0."""
        states = np.zeros((n, self.n_embd), np.float32)
        if n == 0:
            return states
        first = max(start - 1, 0)
        states[first - (start - 1):] = self.rows[first:start - 1 + n]
        return states


# ---------------------------------------------------------------- the MTP context

class MtpContext(Context):
    """The MTP block's own llama.cpp context over the target's model; rollback by cutting its KV
    cache (llama.cpp gives every MTP head a plain attention cache), never past the true entries."""

    def __init__(self, target: Context, hidden: HiddenStates, type_k: str = "f16", type_v: str = "f16"):
        params = llama_cpp.llama_context_default_params()
        params.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
        params.type_k, params.type_v = cache_type(type_k), cache_type(type_v)  # -ctkd / -ctvd: the draft's
        params.n_ctx, params.n_batch, params.n_ubatch = target.n_ctx, target.n_batch, target.n_batch
        params.n_threads = llama_cpp.llama_n_threads(target.ctx)
        params.n_threads_batch = llama_cpp.llama_n_threads_batch(target.ctx)
        params.swa_full = True  # a cut never needs a checkpoint
        # llama.cpp makes the MTP context from the target's params (common_base_params_to_speculative): its
        # RoPE/YaRN flags, -fa, -nkvo, --no-op-offload and --no-perf as well
        for name in (*ROPE_FIELDS, *TARGET_CONTEXT_FIELDS):
            setattr(params, name, getattr(target.llm.context_params, name))
        if hasattr(params, "n_rs_seq"):
            params.n_rs_seq = 0
        ctx = llama_cpp.llama_init_from_model(target.llm._model.model, params)
        if not ctx:
            raise ModelFileError(f"llama.cpp could not open an MTP context over the {target.name} model")
        # the target's LoRA adapters too: the head drafts from the adapted target's states, for it. Not its
        # control vectors (`cvec`): the states it reads are steered already, and llama.cpp's MTP graphs add a
        # vector at the MTP block's index only, past the layers a vector covers (nor does llama.cpp set them)
        set_lora(ctx, adapters_of(target.llm))
        # what Context.__init__ reads of a llama_cpp.Llama, which this context is not
        super().__init__(SimpleNamespace(_model=target.llm._model, _ctx=SimpleNamespace(ctx=ctx), context_params=params,
                                         tokenize=target.llm.tokenize), "mtp")
        self.rollback, self.n_swa = "cut", 0
        self.target, self.hidden = target, hidden
        self.n_true = 0  # entries [0, n_true) were made with the target's hidden states
        self._own_state, self._own_pos = np.zeros(hidden.n_embd, np.float32), -1
        _set_embeddings_nextn(ctx, True, True)  # its own state, for the rows with logits
        self._ext = llama_cpp.llama_batch_ext_init(ctx)
        self._pos = (ctypes.c_int32 * 4)()
        self._freed = False

    def _states(self, tokens, start: int) -> tuple[np.ndarray, int]:
        """Each entry's state row, and how many leading entries take the target's own."""
        n = len(tokens)
        known, target_tokens = self.hidden.known(), self.target.tokens
        n_target = 0
        while n_target < n and start + n_target - 1 < known and (
                start + n_target >= len(target_tokens) or target_tokens[start + n_target] == tokens[n_target]):
            n_target += 1
        states = np.zeros((n, self.hidden.n_embd), np.float32)
        states[:n_target] = self.hidden.before(start, n_target)
        if n_target < n and self._own_pos == start + n_target - 1:  # drafting: the MTP's own state
            states[n_target] = self._own_state
        return states, n_target

    def decode(self, tokens, n_logits: int = 1) -> None:
        """As `Context.decode`; a last token with logits goes in a batch of its own, as llama.cpp's
        drafting does: it is the row whose hidden state the next drafted entry takes, and the MTP
        graphs keep all rows of that tensor while llama.cpp copies the first n_outputs of them."""
        if n_logits == 1 and len(tokens) > 1:
            super().decode(tokens[:-1], n_logits=0)
            tokens = tokens[-1:]
        super().decode(tokens, n_logits)

    def _decode_chunk(self, tokens, n_logits: int) -> None:
        start, n = len(self.tokens), len(tokens)
        states, n_target = self._states(tokens, start)
        batch, first_logit = self._ext, n - n_logits
        llama_cpp.llama_batch_ext_clear(batch)
        for i, token in enumerate(tokens):
            idx = llama_cpp.llama_batch_ext_add_token(batch, _SEQ, token)
            self._pos[0] = start + i
            row = llama_cpp.llama_embd(states[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, states.shape[1])
            if idx < 0 or not (llama_cpp.llama_batch_ext_set_pos(batch, idx, self._pos)
                               and llama_cpp.llama_batch_ext_set_embd_token(batch, idx, row)):
                raise DecodeError(f"the MTP batch refused token {token} at position {start + i}")
            if i >= first_logit:
                llama_cpp.llama_batch_ext_set_output_logits(batch, idx, True)
        rc = llama_cpp.llama_process(self.ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, batch)
        if rc != 0:
            llama_cpp.llama_memory_seq_rm(self.memory, _SEQ, start, -1)
            raise DecodeError(f"llama_process failed on the MTP context (code {rc})")
        if start == self.n_true:
            self.n_true = start + n_target
        self.tokens.extend(tokens)
        self._first_logit, self._last_batch = -n_logits, n
        self.n_evaluated += n
        self._remember_own_state(n, n_logits)

    def _remember_own_state(self, n: int, n_logits: int) -> None:
        address = _get_embeddings_nextn_ith(self.ctx, 0) if n == 1 and n_logits else None
        if address:
            self._own_state[:] = np.ctypeslib.as_array(address, shape=(self.hidden.n_embd,))
            self._own_pos = len(self.tokens) - 1
        else:
            self._own_pos = -1

    def keep(self, n_tokens: int) -> None:
        super().keep(min(n_tokens, self.n_true))
        self.n_true = min(self.n_true, len(self.tokens))

    def reuse_prefix(self, tokens) -> int:
        kept = super().reuse_prefix(tokens[:self.n_true])
        self.n_true = min(self.n_true, kept)
        return kept

    def close(self) -> None:
        super().close()
        if not self._freed:
            self.hidden.detach()
            llama_cpp.llama_batch_ext_free(self._ext)
            llama_cpp.llama_free(self.ctx)
            self._freed = True


def open_mtp(target: Context, type_k: str = "f16", type_v: str = "f16") -> MtpContext:
    """The MTP context for a target loaded with `LoadParams(load_mtp=True)`, its KV cache of these
    types; it empties the target's cache once and records the target's hidden states from then on."""
    if not has_mtp(target.llm):
        raise ModelFileError(f"the {target.name} model has no MTP layers to draft with (or was loaded without them); "
                             f"give a draft model with -md")
    hidden = HiddenStates(target)
    try:
        return MtpContext(target, hidden, type_k, type_v)
    except BaseException:
        hidden.detach()
        raise


class MtpDrafter(ModelDrafter):
    """`ModelDrafter` over an `MtpContext`. Its drafted entries are dropped after each step, so a
    step leaves it behind by what was accepted plus the target's own token: catching up on that is
    part of a step's cost, only more than that means it sat idle."""

    def __init__(self, context: MtpContext, p_min: float = 0.0, n_min: int = 0):
        super().__init__(context, p_min, n_min)
        self.CATCH_UP = ModelDrafter.CATCH_UP

    def propose(self, tokens, k, params, draws, guide=None):
        proposals = super().propose(tokens, k, params, draws, guide)
        self.CATCH_UP = max(k, 1) + 1
        return proposals
