"""One assembly of a decoder from options: what `run`, `chat`, `serve`, `bench` and `eval` all open.

    ModelOptions --resolve--> files (a registry pair, -m/-md paths, hub references pulled)
                 --plan-----> -ngl / -ngld (the planner, where this build can offload and none was given)
                 --rpc------> the target's layers across workers (checked before anything loads)
                 --open-----> SpeculativeDecoder, its layers placed, in a Session

The engine (`speculate`) knows nothing of the registry, the store, the planner or RPC: they are
loading and placement concerns, and they live here.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import cvec
from .cpuflags import CpuLoadFlags
from .errors import GgufspecError
from .lora import checked as checked_lora
from .modelflags import fields_by_role, offload_given
from .ngram import DEFAULT_POOL_SIZE, NgramPool
from .speculate import MTP, SpeculativeDecoder

Log = Callable[[str], None]


def _stderr(line: str) -> None:
    sys.stderr.write(line + "\n")


@dataclass
class ModelOptions(CpuLoadFlags):
    """The models and how they load (the CLI's model flags; the Python API's keywords)."""

    pair: str | None = None
    model: str | None = None            # -m: a GGUF path, hf://OWNER/REPO/FILE.gguf or OWNER/REPO:QUANT
    model_draft: str | None = None      # -md; with -m alone, one is chosen (`finddraft`)
    draft_dir: str | None = None        # --draft-dir: a folder of drafts to choose from, besides the store
    no_draft: bool = False              # the target alone: no draft model is loaded
    needs_draft_model: bool = True      # False for n-gram lookup alone: no draft model is loaded either
    lookup_pool: int = DEFAULT_POOL_SIZE  # --lookup-pool: n-grams the decoder's shared pool keeps
    n_ctx: int = 4096
    n_threads: int | None = None
    n_gpu_layers: int | None = None     # None: planned
    n_gpu_layers_draft: int | None = None
    flash_attn: str = "auto"
    rpc: str | None = None              # HOST:PORT[,...]: the target's layers go to these workers
    rpc_timeout: float | None = None    # with rpc: no progress for this long ends the process (a hung worker)
    strict: bool = False
    exact: bool = False                 # --exact: batches computed as single tokens are (CPU), greedy bit-identical
    swa_full: bool = False              # full-size caches for sliding-window layers (default: window-sized)
    n_parallel: int = 1                 # -np/--parallel: sequences decoded at once (serve's slots)
    chat_template: str | None = None    # --chat-template(-file): rendered instead of the target's own (Jinja)
    # llama.cpp's load flags. As in llama.cpp the draft shares -b, -ub, --mlock and --no-mmap, its threads
    # default to the target's, and its cache types are its own (f16 unless -ctkd / -ctvd)
    n_batch: int | None = None          # -b; None: 512 (or -ub where larger): see `load_flags_by_role`
    n_ubatch: int | None = None         # -ub; None: 512, as llama.cpp
    n_threads_batch: int | None = None  # -tb; None: n_threads
    n_threads_draft: int | None = None  # -td; None: n_threads
    n_threads_batch_draft: int | None = None  # -tbd; None: -tb
    use_mmap: bool = True               # False: --no-mmap
    use_mlock: bool = False             # --mlock
    cache_type_k: str = "f16"           # -ctk / -ctv: the target's KV cache types
    cache_type_v: str = "f16"
    cache_type_k_draft: str = "f16"     # -ctkd / -ctvd
    cache_type_v_draft: str = "f16"
    # A K was asked for (--draft 3, not auto): the draft runs even where the plan says it would not
    # pay, so it goes on the GPU beside the target (H100: K = 3 at 148 tok/s there, 30 on the CPU).
    # With auto it follows the plan: a draft left on the CPU is timed too dear to try (auto 1.03x;
    # on the GPU, probing it cost 8%).
    fixed_draft: bool = False
    # --lora / --lora-scaled: LoRA adapters on the target, (path, scale) each (`ggufspec.lora`)
    lora: tuple = ()
    # tensors placed by name (`ggufspec.placement`): -ot's PATTERN=TYPE,... values (a string or several),
    # --cpu-moe, --n-cpu-moe N; the draft's -otd, -cmoed, -ncmoed
    override_tensor: tuple | str = ()
    cpu_moe: bool = False
    n_cpu_moe: int = 0
    override_tensor_draft: tuple | str = ()
    cpu_moe_draft: bool = False
    n_cpu_moe_draft: int = 0
    # RoPE/YaRN context extension, None: the model's own (`ggufspec.modelflags`); both models get them, as
    # llama.cpp's draft context is made from the target's params
    rope_scaling: str | None = None     # --rope-scaling none | linear | yarn
    rope_scale: float | None = None     # --rope-scale N: --rope-freq-scale 1/N
    rope_freq_base: float | None = None
    rope_freq_scale: float | None = None
    yarn_orig_ctx: int | None = None
    yarn_ext_factor: float | None = None
    yarn_attn_factor: float | None = None
    yarn_beta_slow: float | None = None
    yarn_beta_fast: float | None = None
    override_kv: tuple | str = ()       # --override-kv KEY=TYPE:VALUE,... (repeatable): both models' metadata
    # several GPUs: -sm none | layer | row | tensor, -mg INDEX, -ts N0,N1,... (the draft's too, but on --rpc),
    # -dev NAME,... | none (the draft follows it unless -devd)
    split_mode: str | None = None
    main_gpu: int | None = None
    tensor_split: str | tuple | None = None
    device: str | tuple | None = None
    device_draft: str | tuple | None = None
    # control vectors on the target (`ggufspec.cvec`): --control-vector's values (paths, FNAME,... texts),
    # --control-vector-scaled's (FNAME:SCALE,... texts or (path, scale) pairs), and the layers they apply to,
    # (START, END) inclusive, 0 or less llama.cpp's default (1, the last layer)
    control_vector: tuple | str = ()
    control_vector_scaled: tuple | str = ()
    control_vector_layer_range: tuple | None = None


@dataclass
class Session:
    """An opened decoder and what it was opened from."""

    decoder: SpeculativeDecoder
    name: str                           # the pair's name, else the target file's stem (the server's model id)
    target_path: str
    draft_path: str | None
    draft_k: int | None                 # the pair's recommended K, when a registry pair was named
    # what drafts and why: {"kind": "model" | "ngram" | "none", "path": the draft's file or None, "why": ...}
    draft_choice: dict = field(default_factory=lambda: {"kind": "none", "path": None, "why": ""})

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.decoder.close()


def open_session(options: ModelOptions, *, log: Log = _stderr) -> Session:
    """Resolve, plan, connect and load. Bad input fails before any model loads."""
    if options.rpc is not None:  # "" too: one line, not a run that is silently local
        from .rpc import install_abort_message, parse_endpoints
        # before the planner asks the workers their memory (native calls that abort on a failing worker)
        install_abort_message(parse_endpoints(options.rpc))
    pool = NgramPool(options.lookup_pool)  # a bad size fails before anything loads
    flags = load_flags_by_role(options)     # bad load flags too
    lora = checked_lora(options.lora)        # and a LoRA adapter that is missing or is no adapter
    steering = cvec.steering(options.control_vector, options.control_vector_scaled,
                             options.control_vector_layer_range)  # and control vectors, read
    if options.chat_template is not None:    # and a template that does not compile
        from .load import checked_chat_template
        template = checked_chat_template(options.chat_template, "--chat-template")
    pair = options.pair
    if pair is None and options.model is None:
        from .registry import load_registry
        pair = load_registry().default  # named, so that serve can call its model by the pair's name
    target, draft, draft_k, choice = resolve_models(pair, options, log)
    check_cache_widths(target, None if draft == MTP else draft, flags)
    cvec.check_model(steering, target)  # as wide as the target, a layer of it steered
    ngl_given, ngld_given = offload_given(options)  # -dev none: 0
    ngl, ngld = planned_offload(target, None if draft == MTP else draft, options.n_ctx, draft_k or 3, ngl_given,
                                ngld_given, log, fixed_draft=options.fixed_draft, flags=flags)
    ngl, tensor_split = planned_rpc_split(target, options.rpc, ngl_given, ngl, options.n_ctx, flags["target"])
    n_parallel = options.n_parallel
    if draft == MTP and n_parallel > 1:
        log(f"ggufspec: MTP drafting runs one sequence at a time: 1 slot instead of --parallel {n_parallel}")
        n_parallel = 1
    decoder = open_decoder(target, draft, n_ctx=options.n_ctx, n_threads=options.n_threads, n_gpu_layers=ngl,
                           n_gpu_layers_draft=ngld, strict=options.strict, exact=options.exact,
                           flash_attn=options.flash_attn, rpc=options.rpc, tensor_split=tensor_split,
                           swa_full=options.swa_full, n_parallel=n_parallel, rpc_timeout=options.rpc_timeout,
                           load_flags=flags, lora=lora)
    cvec.steer(decoder, steering)  # the target's context alone, as llama.cpp's (the draft's never)
    decoder.ngram_pool = pool  # n-grams of every request, for the next ones (`ngram`)
    if options.chat_template is not None:
        from .load import use_chat_template
        use_chat_template(decoder.target_llm, template)
    if choice.kind == "ngram":  # the Python API drafts as the CLI does: by n-gram where no model drafts
        decoder.default_drafter = "lookup"
    return Session(decoder, pair or Path(target).stem, target, draft, draft_k, choice.as_dict())


DEFAULT_BATCH = 512  # -b: llama.cpp's is 2048; a prompt goes in chunks of it, and a server's other slots wait on one
DEFAULT_UBATCH = 512  # -ub: llama.cpp's


def load_flags_by_role(options: ModelOptions) -> dict[str, dict]:
    """The LoadParams fields llama.cpp's load flags give the target and the draft (SpeculativeDecoder's
    `load_flags`)."""
    from .load import check_cache_types, default_threads
    for flag, value in (("-b", options.n_batch), ("-ub", options.n_ubatch), ("-tb", options.n_threads_batch),
                        ("-td", options.n_threads_draft), ("-tbd", options.n_threads_batch_draft)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise GgufspecError(f"{flag} must be a whole number >= 1, got {value!r}")
    check_cache_types(options.cache_type_k, options.cache_type_v, options.flash_attn, "-ctv")
    check_cache_types(options.cache_type_k_draft, options.cache_type_v_draft, options.flash_attn, "-ctvd")
    n_ubatch = options.n_ubatch or DEFAULT_UBATCH
    shared = dict(n_batch=options.n_batch or max(DEFAULT_BATCH, n_ubatch), n_ubatch=n_ubatch,
                  use_mmap=options.use_mmap, use_mlock=options.use_mlock, flash_attn=options.flash_attn)
    target = dict(shared, n_threads_batch=options.n_threads_batch, type_k=options.cache_type_k,
                  type_v=options.cache_type_v)
    draft = dict(shared, n_threads_batch=options.n_threads_batch_draft or options.n_threads_batch,
                 type_k=options.cache_type_k_draft, type_v=options.cache_type_v_draft)
    if options.n_threads_draft:  # batches keep the target's threads unless -tbd or -tb says (llama.cpp's)
        draft["n_threads"] = options.n_threads_draft
        draft["n_threads_batch"] = draft["n_threads_batch"] or options.n_threads or default_threads()
    target["tensor_overrides"], draft["tensor_overrides"] = _tensor_overrides(options)
    rope_kv_gpus = fields_by_role(options)  # RoPE/YaRN, --override-kv, -sm, -mg, -ts, -dev, -devd
    return {"target": {**target, **rope_kv_gpus[0]}, "draft": {**draft, **rope_kv_gpus[1]}}


def _tensor_overrides(options: ModelOptions) -> tuple[tuple, tuple]:
    """The target's and the draft's tensor overrides, checked: their buffer types too, but for a run on
    RPC workers, whose buffer types exist once they are registered (then checked as each model loads)."""
    from . import placement
    by_role = (placement.tensor_overrides(options.override_tensor, options.cpu_moe, options.n_cpu_moe, "target"),
               placement.tensor_overrides(options.override_tensor_draft, options.cpu_moe_draft,
                                          options.n_cpu_moe_draft, "draft"))
    if options.rpc is None and any(by_role):
        known = placement.buffer_types()
        for overrides, flag in zip(by_role, ("-ot", "-otd")):
            placement.check_buffer_types(overrides, flag, known)
    return by_role


def check_cache_widths(target: str, draft: str | None, flags: dict[str, dict]) -> None:
    """A quantized cache stores blocks of 32 elements: llama.cpp refuses one whose attention heads are
    not a multiple of that wide (with flash attention; without, every decode fails). Said before loading."""
    from .load import FLOAT_CACHE_TYPES
    for role, path, suffix in (("target", target, ""), ("draft", draft, "d")):
        for kv in "kv" if path is not None else "":
            name = flags[role][f"type_{kv}"]
            width = None if name in FLOAT_CACHE_TYPES else _head_width(path, kv)
            if width and width % 32:
                raise GgufspecError(f"-ct{kv}{suffix} {name}: the {role}'s attention heads are {width} wide, not a "
                                    f"multiple of the 32-element blocks a quantized cache stores (llama.cpp refuses "
                                    f"it): use {', '.join(FLOAT_CACHE_TYPES)}")


def _head_width(path: str, kv: str) -> int | None:
    """Elements per attention head of K ("k") or V ("v"), from the GGUF header; None where unread."""
    from . import plan as P
    try:
        shape = P.read_shape(path)
    except P.PlanError:
        return None  # llama.cpp will say
    return (shape.n_embd_k_gqa if kv == "k" else shape.n_embd_v_gqa) // max(shape.n_head_kv, 1)


def resolve_models(pair, options: ModelOptions, log: Log = _stderr):
    """(target path, draft path or None, the pair's recommended K or None, the `DraftChoice`) from
    -m/-md or a registry pair. With -m alone the draft is chosen (`finddraft`), and the choice logged."""
    from . import finddraft, store
    from .load import check_gguf_file
    folders = [store.models_dir()] + [d for d in [finddraft.check_draft_dir(options.draft_dir)] if d]
    skip = _no_draft_model(options)
    if options.model is None:
        if options.model_draft is not None:
            raise GgufspecError("-md needs -m (the target it drafts for); a PAIR name brings its own draft")
        target, draft, draft_k = store.pair_paths(pair)
        choice = skip or finddraft.DraftChoice("model", str(draft), f"the registry pair {pair}")
        return str(target), None if skip else str(draft), draft_k, choice
    if pair is not None:
        raise GgufspecError("give a PAIR name or -m/-md files, not both")
    for flag, given in (("-m", options.model), ("-md", options.model_draft)):
        if given is not None and not str(given).strip():
            raise GgufspecError(f"{flag} is empty: give a GGUF file")
    target = store.resolve_model_arg(options.model)
    if skip:
        return target, None, None, skip
    if options.model_draft == MTP or (options.model_draft is None and _has_mtp(target)):
        return target, MTP, None, _mtp_choice(target, given=options.model_draft == MTP, log=log)
    if options.model_draft is not None:
        draft = store.resolve_model_arg(options.model_draft)
        check_gguf_file(target, "target")
        check_gguf_file(draft, "draft")
        finddraft.check_draft(target, draft, folders=folders)
        return target, draft, None, finddraft.DraftChoice("model", draft, "given with -md")
    check_gguf_file(target, "target")
    choice = finddraft.choose_draft(target, folders)
    log(choice.line())
    return target, choice.path, None, choice


def _has_mtp(target: str) -> bool:
    from .mtp import gguf_has_mtp
    return Path(target).is_file() and gguf_has_mtp(target)


def _mtp_choice(target: str, *, given: bool, log: Log):
    """-md mtp, or -m alone on a target whose GGUF carries MTP (nextn) blocks: they draft, first choice."""
    from .finddraft import DraftChoice
    from .load import check_gguf_file
    check_gguf_file(target, "target")
    if not _has_mtp(target):
        raise GgufspecError(f"-md mtp: {Path(target).name} has no MTP (nextn) blocks to draft with; "
                            f"give a draft model with -md, or leave -md out to have one chosen")
    choice = DraftChoice("mtp", None, "given with -md mtp" if given else "the target's GGUF carries MTP blocks")
    log(choice.line())
    return choice


def _no_draft_model(options: ModelOptions):
    """The choice when the options load no draft model (--no-draft, --lookup), else None."""
    from .finddraft import DraftChoice
    if options.no_draft:
        return DraftChoice("none", None, "--no-draft")
    if not options.needs_draft_model:
        return DraftChoice("ngram", None, "--lookup: n-gram drafting alone")
    return None


# ---------------------------------------------------------------- placement: GPU offload, RPC workers

def planned_offload(target_path, draft_path, n_ctx, n_draft, ngl, ngld, log: Log = _stderr,
                    fixed_draft: bool = False, flags: dict | None = None) -> tuple[int, int]:
    """-ngl / -ngld as given, else from the planner (only where this build can offload at all).
    `fixed_draft`: the draft runs whatever the plan says (see ModelOptions.fixed_draft); `flags`: each
    role's load flags (`load_flags_by_role`), whose cache types and -ub size its cache and compute buffer."""
    from . import plan as P
    as_given = ngl or 0, ngld if ngld is not None else (ngl or 0)
    if (ngl is not None and (ngld is not None or draft_path is None)) or not P.gpu_offload_supported():
        return as_given
    gpu, host = memory_devices()
    if gpu is None:  # nothing to plan: everything runs on the CPU
        return as_given
    target = _as_loaded(target_path, (flags or {}).get("target"))
    draft = _as_loaded(draft_path, (flags or {}).get("draft")) if draft_path else None
    result = P.make_plan(target, draft, gpu=gpu, ram=host, n_ctx=n_ctx, ctx_given=True, n_draft=n_draft)
    draft_placed = result.draft_if_used if fixed_draft else result.draft
    if draft is not None and (ngl is not None or ngld is not None):  # one given: the other fitted around it
        chosen = P.around_given(target, draft, n_ctx, gpu, ngl, ngld, with_draft=draft_placed is not None)
        log(f"offload: -ngl {chosen[0]} -ngld {chosen[1]} ({'-ngl' if ngl is not None else '-ngld'} as given, "
            f"the other fitted to the GPU memory it leaves)")
        return chosen
    log(result.summary())
    return result.target.n_gpu_layers, ngld if ngld is not None else draft_placed.n_gpu_layers if draft_placed else 0


def _as_loaded(path: str, flags: dict | None):
    """The model's shape with the KV cache types and micro-batch it will load with (None: llama.cpp's
    defaults), and the tensors its overrides keep on the CPU (--cpu-moe's experts) off the GPU's share."""
    from . import plan as P
    shape = P.read_shape(path)
    if not flags:
        return shape
    shape = P.loaded_as(shape, flags["type_k"], flags["type_v"], min(flags["n_ubatch"], flags["n_batch"]),
                        flags.get("offload_kqv", True))
    return P.kept_on_host(shape, path, flags.get("tensor_overrides", ()))


def memory_devices(vram: str | None = None, ram: str | None = None):
    """(the GPU to plan for or None, host memory): detected, or as declared by --vram / --ram."""
    from . import plan as P
    if vram is not None:
        size = P.parse_size(vram)  # 0: plan as if there were no GPU (the draft priced on the CPU too)
        gpu = P.DeviceMemory("cuda", f"GPU ({vram})", size, size, P.DEFAULT_GPU_BANDWIDTH_GBS) if size else None
    else:
        gpus = P.detect_gpus()
        gpu = max(gpus, key=lambda g: g.free) if gpus else None
    host = P.detect_ram()
    if ram is not None:
        host.total = host.free = P.parse_size(ram)
        if not host.total:
            raise P.PlanError("--ram 0: give the host memory to plan for, like 16GiB")
    return gpu, host


def rpc_split(target_shape, rpc: str, rpc_mem, n_ctx: int):
    """The target's blocks per worker (plan.split_across_hosts), with each worker's free memory and
    round trip asked from it unless --rpc-mem declares its memory."""
    from . import plan as P
    from . import rpc as R
    endpoints = R.parse_endpoints(rpc)
    declared = _declared_memory(P.parse_host_sizes(rpc_mem), endpoints)
    hosts, rtt_ms = [], {}
    for endpoint in endpoints:
        name = str(endpoint)
        if endpoint in declared:
            hosts.append((name, declared[endpoint]))
            continue
        hosts.append((name, R.worker_memory(endpoint)[0]))
        rtt_ms[name] = 1e3 * R.round_trip_time(endpoint)
    return P.split_across_hosts(target_shape, n_ctx, hosts, rtt_ms)


def _declared_memory(sizes: dict[str, int], endpoints) -> dict:
    """--rpc-mem's sizes by the --rpc worker each names, matched as --rpc compares addresses (LOCALHOST:050052
    is localhost:50052); an entry that names no --rpc worker is refused rather than silently ignored."""
    from . import rpc as R
    workers = {R.worker_key(endpoint): endpoint for endpoint in endpoints}
    declared: dict = {}
    for host, size in sizes.items():
        try:
            key = R.worker_key(R.parse_endpoint(host))
        except R.RpcError as exc:
            raise R.RpcError(f"--rpc-mem: {exc}") from None
        if key not in workers:
            raise R.RpcError(f"--rpc-mem names {host}, which is none of --rpc's workers "
                             f"({', '.join(map(str, endpoints))})")
        if workers[key] in declared:
            raise R.RpcError(f"--rpc-mem names the worker {workers[key]} twice")
        declared[workers[key]] = size
    return declared


def planned_rpc_split(target_path, rpc: str | None, given_ngl: int | None, ngl: int, n_ctx: int,
                      flags: dict | None = None):
    """(-ngl, tensor_split) for a target on RPC workers: as given with -ngl (0: every layer here), else
    the planner's split by the workers' free memory; -ts (in `flags`) as given. Without --rpc, or planned onto
    a GPU here: (ngl, None)."""
    if rpc is None:
        return ngl, None
    if (flags or {}).get("tensor_split"):  # -ts: its shares; every layer offloaded unless -ngl says
        return (-1 if given_ngl is None else given_ngl), list(flags["tensor_split"])
    if given_ngl is not None:
        return given_ngl, None
    if ngl:
        return ngl, None
    shares, ngl = rpc_split(_as_loaded(target_path, flags), rpc, (), n_ctx)
    return ngl, [s.blocks for s in shares[1:]]


def open_decoder(target, draft=None, *, rpc: str | None = None, n_gpu_layers: int | None = None, tensor_split=None,
                 rpc_timeout: float | None = None, **options) -> SpeculativeDecoder:
    """A SpeculativeDecoder whose target may live on RPC workers (HOST:PORT[,...]).

    The workers are checked (reachable, same protocol) before anything loads; a worker lost mid-run
    becomes one clear line, the partial statistics and exit code 1 instead of llama.cpp's abort. With
    `rpc_timeout` (seconds), so does a generation that makes no progress for that long (a hung worker)."""
    if rpc is None:
        return SpeculativeDecoder(target, draft, n_gpu_layers=n_gpu_layers or 0, tensor_split=tensor_split, **options)
    from . import rpc as R
    endpoints = R.parse_endpoints(rpc)
    opened: list[SpeculativeDecoder] = []
    R.install_abort_message(endpoints, on_abort=lambda _message: _print_partial_stats(opened))
    devices = tuple(R.target_devices(R.register_workers(endpoints)))
    # one share per device (the workers' in --rpc's order, then this machine's GPUs); fewer leave the rest
    # none, as in llama.cpp (the planner gives one per worker, whose GPUs may be several devices)
    if tensor_split is not None and (len(tensor_split) > len(devices) or not all(x >= 0 for x in tensor_split)):
        raise GgufspecError(f"-ts/tensor_split: give at most {len(devices)} shares of 0 or more, one per device (the "
                            f"workers' in --rpc's order, then this machine's GPUs), got {list(tensor_split)}")
    if n_gpu_layers is None:  # with workers, the target's layers go to them unless -ngl says otherwise
        n_gpu_layers = -1
    decoder = SpeculativeDecoder(target, draft, n_gpu_layers=n_gpu_layers, tensor_split=tensor_split,
                                 devices=devices, costs_tag=f"rpc{rpc}", **options)
    opened.append(decoder)
    R.keepalive(endpoints, 30)  # a silently cut network fails within a bounded time
    n_layer = decoder.n_layer
    offloaded = n_layer + 1 if n_gpu_layers < 0 else n_gpu_layers  # -1: all blocks and the output layer
    decoder.placement = R.layer_placement(devices, n_layer, offloaded, tensor_split)
    if rpc_timeout:
        _watch_stalls(decoder, R.StallWatch(endpoints, rpc_timeout, lambda: _evaluated(decoder),
                                            on_stall=lambda: _print_partial_stats(opened)))
    return decoder


def _evaluated(decoder: SpeculativeDecoder) -> int:
    """Tokens the decoder's contexts (every slot's) have evaluated: what grows while generation progresses."""
    slots = getattr(decoder, "slots", None)
    contexts = [c for slot in slots.slots for c in slot.contexts()] if slots is not None else [decoder.target, decoder.draft]
    return sum(getattr(c, "n_evaluated", 0) for c in contexts if c is not None)


def _watch_stalls(decoder: SpeculativeDecoder, watch) -> None:
    """Arm `watch` while the decoder computes: within each next() of its streams (not while their reader
    holds a piece) and through generate_many (generate goes through stream)."""
    stream, generate_many = decoder.stream, decoder.generate_many

    def watched(pieces):
        try:
            while True:
                with watch.armed():
                    try:
                        piece = next(pieces)
                    except StopIteration:
                        return
                yield piece
        finally:
            pieces.close()

    def watched_generate_many(*args, **kwargs):
        with watch.armed():
            return generate_many(*args, **kwargs)
    decoder.stream = lambda *args, **kwargs: watched(stream(*args, **kwargs))  # checks the options at once, as before
    decoder.generate_many = watched_generate_many


def _print_partial_stats(opened: list[SpeculativeDecoder]) -> None:
    if opened and opened[0].last_stats is not None:
        sys.stderr.write(opened[0].last_stats.llamacpp_block() + "\n")
