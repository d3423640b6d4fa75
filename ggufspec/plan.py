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

import ctypes
import functools
import importlib.util
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
# The speed model (token_seconds) is an estimate, fitted to measured decode speeds:
# - GPU: llama-bench tg on an H100 (3350 GB/s), Q4_K_M, 0.5B / 1.5B / 7B (24 / 28 / 28 layers, 0.39 /
#   0.98 / 4.4 GB read per token): 811 / 543 / 269 tok/s. Small models there are bound by kernel
#   launches, not bandwidth: a fixed 45 us per layer per token, and 55% of the vendor's bandwidth for
#   the bytes, reproduce all three within 5% (773 / 558 / 275).
# - CPU: the measured copy bandwidth as is, and 20 us per layer (thread synchronisation: tiny models
#   with 2 to 24 layers, 15-18 us a layer at 1 and 2 threads on a 2-core EPYC). The demo pair there:
#   1.5B target 39 ms/token (estimate 50), 0.5B draft 23 ms (estimate 20).
GPU_LAYER_SECONDS = 45e-6
GPU_BANDWIDTH_EFFICIENCY = 0.55
CPU_LAYER_SECONDS = 20e-6
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
    n_ctx_train: int = 0       # the context length it was trained for (0: not in the header)

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


def _shape_from_header(kv, tensors: list[tuple[str, int]], n_tokens: int | None, name: str) -> ModelShape:
    """kv: key -> value for the keys the planner needs; tensors: (name, bytes); n_tokens: the
    tokenizer's vocabulary length (None when the file has no token list)."""
    arch = kv("general.architecture")
    if not arch:
        raise PlanError(f"{name}: no general.architecture in the GGUF header")
    get = lambda key, default=None: kv(f"{arch}.{key}", default)
    n_layer = get("block_count")
    if n_layer is None:
        raise PlanError(f"{name}: no {arch}.block_count in the GGUF header")
    layers = [0] * n_layer
    embd = output = other = 0
    for tensor_name, size in tensors:
        if m := re.match(r"blk\.(\d+)\.", tensor_name):
            layers[int(m[1])] += size
        elif tensor_name.startswith("token_embd."):
            embd += size
        elif tensor_name.startswith(("output.", "output_norm.")):
            output += size
        else:
            other += size
    if not any(t.startswith("output.") for t, _ in tensors):
        output += embd  # tied embeddings: the GPU gets its own copy of the matrix for the output layer
    n_vocab = n_tokens if n_tokens is not None else get("vocab_size", 0)
    n_embd, n_head = get("embedding_length"), get("attention.head_count")
    n_ctx_train = get("context_length", 0) or 0
    if n_embd is None or not n_head:
        warnings.warn(f"{name}: architecture {arch!r} lacks the usual shape keys; sizing from tensors alone")
        return ModelShape(name, arch, n_layer, n_embd or 0, 1, 1, 0, 0, 0, n_vocab, layers, embd, output, other,
                          n_ctx_train)
    n_head = max(n_head) if isinstance(n_head, list) else n_head  # per-layer lists in some archs
    n_head_kv = get("attention.head_count_kv", n_head)
    n_head_kv = max(n_head_kv) if isinstance(n_head_kv, list) else n_head_kv
    key_len = get("attention.key_length", n_embd // n_head)
    value_len = get("attention.value_length", key_len)
    n_ff = get("feed_forward_length", 4 * n_embd)
    n_ff = max(n_ff) if isinstance(n_ff, list) else n_ff
    return ModelShape(name, arch, n_layer, n_embd, n_head, n_head_kv, n_head_kv * key_len,
                      n_head_kv * value_len, n_ff, n_vocab, layers, embd, output, other, n_ctx_train)


def shape_from_reader(reader, name: str) -> ModelShape:
    """The same from the gguf package's GGUFReader (slow on big vocabularies: the fallback only)."""
    def kv(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return _shape_from_header(kv, [(t.name, int(t.n_bytes)) for t in reader.tensors],
                              None if tokens is None else len(tokens.data), name)


# ggml's own GGUF reader (libggml-base, shipped with llama-cpp-python), through ctypes. It parses the
# header in C++ in tens of milliseconds where GGUFReader spends seconds in Python building an object
# per vocabulary entry; no tensor data is read (no_alloc, no ggml context).

class _GGUFInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


_LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_SCALARS = {  # gguf_type -> (getter suffix, ctypes type)
    0: ("u8", ctypes.c_uint8), 1: ("i8", ctypes.c_int8), 2: ("u16", ctypes.c_uint16), 3: ("i16", ctypes.c_int16),
    4: ("u32", ctypes.c_uint32), 5: ("i32", ctypes.c_int32), 6: ("f32", ctypes.c_float), 7: ("bool", ctypes.c_bool),
    10: ("u64", ctypes.c_uint64), 11: ("i64", ctypes.c_int64), 12: ("f64", ctypes.c_double)}


def llama_cpp_lib_dir() -> Path | None:
    """Where llama-cpp-python keeps its shared libraries ($LLAMA_CPP_LIB_PATH, as llama_cpp itself
    honours), found without importing llama_cpp."""
    if os.environ.get("LLAMA_CPP_LIB_PATH"):
        return Path(os.environ["LLAMA_CPP_LIB_PATH"])
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


def _find_lib(stem: str) -> Path | None:
    folder = llama_cpp_lib_dir()
    if folder is None:
        return None
    for name in (f"lib{stem}.so", f"lib{stem}.dylib", f"{stem}.dll", f"lib{stem}.dll"):
        if (folder / name).is_file():
            return folder / name
    return None


@functools.lru_cache(maxsize=None)
def _ggml_base():
    """libggml-base with the gguf functions typed, or None where it cannot be loaded."""
    path = _find_lib("ggml-base")
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None
    ctx, i64, c_char_p = ctypes.c_void_p, ctypes.c_int64, ctypes.c_char_p
    signatures = {
        "gguf_init_from_file": ([c_char_p, _GGUFInitParams], ctx), "gguf_free": ([ctx], None),
        "gguf_init_from_buffer": ([ctypes.c_void_p, ctypes.c_size_t, _GGUFInitParams], ctx),
        "gguf_find_key": ([ctx, c_char_p], i64), "gguf_get_kv_type": ([ctx, i64], ctypes.c_int),
        "gguf_get_arr_type": ([ctx, i64], ctypes.c_int), "gguf_get_arr_n": ([ctx, i64], ctypes.c_size_t),
        "gguf_get_arr_data": ([ctx, i64], ctypes.c_void_p), "gguf_get_val_str": ([ctx, i64], c_char_p),
        "gguf_get_n_tensors": ([ctx], i64), "gguf_get_tensor_name": ([ctx, i64], c_char_p),
        "gguf_get_tensor_type": ([ctx, i64], ctypes.c_int), "gguf_get_tensor_size": ([ctx, i64], ctypes.c_size_t),
        "ggml_log_get": ([ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)], None),
        "ggml_log_set": ([ctypes.c_void_p, ctypes.c_void_p], None),
        **{f"gguf_get_val_{suffix}": ([ctx, i64], ctype) for suffix, ctype in _GGUF_SCALARS.values()}}
    try:
        for fn, (argtypes, restype) in signatures.items():
            getattr(lib, fn).argtypes, getattr(lib, fn).restype = argtypes, restype
    except AttributeError:  # an older or newer libggml without one of these: use the gguf package
        return None
    return lib


class _GGMLHeader:
    """An open gguf_context, from a file or from a file's first bytes (a header that ends inside
    them reads whole; one cut short fails, never reads past them): values by key, the token
    list's length, tensor (name, bytes)."""

    def __init__(self, lib, path: str | None = None, data: bytes | None = None):
        self.lib = lib
        errors: list[str] = []
        # ggml logs its reasons for refusing a file; catch them for our own error message
        callback = _LOG_CALLBACK(lambda level, text, _: errors.append(text.decode(errors="replace").strip()))
        saved_cb, saved_data = ctypes.c_void_p(), ctypes.c_void_p()
        lib.ggml_log_get(ctypes.byref(saved_cb), ctypes.byref(saved_data))
        lib.ggml_log_set(ctypes.cast(callback, ctypes.c_void_p), None)
        try:
            params = _GGUFInitParams(True, None)  # no_alloc, no ggml context: the header only
            self.ctx = (lib.gguf_init_from_file(os.fsencode(path), params) if data is None
                        else lib.gguf_init_from_buffer(data, len(data), params))
        finally:
            lib.ggml_log_set(saved_cb, saved_data)
        if not self.ctx:
            raise PlanError(errors[-1] if errors else "not a GGUF file")

    def close(self):
        if self.ctx:
            self.lib.gguf_free(self.ctx)
            self.ctx = None

    def value(self, key: str, default=None):
        lib, ctx = self.lib, self.ctx
        kid = lib.gguf_find_key(ctx, key.encode())
        if kid < 0:
            return default
        kind = lib.gguf_get_kv_type(ctx, kid)
        if kind == _GGUF_STRING:
            return lib.gguf_get_val_str(ctx, kid).decode(errors="replace")
        if kind in _GGUF_SCALARS:
            return getattr(lib, f"gguf_get_val_{_GGUF_SCALARS[kind][0]}")(ctx, kid)
        if kind == _GGUF_ARRAY and lib.gguf_get_arr_type(ctx, kid) in _GGUF_SCALARS:  # per-layer lists
            ctype = _GGUF_SCALARS[lib.gguf_get_arr_type(ctx, kid)][1]
            n = lib.gguf_get_arr_n(ctx, kid)
            return list((ctype * n).from_address(lib.gguf_get_arr_data(ctx, kid))) if n else []
        return default

    def array_length(self, key: str) -> int | None:
        kid = self.lib.gguf_find_key(self.ctx, key.encode())
        if kid < 0 or self.lib.gguf_get_kv_type(self.ctx, kid) != _GGUF_ARRAY:
            return None
        return self.lib.gguf_get_arr_n(self.ctx, kid)

    def tensors(self) -> list[tuple[str, int]]:
        lib, ctx = self.lib, self.ctx
        return [(lib.gguf_get_tensor_name(ctx, i).decode(errors="replace"), lib.gguf_get_tensor_size(ctx, i))
                for i in range(lib.gguf_get_n_tensors(ctx))]


def _read_shape_uncached(path: str | None, name: str, data: bytes | None = None) -> ModelShape:
    lib = _ggml_base()
    if lib is None:
        return _read_shape_with_gguf_package(path, name)
    try:
        header = _GGMLHeader(lib, path, data)
    except PlanError as exc:
        raise PlanError(f"{name}: cannot read the GGUF header ({exc}); the file may be truncated") from None
    try:
        return _shape_from_header(header.value, header.tensors(), header.array_length("tokenizer.ggml.tokens"), name)
    finally:
        header.close()


def _read_shape_with_gguf_package(path: str, name: str) -> ModelShape:
    from gguf import GGUFReader
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, OSError, KeyError) as exc:
        raise PlanError(f"{name}: cannot read the GGUF header ({exc}); the file may be truncated") from None
    return shape_from_reader(reader, name)


# Shapes are remembered per file (GGUFSPEC_HOME/shapes.json): a second plan reads no header at all.
SHAPES_KEPT = 64


def _shapes_file() -> Path:
    from .home import home
    return home() / "shapes.json"


def _load_shapes() -> dict:
    try:
        data = json.loads(_shapes_file().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # none yet, or damaged: it only costs a header read


def _remember_shape(key: str, shape: ModelShape) -> None:
    data = _load_shapes()
    data.pop(key, None)
    data[key] = {k: v for k, v in asdict(shape).items() if k != "name"}
    data = dict(list(data.items())[-SHAPES_KEPT:])  # the most recently read files
    from .home import write_json
    write_json(_shapes_file().name, data)


def _cached_shape(key: str, name: str, read) -> ModelShape:
    known = _load_shapes().get(key)
    if known is not None:
        try:
            return ModelShape(name=name, **known)
        except TypeError:  # written by another version of ModelShape: read the header again
            pass
    shape = read()
    _remember_shape(key, shape)
    return shape


def read_shape(path: str | os.PathLike, name: str | None = None) -> ModelShape:
    """A local GGUF file's shape from its header (the tensor data is not touched), remembered per
    file by its absolute path, size and modification time."""
    name = name or Path(path).name
    try:
        stat = os.stat(path)
    except OSError as exc:
        raise PlanError(f"{name}: cannot read the GGUF header ({exc.strerror})") from None
    key = f"{os.path.abspath(os.fspath(path))}|{stat.st_size}|{stat.st_mtime_ns}"
    return _cached_shape(key, name, lambda: _read_shape_uncached(os.fspath(path), name))


def read_remote_shape(url: str, size: int, name: str, first_bytes: int = 8 * MiB) -> ModelShape:
    """The header of a hub file, without downloading the file: a range request for its first bytes,
    parsed by ggml's reader from memory (without it: placed in a sparse file of the full size for the
    gguf package's reader). Remembered per URL and size."""
    return _cached_shape(f"{url}|{size}", name, lambda: _read_remote_shape(url, size, name, first_bytes))


def _read_remote_shape(url: str, size: int, name: str, first_bytes: int) -> ModelShape:
    from huggingface_hub.utils import build_hf_headers, http_backoff
    while True:
        response = http_backoff("GET", url, headers={**build_hf_headers(), "Range": f"bytes=0-{first_bytes - 1}"})
        response.raise_for_status()
        if _ggml_base() is not None:
            try:
                return _read_shape_uncached(None, name, data=response.content)
            except PlanError:
                if first_bytes >= min(size, 256 * MiB):
                    raise
            first_bytes *= 4  # a header bigger than we asked for (large vocabularies): ask for more
            continue
        with tempfile.NamedTemporaryFile(suffix=".gguf") as sparse:  # the gguf package reads files only
            sparse.write(response.content)
            sparse.truncate(size)
            sparse.flush()
            try:
                return _read_shape_uncached(sparse.name, name)
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


# ggml's backend names (registry name or library file stem) -> what a user calls them
_BACKEND_NAMES = {"cpu": "CPU", "cuda": "CUDA", "hip": "ROCm", "rocm": "ROCm", "musa": "MUSA", "mtl": "Metal",
                  "metal": "Metal", "vulkan": "Vulkan", "sycl": "SYCL", "opencl": "OpenCL", "blas": "BLAS",
                  "rpc": "RPC", "cann": "CANN", "webgpu": "WebGPU", "zdnn": "zDNN"}


@functools.lru_cache(maxsize=1)
def build_backends() -> list[str]:
    """The ggml backends the installed llama-cpp-python build has, e.g. ['CUDA', 'RPC', 'CPU']: ggml's
    own backend registry (libggml, through ctypes), plus any backend library beside it that the
    registry has not loaded (builds with dynamically loaded backends)."""
    names: list[str] = []
    lib_path = _find_lib("ggml")
    if lib_path is not None:
        try:
            lib = ctypes.CDLL(str(lib_path))
            lib.ggml_backend_reg_count.restype = ctypes.c_size_t
            lib.ggml_backend_reg_get.argtypes, lib.ggml_backend_reg_get.restype = [ctypes.c_size_t], ctypes.c_void_p
            lib.ggml_backend_reg_name.argtypes, lib.ggml_backend_reg_name.restype = [ctypes.c_void_p], ctypes.c_char_p
            for i in range(lib.ggml_backend_reg_count()):
                names.append(lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i)).decode())
        except (OSError, AttributeError):
            pass  # not loadable here: the library files still say what was built
    folder = llama_cpp_lib_dir()
    if folder is not None and folder.is_dir():
        for file in sorted(folder.iterdir()):
            if m := re.fullmatch(r"(?:lib)?ggml-(\w+)\.(?:so|dylib|dll)", file.name):
                if m[1] not in ("base",):
                    names.append(m[1])
    pretty = [_BACKEND_NAMES.get(n.lower(), n) for n in names]
    return list(dict.fromkeys(pretty))


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
    """An estimate of one decoded token's time: every weight byte read once, on the device that holds
    it, at the share of its bandwidth that decode kernels reach, plus a fixed cost per layer (kernel
    launches and synchronisation: what bounds small models on a GPU, see GPU_LAYER_SECONDS)."""
    gpu_layers = min(p.n_gpu_layers, shape.n_layer) if gpu is not None else 0
    cpu_weights = shape.weight_bytes - shape.embd_bytes - p.weights_gpu
    seconds = cpu_weights / (ram.bandwidth_gbs * 1e9) + (shape.n_layer - gpu_layers) * CPU_LAYER_SECONDS
    if gpu is not None:
        seconds += (p.weights_gpu / (gpu.bandwidth_gbs * GPU_BANDWIDTH_EFFICIENCY * 1e9)
                    + gpu_layers * GPU_LAYER_SECONDS)
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
                f"(estimated {self.predicted_tps:.1f} tok/s vs {self.predicted_target_alone_tps:.1f} alone): {self.reason}")

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
    lines.append(f"llama-cpp-python build: {', '.join(build_backends()) or 'unknown'}")
    return "\n".join(lines)


# ---------------------------------------------------------------- the target across RPC workers

@dataclass
class HostShare:
    host: str          # the worker's HOST:PORT, or "CPU" for this machine
    blocks: int        # target blocks it holds (repeating layers; the output layer counts as one)
    bytes: int         # their weights and KV cache
    free: int = 0      # the memory it offered
    rtt_ms: float = 0.0


def _block_bytes(shape: ModelShape, n_ctx: int) -> list[int]:
    """Weights + KV cache of each block as llama.cpp offloads them: the layers, then the output layer."""
    kv_per_layer = shape.kv_bytes(n_ctx, 1)
    return [b + kv_per_layer for b in shape.layer_bytes] + [shape.output_bytes]


def split_across_hosts(shape: ModelShape, n_ctx: int, hosts: list[tuple[str, int]],
                       rtt_ms: dict[str, float] | None = None) -> tuple[list[HostShare], int]:
    """Share the target's blocks among RPC workers, in the --rpc order, as llama.cpp places them:
    the last n_gpu_layers blocks are offloaded, the first of those to the first worker. The most
    blocks that fit (each worker's free memory, less the margin and a compute buffer) wins; what is
    left stays on this machine's CPU. Returns the shares (CPU first) and n_gpu_layers."""
    sizes = _block_bytes(shape, n_ctx)
    budgets = [int(free * (1 - MARGIN)) - shape.compute_bytes(n_ctx) for _, free in hosts]
    for n_offloaded in range(len(sizes), -1, -1):
        counts, used, host, fits = [0] * len(hosts), [0] * len(hosts), 0, True
        for size in sizes[len(sizes) - n_offloaded:]:
            while host < len(hosts) and used[host] + size > budgets[host]:
                host += 1
            if host == len(hosts):
                fits = False
                break
            counts[host] += 1
            used[host] += size
        if fits:
            break
    local = len(sizes) - n_offloaded
    shares = [HostShare("CPU", local, sum(sizes[:local]))]
    shares += [HostShare(name, counts[i], used[i], free, (rtt_ms or {}).get(name, 0.0))
               for i, (name, free) in enumerate(hosts)]
    return shares, n_offloaded


def rpc_token_seconds(shape: ModelShape, shares: list[HostShare], ram: Device,
                      worker_bandwidth_gbs: float = DEFAULT_RAM_BANDWIDTH_GBS) -> float:
    """An estimate of one target token across hosts: each host reads its blocks' weights and pays
    its layers' fixed cost; each worker adds a network round trip (ggml-rpc synchronises per graph)."""
    seconds = 0.0
    for share in shares:
        bandwidth = ram.bandwidth_gbs if share.host == "CPU" else worker_bandwidth_gbs
        seconds += share.bytes / (bandwidth * 1e9) + share.blocks * CPU_LAYER_SECONDS
        if share.host != "CPU" and share.blocks:
            seconds += share.rtt_ms / 1e3
    return seconds


def parse_host_sizes(items) -> dict[str, int]:
    """--rpc-mem HOST:PORT=SIZE (repeatable): memory to plan with instead of asking the worker."""
    sizes = {}
    for item in items or ():
        host, sep, size = item.partition("=")
        if not sep or not host:
            raise PlanError(f"--rpc-mem takes HOST:PORT=SIZE (e.g. 10.0.0.2:50052=24GiB), got {item!r}")
        sizes[host.strip()] = parse_size(size)
    return sizes
