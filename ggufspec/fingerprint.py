"""A model's tokenizer as a fingerprint read from its GGUF header, to tell which models can draft
for which: the same token texts and special tokens are what llama.cpp checks before pairing two
models (`load.check_compatible` does it again on the loaded models). Never the file name.

The header's key-value section is read here directly (a memory map, no tensor data): the token
list is hashed as it lies in the file instead of being built as 150,000 Python objects, so a
header reads in tens of milliseconds; fingerprints are remembered per file (path, size, mtime, ctime,
inode: a file rewritten in place with its size and mtime kept is read again).
"""
from __future__ import annotations

import hashlib
import mmap
import os
import struct
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import ModelFileError
from .home import read_json, write_json

FINGERPRINTS_FILE = "fingerprints.json"
FINGERPRINTS_KEPT = 256
FORMAT = "f3"  # of a remembered fingerprint: another format reads the header again
VOCAB_CHECK_START = 5        # llama.cpp compares token texts from this id on (as load.check_compatible)
VOCAB_MAX_SIZE_DIFFERENCE = 128
SPECIAL_IDS = {"bos": "bos", "eos": "eos", "eot": "eot", "pad": "padding", "unk": "unknown"}  # name: GGUF key part

# llama.cpp's special ids and add flags where the header has no key (or an id out of the vocabulary):
# per tokenizer type (llama-vocab.cpp), and for BPE the pre-tokenizers whose default adds a BOS
_DEFAULT_SPECIAL = {"llama": (1, 2, True, False), "gpt2": (11, 11, False, False), "bert": (101, None, True, False),
                    "t5": (None, 1, False, True), "rwkv": (None, None, False, False)}  # bos, eos, add_bos, add_eos
_BPE_ADDING_BOS = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "tekken", "chameleon",
                   "midm-2.0", "lfm2", "jina-v5-nano"}

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class Fingerprint:
    """What decides whether two models tokenize alike: the tokenizer's kind and pre-tokenizer, the
    vocabulary (size, and a hash of the token texts from id VOCAB_CHECK_START on), the special ids."""

    model: str                      # tokenizer.ggml.model: llama (SPM), gpt2 (BPE), ...
    pre: str                        # tokenizer.ggml.pre ("default" when absent)
    n_vocab: int
    tokens_sha256: str
    bos: int | None = None
    eos: int | None = None
    eot: int | None = None
    pad: int | None = None
    unk: int | None = None
    add_bos: bool = False
    add_eos: bool = False


# Fields whose difference keeps two models apart (as llama.cpp: BOS, EOS and the add flags);
# eot, pad and unk are shown but not decisive (conversions of one family differ there).
# What llama.cpp's common_speculative_are_compatible compares, besides the token texts: the tokenizer
# type, the add-BOS/EOS flags, and the BOS (EOS) id only where it is added. Not the pre-tokenizer, nor
# an EOS that is not added (an instruct target's <|im_end|> and a base draft's <|endoftext|> pair): the
# draft reads the target's token ids and never tokenizes text, and the target alone decides the end.
DECISIVE = ("model", "add_bos", "add_eos")
LABELS = {"model": "tokenizer type", "pre": "pre-tokenizer", "n_vocab": "vocabulary size",
          "tokens_sha256": "token texts", "bos": "BOS id", "eos": "EOS id", "add_bos": "add-BOS flag",
          "add_eos": "add-EOS flag"}


def read_fingerprint(path: str | os.PathLike) -> Fingerprint:
    """The fingerprint of a local GGUF file, remembered per file (absolute path, size, mtime)."""
    try:
        stat = os.stat(path)
    except OSError as exc:
        raise ModelFileError(f"{path}: {exc.strerror}") from None
    key = (f"{FORMAT}|{os.path.abspath(os.fspath(path))}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ctime_ns}"
           f"|{stat.st_ino}")
    known = _remembered(read_json(FINGERPRINTS_FILE).get(key))
    if known is not None:
        return known
    found = _fingerprint_of(path)
    data = read_json(FINGERPRINTS_FILE)
    data[key] = {**asdict(found), "seen": time.time_ns()}  # the file's order is not kept (sorted keys)
    newest = sorted(data, key=lambda k: _seen(data[k]))[-FINGERPRINTS_KEPT:]
    write_json(FINGERPRINTS_FILE, {k: data[k] for k in newest})
    return found


def _seen(entry) -> int:
    seen = entry.get("seen") if isinstance(entry, dict) else None
    return seen if isinstance(seen, int) else 0


def _remembered(known) -> Fingerprint | None:
    """A remembered fingerprint, or None where the entry is not one (another version's, or damaged)."""
    if isinstance(known, dict):
        known = {name: value for name, value in known.items() if name != "seen"}
    if not isinstance(known, dict) or set(known) != set(Fingerprint.__dataclass_fields__):
        return None
    if not all(_fits(name, value) for name, value in known.items()):
        return None
    return Fingerprint(**known)


def _fits(name: str, value) -> bool:
    if name in ("model", "pre", "tokens_sha256"):
        return isinstance(value, str)
    if name in ("add_bos", "add_eos"):
        return isinstance(value, bool)
    return (value is None and name != "n_vocab") or (isinstance(value, int) and not isinstance(value, bool))


def differences(target: Fingerprint, draft: Fingerprint, target_path=None, draft_path=None) -> list[str]:
    """What keeps `draft` from drafting for `target`, one phrase per field ([] when it can).

    Vocabulary sizes may differ by up to VOCAB_MAX_SIZE_DIFFERENCE (llama.cpp pairs such models,
    `VocabBridge` maps the ids); the texts of the ids both have must then agree, which needs the two
    token lists again (each a path, or a hub file's header bytes), else the texts count as different."""
    decisive = DECISIVE + (("bos",) if target.add_bos else ()) + (("eos",) if target.add_eos else ())
    found = [f"{LABELS[f]} {getattr(draft, f)!r} vs {getattr(target, f)!r}" for f in decisive
             if getattr(target, f) != getattr(draft, f)]
    if abs(target.n_vocab - draft.n_vocab) > VOCAB_MAX_SIZE_DIFFERENCE:
        found.append(f"vocabulary sizes differ by more than {VOCAB_MAX_SIZE_DIFFERENCE}: "
                     f"{draft.n_vocab} vs {target.n_vocab}")
    elif target.n_vocab == draft.n_vocab:
        if target.tokens_sha256 != draft.tokens_sha256:
            found.append("token texts")
    else:
        shared = min(target.n_vocab, draft.n_vocab)
        if target_path is None or draft_path is None or _tokens_digest(target_path, shared) != _tokens_digest(draft_path, shared):
            found.append(f"token texts (of the {shared} ids both have)")
    return found


def first_token_difference(target_path, draft_path) -> str:
    """Where two token lists first differ, in words (reads both lists: for error messages only)."""
    target, draft = _token_texts(target_path), _token_texts(draft_path)
    for token in range(VOCAB_CHECK_START, min(len(target), len(draft))):
        if target[token] != draft[token]:
            return f"token {token}: {draft[token]!r} vs {target[token]!r}"
    return "the lists are equal"


def _token_texts(path) -> list[str]:
    return _read_header(path, None, _token_texts_in)


def _token_texts_in(data) -> list[str]:
    offset = 24
    for _ in range(struct.unpack_from("<Q", data, 16)[0]):
        key, offset = _string(data, offset)
        (kind,), offset = struct.unpack_from("<I", data, offset), offset + 4
        if kind != _ARRAY:
            offset = _string(data, offset)[1] if kind == _STRING else offset + struct.calcsize(_SCALARS[kind])
            continue
        (item_kind, count), offset = struct.unpack_from("<IQ", data, offset), offset + 12
        if key == "tokenizer.ggml.tokens":
            _check_count(data, offset, count, 8)
            texts = []
            for _ in range(count):
                text, offset = _string(data, offset)
                texts.append(text)
            return texts
        offset = _skip_array(data, offset, item_kind, count)
    return []


class HeaderCutShort(ModelFileError):
    """The bytes given end inside the GGUF header: fetch more of the file (`fingerprint_of_bytes`)."""


def fingerprint_of_bytes(data: bytes, name: str) -> Fingerprint:
    """The fingerprint of a GGUF file from its first bytes (a hub file's prefix, fetched with a Range
    request): HeaderCutShort when the header runs past them."""
    try:
        return _fingerprint_from(*_parse(memoryview(data), name, None))
    except (struct.error, IndexError, ValueError, OverflowError):
        raise HeaderCutShort(f"{name}: its GGUF header runs past the first {len(data)} bytes") from None
    except UnicodeDecodeError:
        raise ModelFileError(f"{name}: its GGUF header is damaged") from None


def _fingerprint_of(path) -> Fingerprint:
    return _fingerprint_from(*_read_header(path, upto=None))


def _fingerprint_from(values: dict, tokens) -> Fingerprint:
    n_vocab, digest = tokens if tokens else (0, "")
    special = {name: _int(values.get(f"tokenizer.ggml.{key}_token_id")) for name, key in SPECIAL_IDS.items()}
    model = str(values.get("tokenizer.ggml.model", ""))
    pre = str(values.get("tokenizer.ggml.pre") or "default")
    # BOS and EOS as llama.cpp loads them: its default where the key is absent or names no token
    bos, eos, add_bos, add_eos = _DEFAULT_SPECIAL.get(model, (None, None, False, False))
    add_bos = add_bos or (model == "gpt2" and pre in _BPE_ADDING_BOS)
    for name, default in (("bos", bos), ("eos", eos)):
        if special[name] is None or not (0 <= special[name] < n_vocab or not tokens):
            special[name] = default
    given_bos, given_eos = values.get("tokenizer.ggml.add_bos_token"), values.get("tokenizer.ggml.add_eos_token")
    add_bos = bool(given_bos) if given_bos is not None else add_bos
    return Fingerprint(model=model, pre=pre, n_vocab=n_vocab, tokens_sha256=digest, **special,
                       add_bos=add_bos or model == "gemma4",  # llama.cpp's override for Gemma 4 (its PR 21500)
                       add_eos=bool(given_eos) if given_eos is not None else add_eos)


def _tokens_digest(source, upto: int) -> str:
    """The digest of the token texts up to `upto`, from a file's path or its header's bytes."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _parse(memoryview(source), "the GGUF header", upto)[1][1]
    return _read_header(source, upto=upto)[1][1]


def _int(value):
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# ---------------------------------------------------------------- the GGUF key-value section

def _read_header(path, upto: int | None, parse=None) -> tuple[dict, tuple[int, str] | None]:
    """The header's scalar and string values by key, and (token count, sha256 of the token texts
    from id VOCAB_CHECK_START to `upto` or the end) as the file stores them; `parse(data)`: what
    it returns instead, with the same one-line errors."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return parse(data) if parse else _parse(data, str(path), upto)
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{path}: cannot read its GGUF header ({exc})") from None
    except (struct.error, IndexError, UnicodeDecodeError, OverflowError, KeyError):
        raise ModelFileError(f"{path}: its GGUF header is cut short or damaged") from None


def _parse(data, name: str, upto: int | None):
    if data[:4] != b"GGUF":
        raise ModelFileError(f"{name}: not a GGUF file (no GGUF magic)")
    version, _n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    if version < 2:
        raise ModelFileError(f"{name}: GGUF version {version} is too old (2 or later)")
    offset, values, tokens = 24, {}, None
    for _ in range(n_kv):
        key, offset = _string(data, offset)
        (kind,), offset = struct.unpack_from("<I", data, offset), offset + 4
        if kind == _ARRAY:
            (item_kind, count), offset = struct.unpack_from("<IQ", data, offset), offset + 12
            if key == "tokenizer.ggml.tokens" and item_kind == _STRING:
                tokens, offset = _hash_strings(data, offset, count, upto)
            else:
                offset = _skip_array(data, offset, item_kind, count)
        elif kind == _STRING:
            values[key], offset = _string(data, offset)
        elif kind in _SCALARS:
            values[key] = struct.unpack_from(_SCALARS[kind], data, offset)[0]
            offset += struct.calcsize(_SCALARS[kind])
        else:
            raise ModelFileError(f"{name}: unknown GGUF value type {kind} at key {key!r}")
    return values, tokens


def _string(data, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", data, offset)
    end = offset + 8 + length
    if end > len(data):
        raise ValueError("a string runs past the end of the file")
    return bytes(data[offset + 8:end]).decode("utf-8", errors="replace"), end


def _hash_strings(data, offset: int, count: int, upto: int | None) -> tuple[tuple[int, str], int]:
    """sha256 of the serialized strings VOCAB_CHECK_START..upto (lengths and bytes as stored);
    returns ((count, digest), the offset after the whole array)."""
    _check_count(data, offset, count, 8)
    unpack, stop = struct.Struct("<Q").unpack_from, count if upto is None else min(upto, count)
    hash_from = hash_to = None
    for i in range(count):
        if i == VOCAB_CHECK_START:
            hash_from = offset
        if i == stop:
            hash_to = offset
        offset += 8 + unpack(data, offset)[0]
    hash_from = offset if hash_from is None else hash_from
    hash_to = offset if hash_to is None else hash_to
    if offset > len(data):
        raise ValueError("the token list runs past the end of the file")
    return (count, hashlib.sha256(data[hash_from:max(hash_from, hash_to)]).hexdigest()), offset


def _check_count(data, offset: int, count: int, item_size: int) -> None:
    if count * item_size > len(data) - offset:
        raise ValueError(f"an array of {count} items runs past the end of the file")


def _skip_array(data, offset: int, kind: int, count: int) -> int:
    if kind in (_STRING, *_SCALARS):
        _check_count(data, offset, count, 8 if kind == _STRING else struct.calcsize(_SCALARS[kind]))
    if kind in _SCALARS:
        return offset + count * struct.calcsize(_SCALARS[kind])
    if kind == _STRING:
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            offset += 8 + unpack(data, offset)[0]
        return offset
    raise ValueError(f"an array of GGUF type {kind}, which no tokenizer key uses")


def describe(fingerprint: Fingerprint) -> str:
    return f"{fingerprint.model}/{fingerprint.pre}, {fingerprint.n_vocab} tokens"


def file_size(path: str | os.PathLike) -> int:
    """Bytes of a model: all shards of a split GGUF (NAME-00001-of-0000N.gguf), else the file."""
    path = Path(path)
    stem = path.name
    marker = stem.rfind("-00001-of-")
    if marker < 0:
        return path.stat().st_size
    total = stem[marker + len("-00001-of-"):-len(".gguf")]
    shards = [path.with_name(f"{stem[:marker]}-{i:05d}-of-{total}.gguf") for i in range(1, int(total) + 1)]
    return sum(s.stat().st_size for s in shards if s.is_file())
