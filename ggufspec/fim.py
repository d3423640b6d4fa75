"""Fill in the middle: the prompt with which a code model writes the text between a prefix and a suffix
(what an editor asks at its cursor), built as llama.cpp's server builds it for `/infill`
(tools/server/server-common.cpp, format_prompt_infill), which the completions API's `suffix` uses too:

    [FIM_REP]myproject\\n [FIM_SEP]name0\\n text0 ... [FIM_SEP]filename\\n      the other files (input_extra)
    [FIM_PRE]prefix prompt [FIM_SUF]suffix [FIM_MID]                        the model writes the middle

The first line is the repository-level pattern of Qwen2.5-Coder (arXiv 2409.12186); a model without
FIM_REP/FIM_SEP gets the other files between "--- snippet ---" lines. The model ends the middle with its
end-of-text token. Speculation needs nothing more: the middle is generated as any answer is, and n-gram
drafting copies from the prefix, the suffix and the other files.

Texts are tokenized as text, never read for control tokens, so a file holding "<|fim_middle|>" cannot
end the prefix early (llama.cpp does the same for the prefix, the suffix and the other files, but reads
them in `prompt`). Unlike llama.cpp, a BOS goes first, before the other files, not between them and the
prefix; and the other files fill the context only up to the middle's room (llama.cpp's can overflow it
with a long `input_extra`)."""
from __future__ import annotations

from collections.abc import Iterable

from .errors import GgufspecError

# llama-server's default n_batch, which bounds what it keeps of the prefix and the suffix (3:1)
FIM_WINDOW = 2048
MIDDLE_ROOM = 128  # tokens the middle has room for at least (llama.vim asks for 128)
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"


class FimUnsupportedError(GgufspecError):
    """The model has no fill-in-the-middle tokens."""


def check_fim(decoder) -> dict[str, int | None]:
    """The target's FIM tokens; FimUnsupportedError names the ones it lacks."""
    tokens = decoder.target.fim_tokens()
    missing = [name for name in ("pre", "suf", "mid") if tokens[name] is None]
    if missing:
        raise FimUnsupportedError(
            "fill in the middle is not supported by this model: it has no FIM " + ", ".join(missing).upper()
            + " token (a code model such as Qwen2.5-Coder, CodeLlama or StarCoder has them)")
    return tokens


def fim_prompt(decoder, prefix: str, suffix: str, prompt: str = "", extra: Iterable[dict] = (),
               n_predict: int = -1, trim: bool = True) -> list[int]:
    """The token ids of the FIM prompt.

    With `trim` (llama-server's /infill), the prompt leaves the middle room for twice `n_predict`
    (at least MIDDLE_ROOM): the server's n_predict, not a request's, so that an editor's requests
    keep the same other files whatever each asks for, and its cache holds them from one to the next.
    Of a long prefix the end is kept and of a long suffix the start (the text nearest the cursor),
    3:1 within the window; `extra`, other files as {"filename", "text"}, fills the context past the
    window and the middle's room, kept from its end. Without `trim` all is kept (what does not fit is the caller's error)."""
    fim = check_fim(decoder)
    n_ctx = decoder.n_ctx
    reserve = 2 * max(n_predict, MIDDLE_ROOM) + 4  # the middle's room, and BOS, PRE, SUF, MID
    window = max(8, min(FIM_WINDOW, n_ctx - reserve)) if trim else 4 * n_ctx

    def text(value: str) -> list[int]:
        return decoder.target_llm.tokenize(value.encode("utf-8"), add_bos=False, special=False) if value else []

    prompt_tokens = text(prompt)
    prefix_tokens = text(prefix)[-(3 * (window // 4)):]
    suffix_take = max(0, window // 4 - (2 + len(prompt_tokens)))
    suffix_tokens = text(suffix)[:suffix_take]
    others = other_files(fim, extra, text)
    if trim:
        room = max(0, n_ctx - reserve - window)  # not what the prefix left: the same for every cursor
        others = others[len(others) - min(room, len(others)):]
    bos = [decoder.target_llm.token_bos()] if decoder.target_llm._model.add_bos_token() else []
    return (bos + others + [fim["pre"]] + prefix_tokens + prompt_tokens + [fim["suf"]] + suffix_tokens
            + [fim["mid"]])


def other_files(fim: dict, extra: Iterable[dict], text) -> list[int]:
    """The repository's other files, ahead of the prefix: after FIM_SEP and the file's name, or after a
    snippet line where the model has no FIM_SEP."""
    tokens = [fim["rep"]] + text("myproject\n") if fim["rep"] is not None else []
    for chunk in extra:
        if fim["sep"] is not None:
            tokens += [fim["sep"]] + text((chunk.get("filename") or "tmp") + "\n")
        else:
            tokens += text(SNIPPET_SEPARATOR)
        tokens += text(chunk["text"])
    if fim["sep"] is not None:
        tokens += [fim["sep"]] + text("filename\n")
    return tokens
