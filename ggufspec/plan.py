"""Offload planning: what the machine has, what each model needs, and -ngl / -ngld for the pair.

Everything is computed from GGUF headers (tensor shapes and types), so a plan can be made before a
model is downloaded: for a registry entry not on disk, the header is read over an HTTP range request.

The memory model, per model and context (n_ctx, n_ubatch), F16 KV cache, no flash attention:
- weights: each tensor's bytes; layer i's tensors go to the GPU when i < ngl, the output matrix when
  ngl > n_layer; the token embedding always stays in host memory (llama.cpp keeps the input layer there).
- KV cache: n_ctx * (n_embd_k_gqa + n_embd_v_gqa) * 2 bytes per layer, where the layer lives.
- compute buffer: the largest set of live activations in llama.cpp's reserve graph, for one ubatch:
  either the output (logits: n_ubatch * n_vocab floats, plus two hidden states) or the attention
  (KQ: n_ubatch * n_ctx * n_head floats, the F32 mask, the FFN and Q/K/V activations). Checked
  against llama.cpp's own buffer sizes in tests/test_plan.py.
"""
from __future__ import annotations

import functools
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import GgufspecError

MiB = 1 << 20
GiB = 1 << 30
KV_BYTES = 2                  # F16 cache
GPU_OVERHEAD = 512 * MiB      # CUDA/Metal context, cuBLAS workspace: measured 300-500 MiB, rounded up
MARGIN = 0.05                 # of the device budget, kept free
DEFAULT_ACCEPTANCE = 0.7      # for predicting a speculative plan's speed before it has run
GPU_BANDWIDTH_GBS = {         # memory bandwidth, GB/s (vendor figures)
    "H200": 4800, "H100": 3350, "A100": 2039, "L40S": 864, "A6000": 768, "A10": 600,
    "RTX 5090": 1792, "RTX 4090": 1008, "RTX 4080": 717, "RTX 4070": 504, "RTX 3090": 936,
    "RTX 3080": 760, "RTX 3060": 360, "T4": 320, "V100": 900,
    "M1": 68, "M1 Pro": 200, "M1 Max": 400, "M1 Ultra": 800, "M2": 100, "M2 Pro": 200, "M2 Max": 400,
    "M2 Ultra": 800, "M3": 100, "M3 Pro": 150, "M3 Max": 400, "M4": 120, "M4 Pro": 273, "M4 Max": 546,
}
DEFAULT_GPU_BANDWIDTH_GBS = 300
DEFAULT_RAM_BANDWIDTH_GBS = 40  # when a measurement fails


class PlanError(GgufspecError):
    pass


# ---------------------------------------------------------------- model shapes from GGUF headers

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

    @property
    def weight_bytes(self) -> int:
        return sum(self.layer_bytes) + self.embd_bytes + self.output_bytes + self.other_bytes

    def kv_bytes(self, n_ctx: int, n_layers: int | None = None) -> int:
        n = self.n_layer if n_layers is None else n_layers
        return n * n_ctx * (self.n_embd_k_gqa + self.n_embd_v_gqa) * KV_BYTES

    def compute_bytes(self, n_ctx: int, n_ubatch: int = 512) -> int:
        n_ub = min(n_ubatch, n_ctx)
        output = 4 * n_ub * (self.n_vocab + 2 * self.n_embd)
        attention = 4 * n_ub * (n_ctx * (self.n_head + 1) + self.n_ff + 3 * self.n_embd + self.n_embd_k_gqa
                                + self.n_embd_v_gqa)
        return max(output, attention)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def shape_from_reader(reader, name: str) -> ModelShape:
    arch = _field(reader, "general.architecture")
    if not arch:
        raise PlanError(f"{name}: no general.architecture in the GGUF header")
    get = lambda key, default=None: _field(reader, f"{arch}.{key}", default)
    n_layer = get("block_count")
    if n_layer is None:
        raise PlanError(f"{name}: no {arch}.block_count in the GGUF header")
    layers = [0] * n_layer
    embd = output = other = 0
    unknown = False
    for t in reader.tensors:
        size = int(t.n_bytes)
        if m := re.match(r"blk\.(\d+)\.", t.name):
            layers[int(m[1])] += size
        elif t.name.startswith("token_embd."):
            embd += size
        elif t.name.startswith(("output.", "output_norm.")):
            output += size
        else:
            other += size
    if not any(t.name.startswith("output.") for t in reader.tensors):
        output += embd  # tied embeddings: the GPU gets its own copy of the matrix for the output layer
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens.data) if tokens is not None else get("vocab_size", 0)
    n_embd, n_head = get("embedding_length"), get("attention.head_count")
    if n_embd is None or not n_head:
        warnings.warn(f"{name}: architecture {arch!r} lacks the usual shape keys; sizing from tensors alone")
        return ModelShape(name, arch, n_layer, n_embd or 0, 1, 1, 0, 0, 0, n_vocab, layers, embd, output, other)
    n_head = max(n_head) if isinstance(n_head, list) else n_head  # per-layer lists in some archs
    n_head_kv = get("attention.head_count_kv", n_head)
    n_head_kv = max(n_head_kv) if isinstance(n_head_kv, list) else n_head_kv
    key_len = get("attention.key_length", n_embd // n_head)
    value_len = get("attention.value_length", key_len)
    n_ff = get("feed_forward_length", 4 * n_embd)
    n_ff = max(n_ff) if isinstance(n_ff, list) else n_ff
    return ModelShape(name, arch, n_layer, n_embd, n_head, n_head_kv, n_head_kv * key_len,
                      n_head_kv * value_len, n_ff, n_vocab, layers, embd, output, other)


def read_shape(path: str | os.PathLike, name: str | None = None) -> ModelShape:
    """A local GGUF file's shape (the gguf package reads the header; the tensor data is not touched)."""
    from gguf import GGUFReader
    name = name or Path(path).name
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, OSError, KeyError) as exc:
        raise PlanError(f"{name}: cannot read the GGUF header ({exc}); the file may be truncated") from None
    return shape_from_reader(reader, name)


def read_remote_shape(url: str, size: int, name: str, first_bytes: int = 8 * MiB) -> ModelShape:
    """The header of a hub file, without downloading the file: a range request for its first bytes,
    placed in a sparse file of the full size so the gguf package's reader can parse it as usual."""
    from huggingface_hub.utils import build_hf_headers, http_backoff
    while True:
        response = http_backoff("GET", url, headers={**build_hf_headers(), "Range": f"bytes=0-{first_bytes - 1}"})
        response.raise_for_status()
        with tempfile.NamedTemporaryFile(suffix=".gguf") as sparse:
            sparse.write(response.content)
            sparse.truncate(size)
            sparse.flush()
            try:
                return read_shape(sparse.name, name)
            except PlanError:
                if first_bytes >= min(size, 256 * MiB):
                    raise
        first_bytes *= 4  # a header bigger than we asked for (large vocabularies): ask for more


# ---------------------------------------------------------------- devices

@dataclass
class Device:
    kind: str            # cuda | metal | rocm | cpu
    name: str
    total: int           # bytes
    free: int            # bytes usable now
    bandwidth_gbs: float


def bandwidth_for(name: str) -> float:
    best = None
    for key, gbs in GPU_BANDWIDTH_GBS.items():
        if key.lower() in name.lower() and (best is None or len(key) > len(best[0])):
            best = (key, gbs)
    return best[1] if best else DEFAULT_GPU_BANDWIDTH_GBS


def parse_nvidia_smi(text: str) -> list[Device]:
    """`nvidia-smi --query-gpu=name,memory.total,memory.free --format=csv,noheader,nounits` (MiB)."""
    devices = []
    for line in text.strip().splitlines():
        name, total, free = [part.strip() for part in line.rsplit(",", 2)]
        devices.append(Device("cuda", name, int(float(total)) * MiB, int(float(free)) * MiB, bandwidth_for(name)))
    return devices


def parse_apple_sysctl(memsize: str, wired_limit_mb: str | None, chip: str = "Apple") -> Device:
    """Metal can wire `iogpu.wired_limit_mb` when set (non-zero), else the default working set:
    about 2/3 of unified memory up to 36 GB, 3/4 above (recommendedMaxWorkingSetSize)."""
    total = int(memsize)
    limit = int(wired_limit_mb or 0) * MiB
    if not limit:
        limit = int(total * (0.75 if total > 36 * 10**9 else 2 / 3))
    return Device("metal", chip, total, limit, bandwidth_for(chip))


def parse_rocm_smi(text: str) -> list[Device]:
    """`rocm-smi --showmeminfo vram --showproductname --json`."""
    devices = []
    for card, info in json.loads(text).items():
        total = int(info.get("VRAM Total Memory (B)", 0))
        used = int(info.get("VRAM Total Used Memory (B)", 0))
        name = info.get("Card Series") or info.get("Card series") or card
        devices.append(Device("rocm", name, total, total - used, DEFAULT_GPU_BANDWIDTH_GBS))
    return devices


def _nvml_devices() -> list[Device]:
    import pynvml
    pynvml.nvmlInit()
    try:
        devices = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            devices.append(Device("cuda", name, int(mem.total), int(mem.free), bandwidth_for(name)))
        return devices
    finally:
        pynvml.nvmlShutdown()


def _run(cmd: list[str]) -> str | None:
    if not shutil.which(cmd[0]):
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return None


def detect_gpus() -> list[Device]:
    """NVIDIA (NVML, else nvidia-smi), Apple Silicon (sysctl), AMD (rocm-smi); [] when none answers."""
    try:
        return _nvml_devices()
    except Exception:  # no driver, no library: try the next source
        pass
    if out := _run(["nvidia-smi", "--query-gpu=name,memory.total,memory.free", "--format=csv,noheader,nounits"]):
        return parse_nvidia_smi(out)
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        memsize = _run(["sysctl", "-n", "hw.memsize"])
        if memsize:
            chip = (_run(["sysctl", "-n", "machdep.cpu.brand_string"]) or "Apple").strip()
            return [parse_apple_sysctl(memsize, _run(["sysctl", "-n", "iogpu.wired_limit_mb"]), chip)]
    if out := _run(["rocm-smi", "--showmeminfo", "vram", "--showproductname", "--json"]):
        try:
            return parse_rocm_smi(out)
        except (ValueError, AttributeError):
            return []
    return []


def detect_ram() -> Device:
    import psutil
    mem = psutil.virtual_memory()
    return Device("cpu", "system RAM", mem.total, mem.available, measure_ram_bandwidth())


@functools.lru_cache(maxsize=1)
def measure_ram_bandwidth(size: int = 64 * MiB) -> float:
    """GB/s of a large memory copy (read + write counted), best of three: what decoding on the CPU
    can stream weights at, give or take the kernels' efficiency."""
    import time

    import numpy as np
    src = np.ones(size // 8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * size / best / 1e9 if best > 0 else DEFAULT_RAM_BANDWIDTH_GBS


def gpu_offload_supported() -> bool:
    import llama_cpp
    return bool(llama_cpp.llama_supports_gpu_offload())


def parse_size(text: str) -> int:
    """'24GiB', '24 GB', '8192MiB', '16g' -> bytes."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]?)(i?)b?\s*", text.lower())
    if not m:
        raise PlanError(f"cannot read the size {text!r}: write it like 24GiB, 16GB or 8192MiB")
    number, unit, binary = float(m[1]), m[2], m[3]
    base = 1024 if binary or unit == "" else 1000
    return int(number * base ** " kmgt".index(unit or " ")) if unit else int(number)


# ---------------------------------------------------------------- the plan

@dataclass
class Placement:
    n_gpu_layers: int        # llama.cpp's -ngl: n_layer + 1 puts the output layer there too
    gpu_bytes: int
    cpu_bytes: int
    weights_gpu: int
    kv_gpu: int
    compute_gpu: int


def placement(shape: ModelShape, ngl: int, n_ctx: int) -> Placement:
    ngl = max(0, min(ngl, shape.n_layer + 1))
    layers_on_gpu = min(ngl, shape.n_layer)
    weights_gpu = sum(shape.layer_bytes[shape.n_layer - layers_on_gpu:])  # llama.cpp offloads the last layers
    if ngl > shape.n_layer:
        weights_gpu += shape.output_bytes
    kv_gpu = shape.kv_bytes(n_ctx, layers_on_gpu)
    compute = shape.compute_bytes(n_ctx)
    compute_gpu = compute if ngl > 0 else 0
    gpu = weights_gpu + kv_gpu + compute_gpu
    cpu = shape.weight_bytes - weights_gpu + shape.kv_bytes(n_ctx) - kv_gpu + (compute if ngl == 0 else compute // 8)
    return Placement(ngl, gpu, cpu, weights_gpu, kv_gpu, compute_gpu)


def token_seconds(shape: ModelShape, p: Placement, gpu: Device | None, ram: Device) -> float:
    """Memory-bound decode: every weight byte read once per token, on the device that holds it."""
    cpu_weights = shape.weight_bytes - shape.embd_bytes - p.weights_gpu
    seconds = cpu_weights / (ram.bandwidth_gbs * 1e9)
    if gpu is not None:
        seconds += p.weights_gpu / (gpu.bandwidth_gbs * 1e9)
    return seconds


@dataclass
class Plan:
    n_ctx: int
    target: Placement
    draft: Placement | None
    n_draft: int
    predicted_tps: float
    predicted_target_alone_tps: float
    reason: str
    gpu: Device | None
    ram: Device
    budget: int = 0
    alternatives: list[dict] = field(default_factory=list)

    def summary(self) -> str:
        draft = "no draft" if self.draft is None else f"-ngld {self.draft.n_gpu_layers}"
        return (f"plan: -ngl {self.target.n_gpu_layers} {draft} -c {self.n_ctx} "
                f"(predicted {self.predicted_tps:.1f} tok/s vs {self.predicted_target_alone_tps:.1f} alone): {self.reason}")

    def to_dict(self) -> dict:
        return asdict(self)


def _speculative_tps(t_target: float, t_draft: float, k: int, acceptance: float) -> float:
    """Leviathan et al.: a step drafts k tokens and verifies them in one target pass (memory-bound:
    about one token's cost) and yields (1 - a^(k+1)) / (1 - a) tokens on average."""
    expected = (1 - acceptance ** (k + 1)) / (1 - acceptance) if acceptance < 1 else k + 1
    return expected / (k * t_draft + t_target)


def _max_layers(shape: ModelShape, n_ctx: int, budget: int) -> int:
    best = 0
    for ngl in range(shape.n_layer + 2):
        if placement(shape, ngl, n_ctx).gpu_bytes <= budget:
            best = ngl
    return best


def make_plan(target: ModelShape, draft: ModelShape | None, *, gpu: Device | None, ram: Device,
              n_ctx: int = 4096, ctx_given: bool = False, n_draft: int = 3,
              acceptance: float = DEFAULT_ACCEPTANCE) -> Plan:
    """Draft fully on the GPU first, then as many target layers as fit; compare the options by
    predicted speed and keep the fastest. Shrinks the context only when the user did not set -c."""
    budget = 0 if gpu is None else int(gpu.free * (1 - MARGIN)) - GPU_OVERHEAD
    contexts = [n_ctx] if ctx_given else [c for c in (n_ctx, n_ctx // 2, n_ctx // 4) if c >= 1024] or [n_ctx]
    options = []
    for ctx in contexts:
        alone = placement(target, _max_layers(target, ctx, budget), ctx)
        t_alone = token_seconds(target, alone, gpu, ram)
        options.append(("target alone", ctx, alone, None, 1 / t_alone, t_alone))
        if draft is None:
            continue
        for draft_ngl in {draft.n_layer + 1, 0} if budget > 0 else {0}:
            d = placement(draft, draft_ngl, ctx)
            if d.gpu_bytes > budget:
                continue
            t = placement(target, _max_layers(target, ctx, budget - d.gpu_bytes), ctx)
            tps = _speculative_tps(token_seconds(target, t, gpu, ram), token_seconds(draft, d, gpu, ram),
                                   n_draft, acceptance)
            where = "draft on the GPU" if draft_ngl else "draft on the CPU"
            options.append((where, ctx, t, d, tps, t_alone))
        if not ctx_given and any(o[3] is not None and o[3].n_gpu_layers == draft.n_layer + 1 and o[1] == ctx
                                 for o in options if draft is not None):
            break  # the draft fits whole at this context: no need to shrink it further
    fits = [o for o in options if o[2].cpu_bytes <= ram.free or o is options[0]]
    best = max(fits, key=lambda o: (o[4], o[1]))
    name, ctx, t, d, tps, t_alone = best
    reason = _reason(name, target, t, d, draft, gpu, budget, ctx, n_ctx)
    plan = Plan(ctx, t, d, n_draft, tps, 1 / t_alone, reason, gpu, ram, budget,
                [{"option": o[0], "n_ctx": o[1], "ngl": o[2].n_gpu_layers,
                  "ngld": None if o[3] is None else o[3].n_gpu_layers, "predicted_tps": o[4]} for o in options])
    if draft is not None and gpu is not None and placement(draft, draft.n_layer + 1, ctx).gpu_bytes > budget:
        plan.reason += (f"; the draft needs {placement(draft, draft.n_layer + 1, ctx).gpu_bytes / GiB:.1f} GiB on the GPU "
                        f"but only {max(budget, 0) / GiB:.1f} GiB is usable: use a smaller -c, keep the draft on "
                        f"the CPU (-ngld 0), or run without a draft (--no-draft)")
    return plan


def _reason(name, target, t, d, draft, gpu, budget, ctx, asked_ctx) -> str:
    if gpu is None or budget <= 0:
        return f"no usable GPU: everything on the CPU ({name})"
    parts = [f"{name}"]
    parts.append(f"{min(t.n_gpu_layers, target.n_layer)}/{target.n_layer} target layers on {gpu.name}"
                 + (" with the output layer" if t.n_gpu_layers > target.n_layer else ""))
    if d is not None and draft is not None:
        parts.append(f"draft {'whole on the GPU' if d.n_gpu_layers > draft.n_layer else f'{d.n_gpu_layers} layers on the GPU'}")
    if ctx != asked_ctx:
        parts.append(f"context shrunk from {asked_ctx} to {ctx} to fit")
    return ", ".join(parts)


def plan_table(plan: Plan, target: ModelShape, draft: ModelShape | None) -> str:
    rows = [("model", "-ngl", "weights GPU", "KV GPU", "compute GPU", "GPU total", "host total")]
    for shape, p in ((target, plan.target), (draft, plan.draft)):
        if shape is None or p is None:
            continue
        rows.append((shape.name, str(p.n_gpu_layers), *(f"{v / MiB:.0f} MiB" for v in
                     (p.weights_gpu, p.kv_gpu, p.compute_gpu, p.gpu_bytes, p.cpu_bytes))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    gpu = plan.gpu
    if gpu is not None:
        used = plan.target.gpu_bytes + (plan.draft.gpu_bytes if plan.draft else 0)
        lines.append(f"\n{gpu.name}: {gpu.free / MiB:.0f} MiB free, budget {plan.budget / MiB:.0f} MiB "
                     f"(margin {MARGIN:.0%} + {GPU_OVERHEAD / MiB:.0f} MiB overhead), planned {used / MiB:.0f} MiB")
    lines.append(f"{plan.ram.name}: {plan.ram.free / MiB:.0f} MiB available")
    return "\n".join(lines)
