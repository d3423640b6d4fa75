"""llama.cpp's remaining model-loading flags, checked and turned into `load.LoadParams` fields by role:
RoPE/YaRN context extension (--rope-scaling, --rope-scale, --rope-freq-base, --rope-freq-scale, --yarn-*),
--override-kv KEY=TYPE:VALUE, and multi-GPU placement (-sm, -mg, -ts, -dev, -devd); with `cpuflags`' too
(-nkvo, -nr, --numa, -C, --prio, -ncffn, -fit...) where the options carry them.

Which model gets what is llama.cpp's: its draft model and context are made from a copy of the target's
params (common_base_params_to_speculative, used by llama-server and llama-speculative-simple), which
replaces only the draft's model, -ngld, -otd, threads, cache types and, where -devd is given, devices.
So the draft gets the target's RoPE/YaRN params, metadata overrides, -sm, -mg and -ts, and follows -dev
unless -devd says otherwise. Only ggufspec's --rpc differs: the draft stays on this machine, so -ts (one
share per device, the workers' first) is the target's alone there.
"""
from __future__ import annotations

import csv
import math
import re
from typing import Sequence

import llama_cpp

from .cpuflags import cpu_fields_by_role, fit_setting
from .errors import GgufspecError
from . import placement

# --rope-scaling's names, as llama.h's enum llama_rope_scaling_type
ROPE_SCALING_TYPES = {"none": llama_cpp.LLAMA_ROPE_SCALING_TYPE_NONE,
                      "linear": llama_cpp.LLAMA_ROPE_SCALING_TYPE_LINEAR,
                      "yarn": llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN}
KV_OVERRIDE_TYPES = ("int", "float", "bool", "str")
KV_TEXT_MAX = 127   # bytes: llama_model_kv_override's key and val_str are char[128], NUL included
INT64 = 2 ** 63


def rope_keywords(rope_scaling=None, rope_scale=None, rope_freq_base=None, rope_freq_scale=None, yarn_orig_ctx=None,
                  yarn_ext_factor=None, yarn_attn_factor=None, yarn_beta_slow=None,
                  yarn_beta_fast=None) -> tuple[tuple[str, float | int], ...]:
    """The flags given (None: not given) as (llama_context_params field, value) pairs, which are also
    llama_cpp.Llama's keywords. --rope-scale N is --rope-freq-scale 1/N, as llama.cpp sets it."""
    pairs = []
    if rope_scaling is not None:
        if rope_scaling not in ROPE_SCALING_TYPES:
            raise GgufspecError(f"--rope-scaling takes {', '.join(ROPE_SCALING_TYPES)}, got {rope_scaling!r}")
        pairs.append(("rope_scaling_type", ROPE_SCALING_TYPES[rope_scaling]))
    if rope_scale is not None and rope_freq_scale is not None:
        raise GgufspecError("--rope-scale N and --rope-freq-scale 1/N set the same factor: give one of them")
    if rope_scale is not None:
        pairs.append(("rope_freq_scale", 1.0 / _positive("--rope-scale", rope_scale)))
    if rope_freq_scale is not None:
        pairs.append(("rope_freq_scale", _positive("--rope-freq-scale", rope_freq_scale)))
    if rope_freq_base is not None:
        pairs.append(("rope_freq_base", _positive("--rope-freq-base", rope_freq_base)))
    if yarn_orig_ctx is not None:
        if isinstance(yarn_orig_ctx, bool) or not isinstance(yarn_orig_ctx, int) or yarn_orig_ctx < 0:
            raise GgufspecError(f"--yarn-orig-ctx takes the model's original context in tokens, a whole number "
                                f">= 0 (0: the one it was trained with), got {yarn_orig_ctx!r}")
        pairs.append(("yarn_orig_ctx", yarn_orig_ctx))
    # negative: the model's own (or, for the extrapolation mix, what the scaling type implies), as llama.cpp
    for flag, name, value in (("--yarn-ext-factor", "yarn_ext_factor", yarn_ext_factor),
                              ("--yarn-attn-factor", "yarn_attn_factor", yarn_attn_factor),
                              ("--yarn-beta-slow", "yarn_beta_slow", yarn_beta_slow),
                              ("--yarn-beta-fast", "yarn_beta_fast", yarn_beta_fast)):
        if value is not None:
            pairs.append((name, _finite(flag, value)))
    return tuple(pairs)


def _finite(flag: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise GgufspecError(f"{flag} takes a finite number, got {value!r}")
    return float(value)


def _positive(flag: str, value) -> float:
    if _finite(flag, value) <= 0:
        raise GgufspecError(f"{flag} must be above 0, got {value!r}")
    return float(value)


# ---------------------------------------------------------------- --override-kv

def kv_overrides(values: Sequence[str] | str = ()) -> tuple[tuple[str, bool | int | float | str], ...]:
    """--override-kv's values (each a comma-separated list, as llama.cpp reads it with parse_csv_row) as
    (GGUF key, value) pairs, the value's Python type the override's (llama_cpp.Llama's kv_overrides). A key
    given twice with two values is refused (llama.cpp would keep the first without a word)."""
    found: dict[str, bool | int | float | str] = {}
    given = (values,) if isinstance(values, str) else values if isinstance(values, (tuple, list)) else (values,)
    for value in given:
        if not isinstance(value, str):
            raise GgufspecError(f"--override-kv takes KEY=TYPE:VALUE text, got {value!r}")
        for item in next(csv.reader([value]), None) or [""]:
            key, parsed = parse_kv_override(item)
            if key in found and (found[key], type(found[key])) != (parsed, type(parsed)):
                raise GgufspecError(f"--override-kv gives {key} twice, as {found[key]!r} and {parsed!r}: give one")
            found[key] = parsed
    return tuple(found.items())


def parse_kv_override(item: str) -> tuple[str, bool | int | float | str]:
    """KEY=TYPE:VALUE (common.cpp's string_parse_kv_override): int, float, bool (true or false) or str
    (127 bytes at most). Stricter than llama.cpp's atol/atof, which read "12abc" as 12 and "abc" as 0."""
    key, equals, typed = item.partition("=")
    kind, colon, text = typed.partition(":")
    example = "e.g. --override-kv tokenizer.ggml.add_bos_token=bool:false"
    if not equals or not key or not colon or kind not in KV_OVERRIDE_TYPES:
        raise GgufspecError(f"--override-kv {item!r}: give KEY=TYPE:VALUE, TYPE one of {', '.join(KV_OVERRIDE_TYPES)} "
                            f"({example}; several comma-separated)")
    if len(key.encode()) > KV_TEXT_MAX:
        raise GgufspecError(f"--override-kv {item!r}: the key is longer than llama.cpp's {KV_TEXT_MAX} bytes")
    try:
        return key, _kv_value(kind, text)
    except ValueError:
        raise GgufspecError(f"--override-kv {item!r}: {text!r} is no {kind} value"
                            + (" (true or false)" if kind == "bool" else "")) from None


def _kv_value(kind: str, text: str) -> bool | int | float | str:
    if kind == "int":
        number = int(text)
        if not -INT64 <= number < INT64:  # val_i64
            raise ValueError(text)
        return number
    if kind == "float":
        number = float(text)
        if not math.isfinite(number):
            raise ValueError(text)
        return number
    if kind == "bool":
        if text not in ("true", "false"):
            raise ValueError(text)
        return text == "true"
    if len(text.encode()) > KV_TEXT_MAX:
        raise ValueError(text)
    return text


# ---------------------------------------------------------------- -sm, -mg, -ts, -dev, -devd

def tensor_split(value: str | Sequence[float] | None) -> tuple[float, ...] | None:
    """-ts N0,N1,...: each device's share of the offloaded layers (llama.cpp splits at commas and slashes);
    None where not given."""
    if value is None:
        return None
    items = re.split(r"[,/]+", value) if isinstance(value, str) else list(value)
    try:
        shares = tuple(float(item) for item in items)
    except (TypeError, ValueError):
        shares = ()
    if not shares or not all(math.isfinite(s) and s >= 0 for s in shares):
        raise GgufspecError(f"-ts/--tensor-split takes each device's share, numbers >= 0 separated by commas "
                            f"(e.g. -ts 3,1), got {value!r}")
    if len(shares) > llama_cpp.LLAMA_MAX_DEVICES:
        raise GgufspecError(f"-ts/--tensor-split {value}: {len(shares)} shares, but llama.cpp takes "
                            f"{llama_cpp.LLAMA_MAX_DEVICES} devices at most")
    return shares


def split_fields(split_mode: str | None, main_gpu: int | None) -> dict:
    """-sm and -mg as LoadParams fields (none given: {})."""
    fields = {}
    if split_mode is not None:
        if split_mode not in placement.SPLIT_MODES:
            raise GgufspecError(f"-sm/--split-mode takes {', '.join(placement.SPLIT_MODES)}, got {split_mode!r}")
        fields["split_mode"] = split_mode
    if main_gpu is not None:
        if isinstance(main_gpu, bool) or not isinstance(main_gpu, int) or main_gpu < 0:
            raise GgufspecError(f"-mg/--main-gpu takes a device index >= 0 (-dev none: no GPU), got {main_gpu!r}")
        fields["main_gpu"] = main_gpu
    return fields


def check_split(fields: dict, rpc: str | None) -> None:
    """What llama.cpp would refuse as the model loads, said before: -sm tensor with no device to split the
    weights across, -sm none's -mg past the devices. With --rpc the workers' devices are known only later."""
    if rpc is not None or fields.get("split_mode") not in ("tensor", "none"):
        return
    names = fields.get("device_names")
    devices = list(names) if names is not None else [d.name for d in placement.default_devices()]
    if fields["split_mode"] == "tensor" and not devices:
        raise GgufspecError("-sm tensor splits the weights across GPUs, and there is none to offload to here "
                            "(--list-devices): leave -sm out")
    main_gpu = fields.get("main_gpu", 0)
    if fields["split_mode"] == "none" and devices and main_gpu >= len(devices):
        raise GgufspecError(f"-mg {main_gpu}: there are {len(devices)} devices to choose from "
                            f"({', '.join(devices)}), counted from 0")


def fields_by_role(options) -> tuple[dict, dict]:
    """The LoadParams fields these flags give the target and the draft (`ModelOptions`: its fields of
    the flags' names), checked; the rest of `session.load_flags_by_role`."""
    rope = rope_keywords(options.rope_scaling, options.rope_scale, options.rope_freq_base, options.rope_freq_scale,
                         options.yarn_orig_ctx, options.yarn_ext_factor, options.yarn_attn_factor,
                         options.yarn_beta_slow, options.yarn_beta_fast)
    shared = dict(rope=rope, kv_overrides=kv_overrides(options.override_kv),
                  **split_fields(options.split_mode, options.main_gpu))
    target, draft = _devices_by_role(options, dict(shared), dict(shared))
    check_split(target, options.rpc)
    check_split(draft, options.rpc)
    cpu_target, cpu_draft = cpu_fields_by_role(options)  # -nkvo, -nr, --numa, -C, --prio, -ncffn... (`cpuflags`)
    target.update(cpu_target)
    draft.update(cpu_draft)
    return target, draft


def _devices_by_role(options, target: dict, draft: dict) -> tuple[dict, dict]:
    """-ts, -dev and -devd added to each model's fields."""
    shares = tensor_split(options.tensor_split)
    if shares is not None:
        target["tensor_split"] = shares
        if options.rpc is None:  # on --rpc's workers the target's devices are not the (local) draft's
            draft["tensor_split"] = shares
    if options.device is not None:
        if options.rpc is not None:
            raise GgufspecError("-dev and --rpc: --rpc puts the target on its workers, then this machine's GPUs; "
                                "share the layers among them with -ts, or leave --rpc out")
        target["device_names"] = draft["device_names"] = placement.parse_devices(options.device, "-dev")
    if options.device_draft is not None:
        draft["device_names"] = placement.parse_devices(options.device_draft, "-devd")
        if len(draft["device_names"]) == 1:  # as llama.cpp: a draft on one device needs no -sm tensor wrapper
            draft["split_mode"] = "layer"
    return target, draft


def offload_given(options) -> tuple[int | None, int | None]:
    """-ngl and -ngld as given, 0 where -dev none (-devd none for the draft, which follows -dev) leaves
    no device to offload to: llama.cpp keeps such a model on the CPU whatever -ngl says. With -fit off, -1
    (every layer) where not given and there is a GPU here: llama.cpp's -ngl auto, unfitted."""
    no_device = options.device is not None and placement.parse_devices(options.device) == ()
    draft_none = no_device if options.device_draft is None else placement.parse_devices(options.device_draft) == ()
    fit = getattr(options, "fit", None)
    unset = -1 if fit is not None and not fit_setting(fit) and placement.default_devices() else None
    ngl, ngld = options.n_gpu_layers, options.n_gpu_layers_draft
    return (0 if no_device else unset if ngl is None else ngl), (0 if draft_none else unset if ngld is None else ngld)
