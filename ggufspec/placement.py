"""Which buffer (CPU, a GPU, an RPC worker) a model's tensors go to, by name: llama.cpp's tensor buffer
type overrides (common/arg.cpp: -ot/--override-tensor PATTERN=TYPE,..., -cmoe/--cpu-moe, -ncmoe/--n-cpu-moe N,
and the draft's -otd, -cmoed, -ncmoed). The standard use: a Mixture-of-Experts model's expert tensors kept
in host memory, everything else on the GPU.

An override is a (pattern, buffer type name) pair. llama.cpp's loader tries them in order for every
tensor and the first whose regex matches anywhere in the name (std::regex_search) decides; it logs each
("tensor blk.0.ffn_up_exps.weight (0 MiB f32) buffer type overridden to CPU", at debug level: -v shows it).

And where the process runs: its CPUs and priority (-C/-Cr, --prio) and its NUMA strategy (--numa), which
llama.cpp sets on its own thread pools and ggufspec, whose llama-cpp-python attaches none, on the process.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
from dataclasses import dataclass
from typing import Sequence

import llama_cpp

from .errors import GgufspecError
from .ggufheader import local_header

# common/common.h's LLM_FFN_EXPS_REGEX: the experts' FFN tensors (ffn_up_exps, ffn_gate_up_exps, ffn_down_chexps...)
EXPERTS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
DENSE_FFN_REGEX = r"\.ffn_(up|down|gate)\."  # LLM_FFN_DENSE_REGEX: a dense model's FFN (-ncffn)
CPU = "CPU"  # the CPU device's buffer type (ggml_backend_cpu_buffer_type)
FLAGS = {"target": ("-ot", "--cpu-moe", "--n-cpu-moe"), "draft": ("-otd", "--cpu-moe-draft", "--n-cpu-moe-draft")}
# The most layers -ncmoe/-ncffn write a pattern for (plan.shape's bound on a model's block_count): a larger N
# means every layer, as in llama.cpp, without a pattern per number up to N (-ncmoe 99999999999 never ended).
MAX_LAYERS = 10_000
# one of those patterns: (its layer, its regex)
_LAYER_PATTERN = re.compile(r"blk\\\.(\d+)(" + re.escape(EXPERTS_REGEX) + "|" + re.escape(DENSE_FFN_REGEX) + ")")


def expert_overrides(cpu_moe: bool = False, n_cpu_moe: int = 0) -> tuple[tuple[str, str], ...]:
    """--n-cpu-moe N (the experts of layers 0..N-1: llm_add_n_cpu_ffn_overrides) and --cpu-moe (every
    layer's: llm_ffn_exps_cpu_override), to the CPU."""
    return _first_layers(n_cpu_moe, EXPERTS_REGEX) + (((EXPERTS_REGEX, CPU),) if cpu_moe else ())


def dense_ffn_overrides(n_cpu_ffn: int) -> tuple[tuple[str, str], ...]:
    """-ncffn N: the dense FFN weights of layers 0..N-1 to the CPU (llm_add_n_cpu_ffn_overrides)."""
    return _first_layers(n_cpu_ffn, DENSE_FFN_REGEX)


def _first_layers(n: int, regex: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"blk\\.{i}{regex}", CPU) for i in range(min(n, MAX_LAYERS)))


def within_layers(overrides: Sequence[tuple[str, str]], n_layer: int | None) -> tuple[tuple[str, str], ...]:
    """`overrides` less -ncmoe's and -ncffn's patterns for layers from `n_layer` on (None: unknown, all
    kept), which match no tensor of the model: llama.cpp compiles every pattern for every tensor it loads,
    and an N far past the model's layers cost seconds there."""
    if n_layer is None:
        return tuple(overrides)
    return tuple(o for o in overrides if not ((m := _LAYER_PATTERN.fullmatch(o[0])) and int(m[1]) >= n_layer))


def parse_override_tensor(value: str, flag: str = "-ot") -> tuple[tuple[str, str], ...]:
    """-ot's value, PATTERN=TYPE,... split as llama.cpp splits it (on every comma, then at the first '='),
    each pattern checked to compile (Python's re standing in for std::regex, which would fail the load)."""
    if not isinstance(value, str):
        raise GgufspecError(f"{flag} takes PATTERN=BUFFER_TYPE,... (e.g. {flag} 'blk\\.0\\.ffn_.*_exps\\.=CPU'), "
                            f"got {value!r}")
    overrides = []
    for item in value.split(","):
        pattern, equals, buffer_type = item.partition("=")
        if not equals:
            raise GgufspecError(f"{flag} {item!r}: give PATTERN=BUFFER_TYPE (e.g. {flag} "
                                f"'blk\\.0\\.ffn_.*_exps\\.=CPU'), several comma-separated")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise GgufspecError(f"{flag} {item!r}: {pattern!r} is no regular expression ({exc})") from None
        overrides.append((pattern, buffer_type))
    return tuple(overrides)


def tensor_overrides(override_tensor: Sequence[str] | str = (), cpu_moe: bool = False, n_cpu_moe: int = 0,
                     role: str = "target") -> tuple[tuple[str, str], ...]:
    """One model's overrides from its flags, checked. -ot's come first whatever the order they were given
    in (llama.cpp keeps the command line's, where an -ot after --cpu-moe never matches an expert): an -ot
    exception to --cpu-moe or --n-cpu-moe, e.g. one layer's experts on CUDA0, takes effect."""
    ot_flag, _, ncmoe_flag = FLAGS[role]
    if not isinstance(n_cpu_moe, int) or isinstance(n_cpu_moe, bool) or n_cpu_moe < 0:
        raise GgufspecError(f"{ncmoe_flag} must be a whole number >= 0 (the layers whose experts stay on the CPU), "
                            f"got {n_cpu_moe!r}")
    given = (override_tensor,) if isinstance(override_tensor, str) else tuple(override_tensor)
    return tuple(o for value in given for o in parse_override_tensor(value, ot_flag)) + expert_overrides(
        bool(cpu_moe), n_cpu_moe)


# ---------------------------------------------------------------- buffer types, as llama.cpp names them

@functools.cache
def _ggml():
    """libllama's ggml backend functions, on a handle of our own (the same library llama_cpp loaded, so
    the same devices; our argument types do not touch llama_cpp's)."""
    lib = ctypes.CDLL(llama_cpp.llama_cpp._lib._name)
    vp = ctypes.c_void_p
    for name, restype, argtypes in (("ggml_backend_dev_count", ctypes.c_size_t, []),
                                    ("ggml_backend_dev_get", vp, [ctypes.c_size_t]),
                                    ("ggml_backend_dev_buffer_type", vp, [vp]),
                                    ("ggml_backend_buft_name", ctypes.c_char_p, [vp]),
                                    ("ggml_backend_dev_type", ctypes.c_int, [vp]),
                                    ("ggml_backend_dev_name", ctypes.c_char_p, [vp]),
                                    ("ggml_backend_dev_description", ctypes.c_char_p, [vp]),
                                    ("ggml_backend_dev_memory", None, [vp, ctypes.POINTER(ctypes.c_size_t),
                                                                       ctypes.POINTER(ctypes.c_size_t)])):
        getattr(lib, name).restype, getattr(lib, name).argtypes = restype, argtypes
    return lib


def buffer_types() -> dict[str, int]:
    """Buffer type name -> ggml_backend_buffer_type_t: each device's own (parse_tensor_buffer_overrides'
    map: "CPU", "CUDA0", "RPC0[host:port]" once the workers are registered...)."""
    llama_cpp.llama_backend_init()  # loads the backends where the build loads them dynamically (idempotent)
    lib = _ggml()
    found = {}
    for i in range(lib.ggml_backend_dev_count()):
        buft = lib.ggml_backend_dev_buffer_type(lib.ggml_backend_dev_get(i))
        if buft:
            found[lib.ggml_backend_buft_name(buft).decode(errors="replace")] = buft
    return found


def check_buffer_types(overrides: Sequence[tuple[str, str]], flag: str = "-ot",
                       known: dict[str, int] | None = None) -> None:
    """A buffer type no device here has fails in one line naming the ones there are (llama.cpp prints them)."""
    known = buffer_types() if known is None else known
    for pattern, name in overrides:
        if name not in known:
            raise GgufspecError(f"{flag} {pattern}={name}: unknown buffer type {name!r} (the ones here: "
                                f"{', '.join(known) or 'none'})")


class _Override(ctypes.Structure):
    """llama.h's struct llama_model_tensor_buft_override (llama-cpp-python declares none)."""
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def override_array(overrides: Sequence[tuple[str, str]], flag: str = "-ot", path: str | os.PathLike | None = None):
    """llama_model_params.tensor_buft_overrides for `overrides` (for the model at `path`: the per-layer
    ones within its layers): llama_model_tensor_buft_override structs ({const char * pattern; buft})
    ended by a NULL pattern, as common.cpp terminates its list. The array holds its pattern strings:
    keep it alive while the model loads."""
    known = buffer_types()
    check_buffer_types(overrides, flag, known)
    if path is not None and any(_LAYER_PATTERN.fullmatch(pattern) for pattern, _ in overrides):
        overrides = within_layers(overrides, block_count(path))
    patterns = [pattern.encode() for pattern, _ in overrides]
    array = (_Override * (len(overrides) + 1))(*[_Override(p, known[b]) for p, (_, b) in zip(patterns, overrides)],
                                               _Override(None, None))
    array.patterns = patterns  # the bytes the structs point at, owned by the array
    return array


def block_count(path: str | os.PathLike) -> int | None:
    """A GGUF's ARCH.block_count, read from its header (no tensor data); None where it cannot be read."""
    header = local_header(path)
    if header is None:
        return None
    with header:
        return header.block_count()


def overrides_tag(overrides: Sequence[tuple[str, str]]) -> str:
    """A short stable name for a set of overrides (step costs are remembered per placement)."""
    return hashlib.sha1(repr(tuple(map(tuple, overrides))).encode()).hexdigest()[:10]


# ---------------------------------------------------------------- devices, as -dev and --list-devices name them

# llama.h's enum llama_split_mode, by -sm's names (tensor: llama.cpp's experimental tensor parallelism)
SPLIT_MODES = {"none": llama_cpp.LLAMA_SPLIT_MODE_NONE, "layer": llama_cpp.LLAMA_SPLIT_MODE_LAYER,
               "row": llama_cpp.LLAMA_SPLIT_MODE_ROW, "tensor": llama_cpp.LLAMA_SPLIT_MODE_TENSOR}
# ggml-backend.h's enum ggml_backend_dev_type (ACCEL: BLAS, AMX..., which work beside the CPU)
DEVICE_CPU, DEVICE_GPU, DEVICE_IGPU, DEVICE_ACCEL = range(4)


@dataclass(frozen=True)
class Device:
    """A ggml device layers can be offloaded to (`load.load_on_devices` takes its handle)."""
    handle: int
    name: str          # "CUDA0", "Vulkan1"...: what -dev takes
    description: str
    free: int          # bytes
    total: int
    kind: int          # DEVICE_GPU, DEVICE_IGPU or DEVICE_ACCEL


def offload_devices() -> list[Device]:
    """Every device but the CPU, in ggml's order: those -dev may name and --list-devices prints (llama.cpp's
    common_print_available_devices). --rpc's workers are not among them: ggufspec registers them for --rpc only."""
    llama_cpp.llama_backend_init()  # loads the backends where the build loads them dynamically (idempotent)
    lib = _ggml()
    found = []
    for i in range(lib.ggml_backend_dev_count()):
        handle = lib.ggml_backend_dev_get(i)
        kind = lib.ggml_backend_dev_type(handle)
        if kind == DEVICE_CPU:
            continue
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        lib.ggml_backend_dev_memory(handle, ctypes.byref(free), ctypes.byref(total))
        found.append(Device(handle, lib.ggml_backend_dev_name(handle).decode(errors="replace"),
                            (lib.ggml_backend_dev_description(handle) or b"").decode(errors="replace"),
                            free.value, total.value, kind))
    return found


def default_devices() -> list[Device]:
    """The devices llama.cpp offloads to when -dev names none (llama_model_load's default selection, --rpc's
    workers aside): the GPUs, else the integrated ones."""
    devices = offload_devices()
    return [d for d in devices if d.kind == DEVICE_GPU] or [d for d in devices if d.kind == DEVICE_IGPU]


def device_list() -> str:
    """--list-devices' text, as llama.cpp prints it."""
    devices = [f"  {d.name}: {d.description} ({d.total >> 20} MiB, {d.free >> 20} MiB free)" for d in offload_devices()]
    return "\n".join(["Available devices:", *(devices or ["  (none)"])])


def parse_devices(value: str | Sequence[str], flag: str = "-dev") -> tuple[str, ...]:
    """-dev's value (llama.cpp's parse_device_list): "none" is () (nothing offloaded), else comma-separated
    names of devices here, the CPU not one of them (it always takes what is not offloaded)."""
    names = value.split(",") if isinstance(value, str) else list(value)
    if names == ["none"]:
        return ()
    known = {device.name for device in offload_devices()}
    for name in names:
        if name not in known:
            raise GgufspecError(f"{flag} {','.join(names)}: no device {name!r} here (the ones there are: "
                                f"{', '.join(sorted(known)) or 'none'}; --list-devices shows them; none: the CPU only)")
    return tuple(names)


def devices_named(names: Sequence[str]) -> list[Device]:
    """The devices of `parse_devices`' names, in their order."""
    known = {device.name: device for device in offload_devices()}
    return [known[name] for name in names]


# ---------------------------------------------------------------- what the planner counts

def host_tensor_bytes(tensors: Sequence[tuple[str, int]], overrides: Sequence[tuple[str, str]]) -> dict[str, int]:
    """The tensors (name -> bytes) whose first matching override is the CPU's: in host memory whatever -ngl."""
    kept = {}
    layers = [int(m[1]) for name, _ in tensors if (m := re.match(r"blk\.(\d+)\.", name))]
    overrides = within_layers(overrides, max(layers, default=-1) + 1)  # not 10,000 patterns per tensor
    for name, size in tensors:
        first = next((buffer for pattern, buffer in overrides if re.search(pattern, name)), None)
        if first == CPU:
            kept[name] = size
    return kept


# ---------------------------------------------------------------- the process's CPUs, priority and NUMA

# llama.cpp's set_process_priority (common.cpp): its --prio as a nice value (0, normal: left as it is)
PRIORITY_NICE = {-1: 5, 1: -5, 2: -10, 3: -20}
NUMA_STRATEGIES = {"distribute": llama_cpp.GGML_NUMA_STRATEGY_DISTRIBUTE,
                   "isolate": llama_cpp.GGML_NUMA_STRATEGY_ISOLATE, "numactl": llama_cpp.GGML_NUMA_STRATEGY_NUMACTL}
_numa_in_effect: list[str] = []  # ggml sets its NUMA strategy once per process (ggml_numa_init)


def _threads() -> list[int]:
    """This process's thread ids (Linux: affinity and nice values are per thread; 0, the caller, elsewhere)."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def apply_process_placement(cpus: Sequence[int] | None, priority: int) -> None:
    """-C/-Cr and --prio for the whole process: every thread's CPU affinity and nice value, and so those of
    the threads started from them (llama.cpp's compute threads; the OpenMP pool already running too).
    llama.cpp sets these on its own thread pools; llama-cpp-python attaches none, so it is the process."""
    if cpus is not None:
        if not hasattr(os, "sched_setaffinity"):
            raise GgufspecError("-C/-Cr: this system has no CPU affinity to set (llama.cpp ignores it here too): "
                                "leave -C/-Cr out")
        _each_thread(lambda tid: os.sched_setaffinity(tid, cpus),
                     f"-C/-Cr: could not run on CPUs {','.join(map(str, cpus))}", "give CPUs this process may use")
    if priority:
        nice = PRIORITY_NICE[priority]
        _each_thread(lambda tid: os.setpriority(os.PRIO_PROCESS, tid, nice),
                     f"--prio {priority}: could not set the process's nice value to {nice}",
                     "raising the priority needs root or CAP_SYS_NICE; give --prio 0 (or -1: lower)")


def _each_thread(apply, failed: str, what_instead: str) -> None:
    for tid in _threads():
        try:
            apply(tid)
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
        except OSError as exc:
            raise GgufspecError(f"{failed}: {exc.strerror or exc}; {what_instead}") from None


def numa_strategy(name: str | None) -> int:
    """--numa's strategy as llama_cpp.Llama's `numa` (0: none). ggml takes the first one a process sets and
    ignores the rest: another one after it is refused rather than silently not applied."""
    if name is None:
        return llama_cpp.GGML_NUMA_STRATEGY_DISABLED
    if name not in NUMA_STRATEGIES:
        raise GgufspecError(f"--numa takes {', '.join(NUMA_STRATEGIES)}, got {name!r}")
    if _numa_in_effect and _numa_in_effect[0] != name:
        raise GgufspecError(f"--numa {name}: this process already runs with --numa {_numa_in_effect[0]} (ggml sets "
                            f"it once per process): give the same, or start a new process")
    _numa_in_effect[:1] = [name]
    return NUMA_STRATEGIES[name]
