"""llama.cpp's CPU, memory and loading flags (common/arg.cpp) as click options, by its names and aliases:
-kvo/-nkvo, --op-offload, --repack/-nr, --no-host, --check-tensors, --numa, -lzm, -ncffn, -fit, --perf,
and CPU placement: -C/-Cr/--prio and their batch (-Cb, -Crb, --prio-batch) and draft (-Cd, -Crd,
--prio-draft, -Cbd, -Crbd, --prio-batch-draft) variants. `ggufspec.cpuflags` checks them and says which
model gets what. The flags ggufspec cannot honour are here too, taken at their does-nothing value and
refused in one line otherwise: --cpu-strict, --poll (and their variants), -dt, -bs,
--spec-draft-backend-sampling, -fitt, -fitc."""
from __future__ import annotations

import click

from ..cpuflags import LAZY_MODES, NUMA_STRATEGIES

BOTH = " (both models, as llama.cpp)"
GGML_POLL = 50  # the polling level of the thread pool ggml makes for each graph without one attached (its default)


def cpu_load_options():
    return [*offload_options(), *placement_options(), *refused_options()]


def offload_options():
    """The llama_model_params / llama_context_params switches, --numa, -lzm, -ncffn and -fit."""
    return [
        click.option("-kvo/-nkvo", "--kv-offload/--no-kv-offload", "kv_offload", default=None,
                     help="Whether the KV cache goes to the GPU with its layers; -nkvo keeps it in host memory (the "
                          f"planned -ngl counts it there) [default: enabled]{BOTH}."),
        click.option("--op-offload/--no-op-offload", "op_offload", default=None,
                     help="Whether llama.cpp offloads host tensor operations (weights kept on the CPU) to the GPU "
                          f"[default: true]{BOTH}."),
        click.option("--repack/--no-repack", " /-nr", "repack", default=None,
                     help="Whether weights are repacked for the CPU's tiled kernels [default: enabled; --exact loads "
                          f"the target unrepacked, and --repack with --exact is refused]{BOTH}."),
        click.option("--no-host", "no_host", is_flag=True, default=False,
                     help=f"Bypass the host buffer, allowing extra buffer types to be used{BOTH}."),
        click.option("--check-tensors", "check_tensors", is_flag=True, default=False,
                     help=f"Check every weight for invalid values (NaN, inf) as the models load{BOTH}."),
        click.option("--numa", "numa", type=click.Choice(NUMA_STRATEGIES), default=None, metavar="TYPE",
                     help="NUMA optimizations (llama_numa_init, once per process): distribute (spread execution "
                          "evenly over all nodes), isolate (threads on the node execution started on), numactl "
                          "(the CPU map numactl gives)."),
        click.option("-lzm", "--lazy-mode", "lazy_mode", type=click.Choice(LAZY_MODES), default=None, metavar="MODE",
                     help="On-demand reading of tensors the architecture marks (per-layer embeddings): on (their "
                          "rows read from the file as needed; needs mmap), auto (on for those above 4 GiB), off "
                          f"(kept resident) [default: auto]{BOTH}."),
        click.option("-ncffn", "--n-cpu-ffn", "n_cpu_ffn", type=click.IntRange(min=0), default=0, metavar="N",
                     help="Keep the target's dense FFN weights of its first N layers on the CPU (dense models; for "
                          "experts --n-cpu-moe); the planned -ngl counts them in host memory."),
        click.option("-fit", "--fit", "fit", default=None, metavar="[on|off]",
                     type=click.Choice(["on", "off", "enabled", "disabled", "true", "false", "1", "0"]),
                     help="on: an unset -ngl/-ngld is chosen by ggufspec's planner (its own fit: the GPU's free "
                          "memory less 5% and 512 MiB, the context as -c says); off: an unset -ngl/-ngld offloads "
                          "every layer, as llama.cpp's -ngl auto without fitting [default: on]."),
        click.option("--perf/--no-perf", "perf", default=None,
                     help=f"Whether libllama keeps its internal performance timings [default: true]{BOTH}."),
    ]


def placement_options():
    """-C, -Cr, --prio: the whole process's; their batch and draft variants only repeat them."""
    mask, cpus = dict(default=None, metavar="M"), dict(default=None, metavar="lo-hi")
    same = ": taken where it names -C/-Cr's CPUs (the whole process runs on one set)"
    prio = ": taken where it equals --prio (the whole process has one priority)"
    return [
        click.option("-C", "--cpu-mask", "cpu_mask", **mask,
                     help="CPU affinity mask, arbitrarily long hex (bit i: CPU i), e.g. 0x3; complements -Cr. "
                          "ggufspec sets it on the whole process, every thread [default: \"\", as started]."),
        click.option("-Cr", "--cpu-range", "cpu_range", **cpus,
                     help="Range of CPUs for affinity, e.g. 0-3 (either end optional); complements -C."),
        click.option("--prio", "prio", type=click.IntRange(-1, 3), default=None, metavar="N",
                     help="Process priority: low (-1), normal (0), medium (1), high (2), realtime (3): the process's "
                          "nice value 5, unchanged, -5, -10, -20, as llama.cpp's set_process_priority (llama.cpp "
                          "also gives its own thread pools real-time scheduling from 1 up; ggufspec's threads keep "
                          "theirs); above 0 needs root or CAP_SYS_NICE [default: 0]."),
        click.option("-Cb", "--cpu-mask-batch", "cpu_mask_batch", **mask, help="-C for batches" + same + "."),
        click.option("-Crb", "--cpu-range-batch", "cpu_range_batch", **cpus, help="-Cr for batches" + same + "."),
        click.option("--prio-batch", "prio_batch", type=click.IntRange(0, 3), default=None, metavar="N",
                     help="--prio for batches" + prio + "."),
        click.option("-Cd", "--cpu-mask-draft", "--spec-draft-cpu-mask", "cpu_mask_draft", **mask,
                     help="-C for the draft" + same + "."),
        click.option("-Crd", "--cpu-range-draft", "--spec-draft-cpu-range", "cpu_range_draft", **cpus,
                     help="-Cr for the draft" + same + "."),
        click.option("--prio-draft", "--spec-draft-prio", "prio_draft", type=click.IntRange(0, 3), default=None,
                     metavar="N", help="--prio for the draft" + prio + "."),
        click.option("-Cbd", "--cpu-mask-batch-draft", "--spec-draft-cpu-mask-batch", "cpu_mask_batch_draft", **mask,
                     help="-C for the draft's batches" + same + "."),
        click.option("-Crbd", "--cpu-range-batch-draft", "--spec-draft-cpu-range-batch", "cpu_range_batch_draft",
                     **cpus, help="-Cr for the draft's batches" + same + "."),
        click.option("--prio-batch-draft", "--spec-draft-prio-batch", "prio_batch_draft", type=click.IntRange(0, 3),
                     default=None, metavar="N", help="--prio for the draft's batches" + prio + "."),
    ]


# ---------------------------------------------------------------- taken at their does-nothing value, or refused

def _only(value_taken, why: str):
    """A callback taking `value_taken` (or the flag left out) and refusing any other value in one line."""
    def check(ctx, param, value):
        if value is not None and value != value_taken:
            raise click.BadParameter(why if isinstance(value, bool) else f"{value}: {why}", ctx=ctx, param=param)
    return check


def _deprecated(ctx, param, value):
    if value is not None:
        click.echo("ggufspec: --defrag-thold is deprecated (llama.cpp: no longer necessary to specify): it does "
                   "nothing", err=True)


STRICT = ("pins each thread to a CPU of its own, and llama-cpp-python attaches no ggml thread pool to pin: "
          "ggufspec's threads share the process's CPUs (-C/-Cr); give 0 or leave it out")
POLL = (f"llama-cpp-python attaches no ggml thread pool, so llama.cpp's threads wait with ggml's default polling "
        f"level, {GGML_POLL}; give {GGML_POLL} or leave it out")
FIT = ("ggufspec plans an unset -ngl/-ngld itself (its planner keeps 5% of the GPU's free memory and 512 MiB free, "
       "and never shrinks -c), not with llama.cpp's fitting")


def refused_options():
    strict = dict(type=click.IntRange(min=0), default=None, expose_value=False, metavar="<0|1>",
                  callback=_only(0, STRICT))
    poll = dict(type=click.IntRange(0, 100), default=None, expose_value=False, metavar="<0...100>",
                callback=_only(GGML_POLL, POLL))
    taken = ": only 0 is taken (ggufspec's threads share -C/-Cr's CPUs)"
    polled = f": only {GGML_POLL} is taken (ggml's default, which llama-cpp-python cannot change)"
    return [
        click.option("--cpu-strict", **strict, help=f"Strict CPU placement, each thread on a CPU of its own{taken}."),
        click.option("--cpu-strict-batch", **strict, help=f"--cpu-strict for batches{taken}."),
        click.option("--cpu-strict-draft", "--spec-draft-cpu-strict", **strict,
                     help=f"--cpu-strict for the draft{taken}."),
        click.option("--cpu-strict-batch-draft", "--spec-draft-cpu-strict-batch", **strict,
                     help=f"--cpu-strict for the draft's batches{taken}."),
        click.option("--poll", **poll, help=f"Polling level to wait for work{polled}."),
        click.option("--poll-batch", **poll, help=f"--poll for batches{polled}."),
        click.option("--poll-draft", "--spec-draft-poll", **poll, help=f"--poll for the draft{polled}."),
        click.option("--poll-batch-draft", "--spec-draft-poll-batch", **poll,
                     help=f"--poll for the draft's batches{polled}."),
        click.option("-dt", "--defrag-thold", default=None, expose_value=False, metavar="N", callback=_deprecated,
                     help="KV cache defragmentation threshold: deprecated in llama.cpp, where it does nothing; "
                          "taken, and does nothing here either."),
        click.option("-bs", "--backend-sampling", is_flag=True, default=False, expose_value=False,
                     callback=_only(False, "ggufspec samples every token on the host, where it compares the draft's "
                                    "and the target's (llama.cpp's default too); leave it out"),
                     help="Backend sampling (experimental in llama.cpp): refused, ggufspec samples on the host."),
        click.option("--spec-draft-backend-sampling/--no-spec-draft-backend-sampling", default=None,
                     expose_value=False, callback=_only(False, "ggufspec picks the draft's tokens on the host "
                                                        "from its logits (--no-spec-draft-backend-sampling); leave it "
                                                        "out"),
                     help="Draft sampling on the backend (llama.cpp's default): ggufspec drafts on the host, so "
                          "only --no-spec-draft-backend-sampling is taken."),
        click.option("-fitt", "--fit-target", default=None, expose_value=False, metavar="MiB0,MiB1,...",
                     callback=_only(None, FIT + ": set -ngl/-ngld to leave another margin"),
                     help="llama.cpp's margin per device for -fit: refused, ggufspec's planner keeps its own."),
        click.option("-fitc", "--fit-ctx", default=None, expose_value=False, metavar="N",
                     callback=_only(None, FIT + ": the context is -c's; give -c N"),
                     help="llama.cpp's smallest context -fit may choose: refused, ggufspec never shrinks -c."),
    ]

