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


# ---------------------------------------------------------------- Qwen3.5: a hybrid trunk, a plain MTP cache

QWEN35_SSM = dict(d_conv=4, d_state=16, n_group=2, dt_rank=2)  # linear-attention (gated delta net) sizes


def make_qwen35_weights(shape: Shape, seed: int = 0, recurrent_scale: float = 0.1,
                        state_weight: float = 0.3) -> dict[str, np.ndarray]:
    """Qwen3.5 with full attention every second layer (layer 1, 3, ...), linear attention between;
    the MTP block copies layer 1 and the linear-attention layers are damped (`recurrent_scale`), so
    the MTP agrees with the target often. Numpy shapes: rows = outputs."""
    rng = np.random.default_rng(seed)
    e, ff, head = shape.n_embd, shape.n_ff, shape.n_embd // shape.n_head
    kv = head * shape.n_head_kv
    s = QWEN35_SSM
    key_dim, value_dim = s["d_state"] * s["n_group"], s["d_state"] * s["dt_rank"]

    def w(*dims, scale=shape.weight_scale):
        return (rng.standard_normal(dims) * scale / np.sqrt(dims[-1])).astype(np.float32)

    n_vocab = len(vocabulary(shape.extra_words)[0])
    weights = {"token_embd.weight": w(n_vocab, e, scale=float(np.sqrt(e))),
               "output_norm.weight": np.ones(e, np.float32), "output.weight": w(n_vocab, e, scale=8.0)}
    weights["output.weight"][2] += np.float32(shape.eos_bias / np.sqrt(e))
    for i in range(shape.n_layer):
        p = f"blk.{i}."
        weights.update({p + "attn_norm.weight": np.ones(e, np.float32), p + "post_attention_norm.weight": np.ones(e, np.float32),
                        p + "ffn_gate.weight": w(ff, e), p + "ffn_up.weight": w(ff, e), p + "ffn_down.weight": w(e, ff)})
        if i % 2 == 1:  # full attention: the query projection carries its gate too
            weights.update({p + "attn_q.weight": w(2 * e, e), p + "attn_k.weight": w(kv, e), p + "attn_v.weight": w(kv, e),
                            p + "attn_output.weight": w(e, e), p + "attn_q_norm.weight": np.ones(head, np.float32),
                            p + "attn_k_norm.weight": np.ones(head, np.float32)})
        else:
            weights[p + "ffn_down.weight"] *= np.float32(recurrent_scale)
            weights.update({p + "attn_qkv.weight": w(2 * key_dim + value_dim, e), p + "attn_gate.weight": w(value_dim, e),
                            p + "ssm_conv1d.weight": w(2 * key_dim + value_dim, s["d_conv"], scale=1.0),
                            p + "ssm_dt.bias": np.zeros(s["dt_rank"], np.float32),
                            p + "ssm_a": -np.ones(s["dt_rank"], np.float32),
                            p + "ssm_beta.weight": w(s["dt_rank"], e), p + "ssm_alpha.weight": w(s["dt_rank"], e),
                            p + "ssm_norm.weight": np.ones(s["d_state"], np.float32),
                            p + "ssm_out.weight": w(e, value_dim, scale=recurrent_scale)})
    mtp = f"blk.{shape.n_layer}."
    weights.update({mtp + name[len("blk.1."):]: t.copy() for name, t in list(weights.items()) if name.startswith("blk.1.")})
    weights[mtp + "nextn.eh_proj.weight"] = np.concatenate(
        [np.eye(e, dtype=np.float32), np.float32(state_weight) * np.eye(e, dtype=np.float32)], axis=1)
    for norm in ("nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm"):
        weights[mtp + norm + ".weight"] = np.ones(e, np.float32)
    return weights


def make_qwen35_model(directory: Path, seed: int = 0, shape: Shape | None = None) -> Path:
    """A Qwen3.5 target (hybrid: linear and full attention) with one MTP block."""
    shape = shape or Shape(n_layer=3)
    vocab, types = vocabulary(shape.extra_words)
    path = directory / "qwen35-mtp.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen35")
    writer.add_context_length(shape.n_ctx_train)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer + 1)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_uint32("qwen35.nextn_predict_layers", 1)
    writer.add_uint32("qwen35.full_attention_interval", 2)
    writer.add_array("qwen35.rope.dimension_sections", [3, 3, 2, 0])
    s = QWEN35_SSM
    writer.add_ssm_conv_kernel(s["d_conv"])
    writer.add_ssm_state_size(s["d_state"])
    writer.add_ssm_group_count(s["n_group"])
    writer.add_ssm_time_step_rank(s["dt_rank"])
    writer.add_ssm_inner_size(s["d_state"] * s["dt_rank"])
    _write_common(writer, vocab, types, CHAT_TEMPLATE)
    return _finish(writer, make_qwen35_weights(shape, seed), path)
