"""Opening the two models as `llama_cpp.Llama` objects, and checking that they can be paired."""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import llama_cpp
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from .errors import GgufspecError, IncompatibleModelsError, ModelFileError
from .llamalog import allocation_failures, interrupt_after_native, quiet_llama_logs
from .native import Context

GGUF_MAGIC = b"GGUF"
# llama.cpp's speculative example allows this much vocabulary size difference, and compares token
# texts from this id up (ids below it are often special tokens that differ harmlessly).
VOCAB_MAX_SIZE_DIFFERENCE = 128
VOCAB_CHECK_START_TOKEN_ID = 5


@dataclass(frozen=True)
class LoadParams:
    n_ctx: int = 4096
    n_threads: int | None = None
    n_gpu_layers: int = 0
    n_batch: int = 512
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


FLASH_ATTN_TYPES = {"auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                    "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED}


def flash_attn_type(setting: str | bool) -> int:
    """-fa on|off|auto (or a bool) as llama.cpp's enum."""
    if isinstance(setting, bool):
        setting = "on" if setting else "off"
    if setting not in FLASH_ATTN_TYPES:
        raise GgufspecError(f"-fa/--flash-attn takes on, off or auto, got {setting!r}")
    return FLASH_ATTN_TYPES[setting]


@contextlib.contextmanager
def _model_params(load_mtp: bool, repack: bool):
    """Set llama_model_params fields Llama(...) has no argument for, for the next load only: load_mtp
    (the MTP blocks) and use_extra_bufts (repacking). It builds the model through
    `_internals.LlamaModel(params=...)`."""
    from llama_cpp import _internals
    original = _internals.LlamaModel

    def with_fields(*args, params, **kwargs):
        if load_mtp:
            params.load_mtp = True
        if not repack:
            params.use_extra_bufts = False
        return original(*args, params=params, **kwargs)
    _internals.LlamaModel = with_fields
    try:
        yield
    finally:
        _internals.LlamaModel = original


@contextlib.contextmanager
def _context_flash_attn(kind: int, n_rs_seq: int = 0, n_seq: int = 1, unified: bool = True):
    """Make the next llama context use flash-attention type `kind`.

    Llama(flash_attn=...) is a bool (on or off); llama.cpp's own default, auto (on where the
    backend supports it: CUDA, Metal, CPU), is not reachable through it. Llama builds its context
    through `_internals.LlamaContext(params=...)`, so the field is set there, for this load only.
    """
    from llama_cpp import _internals
    original = _internals.LlamaContext

    def with_flash_attn(*args, params, **kwargs):
        params.flash_attn_type = kind
        if n_rs_seq and hasattr(params, "n_rs_seq"):
            params.n_rs_seq = n_rs_seq
        if n_seq > 1:
            params.n_seq_max, params.kv_unified = n_seq, unified
        return original(*args, params=params, **kwargs)
    _internals.LlamaContext = with_flash_attn
    try:
        yield
    finally:
        _internals.LlamaContext = original


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
    path = Path(path)
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.gguf"))[:3]
        raise ModelFileError(f"{role} model {path} is a folder: give a .gguf file" +
                             (f" in it ({', '.join(found)})" if found else ""))
    if not path.is_file():
        raise ModelFileError(f"{role} model not found: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{role} model {path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    return path


def open_model(path: str | os.PathLike, role: str, params: LoadParams, *, strict: bool = False) -> llama_cpp.Llama:
    path = check_gguf_file(path, role)
    if params.exact:
        if params.flash_attn == "off":
            raise GgufspecError("--exact needs flash attention (-fa on or auto): without it attention is batched too")
        exact_kernels(path, role)
    elif os.environ.get("GGML_CPU_TILED_MM") != "0":
        _opened_with_tiled_products.append(str(path))
    threads = params.n_threads or default_threads()
    quiet_llama_logs()
    allocation_failures()  # an earlier load's are not this one's
    try:
        unified = params.kv_unified and not (strict or params.strict or params.exact)
        n_ctx = params.n_ctx if unified else params.n_ctx * params.n_seq
        n_ubatch = 1 if strict else min(params.n_batch, EXACT_UBATCH) if params.exact else params.n_batch
        if params.n_rs_seq and n_ubatch <= params.n_rs_seq:  # llama.cpp asserts (aborts) in the first batch
            raise GgufspecError(f"n_rs_seq {params.n_rs_seq} needs micro-batches of more than {params.n_rs_seq} "
                                f"tokens, but they are {n_ubatch}" + (" (--strict)" if strict else "")
                                + ": leave n_rs_seq 0 (snapshots) or raise n_batch")
        # bit-exact (--strict, --exact): a window-sized cache, once it wraps, refills freed cells out of
        # position order, and attention sums the cells in cell order: another rounding than alone
        swa_full = params.swa_full or strict or params.strict or params.exact
        options = dict(n_ctx=n_ctx, n_batch=params.n_batch, n_ubatch=n_ubatch,
                       n_threads=threads, n_threads_batch=threads, n_gpu_layers=params.n_gpu_layers,
                       logits_all=False, verbose=False, swa_full=swa_full)
        with _context_flash_attn(flash_attn_type(params.flash_attn), params.n_rs_seq, params.n_seq, unified), \
                _model_params(params.load_mtp, repack=not params.exact), interrupt_after_native():
            if params.devices is not None:  # placed on RPC workers: a loading concern, same Llama
                split = list(params.tensor_split) if params.tensor_split else None
                return load_on_devices(path, params.devices, tensor_split=split, **options)
            return llama_cpp.Llama(model_path=str(path), **options)
    except (ValueError, RuntimeError) as exc:
        raise ModelFileError(f"llama.cpp could not load the {role} model {path}: {load_failure(exc, params)}") from None


def load_failure(exc: Exception, params: LoadParams) -> str:
    """Why a load failed: where the memory ran out, when llama.cpp's log said so (its exception says
    only "Failed to load model from file"), with what to change; else llama.cpp's words."""
    failed = allocation_failures()
    if not failed:
        hint = f" (-c {params.n_ctx}: a smaller context needs less memory)" if "context" in str(exc) else ""
        return f"{exc}{hint}"
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


# llama.cpp's fallback for a model without a chat template is ChatML; this one also renders tools,
# tool calls and tool results the way Hermes/Qwen models were trained to read them.
DEFAULT_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and tools and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}{{- '\n<tool_call>\n{\"name\": \"' + call.function.name + "
    "'\", \"arguments\": ' + (call.function.arguments | tojson) + '}\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")


@dataclass(frozen=True)
class ChatTemplate:
    text: str
    fallback: bool  # the model has none: DEFAULT_CHAT_TEMPLATE (ChatML) stands in


def chat_template(llm: llama_cpp.Llama) -> ChatTemplate:
    """The target's chat template (GGUF `tokenizer.chat_template`), or ChatML where it has none."""
    text = llm.metadata.get("tokenizer.chat_template")
    return ChatTemplate(text, False) if text else ChatTemplate(DEFAULT_CHAT_TEMPLATE, True)


def check_messages(messages) -> None:
    if (not isinstance(messages, (list, tuple)) or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
        raise GgufspecError('messages must be a non-empty list of {"role": ..., "content": ...} dicts')


def chat_prompt(llm: llama_cpp.Llama, user: str, system: str | None = None) -> str:
    """The target's own chat template applied to one user turn (ChatML where it has none:
    `chat_template(llm).fallback` says so)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return render_chat(llm, messages, warn=True)


def render_chat(llm: llama_cpp.Llama, messages: list[dict], tools: list[dict] | None = None, *, warn: bool = False,
                **variables) -> str:
    """The target's chat template over a conversation, ending with the assistant's turn opened.
    llama-cpp-python's formatter renders it in a sandboxed Jinja. `tools` (OpenAI's tool objects) and
    other `variables` are passed to the template. A model without a template gets ChatML
    (`chat_template(llm).fallback` is then true; `warn`: a warning says so, once, where the caller
    has not said it already, as the server does when it starts)."""
    check_messages(messages)
    found = chat_template(llm)
    if found.fallback and warn:  # (Python's warnings: once per place): its markers may be no tokens of the model
        warnings.warn("the model has no chat template: the conversation is rendered as ChatML", stacklevel=3)
    template = found.text
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    token_text = lambda t: (llama_cpp.llama_vocab_get_text(vocab, t) or b"").decode(errors="replace") if t >= 0 else ""
    formatter = Jinja2ChatFormatter(template=template, eos_token=token_text(llama_cpp.llama_vocab_eos(vocab)),
                                    bos_token=token_text(llama_cpp.llama_vocab_bos(vocab)))
    try:
        return formatter(messages=messages, tools=tools or None, **variables).prompt
    except Exception as exc:  # jinja2's TemplateError, or the template's own raise_exception()
        merged = system_in_first_user(messages)
        if merged is not None:  # a template without a system role (Gemma 2's raises on one)
            try:
                return formatter(messages=merged, tools=tools or None, **variables).prompt
            except Exception:
                pass
        raise GgufspecError(f"the chat template refused these messages: {exc}") from None


def system_in_first_user(messages: list[dict]) -> list[dict] | None:
    """The conversation with its leading system message put in front of the next message, as llama.cpp
    renders it for a template without a system role (chat.cpp's system_message_not_supported); None
    where there is none to move (or either content is not text)."""
    if len(messages) < 2 or messages[0].get("role") != "system":
        return None
    system, following = messages[0].get("content"), messages[1].get("content")
    if not isinstance(system, str) or not isinstance(following, str):
        return None
    return [{**messages[1], "content": system + "\n" + following}] + messages[2:]


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
    with model_devices(devices) as array:
        llm = llama_cpp.Llama(model_path=str(model_path), **llama_kwargs)
    llm._ggufspec_devices = array  # llama.cpp copied the pointers; keep the array anyway
    return llm
