"""A model's shape, as the planner needs it: each layer's bytes and the sizes that set its KV cache
and compute buffer, from the GGUF header's keys and tensor list.

The memory model, per model and context (n_ctx, n_ubatch), no flash attention:
- weights: each tensor's bytes (where they go is `estimate.placement`'s business).
- KV cache: n_ctx rows of n_embd_k_gqa K and n_embd_v_gqa V elements per layer, where the layer lives
  (with -nkvo, llama.cpp's offload_kqv off, all of it in host memory),
  at the cache types' bytes (-ctk/-ctv, F16 by default: 2 bytes; q8_0 34 bytes a block of 32); a
  sliding-window layer holds min(n_ctx, pad256(n_swa + n_ubatch)) cells instead, as llama.cpp
  allocates it by default (llama-server's, and ggufspec's: `--swa-full` keeps n_ctx for every layer).
- compute buffer: the largest set of live activations in llama.cpp's reserve graph, for one ubatch:
  either the output (logits: n_ubatch * n_vocab floats, plus two hidden states) or the attention
  (KQ: n_ubatch * n_ctx * n_head floats, the F32 mask, the FFN and Q/K/V activations). Checked
  against llama.cpp's own buffer sizes in tests/test_plan.py.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, replace

import gguf

from ..load import KV_CACHE_TYPES
from .units import PlanError

KV_BYTES = 2                  # an F16 cache's bytes per element (llama.cpp's default; `cache_bytes` for any)
# Which layers use the sliding window, where the header does not say: llama.cpp's default pattern per
# architecture (src/models/*.cpp, load_swa_pattern): n means n - 1 window layers, then a full one.
SWA_PATTERNS = {"gemma2": 2, "gemma3": 6, "gemma3n": 5, "gemma-embedding": 6, "cohere2": 4, "gpt-oss": 2,
                "exaone4": 4, "olmo2": 4, "plamo3": 8}
MAX_LAYERS = 10_000           # a sanity bound on block_count (the largest models have a few hundred)
MAX_DIMENSION = 1 << 32       # and on any other size in the header (widths, heads, vocabulary, context)


@dataclass
class ModelShape:
    name: str
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_embd_k_gqa: int
    n_embd_v_gqa: int
    n_ff: int
    n_vocab: int
    layer_bytes: list[int]
    embd_bytes: int
    output_bytes: int          # output matrix + output norm (tied embeddings: the embedding again)
    other_bytes: int = 0
    n_ctx_train: int = 0       # the context length it was trained for (0: not in the header)
    n_swa: int = 0             # the sliding window (0: none)
    swa_layers: tuple[bool, ...] = ()  # which layers use it
    # how it will load, not read from the file (`loaded_as`): the KV cache's types (-ctk, -ctv) and the
    # micro-batch (-ub), which size its cache and compute buffer
    type_k: str = "f16"
    type_v: str = "f16"
    n_ubatch: int = 512
    kv_offload: bool = True    # False (-nkvo): the whole KV cache in host memory, whatever -ngl offloads

    def __post_init__(self):
        self.swa_layers = tuple(self.swa_layers)  # a list, when remembered as JSON
        if not {self.type_k, self.type_v} <= set(KV_CACHE_TYPES) or not _is_count(self.n_ubatch, 1, MAX_DIMENSION):
            raise PlanError(f"{self.name}: KV cache types {self.type_k!r}/{self.type_v!r} and -ub {self.n_ubatch!r}: "
                            f"give cache types of {', '.join(KV_CACHE_TYPES)} and -ub >= 1")
        sizes = [self.n_layer, self.n_embd, self.n_head, self.n_head_kv, self.n_embd_k_gqa, self.n_embd_v_gqa,
                 self.n_ff, self.n_vocab, self.embd_bytes, self.output_bytes, self.other_bytes, self.n_ctx_train,
                 self.n_swa, *self.layer_bytes]
        if (not all(_is_count(v, 0, 1 << 62) for v in sizes) or not 1 <= self.n_layer <= MAX_LAYERS
                or len(self.layer_bytes) != self.n_layer or (self.n_swa and len(self.swa_layers) != self.n_layer)):
            raise PlanError(f"{self.name}: an impossible model shape ({self.n_layer!r} layers, "
                            f"{len(self.layer_bytes)} sized): read its GGUF header again")

    @property
    def weight_bytes(self) -> int:
        return sum(self.layer_bytes) + self.embd_bytes + self.output_bytes + self.other_bytes

    def kv_bytes(self, n_ctx: int, n_layers: int | None = None, n_ubatch: int | None = None, swa_full: bool = False) -> int:
        """The KV cache of the last n_layers layers (those -ngl offloads; default all)."""
        n = self.n_layer if n_layers is None else n_layers
        n_ubatch = n_ubatch or self.n_ubatch
        window_cells = -(-min(n_ctx, self.n_swa + n_ubatch) // 256) * 256  # llama-kv-cache-iswa.cpp
        cells = sum(window_cells if self.n_swa and not swa_full and self.swa_layers[il] else n_ctx
                    for il in range(self.n_layer - n, self.n_layer))
        return cells * (cache_bytes(self.type_k, self.n_embd_k_gqa) + cache_bytes(self.type_v, self.n_embd_v_gqa))

    def compute_bytes(self, n_ctx: int, n_ubatch: int | None = None) -> int:
        n_ub = min(n_ubatch or self.n_ubatch, n_ctx)
        output = 4 * n_ub * (self.n_vocab + 2 * self.n_embd)
        attention = 4 * n_ub * (n_ctx * (self.n_head + 1) + self.n_ff + 3 * self.n_embd + self.n_embd_k_gqa
                                + self.n_embd_v_gqa)
        return max(output, attention)


def cache_bytes(type_name: str, n_elements: int) -> int:
    """Bytes of a KV cache row of n_elements of this type (ggml_row_size: gguf's GGML_QUANT_SIZES gives
    the bytes per block; f16 2 bytes an element, q8_0 34 bytes a block of 32, q4_0 18)."""
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name.upper()]]
    return n_elements * size // block


def loaded_as(shape: ModelShape, type_k: str = "f16", type_v: str = "f16", n_ubatch: int = 512,
              kv_offload: bool = True) -> ModelShape:
    """The shape with the KV cache types and micro-batch it will be loaded with, and where its KV cache
    goes (kv_offload False, -nkvo: host memory)."""
    return replace(shape, type_k=type_k, type_v=type_v, n_ubatch=n_ubatch, kv_offload=kv_offload)


def with_host_tensors(shape: ModelShape, tensors: dict[str, int]) -> ModelShape:
    """The shape with these tensors (name -> bytes) in host memory whatever -ngl (tensor overrides to the
    CPU: --cpu-moe's experts): out of their layer's bytes, which -ngl offloads, into those that stay."""
    layers, moved = list(shape.layer_bytes), 0
    for name, size in tensors.items():
        if (m := re.match(r"blk\.(\d+)\.", name)) and int(m[1]) < shape.n_layer:
            layers[int(m[1])] -= size
            moved += size
    return replace(shape, layer_bytes=layers, other_bytes=shape.other_bytes + moved)


def _is_count(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _count(name: str, key: str, value, low: int = 0, high: int = MAX_DIMENSION, per_layer: bool = False) -> int:
    """A size from the header, checked: a whole number in [low, high] (NaN, a string, a negative
    count are a damaged or misconverted file), or a per-layer list of them, sized by its largest."""
    values = value if per_layer and isinstance(value, list) and value else [value]
    if not all(_is_count(v, 0, high) for v in values) or max(values) < low:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise PlanError(f"{name}: {key} is {shown} in the GGUF header, not a whole number from {low} to {high}: "
                        f"the file is damaged or was converted wrongly (convert it again, or use another file)")
    return max(values)


def _tensor_bytes(tensors: list[tuple[str, int]], n_layer: int, name: str, key: str) -> tuple[list[int], int, int, int]:
    """(bytes per layer, token embedding, output, everything else) from the tensor list."""
    layers = [0] * n_layer
    embd = output = other = 0
    for tensor_name, size in tensors:
        if m := re.match(r"blk\.(\d+)\.", tensor_name):
            if int(m[1]) >= n_layer:
                raise PlanError(f"{name}: tensor {tensor_name} is past the {n_layer} layers {key} gives: the "
                                f"file is damaged or was converted wrongly (convert it again, or use another file)")
            layers[int(m[1])] += size
        elif tensor_name.startswith("token_embd."):
            embd += size
        elif tensor_name.startswith(("output.", "output_norm.")):
            output += size
        else:
            other += size
    if not any(t.startswith("output.") for t, _ in tensors):
        output += embd  # tied embeddings: the GPU gets its own copy of the matrix for the output layer
    return layers, embd, output, other


def shape_from_header(kv, tensors: list[tuple[str, int]], n_tokens: int | None, name: str) -> ModelShape:
    """kv: key -> value for the keys the planner needs; tensors: (name, bytes); n_tokens: the
    tokenizer's vocabulary length (None when the file has no token list)."""
    arch = kv("general.architecture")
    if not arch:
        raise PlanError(f"{name}: no general.architecture in the GGUF header")
    if not isinstance(arch, str):
        raise PlanError(f"{name}: general.architecture is {arch!r} in the GGUF header, not a name: the file is damaged")

    def get(key, default=None, low=0, high=MAX_DIMENSION, per_layer=False):  # a size, checked (None: absent)
        value = kv(f"{arch}.{key}", default)
        return None if value is None else _count(name, f"{arch}.{key}", value, low, high, per_layer)
    n_layer = get("block_count", low=1, high=MAX_LAYERS)
    if n_layer is None:
        raise PlanError(f"{name}: no {arch}.block_count in the GGUF header")
    sizes = _tensor_bytes(tensors, n_layer, name, f"{arch}.block_count")
    n_vocab = n_tokens if n_tokens is not None else get("vocab_size", 0)
    n_embd, n_head = get("embedding_length", low=1), get("attention.head_count", per_layer=True)
    n_ctx_train = get("context_length", 0)
    if n_embd is None or not n_head:  # 0 heads: an attention-free model (mamba writes 0)
        warnings.warn(f"{name}: architecture {arch!r} lacks the usual shape keys; sizing from tensors alone")
        return ModelShape(name, arch, n_layer, n_embd or 0, 1, 1, 0, 0, 0, n_vocab, *sizes, n_ctx_train)
    n_head_kv = get("attention.head_count_kv", n_head, per_layer=True)
    key_len = get("attention.key_length", n_embd // n_head)
    value_len = get("attention.value_length", key_len)
    n_ff = get("feed_forward_length", 4 * n_embd, per_layer=True)
    n_swa = get("attention.sliding_window", 0)
    swa = _swa_layers(name, arch, n_layer, kv(f"{arch}.attention.sliding_window_pattern")) if n_swa else ()
    return ModelShape(name, arch, n_layer, n_embd, n_head, n_head_kv, n_head_kv * key_len,
                      n_head_kv * value_len, n_ff, n_vocab, *sizes, n_ctx_train, n_swa, swa)


def _swa_layers(name: str, arch: str, n_layer: int, pattern) -> tuple[bool, ...]:
    """Which layers use the sliding window: the header's per-layer list, or a pattern n (n - 1 window
    layers, then a full one), or llama.cpp's default for the architecture (all layers if unknown)."""
    key = f"{arch}.attention.sliding_window_pattern"
    if isinstance(pattern, list):
        if len(pattern) < n_layer or not all(_is_count(x, 0, 1) or isinstance(x, bool) for x in pattern):
            raise PlanError(f"{name}: {key} holds {len(pattern)} value(s) for {n_layer} layers, not one true or "
                            f"false a layer: the file is damaged or was converted wrongly (convert it again)")
        return tuple(bool(x) for x in pattern[:n_layer])
    n = SWA_PATTERNS.get(arch, 0) if pattern is None else _count(name, key, pattern, 0, MAX_LAYERS)
    return tuple(n == 0 or il % n < n - 1 for il in range(n_layer))


def shape_from_reader(reader, name: str, other_shards=lambda n_shards: []) -> ModelShape:
    """The same from the gguf package's GGUFReader (slow on big vocabularies: the fallback only).
    `other_shards(split.count)`: a split GGUF's other shards' tensors, as (name, bytes)."""
    def kv(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    tensors = [(t.name, int(t.n_bytes)) for t in reader.tensors] + other_shards(kv("split.count", 1))
    return shape_from_header(kv, tensors, None if tokens is None else len(tokens.data), name)
