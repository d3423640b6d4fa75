"""Opening the two models as `llama_cpp.Llama` objects, and checking that they can be paired."""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Sequence

import llama_cpp

from . import lora
from .errors import GgufspecError, IncompatibleModelsError, ModelFileError
from .ggufheader import cut_short
from .gguffiles import check_gguf
from .llamalog import FD2_SWAP, allocation_failures, ignored_overrides, interrupt_after_native, quiet_llama_logs
from .native import Context
from .placement import (SPLIT_MODES, apply_process_placement, devices_named, numa_strategy, override_array,
                        overrides_tag)
# the chat template (its own module): re-exported, readers call load.chat_template and load.render_chat
from .chat_templates import (DEFAULT_CHAT_TEMPLATE, ChatTemplate, chat_prompt, chat_template,  # noqa: F401
                             check_messages, checked_chat_template, render_chat, system_in_first_user,
                             use_chat_template)

# llama.cpp's speculative example allows this much vocabulary size difference, and compares token
# texts from this id up (ids below it are often special tokens that differ harmlessly).
VOCAB_MAX_SIZE_DIFFERENCE = 128
VOCAB_CHECK_START_TOKEN_ID = 5


@dataclass(frozen=True)
class LoadParams:
    n_ctx: int = 4096
    n_threads: int | None = None
    n_gpu_layers: int = 0
    n_batch: int = 512  # -b: the most tokens one llama_decode takes (a prompt goes in chunks of it; K + 1 at most)
    # -ub: the tokens llama.cpp computes at once, a batch split into these (None: n_batch, at most n_batch)
    n_ubatch: int | None = None
    n_threads_batch: int | None = None  # -tb: threads for a batch (a prompt, a verification); None: n_threads
    use_mmap: bool = True               # False (--no-mmap): read the weights into memory, not mapped from the file
    use_mlock: bool = False             # --mlock: keep the weights in RAM, never swapped out
    type_k: str = "f16"                 # -ctk / -ctv: the KV cache's element types (KV_CACHE_TYPES)
    type_v: str = "f16"
    strict: bool = False  # verify token by token (n_ubatch=1): bit-identical to the target alone
    flash_attn: str = "auto"  # on | off | auto (llama.cpp's default: on where the backend has it)
    devices: tuple | None = None       # RPC workers (and local GPUs) to place layers on; None: llama.cpp's default
    tensor_split: tuple | None = None  # how those devices share the offloaded layers (one weight each)
    # a sliding-window model's cache holds the window only, as llama-server's default; True keeps
    # every position (llama.cpp's --swa-full: more memory, any prefix reusable without checkpoints)
    swa_full: bool = False
    # recurrent rollback snapshots per sequence (llama.cpp's n_rs_seq, where the architecture has
    # them); 0: roll back by saving and restoring the recurrent state
    n_rs_seq: int = 0
    # load the GGUF's MTP (nextn) blocks too, for drafting with them (`mtp`); llama.cpp skips them by
    # default, and an MTP context over a model loaded without them aborts the process
    load_mtp: bool = False
    # --exact: a batch computed by the kernels a single token uses, so that on the CPU a verification
    # batch's logits equal the single-token ones bit for bit (see `exact_kernels`)
    exact: bool = False
    # sequences the context holds at once (serve --parallel's slots); above 1 they share one cache of
    # n_ctx cells (llama.cpp's unified KV cache, llama-server's default): each may grow to n_ctx.
    # Strict or exact: a cache of n_ctx cells per sequence instead, so that where a sequence's tokens
    # lie in the cache (the order attention sums them in) does not depend on the other sequences
    n_seq: int = 1
    # False: a cache per sequence even without strict/exact (llama.cpp's kv_unified=false; measured
    # no faster on a CPU: docs/benchmarks.md, "Many at once")
    kv_unified: bool = True
    # LoRA adapters, (path, scale) each (--lora, --lora-scaled), loaded with the model and set on its
    # context (`lora`); given to the target only
    lora: tuple = ()
    # tensor buffer type overrides, (regex, buffer type name) each, first match wins (-ot, --cpu-moe,
    # --n-cpu-moe; the draft's -otd...: `placement`): an MoE's experts kept on the CPU, the rest offloaded
    tensor_overrides: tuple = ()
    # RoPE/YaRN context extension (--rope-scaling, --rope-freq-base...: `modelflags.rope_keywords`), as
    # (llama_context_params field, value) pairs, which are llama_cpp.Llama's keywords too
    rope: tuple = ()
    # --override-kv: (GGUF key, value) pairs, the value's Python type the override's (bool, int, float, str)
    kv_overrides: tuple = ()
    split_mode: str = "layer"          # -sm: how several GPUs share the model (placement.SPLIT_MODES)
    main_gpu: int = 0                  # -mg: the GPU of -sm none, or of -sm row's intermediate results
    device_names: tuple | None = None  # -dev: the devices offloaded to, by name (() none: the CPU only)
    # llama_context_params / llama_model_params fields by their names (`cpuflags`: -nkvo, --no-op-offload,
    # --no-perf, -nr, --no-host, --check-tensors, -lzm): llama.cpp's defaults. --exact's target is never repacked
    offload_kqv: bool = True
    op_offload: bool = True
    no_perf: bool = False
    repack: bool = True
    no_host: bool = False
    check_tensors: bool = False
    lazy_mode: str = "auto"            # on | auto | off (LAZY_MODES)
    # the process's, set as the model loads (`placement`): --numa's strategy, -C/-Cr's CPUs, --prio's priority
    numa: str | None = None
    cpus: tuple | None = None
    priority: int = 0


# the RoPE/YaRN fields of llama_context_params (and Llama's keywords) that `rope` may set
ROPE_FIELDS = ("rope_scaling_type", "rope_freq_base", "rope_freq_scale", "yarn_ext_factor", "yarn_attn_factor",
               "yarn_beta_fast", "yarn_beta_slow", "yarn_orig_ctx")
# llama.cpp's tools leave these at -1, "the model's own" (llama_context_default_params); llama_cpp.Llama's
# defaults (1, 32, 1) would override a GGUF's own YaRN parameters
YARN_FROM_MODEL = {"yarn_attn_factor": -1.0, "yarn_beta_fast": -1.0, "yarn_beta_slow": -1.0}


LAZY_MODES = {"off": llama_cpp.LLAMA_LAZY_MODE_OFF, "auto": llama_cpp.LLAMA_LAZY_MODE_AUTO,
              "on": llama_cpp.LLAMA_LAZY_MODE_ON}
FLASH_ATTN_TYPES = {"auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                    "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED}


# llama.cpp's KV cache types (common/arg.cpp's kv_cache_types: what -ctk/-ctv take), by ggml's names
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
FLOAT_CACHE_TYPES = ("f32", "f16", "bf16")  # the others are quantized: blocks of 32 elements


def cache_type(name: str) -> int:
    """A -ctk/-ctv name as ggml's type id (llama_context_params.type_k/type_v)."""
    if name not in KV_CACHE_TYPES:
        raise GgufspecError(f"a KV cache type is one of {', '.join(KV_CACHE_TYPES)}, got {name!r}")
    import gguf
    return int(gguf.GGMLQuantizationType[name.upper()])


def check_cache_types(type_k: str, type_v: str, flash_attn: str, flag: str = "-ctv") -> None:
    """Cache types llama.cpp would refuse fail here in one line. A quantized V cache needs flash
    attention: llama.cpp switches -fa auto on for it, and fails the load with -fa off."""
    cache_type(type_k)
    cache_type(type_v)
    if flash_attn in ("off", False) and type_v not in FLOAT_CACHE_TYPES:
        raise GgufspecError(f"{flag} {type_v}: a quantized V cache needs flash attention, and -fa is off: "
                            f"use -fa on (or auto), or a V cache of {', '.join(FLOAT_CACHE_TYPES)}")


def with_flags(target: LoadParams, draft: LoadParams, flags: dict | None) -> tuple[LoadParams, LoadParams]:
    """The two models' LoadParams with llama.cpp's load flags applied by role (flags["target"]: fields
    of the target's, e.g. {"type_k": "q8_0"}; flags["draft"] the draft's)."""
    flags = flags or {}
    return replace(target, **flags.get("target", {})), replace(draft, **flags.get("draft", {}))


# load flags that change what a step costs (flash attention, the micro-batch, the cache types, the batch threads,
# where the tensors and the KV cache live, the kernels, the CPUs): part of the key under which --draft auto
# remembers a machine's step costs
COST_FLAGS = ("flash_attn", "n_ubatch", "n_threads_batch", "type_k", "type_v", "n_threads", "tensor_overrides",
              "kv_overrides", "split_mode", "main_gpu", "tensor_split", "device_names", "offload_kqv", "op_offload",
              "repack", "no_host", "lazy_mode", "numa", "cpus", "priority")


def flags_tag(flags: dict | None) -> str:
    """The load flags that change step costs, as a costs key's tag ("" for llama.cpp's defaults)."""
    defaults = {"flash_attn": "auto", "n_ubatch": 512, "type_k": "f16", "type_v": "f16", "tensor_overrides": (),
                "kv_overrides": (), "split_mode": "layer", "main_gpu": 0, "offload_kqv": True, "op_offload": True,
                "repack": True, "no_host": False, "lazy_mode": "auto", "priority": 0}
    return "".join(f",{role[0]}{name}={_tag_value(name, value)}"
                   for role, fields in sorted((flags or {}).items()) for name, value in sorted(fields.items())
                   if name in COST_FLAGS and value is not None and defaults.get(name) != value)


def _tag_value(name: str, value) -> str:
    """A flag's value in a costs key: lists of pairs (the overrides) by a short hash, other lists joined."""
    if name in ("tensor_overrides", "kv_overrides"):
        return overrides_tag(value)
    return "/".join(map(str, value)) if isinstance(value, tuple) else str(value)


def resolved_flash_attn(params: LoadParams) -> str:
    """-fa auto as ggufspec takes it: off where this machine's CPU computes every layer, else llama.cpp's auto
    (on where the backend has it). llama.cpp's CPU flash attention walks the cache once per query row below
    its 64-row tiles, so at depth the batches speculation verifies cost more with it: at 1,500 tokens of
    context a batch of 4 rows 1.1-1.3x, of 16 1.5-1.7x the matrix products' time, one token and a prompt the
    same within 6% (docs/benchmarks.md, round 29). Left on where it is needed: --exact, a quantized V cache."""
    if params.flash_attn != "auto" or params.exact or params.type_v not in FLOAT_CACHE_TYPES:
        return params.flash_attn
    on_cpu = params.n_gpu_layers == 0 and params.devices is None and not params.device_names
    return "off" if on_cpu else "auto"


def flash_attn_type(setting: str | bool) -> int:
    """-fa on|off|auto (or a bool) as llama.cpp's enum."""
    if isinstance(setting, bool):
        setting = "on" if setting else "off"
    if setting not in FLASH_ATTN_TYPES:
        raise GgufspecError(f"-fa/--flash-attn takes on, off or auto, got {setting!r}")
    return FLASH_ATTN_TYPES[setting]


@contextlib.contextmanager
def _params_set(built_by: str, set_fields):
    """For the next load only, `set_fields(params)` before llama-cpp-python's `_internals.<built_by>(params=...)`
    builds the model (LlamaModel) or its context (LlamaContext): the fields Llama(...) has no argument for."""
    from llama_cpp import _internals
    original = getattr(_internals, built_by)

    def with_fields(*args, params, **kwargs):
        set_fields(params)
        return original(*args, params=params, **kwargs)
    setattr(_internals, built_by, with_fields)
    try:
        yield
    finally:
        setattr(_internals, built_by, original)


def _model_params(load: LoadParams, overrides=None):
    """llama_model_params' load_mtp (the MTP blocks), use_extra_bufts (repacking: never under --exact),
    check_tensors, no_host, lazy_mode and tensor_buft_overrides (`placement.override_array`, kept alive by
    the caller), for the next load."""
    def set_fields(params):
        params.load_mtp = params.load_mtp or load.load_mtp
        params.use_extra_bufts = params.use_extra_bufts and load.repack and not load.exact
        params.check_tensors, params.no_host = load.check_tensors, load.no_host
        params.lazy_mode = LAZY_MODES[load.lazy_mode]
        if overrides is not None:
            params.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p).value
    return _params_set("LlamaModel", set_fields)


def _context_params(flash_attn: int, n_rs_seq: int = 0, n_seq: int = 1, unified: bool = True):
    """llama_context_params' flash-attention type, recurrent-state cells and sequences, for the next load.
    Llama(flash_attn=...) is a bool (on or off); llama.cpp's own default, auto (on where the backend
    supports it: CUDA, Metal, CPU), is not reachable through it."""
    def set_fields(params):
        params.flash_attn_type = flash_attn
        if n_rs_seq and hasattr(params, "n_rs_seq"):
            params.n_rs_seq = n_rs_seq
        if n_seq > 1:
            params.n_seq_max, params.kv_unified = n_seq, unified
    return _params_set("LlamaContext", set_fields)


# --exact: at most this many tokens a llama_decode step (ubatch). From 64 query rows of a sequence
# (GGML_FA_TILE_Q) llama.cpp's CPU flash attention takes a tiled kernel that rounds otherwise, so a
# prompt's longer batch (and the cache it leaves) would differ from the same tokens in shorter ones.
EXACT_UBATCH = 32


def exact_kernels(path: Path, role: str) -> None:
    """Make llama.cpp's CPU backend compute a batch with the kernels of a single token, for models
    loaded from now on. A batch differs from single tokens where it takes other kernels: weights
    repacked for tiled products (llama_model_params.use_extra_bufts, switched off per model in
    `_model_params`), and the tiled K-quant matmul taken from 8 rows up (GGML_CPU_TILED_MM=0, read
    once per process, at its first matrix product: set here, before any). Flash attention must be
    on: without it the attention's matrix products are batched too. Measured: docs/benchmarks.md.
    What cannot be switched off is refused: float weights (llamafile's kernels take their batches)."""
    if os.environ.get("GGML_CPU_TILED_MM") != "0" and _opened_with_tiled_products:
        raise GgufspecError("--exact: a model opened earlier in this process without it may have fixed "
                            "llama.cpp's kernels (read once per process): open the --exact one in a fresh process")
    os.environ["GGML_CPU_TILED_MM"] = "0"
    kind = float_weights(path) if role == "target" else None
    if kind and b"LLAMAFILE = 1" in llama_cpp.llama_print_system_info():
        raise GgufspecError(f"--exact: the target's weights are {kind}, whose batches llama.cpp multiplies with "
                            f"llamafile's kernels, single tokens without: use --strict for bit identity")


_opened_with_tiled_products: list[str] = []  # models opened while GGML_CPU_TILED_MM was not 0


def float_weights(path: Path) -> str | None:
    """F32, F16 or BF16 where a model's first layer's matrices are of that type; None where quantized."""
    from gguf import GGUFReader
    reader = GGUFReader(path)
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.0.") and tensor.name.endswith(("attn_q.weight", "ffn_down.weight")):
            return tensor.tensor_type.name if tensor.tensor_type.name in ("F32", "F16", "BF16") else None
    return None


def default_threads() -> int:
    import psutil
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def check_gguf_file(path: str | os.PathLike, role: str) -> Path:
    return check_gguf(path, f"{role} model", error=ModelFileError)


def open_model(path: str | os.PathLike, role: str, params: LoadParams, *, strict: bool = False) -> llama_cpp.Llama:
    path = check_gguf_file(path, role)
    adapters = lora.checked(params.lora)  # before the model loads
    check_cache_types(params.type_k, params.type_v, params.flash_attn, "-ctv" if role == "target" else "-ctvd")
    if params.exact:
        if params.flash_attn == "off":
            raise GgufspecError("--exact needs flash attention (-fa on or auto): without it attention is batched too")
        lora.check_exact(adapters)
        exact_kernels(path, role)
    elif os.environ.get("GGML_CPU_TILED_MM") != "0":
        _opened_with_tiled_products.append(str(path))
    quiet_llama_logs()
    # resolved by name now: RPC workers' buffer types exist once they are registered (an unknown one: one line)
    overrides = override_array(params.tensor_overrides, "-ot" if role == "target" else "-otd", path) \
        if params.tensor_overrides else None
    # RPC workers, or -dev's devices (resolved by name: handles are this process's)
    devices = params.devices if params.devices is not None or params.device_names is None \
        else devices_named(params.device_names)
    apply_process_placement(params.cpus, params.priority)  # -C/-Cr, --prio: the process's, before it loads
    allocation_failures()  # an earlier load's are not this one's
    ignored_overrides()
    try:
        unified = params.kv_unified and not (strict or params.strict or params.exact)
        options = _llama_options(params, strict, unified)
        with _context_params(flash_attn_type(resolved_flash_attn(params)), params.n_rs_seq, params.n_seq, unified), \
                _model_params(params, overrides), interrupt_after_native(), FD2_SWAP:  # it points fd 2 elsewhere
            if devices is not None:  # placed on chosen devices: a loading concern, same Llama
                llm = load_on_devices(path, devices, **options)
            else:
                llm = llama_cpp.Llama(model_path=str(path), **options)
    except (ValueError, RuntimeError, MemoryError) as exc:  # MemoryError: llama-cpp-python's n_ctx-long arrays
        raise ModelFileError(f"llama.cpp could not load the {role} model {path}: {load_failure(exc, params, path)}") from None
    llm._ggufspec_tensor_overrides = overrides  # llama.cpp reads the patterns while loading; kept with the model
    _check_overrides_taken(llm, role)
    if adapters:
        lora.attach(llm, adapters)
    return llm


def micro_batch(params: LoadParams, strict: bool = False) -> int:
    """n_ubatch as loaded: 1 under strict (each row computed alone); at most EXACT_UBATCH under exact;
    else -ub, or n_batch where none was given (llama.cpp caps it at n_batch)."""
    asked = min(params.n_ubatch or params.n_batch, params.n_batch)
    return 1 if strict else min(asked, EXACT_UBATCH) if params.exact else asked


def _llama_options(params: LoadParams, strict: bool, unified: bool) -> dict:
    """llama_cpp.Llama's keyword arguments for `params`."""
    n_ctx = params.n_ctx if unified else params.n_ctx * params.n_seq
    n_ubatch = micro_batch(params, strict)
    if params.n_rs_seq and n_ubatch <= params.n_rs_seq:  # llama.cpp asserts (aborts) in the first batch
        raise GgufspecError(f"n_rs_seq {params.n_rs_seq} needs micro-batches of more than {params.n_rs_seq} "
                            f"tokens, but they are {n_ubatch}" + (" (--strict)" if strict else "")
                            + ": leave n_rs_seq 0 (snapshots) or raise -ub (n_ubatch)")
    # bit-exact (--strict, --exact): a window-sized cache, once it wraps, refills freed cells out of
    # position order, and attention sums the cells in cell order: another rounding than alone
    swa_full = params.swa_full or strict or params.strict or params.exact
    threads = params.n_threads or default_threads()
    return dict(n_ctx=n_ctx, n_batch=params.n_batch, n_ubatch=n_ubatch, n_threads=threads,
                n_threads_batch=params.n_threads_batch or threads, n_gpu_layers=params.n_gpu_layers,
                use_mmap=params.use_mmap, use_mlock=params.use_mlock, type_k=cache_type(params.type_k),
                type_v=cache_type(params.type_v), logits_all=False, verbose=False, swa_full=swa_full,
                split_mode=SPLIT_MODES[params.split_mode], main_gpu=params.main_gpu,
                tensor_split=list(params.tensor_split) if params.tensor_split else None,
                kv_overrides=dict(params.kv_overrides) or None, offload_kqv=params.offload_kqv,
                op_offload=params.op_offload, no_perf=params.no_perf, numa=numa_strategy(params.numa),
                **{**YARN_FROM_MODEL, **dict(params.rope)})


def _check_overrides_taken(llm: llama_cpp.Llama, role: str) -> None:
    """An --override-kv of another type than llama.cpp reads its key as is dropped with a warning in its
    log (the file's value used): one line instead, the model closed."""
    ignored = ignored_overrides()
    if ignored:
        key, expected, given = ignored[0]
        llm.close()
        raise GgufspecError(f"--override-kv {key}={given}:...: llama.cpp reads the {role}'s {key} as {expected}, "
                            f"so it would ignore the override: give {key}={expected}:VALUE")


def load_failure(exc: Exception, params: LoadParams, path=None) -> str:
    """Why a load failed: where the memory ran out, when llama.cpp's log said so (its exception says
    only "Failed to load model from file"), or a file cut short, with what to change; else llama.cpp's words."""
    failed = allocation_failures()
    if path is not None and "model" in str(exc) and (short := cut_short(path)):
        return (f"the file is cut short ({short[0]:,} of the {short[1]:,} bytes its header describes): download "
                f"it again (`ggufspec pull` resumes a partial download)")
    if not failed:
        memory = "context" in str(exc) or isinstance(exc, MemoryError)
        hint = f" (-c {params.n_ctx}: a smaller context needs less memory)" if memory else ""
        if "context" in str(exc) and params.type_v not in FLOAT_CACHE_TYPES + (params.type_k,):
            hint += f"; this model may need the same K and V cache types, not {params.type_k} and {params.type_v}"
        if params.check_tensors and "model" in str(exc):
            hint += "; --check-tensors: a weight may hold NaN or inf values (-v: llama.cpp's log names it)"
        if params.tensor_overrides and "model" in str(exc):  # llama.cpp compiles them as it loads
            hint += ("; check the -ot/-otd patterns for Python-only regex syntax ((?P<name>...), (?<=...), \\A...): "
                     "llama.cpp compiles them as ECMAScript regexes")
        return f"{str(exc) or 'out of memory'}{hint}"
    buffer, size = failed[0]
    if worker := re.fullmatch(r"RPC\d*\[(.+)\]", buffer):
        return (f"the RPC worker {worker[1]} ran out of memory: it could not allocate {size / 2 ** 20:.1f} MiB; free "
                f"memory on it, start it with the --mem it really has (the layers are split by what the workers "
                f"report), or send fewer layers to the workers with -ngl N")
    fix = "a smaller context" if buffer.startswith("CPU") else "fewer layers there (-ngl N) or a smaller context"
    return f"{buffer} ran out of memory: it could not allocate {size / 2 ** 20:.1f} MiB; use {fix} (-c, now {params.n_ctx})"


def check_compatible(target: Context, draft: Context) -> None:
    """The checks llama.cpp makes before pairing two models (common_speculative_are_compatible): a BOS
    or EOS id counts only where it is added (see `fingerprint.DECISIVE`)."""
    t, d = target.vocab, draft.vocab
    if llama_cpp.llama_vocab_type(t) != llama_cpp.llama_vocab_type(d):
        raise IncompatibleModelsError("draft and target use different vocabulary types")
    for what, added, get in (("BOS", llama_cpp.llama_vocab_get_add_bos, llama_cpp.llama_vocab_bos),
                             ("EOS", llama_cpp.llama_vocab_get_add_eos, llama_cpp.llama_vocab_eos)):
        if bool(added(t)) != bool(added(d)):
            raise IncompatibleModelsError(f"draft and target add-{what} flags differ")
        if added(t) and get(t) != get(d):
            raise IncompatibleModelsError(f"draft and target {what} ids differ: {get(d)} vs {get(t)}")
    if abs(target.n_vocab - draft.n_vocab) > VOCAB_MAX_SIZE_DIFFERENCE:
        raise IncompatibleModelsError(
            f"vocabulary sizes differ by more than {VOCAB_MAX_SIZE_DIFFERENCE}: "
            f"target {target.n_vocab}, draft {draft.n_vocab}")
    for token in range(VOCAB_CHECK_START_TOKEN_ID, min(target.n_vocab, draft.n_vocab)):
        t_text, d_text = target.token_text(token), draft.token_text(token)
        if t_text != d_text:
            raise IncompatibleModelsError(
                f"the vocabularies differ at token {token}: target {t_text.decode(errors='replace')!r}, "
                f"draft {d_text.decode(errors='replace')!r} (target {target.n_vocab} tokens, draft "
                f"{draft.n_vocab}); pair models of the same family (see `ggufspec list`)")


def tokenize(llm: llama_cpp.Llama, text: str) -> list[int]:
    """As llama.cpp's tools do: the model's own BOS rule, special tokens in the text parsed."""
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    bos = llama_cpp.llama_vocab_bos(vocab)
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
    if len(tokens) > 1 and tokens[0] == bos and tokens[1] == bos:  # a template that writes BOS itself
        tokens = tokens[1:]
    return tokens


# ---------------------------------------------------------------- what a loaded model is (GET /props)

def gpu_offload_supported() -> bool:
    """Whether this llama.cpp build can place layers off the CPU (a GPU or RPC backend)."""
    return bool(llama_cpp.llama_supports_gpu_offload())


def layer_count(llm: llama_cpp.Llama) -> int:
    return llama_cpp.llama_model_n_layer(llm._model.model)


def offloaded_layers(llm: llama_cpp.Llama) -> int:
    """How many layers run off the CPU; the output layer counts as one more, as in llama.cpp's -ngl."""
    requested = llm.model_params.n_gpu_layers  # -1 was stored as INT32_MAX: every layer
    return min(requested, layer_count(llm) + 1) if gpu_offload_supported() else 0


def model_description(llm: llama_cpp.Llama) -> str:
    """llama.cpp's one-line description of the model: architecture, size, quantization."""
    desc = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(llm._model.model, desc, len(desc))
    return desc.value.decode(errors="replace")


def parameter_count(llm: llama_cpp.Llama) -> int:
    return llama_cpp.llama_model_n_params(llm._model.model)


def weights_size(llm: llama_cpp.Llama) -> int:
    """The model's tensors, in bytes."""
    return llama_cpp.llama_model_size(llm._model.model)


# ---------------------------------------------------------------- loading onto chosen ggml devices

@contextlib.contextmanager
def model_devices(devices: Sequence) -> Iterator[ctypes.Array]:
    """Within it, every llama_cpp.Llama(...) loads onto exactly `devices` (plus the local CPU).

    llama-cpp-python's Llama has no devices argument; it builds its params from
    llama_model_default_params(), which we wrap to fill in the NULL-terminated device array.
    Not thread-safe: load one model at a time inside it.
    """
    import llama_cpp.llama_cpp as low_level
    array = (ctypes.c_void_p * (len(devices) + 1))(*[d.handle for d in devices], None)
    original = low_level.llama_model_default_params

    def params_with_devices():
        params = original()
        params.devices = ctypes.cast(array, ctypes.c_void_p).value
        return params

    low_level.llama_model_default_params = params_with_devices
    try:
        yield array
    finally:
        low_level.llama_model_default_params = original


def load_on_devices(model_path: str | os.PathLike, devices: Sequence, **llama_kwargs) -> llama_cpp.Llama:
    """A llama_cpp.Llama on ggml `devices` (anything with a `handle`: e.g. rpc.target_devices(...)) and the local CPU.

    n_gpu_layers (in llama_kwargs) says how many blocks leave the CPU; tensor_split (one weight
    per device, same order) how they are shared; by default llama.cpp shares by free memory.
    """
    with model_devices(devices) as array, FD2_SWAP:
        llm = llama_cpp.Llama(model_path=str(model_path), **llama_kwargs)
    llm._ggufspec_devices = array  # llama.cpp copied the pointers; keep the array anyway
    return llm
