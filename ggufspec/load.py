"""Opening the two models as `llama_cpp.Llama` objects, and checking that they can be paired."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from .errors import IncompatibleModelsError, ModelFileError
from .native import Context, quiet_llama_logs

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


def default_threads() -> int:
    import psutil
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def check_gguf_file(path: str | os.PathLike, role: str) -> Path:
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{role} model not found: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{role} model {path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    return path


def open_model(path: str | os.PathLike, role: str, params: LoadParams, *, strict: bool = False) -> llama_cpp.Llama:
    path = check_gguf_file(path, role)
    threads = params.n_threads or default_threads()
    quiet_llama_logs()
    try:
        return llama_cpp.Llama(
            model_path=str(path), n_ctx=params.n_ctx, n_batch=params.n_batch,
            n_ubatch=1 if strict else params.n_batch, n_threads=threads, n_threads_batch=threads,
            n_gpu_layers=params.n_gpu_layers, logits_all=False, verbose=False)
    except (ValueError, RuntimeError) as exc:
        raise ModelFileError(f"llama.cpp could not load the {role} model {path}: {exc}") from None


def check_compatible(target: Context, draft: Context) -> None:
    """The checks llama.cpp's speculative example makes before pairing two models."""
    t, d = target.vocab, draft.vocab
    if llama_cpp.llama_vocab_type(t) != llama_cpp.llama_vocab_type(d):
        raise IncompatibleModelsError("draft and target use different vocabulary types")
    for what, get in (("BOS", llama_cpp.llama_vocab_bos), ("EOS", llama_cpp.llama_vocab_eos)):
        if get(t) != get(d):
            raise IncompatibleModelsError(f"draft and target {what} ids differ: {get(d)} vs {get(t)}")
    for what, get in (("add-BOS", llama_cpp.llama_vocab_get_add_bos), ("add-EOS", llama_cpp.llama_vocab_get_add_eos)):
        if bool(get(t)) != bool(get(d)):
            raise IncompatibleModelsError(f"draft and target {what} flags differ")
    if abs(target.n_vocab - draft.n_vocab) > VOCAB_MAX_SIZE_DIFFERENCE:
        raise IncompatibleModelsError(
            f"vocabulary sizes differ by more than {VOCAB_MAX_SIZE_DIFFERENCE}: "
            f"target {target.n_vocab}, draft {draft.n_vocab}")
    for token in range(VOCAB_CHECK_START_TOKEN_ID, min(target.n_vocab, draft.n_vocab)):
        t_text, d_text = target.token_text(token), draft.token_text(token)
        if t_text != d_text:
            raise IncompatibleModelsError(
                f"token {token} differs: target {t_text.decode(errors='replace')!r}, "
                f"draft {d_text.decode(errors='replace')!r}")


def chat_prompt(llm: llama_cpp.Llama, user: str, system: str | None = None) -> str:
    """The target's own chat template (GGUF `tokenizer.chat_template`) applied to one user turn."""
    template = llm.metadata.get("tokenizer.chat_template")
    if not template:
        raise ModelFileError("the target model has no chat template (tokenizer.chat_template); drop --chat")
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    token_text = lambda t: (llama_cpp.llama_vocab_get_text(vocab, t) or b"").decode(errors="replace") if t >= 0 else ""
    formatter = Jinja2ChatFormatter(template=template, eos_token=token_text(llama_cpp.llama_vocab_eos(vocab)),
                                    bos_token=token_text(llama_cpp.llama_vocab_bos(vocab)))
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return formatter(messages=messages).prompt


def tokenize(llm: llama_cpp.Llama, text: str) -> list[int]:
    """As llama.cpp's tools do: the model's own BOS rule, special tokens in the text parsed."""
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    bos = llama_cpp.llama_vocab_bos(vocab)
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
    if len(tokens) > 1 and tokens[0] == bos and tokens[1] == bos:  # a template that writes BOS itself
        tokens = tokens[1:]
    return tokens
