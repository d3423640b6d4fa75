"""llama.cpp's remaining model-loading flags, by its names (common/arg.cpp), as click options: RoPE/YaRN
context extension, --override-kv, multi-GPU placement (-sm, -mg, -ts, -dev, -devd) and --list-devices, the
CPU, memory and loading flags of `cpu_flags` (-nkvo, -nr, --numa, -C, --prio, -fit...), and control vectors.
`ggufspec.modelflags` checks their values and says which model gets what (as llama.cpp: both, but -devd);
`ggufspec.cvec` reads the control vectors, the target's alone (as llama.cpp's)."""
from __future__ import annotations

import click

from ..cpuflags import FIELD_NAMES as CPU_FLAGS
from ..modelflags import KV_OVERRIDE_TYPES, ROPE_SCALING_TYPES
from ..placement import SPLIT_MODES
from .cpu_flags import cpu_load_options

# these options' names, which are ModelOptions fields of the same name (options.LOAD_FLAGS has them too)
EXTRA_LOAD_FLAGS = ("rope_scaling", "rope_scale", "rope_freq_base", "rope_freq_scale", "yarn_orig_ctx",
                    "yarn_ext_factor", "yarn_attn_factor", "yarn_beta_slow", "yarn_beta_fast", "override_kv",
                    "split_mode", "main_gpu", "tensor_split", "device", "device_draft", *CPU_FLAGS,
                    "control_vector", "control_vector_scaled", "control_vector_layer_range")
BOTH = " (both models, as llama.cpp)"


def extra_load_options():
    return [*rope_options(), *gpu_options(),
            click.option("--override-kv", "override_kv", multiple=True, metavar="KEY=TYPE:VALUE,...",
                         help=f"Override a GGUF metadata key as the models load, TYPE {', '.join(KV_OVERRIDE_TYPES)} "
                              f"(repeatable, or comma-separated), e.g. --override-kv "
                              f"tokenizer.ggml.add_bos_token=bool:false{BOTH}."),
            *cpu_load_options(), *control_vector_options()]


def control_vector_options():
    """--control-vector, --control-vector-scaled, --control-vector-layer-range: llama.cpp's syntax, the
    target's alone."""
    return [
        click.option("--control-vector", "control_vector", multiple=True, metavar="FNAME",
                     help="Add a control vector (a GGUF of direction.N tensors, as llama-cvector-generator writes) "
                          "to the target's layers (repeatable, or comma-separated; several are summed); the draft "
                          "has none, the steered target decides every token."),
        click.option("--control-vector-scaled", "control_vector_scaled", multiple=True, metavar="FNAME:SCALE,...",
                     help="Add a control vector with its scale SCALE (repeatable, or comma-separated)."),
        click.option("--control-vector-layer-range", "control_vector_layer_range", nargs=2, type=int, default=None,
                     metavar="START END",
                     help="The layers the control vectors apply to, START and END inclusive [default: 1 to the "
                          "last layer]."),
    ]


def rope_options():
    """--rope-scaling, --rope-scale, --rope-freq-*, --yarn-*: none given, the model's own."""
    number = dict(type=float, default=None, metavar="N")
    return [
        click.option("--rope-scaling", "rope_scaling", type=click.Choice(list(ROPE_SCALING_TYPES)), default=None,
                     help="RoPE frequency scaling method [default: the model's, else linear]; it and the other "
                          "--rope-*/--yarn-* flags apply to both models, as llama.cpp's."),
        click.option("--rope-scale", "rope_scale", **number,
                     help="RoPE context scaling factor: expands the context N times (--rope-freq-scale 1/N)."),
        click.option("--rope-freq-base", "rope_freq_base", **number,
                     help="RoPE base frequency, for NTK-aware scaling [default: the model's]."),
        click.option("--rope-freq-scale", "rope_freq_scale", **number,
                     help="RoPE frequency scaling factor: expands the context 1/N times [default: the model's]."),
        click.option("--yarn-orig-ctx", "yarn_orig_ctx", type=int, default=None, metavar="N",
                     help="YaRN: the model's original context size [default: 0, its training context]."),
        click.option("--yarn-ext-factor", "yarn_ext_factor", **number,
                     help="YaRN: extrapolation mix factor (0: full interpolation) [default: -1, by the scaling type]."),
        click.option("--yarn-attn-factor", "yarn_attn_factor", **number,
                     help="YaRN: scale sqrt(t), or the attention magnitude [default: -1, the model's]."),
        click.option("--yarn-beta-slow", "yarn_beta_slow", **number,
                     help="YaRN: high correction dim, or alpha [default: -1, the model's]."),
        click.option("--yarn-beta-fast", "yarn_beta_fast", **number,
                     help="YaRN: low correction dim, or beta [default: -1, the model's]."),
    ]


def gpu_options():
    """-sm, -mg, -ts, -dev, -devd and --list-devices: where the layers go when there are several GPUs."""
    devices = dict(default=None, metavar="DEV1,DEV2,...")
    return [
        click.option("-sm", "--split-mode", "split_mode", type=click.Choice(list(SPLIT_MODES)), default=None,
                     help="How several GPUs share a model: none (one GPU, -mg), layer (layers and KV cache), row "
                          "(weights by rows), tensor (llama.cpp's experimental tensor parallelism) "
                          f"[default: layer]{BOTH}."),
        click.option("-mg", "--main-gpu", "main_gpu", type=int, default=None, metavar="INDEX",
                     help="The GPU of -sm none, or of -sm row's intermediate results and KV cache "
                          f"[default: 0]{BOTH}."),
        click.option("-ts", "--tensor-split", "tensor_split", default=None, metavar="N0,N1,...",
                     help="Each device's share of the offloaded layers, e.g. 3,1 (with --rpc: the workers' in --rpc's "
                          "order, then this machine's GPUs; the target's only, the draft staying here) "
                          f"[default: by free memory]{BOTH}."),
        click.option("-dev", "--device", "device", **devices,
                     help="Offload to these devices only (--list-devices names them; none: the CPU only, as -ngl 0); "
                          "the draft follows it unless -devd."),
        click.option("-devd", "--device-draft", "--spec-draft-device", "device_draft", **devices,
                     help="-dev for the draft model."),
        click.option("--list-devices", is_flag=True, expose_value=False, is_eager=True, callback=_list_devices,
                     help="Print the devices -dev can name, and exit."),
    ]


def _list_devices(ctx, _param, value) -> None:
    if not value or ctx.resilient_parsing:
        return
    from ..placement import device_list
    click.echo(device_list())
    ctx.exit()
