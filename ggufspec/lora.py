"""LoRA adapters on the target (llama.cpp's --lora / --lora-scaled), the llama.cpp calls wrapped once.

llama.cpp loads an adapter against a model (`llama_adapter_lora_init`) and applies adapters per context
(`llama_set_adapters_lora`): every context over the target's model gets the same adapters and scales
(the decoder's, which its slots share as sequences; the MTP head's). The draft never gets them: it only
proposes, and the target with its adapters decides every token, so the output stays the adapted target's.

An adapter is freed with the Llama it was loaded for (on its exit stack, so before the model: llama.cpp
frees what is left of a model's adapters with it). Scale 0 leaves an adapter out (llama.cpp skips it).
Scales change on the contexts (`rescale`, the server's per-request `lora` and POST /lora-adapters): every
cell those contexts cached was computed under the old ones, so the caller drops them.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, Sequence

import llama_cpp

from .errors import GgufspecError
from .gguffiles import check_gguf, scaled_pair
from . import llamalog

@dataclass(frozen=True)
class LoraAdapter:
    """One loaded adapter: as given (path, scale), its metadata, and llama.cpp's handle."""

    path: str
    scale: float
    task_name: str = ""       # adapter.lora.task_name, as llama-server shows it
    prompt_prefix: str = ""   # adapter.lora.prompt_prefix
    handle: object = field(default=None, compare=False, repr=False)


def requested(lora: Sequence) -> tuple[tuple[str, float], ...]:
    """Adapters as (path, scale) pairs, from paths (scale 1, as --lora) or (path, scale) pairs (as
    --lora-scaled); a scale that is not a finite number is refused."""
    return tuple(scaled_pair("LoRA adapter", item)
                 for item in ([lora] if isinstance(lora, (str, os.PathLike)) else lora or ()))


def checked(lora: Sequence) -> tuple[tuple[str, float], ...]:
    """`requested(lora)`, each file checked (`check_adapter_file`)."""
    adapters = requested(lora)
    for path, _ in adapters:
        check_adapter_file(path)
    return adapters


def check_adapter_file(path: str) -> None:
    """What can be told from the file alone, before any model loads: that it is there and is a LoRA GGUF.
    Whether it fits the model (architecture, tensor names and shapes) llama.cpp says as it loads it."""
    where = check_gguf(path, "LoRA adapter", hint="llama.cpp's convert_lora_to_gguf.py turns a PEFT adapter into one")
    general_type, adapter_type = _header_strings(where, ("general.type", "adapter.type"))
    if general_type != "adapter":
        shown = repr(general_type) if general_type is not None else "missing"
        raise GgufspecError(f"{path} is not a LoRA adapter: its general.type is {shown}, not 'adapter' (a model "
                            f"goes to -m)")
    if adapter_type != "lora":
        raise GgufspecError(f"{path} is an adapter, but not a LoRA one: its adapter.type is {adapter_type!r}, not 'lora'")


def _header_strings(path: Path, keys: tuple[str, ...]) -> tuple[str | None, ...]:
    from gguf import GGUFReader
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # a damaged file: numpy's and struct's errors as much as gguf's own
        raise GgufspecError(f"LoRA adapter {path}: its GGUF header cannot be read ({exc})") from None
    values = []
    for key in keys:
        value = reader.fields.get(key)
        values.append(value.contents() if value is not None and isinstance(value.contents(), str) else None)
    return tuple(values)


def check_exact(adapters: Sequence[tuple[str, float]]) -> None:
    """--exact with adapters: their (float) matrices are multiplied in batches by llamafile's kernels and
    as single tokens without (llamafile's sgemm takes 2 rows up), so a batch would round otherwise."""
    if any(scale for _, scale in adapters) and b"LLAMAFILE = 1" in llama_cpp.llama_print_system_info():
        raise GgufspecError("--exact with a LoRA adapter: llama.cpp multiplies the adapter's matrices in batches "
                            "with llamafile's kernels, single tokens without; use --strict for bit identity")


def check_rescale_exact(llm, scales: Sequence[float], verification: str) -> None:
    """check_exact for `llm`'s adapters at `scales`, where the verification is --exact."""
    if verification == "exact":
        check_exact([(a.path, scale) for a, scale in zip(adapters_of(llm), scales)])


def attach(llm: llama_cpp.Llama, adapters: Sequence[tuple[str, float]]) -> tuple[LoraAdapter, ...]:
    """Load `adapters` for `llm`'s model and set them on its context. On failure `llm` is closed (its
    model freed) and the reason is one line."""
    try:
        loaded = tuple(_load(llm, path, scale) for path, scale in adapters)
        set_on(llm._ctx.ctx, loaded)
    except BaseException:
        llm.close()  # frees the adapters loaded so far, then the model
        raise
    llm._ggufspec_lora = loaded
    return loaded


def adapters_of(llm) -> tuple[LoraAdapter, ...]:
    """The adapters attached to `llm` (none for a draft, or a target loaded without)."""
    return getattr(llm, "_ggufspec_lora", ())


def scales_of(llm) -> tuple[float, ...]:
    """The scales `llm`'s adapters are set to now, in the order they were loaded."""
    return tuple(a.scale for a in adapters_of(llm))


def rescale(llm, scales: Sequence[float], contexts: Sequence = ()) -> None:
    """`llm`'s adapters set to `scales` (one each) on `contexts` (llama.cpp's context pointers over its
    model: its own, an MTP head's). What those contexts cached is stale after: the caller drops it."""
    adapters = adapters_of(llm)
    if len(scales) != len(adapters):
        raise GgufspecError(f"{len(scales)} LoRA scales for {len(adapters)} adapters")
    rescaled = tuple(replace(a, scale=float(s)) for a, s in zip(adapters, scales))
    for ctx in contexts:
        set_on(ctx, rescaled)
    llm._ggufspec_lora = rescaled


def set_on(ctx, adapters: Sequence[LoraAdapter]) -> None:
    """llama_set_adapters_lora: `adapters` (their scales) on the context `ctx`, replacing what it had."""
    if not adapters:
        return
    handles = (llama_cpp.llama_adapter_lora_p_ctypes * len(adapters))(*(a.handle for a in adapters))
    scales = (ctypes.c_float * len(adapters))(*(a.scale for a in adapters))
    if llama_cpp.llama_set_adapters_lora(ctx, handles, len(adapters), scales):
        raise GgufspecError("llama.cpp could not set the LoRA adapters on a context")


def _load(llm: llama_cpp.Llama, path: str, scale: float) -> LoraAdapter:
    model = llm._model.model
    with _llama_log() as log:
        handle = llama_cpp.llama_adapter_lora_init(model, os.fsencode(path))
    if not handle:
        raise GgufspecError(f"llama.cpp could not load the LoRA adapter {path}: {_refusal(log)}")
    llm._stack.callback(llama_cpp.llama_adapter_lora_free, handle)  # before the model (the stack unwinds LIFO)
    return LoraAdapter(path, scale, _meta(handle, "adapter.lora.task_name"), _meta(handle, "adapter.lora.prompt_prefix"),
                       handle)


def _meta(handle, key: str) -> str:
    buf = ctypes.create_string_buffer(1024)
    n = llama_cpp.llama_adapter_meta_val_str(handle, key.encode(), buf, len(buf))
    if n >= len(buf):  # longer than the buffer: llama.cpp said how long
        buf = ctypes.create_string_buffer(n + 1)
        n = llama_cpp.llama_adapter_meta_val_str(handle, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", errors="replace") if n >= 0 else ""


# llama.cpp says why it refused an adapter only in its log: "FUNCTION: failed to apply lora adapter: REASON"
# (REASON alone is kept), or "FUNCTION: failed to open 'PATH': ERROR" (kept from "failed")
REASON_AFTER, FAILED_TO_OPEN = "failed to apply lora adapter: ", "failed to open "


def _refusal(log: list[str]) -> str:
    """llama.cpp's reason from its log lines, without the function names before it."""
    for line in reversed(log):
        if REASON_AFTER in line:
            return line.split(REASON_AFTER, 1)[1].strip()
        if FAILED_TO_OPEN in line:
            return FAILED_TO_OPEN + line.split(FAILED_TO_OPEN, 1)[1].strip()
    errors = [line.strip() for line in log if "error" in line.lower() or "failed" in line.lower()]
    return errors[-1] if errors else "see GGUFSPEC_VERBOSE=1 for llama.cpp's log"


@contextlib.contextmanager
def _llama_log() -> Iterator[list[str]]:
    """llama.cpp's log lines while the block runs (shown as the log flags say, as ever); then the log
    goes back to ggufspec's usual callback."""
    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def record(level, text, user_data):
        lines.append((text or b"").decode("utf-8", errors="replace"))
        llamalog.log_callback(level, text, user_data)
    llama_cpp.llama_log_set(record, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        llamalog.quiet_llama_logs()  # before `record` goes away: llama.cpp must never call a freed callback
