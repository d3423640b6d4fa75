"""Tiny GGUF models written on the spot with the `gguf` package: to test and try ggufspec without downloads.

The test suite, scripts/smoke-decode.py (can this llama-cpp-python build compute here?) and the
benchmarks use them. Llama-architecture by default; Mamba, LFM2, Gemma 2 and MoE (llama with experts)
writers below.

An SPM vocabulary (<unk>, <s>, </s>, 256 byte tokens, a few words) and random F32 weights. A
"draft" shares the vocabulary and is derived from the target: its first layers and the same
embeddings, so it agrees with the target often but not always.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

WORDS = ["▁the", "▁a", "▁cat", "▁dog", "▁sat", "▁on", "▁mat", "▁and", "▁ran", "▁def",
         "▁return", "▁if", "▁else", "▁for", "▁in", "▁x", "▁y", "(", ")", ":", "▁=", "▁+"]


FIM_TOKENS = {"<PRE>": gguf.Keys.Tokenizer.FIM_PRE_ID, "<SUF>": gguf.Keys.Tokenizer.FIM_SUF_ID,
              "<MID>": gguf.Keys.Tokenizer.FIM_MID_ID}  # CodeLlama's fill-in-the-middle tokens, at the end


THINKING_TOKENS = ["<think>", "</think>"]  # Qwen3's: user-defined, one token each, printed as their text


def vocabulary(extra_words: int = 0, fim: bool = False, thinking: bool = False) -> tuple[list[str], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256
    words = WORDS + [f"▁w{i}" for i in range(extra_words)]
    tokens, types = tokens + words, types + [gguf.TokenType.NORMAL] * len(words)
    if fim:
        tokens, types = tokens + list(FIM_TOKENS), types + [gguf.TokenType.CONTROL] * len(FIM_TOKENS)
    if thinking:
        tokens, types = tokens + THINKING_TOKENS, types + [gguf.TokenType.USER_DEFINED] * len(THINKING_TOKENS)
    return tokens, types


@dataclass
class Shape:
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_ctx_train: int = 2048
    extra_words: int = 0
    weight_scale: float = 0.5
    eos_bias: float = 0.0
    tokens: list[str] = field(default_factory=list)
    fim: bool = False  # with fill-in-the-middle tokens
    thinking: bool = False  # with <think> and </think> tokens


def make_weights(shape: Shape, seed: int) -> dict[str, np.ndarray]:
    """Random weights, numpy shapes (rows = output features), as llama.cpp's llama arch wants."""
    rng = np.random.default_rng(seed)
    n_vocab = len(vocabulary(shape.extra_words, shape.fim, shape.thinking)[0])
    e, ff = shape.n_embd, shape.n_ff
    kv = e // shape.n_head * shape.n_head_kv

    def w(*dims, scale=shape.weight_scale):
        return (rng.standard_normal(dims) * scale / np.sqrt(dims[-1])).astype(np.float32)

    weights = {
        "token_embd.weight": w(n_vocab, e, scale=float(np.sqrt(e))),
        "output_norm.weight": np.ones(e, np.float32),
        "output.weight": w(n_vocab, e, scale=8.0),
    }
    weights["output.weight"][2] += np.float32(shape.eos_bias / np.sqrt(e))
    for i in range(shape.n_layer):
        p = f"blk.{i}."
        weights.update({
            p + "attn_norm.weight": np.ones(e, np.float32),
            p + "attn_q.weight": w(e, e), p + "attn_k.weight": w(kv, e),
            p + "attn_v.weight": w(kv, e), p + "attn_output.weight": w(e, e),
            p + "ffn_norm.weight": np.ones(e, np.float32),
            p + "ffn_gate.weight": w(ff, e), p + "ffn_up.weight": w(ff, e),
            p + "ffn_down.weight": w(e, ff),
        })
    return weights


def write_model(path: Path, shape: Shape, weights: dict[str, np.ndarray],
                chat_template: str | None = None, tokens: list[str] | None = None, types: list | None = None) -> Path:
    vocab, default_types = vocabulary(shape.extra_words, shape.fim, shape.thinking)
    types = default_types if types is None else types
    if tokens is not None:
        vocab = tokens
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_common(writer, vocab, types, chat_template)
    for text, key in FIM_TOKENS.items() if shape.fim else ():
        writer.add_uint32(key, vocab.index(text))
    _write_transformer_dims(writer, shape)
    writer.add_rope_dimension_count(shape.n_embd // shape.n_head)
    return _finish(writer, weights, path)


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")
# As ChatML renders an answer: right after the turn's opening, which is the generation prompt, so the
# next turn's prompt holds this turn's prompt and answer as the model produced them (CHAT_TEMPLATE
# adds a space after the colon: a next turn leaves the answer at its first token).
CONTINUING_CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}"
                            "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def make_pair(directory: Path, seed: int = 0, shape: Shape | None = None) -> tuple[Path, Path]:
    """A target and a draft (the target's first layer, same embeddings and output)."""
    shape = shape or Shape()
    weights = make_weights(shape, seed)
    target = write_model(directory / "target.gguf", shape, weights, CHAT_TEMPLATE)
    draft_shape = Shape(**{**shape.__dict__, "n_layer": 1})
    draft_weights = {k: v for k, v in weights.items() if not k.startswith("blk.") or k.startswith("blk.0.")}
    draft = write_model(directory / "draft.gguf", draft_shape, draft_weights, CHAT_TEMPLATE)
    return target, draft


LORA_TARGETS = ("attn_q", "attn_v", "ffn_down")


def write_lora(path: Path, shape: Shape, seed: int = 1, rank: int = 4, strength: float = 1.0,
               task_name: str | None = None, arch: str = "llama", n_blocks: int | None = None) -> Path:
    """A LoRA adapter GGUF for a llama-architecture model of `shape`, as convert_lora_to_gguf.py writes
    one: general.type "adapter", adapter.type "lora", adapter.lora.alpha, and for each adapted matrix W
    (out x in) `W.lora_a` (rank x in) and `W.lora_b` (out x rank), the update being B @ A * alpha / rank.
    `strength` scales the update against W (1: about as large); `n_blocks` the blocks adapted (default:
    shape.n_layer; one more reaches an MTP block after them)."""
    rng = np.random.default_rng(seed)
    kv = shape.n_embd // shape.n_head * shape.n_head_kv
    sizes = {"attn_q": (shape.n_embd, shape.n_embd), "attn_v": (kv, shape.n_embd), "ffn_down": (shape.n_embd, shape.n_ff)}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank))  # alpha = rank: the update as written
    if task_name is not None:
        writer.add_string(gguf.Keys.Adapter.LORA_TASK_NAME, task_name)
    tensors = {}
    for i in range(shape.n_layer if n_blocks is None else n_blocks):
        for name in LORA_TARGETS:
            n_out, n_in = sizes[name]
            scale = strength * shape.weight_scale / np.sqrt(n_in)
            tensors[f"blk.{i}.{name}.weight.lora_a"] = (rng.standard_normal((rank, n_in)) / np.sqrt(rank)).astype(np.float32)
            tensors[f"blk.{i}.{name}.weight.lora_b"] = (rng.standard_normal((n_out, rank)) * scale).astype(np.float32)
    return _finish(writer, tensors, path)


def write_header_only(path: Path, *, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, n_ff: int,
                      n_vocab: int, layer_type=None, embd_type=None, output_type=None, arch: str = "llama") -> Path:
    """A GGUF of a real model's shape with no weights: the header, then a sparse hole of the data's size."""
    Q = gguf.GGMLQuantizationType
    layer_type, embd_type, output_type = layer_type or Q.Q3_K, embd_type or Q.Q3_K, output_type or Q.Q6_K
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(n_layer)
    writer.add_context_length(8192)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_vocab_size(n_vocab)  # the size without the token list: headers that read in milliseconds
    kv = n_embd // n_head * n_head_kv

    def tensor(name, shape, qtype):
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n = int(np.prod(shape))
        byte_shape = (*shape[:-1], shape[-1] // block * type_size)  # numpy order, last axis in bytes
        writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), n // block * type_size, raw_dtype=qtype)

    tensor("token_embd.weight", (n_vocab, n_embd), embd_type)
    for i in range(n_layer):
        p = f"blk.{i}."
        tensor(p + "attn_norm.weight", (n_embd,), Q.F32)
        tensor(p + "ffn_norm.weight", (n_embd,), Q.F32)
        for name, shape in (("attn_q", (n_embd, n_embd)), ("attn_k", (kv, n_embd)), ("attn_v", (kv, n_embd)),
                            ("attn_output", (n_embd, n_embd)), ("ffn_gate", (n_ff, n_embd)),
                            ("ffn_up", (n_ff, n_embd)), ("ffn_down", (n_embd, n_ff))):
            tensor(p + name + ".weight", shape, layer_type)
    tensor("output_norm.weight", (n_embd,), Q.F32)
    tensor("output.weight", (n_vocab, n_embd), output_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    header_end = writer.fout[0].tell()
    data = sum(ti.nbytes for ti in writer.tensors[0].values())
    writer.close()
    with open(path, "r+b") as f:
        f.truncate(header_end + 32 + data + 32 * len(writer.tensors[0]))  # alignment padding, generously
    return path


# ---------------------------------------------------------------- recurrent and sliding-window memory

def _write_transformer_dims(writer: gguf.GGUFWriter, shape: Shape) -> None:
    writer.add_context_length(shape.n_ctx_train)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)


def _write_common(writer: gguf.GGUFWriter, vocab: list[str], types: list, chat_template: str | None) -> None:
    writer.add_name("tiny")
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab)
    writer.add_token_scores([0.0] * 3 + [-1000.0] * 256 + [-float(i) for i in range(len(vocab) - 259)])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if chat_template:
        writer.add_chat_template(chat_template)


def _finish(writer: gguf.GGUFWriter, weights: dict[str, np.ndarray], path: Path) -> Path:
    for name, tensor in weights.items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def make_mamba_weights(n_layer: int, n_embd: int, d_state: int, d_conv: int, dt_rank: int, seed: int,
                       eos_bias: float | None = 0.0, layer_scale: float = 1.0,
                       late_scale: float = 0.3, n_early: int = 2) -> dict[str, np.ndarray]:
    """Mamba (v1) weights in llama.cpp's names (src/models/mamba.cpp; numpy shapes reversed)."""
    rng = np.random.default_rng(seed)
    n_vocab = len(vocabulary()[0])
    d_inner = 2 * n_embd

    def w(*dims, scale=layer_scale):
        return (rng.standard_normal(dims) * scale / np.sqrt(dims[-1])).astype(np.float32)

    weights = {"token_embd.weight": w(n_vocab, n_embd, scale=1.0),
               "output_norm.weight": np.ones(n_embd, np.float32),
               "output.weight": w(n_vocab, n_embd, scale=8.0)}
    if eos_bias is None:  # no end of sequence: its logit is 0, below the largest of the others
        weights["output.weight"][2] = 0.0
    else:
        weights["output.weight"][2] += np.float32(eos_bias / np.sqrt(n_embd))
    for i in range(n_layer):
        p = f"blk.{i}."
        out_scale = layer_scale if i < n_early else layer_scale * late_scale  # the draft's layers dominate
        weights.update({
            p + "attn_norm.weight": np.ones(n_embd, np.float32),
            p + "ssm_in.weight": w(2 * d_inner, n_embd),
            p + "ssm_conv1d.weight": w(d_inner, d_conv, scale=1.0),
            p + "ssm_conv1d.bias": np.zeros(d_inner, np.float32),
            p + "ssm_x.weight": w(dt_rank + 2 * d_state, d_inner),
            p + "ssm_dt.weight": w(d_inner, dt_rank),
            p + "ssm_dt.bias": np.zeros(d_inner, np.float32),
            # A = -exp(A_log), stored already negated as llama.cpp's converter does
            p + "ssm_a": -np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1)),
            p + "ssm_d": np.ones(d_inner, np.float32),
            p + "ssm_out.weight": w(n_embd, d_inner, scale=out_scale),
        })
    return weights


def write_mamba(path: Path, weights: dict[str, np.ndarray], n_layer: int, n_embd: int, d_state: int, d_conv: int,
                dt_rank: int, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    vocab, types = vocabulary()
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_context_length(2048)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    writer.add_ssm_conv_kernel(d_conv)
    writer.add_ssm_inner_size(2 * n_embd)
    writer.add_ssm_state_size(d_state)
    writer.add_ssm_time_step_rank(dt_rank)
    _write_common(writer, vocab, types, chat_template)
    return _finish(writer, weights, path)


def make_mamba_pair(directory: Path, seed: int = 0, n_layer: int = 4, n_embd: int = 64, eos_bias: float | None = 4.0,
                    draft_layers: int = 2, chat_template: str | None = CHAT_TEMPLATE) -> tuple[Path, Path]:
    """A Mamba target and, as its draft, its first `draft_layers` layers (same embeddings and output)."""
    dims = dict(n_embd=n_embd, d_state=16, d_conv=4, dt_rank=8)
    weights = make_mamba_weights(n_layer, seed=seed, eos_bias=eos_bias, **dims)
    target = write_mamba(directory / "mamba-target.gguf", weights, n_layer, **dims, chat_template=chat_template)
    keep = tuple(f"blk.{i}." for i in range(draft_layers))
    draft_weights = {k: v for k, v in weights.items() if not k.startswith("blk.") or k.startswith(keep)}
    draft = write_mamba(directory / "mamba-draft.gguf", draft_weights, draft_layers, **dims, chat_template=chat_template)
    return target, draft


def write_gemma2(path: Path, shape: Shape, weights: dict[str, np.ndarray], window: int,
                 chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """Gemma 2: every other layer attends over a sliding window of `window` tokens (layer 0 does)."""
    vocab, types = vocabulary(shape.extra_words)
    writer = gguf.GGUFWriter(str(path), "gemma2")
    _write_transformer_dims(writer, shape)
    writer.add_key_length(shape.n_embd // shape.n_head)
    writer.add_value_length(shape.n_embd // shape.n_head)
    writer.add_sliding_window(window)
    _write_common(writer, vocab, types, chat_template)
    return _finish(writer, weights, path)


def make_gemma2_pair(directory: Path, seed: int = 0, window: int = 16, n_layer: int = 4, emb_scale: float = 0.1, weight_scale: float = 4.0,
                     eos_bias: float = 0.0, chat_template: str | None = CHAT_TEMPLATE) -> tuple[Path, Path]:
    """A Gemma 2 target with a small sliding window and its first 2 layers as the draft."""
    shape = Shape(n_layer=n_layer, eos_bias=eos_bias, weight_scale=weight_scale)
    base = make_weights(shape, seed)
    weights = {k: v for k, v in base.items() if k != "output.weight"}  # gemma 2 ties the output to the embeddings
    weights["token_embd.weight"] = base["output.weight"] * np.float32(emb_scale)
    for i in range(n_layer):
        weights[f"blk.{i}.post_attention_norm.weight"] = np.ones(shape.n_embd, np.float32)
        weights[f"blk.{i}.post_ffw_norm.weight"] = np.ones(shape.n_embd, np.float32)
    target = write_gemma2(directory / "gemma2-target.gguf", shape, weights, window, chat_template)
    draft_shape = Shape(**{**shape.__dict__, "n_layer": 2})
    draft_weights = {k: v for k, v in weights.items() if not k.startswith("blk.") or k.startswith(("blk.0.", "blk.1."))}
    draft = write_gemma2(directory / "gemma2-draft.gguf", draft_shape, draft_weights, window, chat_template)
    return target, draft


def make_lfm2_pair(directory: Path, seed: int = 0, n_embd: int = 64, l_cache: int = 3,
                   eos_bias: float | None = 4.0, chat_template: str | None = CHAT_TEMPLATE) -> tuple[Path, Path]:
    """LFM2, a hybrid (short convolutions, recurrent state, beside attention layers), one of the
    architectures where llama.cpp keeps per-token rollback states (n_rs_seq). Target: conv, conv,
    attention, conv; draft: its first three (a draft with no attention layer crashes llama.cpp)."""
    kinds = ["conv", "conv", "attn", "conv"]
    rng = np.random.default_rng(seed)
    n_vocab = len(vocabulary()[0])
    n_head, n_head_kv, n_ff = 4, 2, 128
    head = n_embd // n_head

    def w(*dims, scale=1.0):
        return (rng.standard_normal(dims) * scale / np.sqrt(dims[-1])).astype(np.float32)

    weights = {"token_embd.weight": w(n_vocab, n_embd, scale=1.0), "token_embd_norm.weight": np.ones(n_embd, np.float32),
               "output.weight": w(n_vocab, n_embd, scale=8.0)}
    if eos_bias is None:
        weights["output.weight"][2] = 0.0
    else:
        weights["output.weight"][2] += np.float32(eos_bias / np.sqrt(n_embd))
    for i, kind in enumerate(kinds):
        p = f"blk.{i}."
        scale = 1.0 if i < 2 else 0.3
        weights.update({p + "attn_norm.weight": np.ones(n_embd, np.float32), p + "ffn_norm.weight": np.ones(n_embd, np.float32),
                        p + "ffn_gate.weight": w(n_ff, n_embd), p + "ffn_up.weight": w(n_ff, n_embd),
                        p + "ffn_down.weight": w(n_embd, n_ff, scale=scale)})
        if kind == "conv":
            weights.update({p + "shortconv.conv.weight": w(n_embd, l_cache),
                            p + "shortconv.in_proj.weight": w(3 * n_embd, n_embd),
                            p + "shortconv.out_proj.weight": w(n_embd, n_embd, scale=scale)})
        else:
            weights.update({p + "attn_q_norm.weight": np.ones(head, np.float32), p + "attn_k_norm.weight": np.ones(head, np.float32),
                            p + "attn_q.weight": w(n_embd, n_embd), p + "attn_k.weight": w(head * n_head_kv, n_embd),
                            p + "attn_v.weight": w(head * n_head_kv, n_embd),
                            p + "attn_output.weight": w(n_embd, n_embd, scale=scale)})

    def write(path, layers):
        vocab, types = vocabulary()
        writer = gguf.GGUFWriter(str(path), "lfm2")
        writer.add_context_length(2048)
        writer.add_embedding_length(n_embd)
        writer.add_block_count(len(layers))
        writer.add_feed_forward_length(n_ff)
        writer.add_head_count(n_head)
        writer.add_head_count_kv([n_head_kv if k == "attn" else 0 for k in layers])
        writer.add_rope_dimension_count(head)
        writer.add_uint32("lfm2.shortconv.l_cache", l_cache)
        _write_common(writer, vocab, types, chat_template)
        keep = tuple(f"blk.{i}." for i in range(len(layers)))
        return _finish(writer, {k: v for k, v in weights.items() if not k.startswith("blk.") or k.startswith(keep)}, path)

    return write(directory / "lfm2-target.gguf", kinds), write(directory / "lfm2-draft.gguf", kinds[:3])


# ---------------------------------------------------------------- mixture of experts

def make_moe_pair(directory: Path, seed: int = 0, n_layer: int = 2, n_expert: int = 4, n_expert_used: int = 2,
                  shape: Shape | None = None) -> tuple[Path, Path]:
    """A Mixtral-style MoE (llama architecture with experts: src/models/llama.cpp) and, as its draft,
    its first layer. Each layer's FFN is `n_expert` experts in 3D tensors (blk.N.ffn_{gate,up,down}_exps,
    what --cpu-moe keeps on the CPU) and a router, blk.N.ffn_gate_inp."""
    shape = shape or Shape(n_layer=n_layer)
    rng = np.random.default_rng(seed + 1)
    dense_ffn = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")  # the experts replace them
    weights = {k: v for k, v in make_weights(shape, seed).items() if not k.endswith(dense_ffn)}
    e, ff = shape.n_embd, shape.n_ff
    for i in range(shape.n_layer):
        p = f"blk.{i}."
        weights[p + "ffn_gate_inp.weight"] = (rng.standard_normal((n_expert, e)) / np.sqrt(e)).astype(np.float32)
        for name, dims in (("gate", (ff, e)), ("up", (ff, e)), ("down", (e, ff))):  # numpy order: expert first
            weights[p + f"ffn_{name}_exps.weight"] = (rng.standard_normal((n_expert, *dims)) * shape.weight_scale
                                                      / np.sqrt(dims[-1])).astype(np.float32)

    def write(path: Path, layers: int) -> Path:
        vocab, types = vocabulary(shape.extra_words)
        writer = gguf.GGUFWriter(str(path), "llama")
        _write_common(writer, vocab, types, CHAT_TEMPLATE)
        _write_transformer_dims(writer, Shape(**{**shape.__dict__, "n_layer": layers}))
        writer.add_rope_dimension_count(shape.n_embd // shape.n_head)
        writer.add_expert_count(n_expert)
        writer.add_expert_used_count(n_expert_used)
        keep = tuple(f"blk.{i}." for i in range(layers))
        return _finish(writer, {k: v for k, v in weights.items() if not k.startswith("blk.") or k.startswith(keep)}, path)

    return write(directory / "moe-target.gguf", shape.n_layer), write(directory / "moe-draft.gguf", 1)
