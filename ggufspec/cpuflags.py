"""llama.cpp's CPU, memory and loading flags past -t, -ctk, --mlock, -ot... (common/arg.cpp), checked and
turned into `load.LoadParams` fields by role.

What ggufspec honours, and how (both models, as llama.cpp makes its draft from a copy of the target's
params, common_base_params_to_speculative):
- -nkvo, --no-op-offload, -nr/--no-repack, --no-host, --check-tensors, -lzm, --no-perf: the
  llama_model_params / llama_context_params fields of those names (`load`).
- --numa: llama_numa_init, which ggml does once per process (`placement.numa_strategy`).
- -C/-Cr and --prio: the process's CPU affinity and nice value, every thread of it (`placement.
  apply_process_placement`). llama-cpp-python attaches no ggml thread pool, so there is one set of CPUs
  and one priority for the whole process: the batch's and the draft's variants (-Cb, -Cd, --prio-batch,
  --prio-draft...) are taken where they equal the target's, and refused where they would differ.
- -ncffn N: the target's dense FFN weights of its first N layers kept on the CPU (tensor overrides,
  which the planner counts in host memory, as it counts --n-cpu-moe's).
- -fit off: unset -ngl / -ngld offload every layer (llama.cpp's -ngl auto without fitting); on, the
  default, leaves them to ggufspec's planner (`offload_given` in `modelflags`).
What cannot be honoured is refused in one line, or taken at its does-nothing value, by the CLI
(`cli.cpu_flags`: --cpu-strict, --poll, -dt, -bs, -fitt, -fitc...).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import GgufspecError
from . import placement

GGML_MAX_N_THREADS = 512  # CPU indices a mask or range may name (ggml.h)
LAZY_MODES = ("on", "auto", "off")
NUMA_STRATEGIES = ("distribute", "isolate", "numactl")
PRIORITIES = range(-1, 4)  # llama.cpp's --prio: low (-1), normal (0), medium, high, realtime (3)


@dataclass
class CpuLoadFlags:
    """These flags as `session.ModelOptions` fields (it inherits them); None or 0: not given."""
    kv_offload: bool | None = None     # -kvo / -nkvo: the KV cache on the GPU with its layer, or in host memory
    op_offload: bool | None = None     # --op-offload / --no-op-offload
    repack: bool | None = None         # --repack / -nr: weights repacked for the CPU's tiled kernels
    no_host: bool = False              # --no-host: no pinned host buffer (extra buffer types instead)
    check_tensors: bool = False        # --check-tensors: every weight checked for NaN and inf as it loads
    numa: str | None = None            # --numa distribute | isolate | numactl
    lazy_mode: str | None = None       # -lzm on | auto | off: marked tensors read from the file on demand
    n_cpu_ffn: int = 0                 # -ncffn N: the target's dense FFN of layers 0..N-1 on the CPU
    fit: str | None = None             # -fit on | off
    perf: bool | None = None           # --perf / --no-perf: libllama's internal timings
    # the process's CPUs (-C hex mask, -Cr lo-hi: their union) and priority, and their batch and draft
    # variants, which may only repeat them
    cpu_mask: str | None = None
    cpu_range: str | None = None
    prio: int | None = None
    cpu_mask_batch: str | None = None
    cpu_range_batch: str | None = None
    prio_batch: int | None = None
    cpu_mask_draft: str | None = None
    cpu_range_draft: str | None = None
    prio_draft: int | None = None
    cpu_mask_batch_draft: str | None = None
    cpu_range_batch_draft: str | None = None
    prio_batch_draft: int | None = None


FIELD_NAMES = tuple(CpuLoadFlags.__dataclass_fields__)  # the CLI's options of the same names


def cpu_fields_by_role(options: CpuLoadFlags) -> tuple[dict, dict]:
    """The LoadParams fields these flags give the target and the draft, checked (only those given)."""
    shared = _switches(options)
    if options.numa is not None:
        if options.numa not in NUMA_STRATEGIES:
            raise GgufspecError(f"--numa takes {', '.join(NUMA_STRATEGIES)}, got {options.numa!r}")
        shared["numa"] = options.numa
    if options.lazy_mode is not None:
        if options.lazy_mode not in LAZY_MODES:
            raise GgufspecError(f"-lzm/--lazy-mode takes {', '.join(LAZY_MODES)}, got {options.lazy_mode!r}")
        shared["lazy_mode"] = options.lazy_mode
    if options.fit is not None:
        fit_setting(options.fit)  # `modelflags.offload_given` reads it
    cpus, priority = process_placement(options)
    if cpus is not None and options.numa is not None:
        raise GgufspecError(f"--numa {options.numa} and -C/-Cr: on a NUMA machine ggml sets the CPUs of llama.cpp's "
                            f"threads itself (a node's, or numactl's) and resets them after each batch, which would "
                            f"undo -C/-Cr: give one of them (or run under numactl --physcpubind=... with --numa "
                            f"numactl)")
    if cpus is not None:
        shared["cpus"] = cpus
    if priority:
        shared["priority"] = priority
    target, draft = dict(shared), dict(shared)
    if options.n_cpu_ffn:
        target["tensor_overrides"] = _with_dense_ffn(options)
    return target, draft


def _switches(options: CpuLoadFlags) -> dict:
    """The on/off flags given, as LoadParams fields (llama.cpp's defaults left out)."""
    fields = {}
    for name, field, default in (("kv_offload", "offload_kqv", True), ("op_offload", "op_offload", True),
                                 ("repack", "repack", True), ("no_host", "no_host", False),
                                 ("check_tensors", "check_tensors", False)):
        value = getattr(options, name)
        if value is not None and not isinstance(value, bool):
            raise GgufspecError(f"{name} is true or false, got {value!r}")
        if value is not None and value != default:
            fields[field] = value
    if options.perf is not None and not isinstance(options.perf, bool):
        raise GgufspecError(f"perf is true or false, got {options.perf!r}")
    if options.perf is False:
        fields["no_perf"] = True
    # --exact computes a batch with a single token's kernels, which repacked weights do not allow: it loads
    # the target unrepacked, and an explicit --repack beside it is a contradiction, not a silent loser
    if options.repack and getattr(options, "exact", False):
        raise GgufspecError("--repack and --exact: --exact loads the target's weights unrepacked (a batch computed "
                            "with the single-token kernels); leave --repack out")
    return fields


def _with_dense_ffn(options) -> tuple:
    """The target's tensor overrides with -ncffn's after -ot's and --cpu-moe's (`session` builds those; they
    are built again here, the same, so that this field replaces that one with a superset)."""
    n = options.n_cpu_ffn
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise GgufspecError(f"-ncffn/--n-cpu-ffn must be a whole number >= 0 (the layers whose dense FFN weights "
                            f"stay on the CPU), got {n!r}")
    return placement.tensor_overrides(options.override_tensor, options.cpu_moe, options.n_cpu_moe, "target") \
        + placement.dense_ffn_overrides(n)


# ---------------------------------------------------------------- the process's CPUs and priority

def process_placement(options: CpuLoadFlags) -> tuple[tuple[int, ...] | None, int]:
    """(the CPUs the process runs on, None: as it was started; llama.cpp's priority, 0: unchanged), from
    -C/-Cr and --prio, the batch's and the draft's variants checked to say the same."""
    cpus = cpu_set(options.cpu_mask, options.cpu_range, "-C", "-Cr")
    priority = _priority("--prio", options.prio, PRIORITIES)
    for suffix, mask_flag, range_flag in (("_batch", "-Cb", "-Crb"), ("_draft", "-Cd", "-Crd"),
                                          ("_batch_draft", "-Cbd", "-Crbd")):
        mask, cpu_range = getattr(options, "cpu_mask" + suffix), getattr(options, "cpu_range" + suffix)
        if (mask, cpu_range) != (None, None) and cpu_set(mask, cpu_range, mask_flag, range_flag) != cpus:
            given = " ".join(f"{flag} {value}" for flag, value in ((mask_flag, mask), (range_flag, cpu_range)) if value)
            raise GgufspecError(f"{given}: ggufspec runs every model and batch in one process on one set of CPUs "
                                f"(llama-cpp-python gives them no thread pools of their own), which -C/-Cr set "
                                f"({_cpus_text(cpus)}): give the same CPUs, or set them with -C/-Cr alone")
        flag = {"_batch": "--prio-batch", "_draft": "--prio-draft", "_batch_draft": "--prio-batch-draft"}[suffix]
        other = _priority(flag, getattr(options, "prio" + suffix), range(0, 4))
        if getattr(options, "prio" + suffix) is not None and other != priority:
            raise GgufspecError(f"{flag} {other}: ggufspec runs every model and batch in one process with one "
                                f"priority, which --prio sets (now {priority}): leave {flag} out, or give --prio "
                                f"{other} for all")
    return cpus, priority


def _priority(flag: str, value, allowed: range) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value not in allowed:
        raise GgufspecError(f"{flag} takes {allowed.start} to {allowed.stop - 1} (llama.cpp's low -1, normal 0, "
                            f"medium 1, high 2, realtime 3), got {value!r}")
    return value


def cpu_set(mask: str | None, cpu_range: str | None, mask_flag: str = "-C",
            range_flag: str = "-Cr") -> tuple[int, ...] | None:
    """The CPUs of this machine a mask and a range name together (llama.cpp: they complement each other);
    None where they name none (llama.cpp's empty mask: the affinity the process has)."""
    named = set()
    if mask is not None:
        named |= parse_cpu_mask(mask, mask_flag)
    if cpu_range is not None:
        named |= parse_cpu_range(cpu_range, range_flag)
    if not named:
        return None
    here = named & set(range(os.cpu_count() or 1))
    if not here:
        given = " ".join(f"{f} {v}" for f, v in ((mask_flag, mask), (range_flag, cpu_range)) if v is not None)
        raise GgufspecError(f"{given} names no CPU of this machine (it has CPUs 0-{(os.cpu_count() or 1) - 1})")
    return tuple(sorted(here))


def parse_cpu_mask(mask: str, flag: str = "-C") -> set[int]:
    """An arbitrarily long hex mask, 0x optional, bit i CPU i (common.cpp's parse_cpu_mask: 128 digits at most)."""
    if not isinstance(mask, str):
        raise GgufspecError(f"{flag} takes a hex CPU mask such as 0x3, got {mask!r}")
    digits = mask[2:] if mask.startswith("0x") else mask
    if len(digits) > GGML_MAX_N_THREADS // 4 or any(c not in "0123456789abcdefABCDEF" for c in digits):
        raise GgufspecError(f"{flag} {mask}: give a CPU mask in hex (bit i: CPU i), e.g. {flag} 0x3 for CPUs 0 and 1, "
                            f"at most {GGML_MAX_N_THREADS // 4} digits")
    value = int(digits, 16) if digits else 0
    return {cpu for cpu in range(value.bit_length()) if value >> cpu & 1}


def parse_cpu_range(text: str, flag: str = "-Cr") -> set[int]:
    """lo-hi, either end optional (common.cpp's parse_cpu_range: from CPU 0, up to the last ggml knows)."""
    low, dash, high = text.partition("-") if isinstance(text, str) else ("", "", "")
    if not dash or not all(part == "" or part.isdigit() for part in (low, high)):
        raise GgufspecError(f"{flag} {text!r}: give a range of CPUs as lo-hi, e.g. {flag} 0-3 (either end may be "
                            f"left out)")
    first, last = int(low or 0), int(high or GGML_MAX_N_THREADS - 1)
    if max(first, last) >= GGML_MAX_N_THREADS or first > last:
        raise GgufspecError(f"{flag} {text}: give lo <= hi, both below {GGML_MAX_N_THREADS}")
    return set(range(first, last + 1))


def _cpus_text(cpus: tuple[int, ...] | None) -> str:
    return "none given: every CPU the process started with" if cpus is None else "CPUs " + ",".join(map(str, cpus))


# ---------------------------------------------------------------- -fit: who chooses an unset -ngl

def fit_setting(value) -> bool:
    """-fit's value as llama.cpp reads it (is_truthy / is_falsey): True on, False off."""
    if value in ("on", "enabled", "true", "1", True):
        return True
    if value in ("off", "disabled", "false", "0", False):
        return False
    raise GgufspecError(f"-fit/--fit takes on or off, got {value!r}")
