"""A tiny model that carries an MTP (multi-token prediction, "nextn") head, written with the `gguf` package.

llama.cpp runs MTP heads for a handful of architectures (qwen35, glm4moe, deepseek2, hy_v3, ...); the
simplest to write is HY V3 with no experts: a dense Llama-like trunk (q/k norms, SwiGLU) on a plain
KV cache, and one NextN block after it. The GGUF counts the NextN block in `block_count` and says
how many of the last blocks are NextN in `hy_v3.nextn_predict_layers`.

The NextN block at position p+1 reads the token x_{p+1} and the target's hidden state at p:
enorm(embed(x_{p+1})) and hnorm(h_p) are concatenated, projected by `nextn.eh_proj` (n_embd x 2
n_embd) and run through one decoder block, then `nextn.shared_head_norm` and the shared output. With
random weights it would rarely agree with the target; here the block is a copy of the target's first
layer and eh_proj mostly passes the token's normalised embedding through (plus `state_weight` of
the hidden state), so it behaves like a one-layer draft of the target and agrees often, not always.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from .tinymodels import CHAT_TEMPLATE, Shape, _finish, _write_common, make_weights, vocabulary

ARCH = "hy_v3"


def make_mtp_weights(shape: Shape, seed: int = 0, state_weight: float = 0.3) -> dict[str, np.ndarray]:
    """The trunk (shape.n_layer blocks) and one NextN block at index shape.n_layer."""
    weights = make_weights(shape, seed)
    e, head = shape.n_embd, shape.n_embd // shape.n_head
    for i in range(shape.n_layer + 1):
        weights[f"blk.{i}.attn_q_norm.weight"] = np.ones(head, np.float32)
        weights[f"blk.{i}.attn_k_norm.weight"] = np.ones(head, np.float32)
    mtp = f"blk.{shape.n_layer}."
    for name, tensor in list(weights.items()):
        if name.startswith("blk.0."):
            weights[mtp + name[len("blk.0."):]] = tensor.copy()
    # numpy (rows = outputs): the first n_embd inputs are the token's embedding, the next the hidden state
    weights[mtp + "nextn.eh_proj.weight"] = np.concatenate(
        [np.eye(e, dtype=np.float32), np.float32(state_weight) * np.eye(e, dtype=np.float32)], axis=1)
    for norm in ("nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm"):
        weights[mtp + norm + ".weight"] = np.ones(e, np.float32)
    return weights


def write_mtp_model(path: Path, shape: Shape, weights: dict[str, np.ndarray], n_nextn: int = 1,
                    chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """`weights` for shape.n_layer trunk blocks and `n_nextn` NextN blocks after them (0: a trunk-only file)."""
    vocab, types = vocabulary(shape.extra_words)
    writer = gguf.GGUFWriter(str(path), ARCH)
    writer.add_context_length(shape.n_ctx_train)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer + n_nextn)  # the NextN blocks count as blocks
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_uint32(f"{ARCH}.expert_feed_forward_length", shape.n_ff)  # required even with no experts
    if n_nextn:
        writer.add_uint32(f"{ARCH}.nextn_predict_layers", n_nextn)
    _write_common(writer, vocab, types, chat_template)
    return _finish(writer, weights, path)


def make_mtp_model(directory: Path, seed: int = 0, shape: Shape | None = None, state_weight: float = 0.3,
                   name: str = "mtp-target.gguf") -> Path:
    """A HY V3 target with an MTP head that agrees with it often (see the module's docstring)."""
    shape = shape or Shape()
    return write_mtp_model(directory / name, shape, make_mtp_weights(shape, seed, state_weight))


def make_trunk_only(directory: Path, seed: int = 0, shape: Shape | None = None) -> Path:
    """The same target with no NextN block: nothing to draft with."""
    shape = shape or Shape()
    weights = {k: v for k, v in make_mtp_weights(shape, seed).items()
               if not k.startswith(f"blk.{shape.n_layer}.")}
    return write_mtp_model(directory / "trunk-only.gguf", shape, weights, n_nextn=0)
