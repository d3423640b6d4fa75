"""GET /props: the pair as the chat page shows it (files, quantization, size, placement) and the
request defaults, with the fields of llama-server's endpoint of that name for its clients."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from .. import __version__, cvec, load
from ..backends import build_backends
from ..lora import adapters_of
from ..sampling import LLAMACPP_FILTERS, SamplingParams

QUANT_IN_NAME = re.compile(r"(?i)(?:^|[-_.])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)$")


def quantization(llm) -> str | None:
    """Q4_K_M, F16...: GGUF's general.file_type, else the file name's quantization suffix."""
    import gguf
    try:
        name = gguf.LlamaFileType(int(llm.metadata["general.file_type"])).name
    except (AttributeError, KeyError, TypeError, ValueError):
        name = None
    if name and name != "GUESSED":
        return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    stem = Path(getattr(llm, "model_path", "") or "").stem
    match = QUANT_IN_NAME.search(stem)
    return match.group(1).upper() if match else None


def model_info(llm) -> dict | None:
    """One model of the pair as /props shows it."""
    if llm is None:
        return None
    path = Path(llm.model_path)
    return {"file": path.name, "name": llm.metadata.get("general.name") or path.stem,
            "quantization": quantization(llm), "description": load.model_description(llm),
            "n_params": load.parameter_count(llm), "size_bytes": load.weights_size(llm),
            "n_layer": load.layer_count(llm), "n_gpu_layers": load.offloaded_layers(llm), "load": load_settings(llm)}


def load_settings(llm) -> dict:
    """How the model was loaded, by llama.cpp's flags (-b, -ub, -t, -tb, -ctk, -ctv, --mlock, --no-mmap): the
    batch sizes and threads as its context applied them."""
    import gguf
    import llama_cpp
    ctx, context, mode = llm._ctx.ctx, llm.context_params, llm.model_params.load_mode
    cache_type = lambda type_id: gguf.GGMLQuantizationType(type_id).name.lower()
    return {"n_batch": llama_cpp.llama_n_batch(ctx), "n_ubatch": llama_cpp.llama_n_ubatch(ctx),
            "n_threads": llama_cpp.llama_n_threads(ctx), "n_threads_batch": llama_cpp.llama_n_threads_batch(ctx),
            "cache_type_k": cache_type(context.type_k), "cache_type_v": cache_type(context.type_v),
            "mmap": mode in (llama_cpp.LLAMA_LOAD_MODE_MMAP, llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK),
            "mlock": mode in (llama_cpp.LLAMA_LOAD_MODE_MLOCK, llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK)}


def pair_props(decoder, model_name: str, defaults: dict) -> dict:
    """GET /props: the pair, its placement, the request defaults. The llama-server fields
    (default_generation_settings, total_slots, model_path, build_info) are there for its clients."""
    sampling = SamplingParams()  # what a request gets where the server was given no default
    params = {"n_predict": defaults.get("n_predict", -1),
              "temperature": defaults.get("temperature", sampling.temperature),
              "top_k": defaults.get("top_k", sampling.top_k), "top_p": defaults.get("top_p", sampling.top_p),
              "min_p": defaults.get("min_p", sampling.min_p), "seed": defaults.get("seed"),
              **{name: defaults.get(name, getattr(sampling, name)) for name in LLAMACPP_FILTERS},
              "speculative.n_max": defaults.get("draft_max", 8), "speculative.n_min": defaults.get("draft_min", 0),
              "speculative.p_min": defaults.get("draft_p_min", 0.0)}
    return {"model": model_name, "version": __version__, "n_ctx": decoder.n_ctx,
            "target": model_info(decoder.target_llm), "draft": model_info(getattr(decoder, "draft_llm", None)),
            "gpu_offload": load.gpu_offload_supported(), "backends": build_backends(),
            "placement": decoder.placement,
            "defaults": defaults,
            "default_generation_settings": {"n_ctx": decoder.n_ctx, "params": params},
            "total_slots": len(decoder.slots), "model_path": str(decoder.target_llm.model_path), "build_info": f"ggufspec {__version__}"}


def chat_props(template, tool_format, session, decoder) -> dict:
    """/props on chat: the template (llama-server shows it), whether it is ggufspec's ChatML fallback,
    the tool-call format it was recognised as, and how the draft was chosen (where the session says)."""
    draft_choice = getattr(session, "draft_choice", None) or getattr(decoder, "draft_choice", None)
    return {"chat_template": template.text, "chat_template_fallback": template.fallback,
            "chat_template_tool_format": tool_format.name, "chat_template_tools": tool_format.native,
            "draft_choice": draft_choice}


def system_fingerprint(decoder, lora: tuple[float, ...] | None = None) -> str:
    """OpenAI's `system_fingerprint`: a hash of what decides an answer's bits besides the request (the
    builds, the CPU features llama.cpp uses, the model files, their placement, the verification's
    rounding), so that a client comparing seeded answers sees when the backend changed. `lora`: the
    adapters' scales an answer ran under, where not those set now."""
    import llama_cpp
    verification = getattr(decoder, "verification", "batch")
    # the draft decides the batches, so their rounding, but not under --strict or --exact
    models = (decoder.target_llm, getattr(decoder, "draft_llm", None) if verification == "batch" else None)
    files = [file_identity(llm) for llm in models if llm is not None]
    config = {"ggufspec": __version__, "llama_cpp": llama_cpp.__version__, "files": files,
              "system": llama_cpp.llama_print_system_info().decode(errors="replace"),
              "gpu_layers": [load.offloaded_layers(decoder.target_llm), decoder.n_gpu_layers_draft],
              "placement": decoder.placement, "verification": verification,
              "context": context_settings(decoder.target_llm)}
    # what changes the target's logits besides its file, each left out where not given (so that
    # fingerprints without them stay what they were before it was counted)
    setup = cache_setup(decoder.target_llm)
    if lora is not None and "lora" in setup:
        setup["lora"] = [[name, size, scale] for (name, size, _), scale in zip(setup["lora"], lora)]
    config.update({key: setup[key] for key in MODEL_CHANGES if key in setup})
    return "fp_" + hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]


# cache_setup's keys besides the file and the cache types: the flags that change what the model computes
MODEL_CHANGES = ("lora", "cvec", "rope", "override_kv")


def cache_setup(llm) -> dict:
    """What decides the values of the KV cells `llm`'s context computes, beyond the prompt: the model
    file [name, size], the cache types (-ctk/-ctv), and where given, its LoRA adapters [[name, size,
    scale]...] (--lora, --lora-scaled), control vectors [[[name, size, scale]...], first layer, last]
    (--control-vector*), RoPE/YaRN settings {field: value} (--rope-*, --yarn-*) and metadata overrides
    {key: value} (--override-kv). JSON-shaped: a slot file's FILENAME.setup keeps it (`slotsetup`).
    Unlike the system fingerprint, not what only rounds them (builds, threads, batches, offloading):
    llama-server restores a saved cache across those."""
    import gguf
    params = llm.context_params
    types = [gguf.GGMLQuantizationType(type_id).name.lower() for type_id in (params.type_k, params.type_v)]
    setup = {"file": file_identity(llm), "cache_types": types}
    adapters = adapters_of(llm)
    if adapters:
        setup["lora"] = [[Path(a.path).name, file_size(a.path), a.scale] for a in adapters]
    steered = cvec.applied_to(llm)
    if steered is not None:
        setup["cvec"] = [[[Path(path).name, file_size(path), scale] for path, scale in steered.vectors],
                         steered.start, steered.end]
    rope = rope_settings(llm)
    if rope:
        setup["rope"] = rope
    if getattr(llm, "kv_overrides", None):  # llama_cpp.Llama keeps the dict it was given
        setup["override_kv"] = {key: llm.kv_overrides[key] for key in sorted(llm.kv_overrides)}
    return setup


def file_identity(llm) -> list:
    """The model file as the fingerprints know it: [name, size] (moved elsewhere, still the same)."""
    return [Path(llm.model_path).name, file_size(llm.model_path)]


def rope_settings(llm) -> dict:
    """The context's RoPE/YaRN fields that are not llama.cpp's "the model's own" defaults (what --rope-*
    and --yarn-* set), floats as their float32 reads shortest, --rope-scaling by its name."""
    import llama_cpp
    import numpy as np
    from ..modelflags import ROPE_SCALING_TYPES
    params, defaults = getattr(llm, "context_params", None), llama_cpp.llama_context_default_params()
    names = {number: name for name, number in ROPE_SCALING_TYPES.items()}
    found = {}
    for field in load.ROPE_FIELDS:
        value = getattr(params, field, None)
        if value is None or value == getattr(defaults, field):
            continue
        found[field] = names.get(value, value) if field == "rope_scaling_type" else \
            float(str(np.float32(value))) if isinstance(value, float) else value
    return found


def file_size(path) -> int | None:
    try:
        return Path(path).stat().st_size
    except OSError:
        return None


CONTEXT_SETTINGS = ("n_ubatch", "n_seq_max", "flash_attn_type", "type_k", "type_v", "kv_unified", "swa_full",
                    "n_threads", "n_threads_batch")  # threads: how a long attention is split


def context_settings(llm) -> dict:
    """The target context's settings that change how its logits round (the batch a step computes,
    the slots sharing a cache, flash attention, the cache's types)."""
    params = getattr(llm, "context_params", None)
    return {name: getattr(params, name, None) for name in CONTEXT_SETTINGS}
