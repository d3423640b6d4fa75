"""POST /tokenize and /detokenize, as llama-server has them: the target's own tokenizer."""
from __future__ import annotations

from pydantic import Field, StrictInt

from .errors import APIError
from .schemas import Strict


class TokenizeBody(Strict):
    content: str
    add_special: bool = False   # the model's BOS (and EOS) as its tokenizer adds them
    parse_special: bool = True  # "<|im_start|>" in the text as the special token it names
    with_pieces: bool = False


class DetokenizeBody(Strict):
    tokens: list[StrictInt] = Field(default_factory=list)  # true is no token


def tokenize_text(decoder, body: TokenizeBody) -> dict:
    """{"tokens": [id, ...]}, or with_pieces: [{"id", "piece"}] (a piece that is not whole UTF-8:
    its bytes, as llama-server gives them)."""
    llm = decoder.target_llm
    ids = llm.tokenize(body.content.encode("utf-8"), add_bos=body.add_special, special=body.parse_special)
    if not body.with_pieces:
        return {"tokens": ids}
    return {"tokens": [{"id": token, "piece": piece_text(decoder.target.detokenize([token]))} for token in ids]}


def piece_text(raw: bytes) -> str | list[int]:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def detokenize_tokens(decoder, body: DetokenizeBody) -> dict:
    n_vocab = decoder.target.n_vocab
    bad = next((t for t in body.tokens if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens: id {bad} is not in [0, {n_vocab})", code="invalid_value")
    text = decoder.target.detokenize(body.tokens)
    return {"content": text.decode("utf-8", errors="replace")}
