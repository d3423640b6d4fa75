"""POST /slots/{id}?action=save|restore|erase (llama-server's, with --slot-save-path): a slot's cached
conversation written to a file, read back into a slot, or dropped.

A file is llama.cpp's sequence state file (`llama_state_seq_save_file`: the target's cells for the
slot's sequence, or its recurrent state) with the cached tokens in llama-server's own layout (a
marker, a version, the tokens, no media), so that llama-server and ggufspec read each other's files
for the same model and cache settings. The draft model's cache goes beside it, in FILENAME.draft (the
same layout; llama-server neither writes nor reads it): without it a restored conversation's draft
would lag the whole conversation behind, and `--draft auto` does not buy so long a catch-up for one
answer (`drafting`), so the answer would go undrafted. A draft file that does not fit (another draft
model, tokens that are not the target's) is passed over: the draft then catches up as after any new
prompt; it changes what is drafted, never the answer. A restored slot's next request with the same
prefix reuses it (its `timings.cache_n`, `prompt_n` show it); on recurrent and sliding-window memory
only a prompt that continues all the slot saved does (a restored state has no checkpoints inside it to
go back to). FILENAME.setup, beside it, says which setup computed its cells, and a restore under
another is refused (`slotsetup`); so that no file of the slot folder is ever another's sidecar, names
ending in .draft or .setup are not saved to.
"""
from __future__ import annotations

import ctypes
import os
import time

import llama_cpp

from ..native import Context
from . import slotsetup
from .errors import APIError
from .slotsetup import SETUP_SUFFIX

DRAFT_SUFFIX = ".draft"  # the draft model's cache, beside the target's file
TOKENS_MARKER, TOKENS_VERSION = -1, 1  # llama-server's server_tokens::serialize (LLAMA_TOKEN_NULL, version 1)
ACTIONS = ("save", "restore", "erase")
NAME_MAX = 255 - max(len(DRAFT_SUFFIX), len(SETUP_SUFFIX))  # bytes: a saved name leaves room for its sidecars
# codepoints fs_validate_filename refuses besides control characters: lookalikes of . / \, surrogates,
# the replacement character, the BOM, and what Windows forbids in names
FORBIDDEN = {0xFF0E, 0x2215, 0x2216, 0xFFFD, 0xFEFF, *map(ord, ':*?"<>|/\\')}


def valid_filename(name: str) -> bool:
    """llama.cpp's fs_validate_filename (common.cpp) without subfolders: a plain file name, 1 to 255
    bytes, no separator, no "..", no control character, no leading or trailing space or trailing dot."""
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate
        return False
    if not 0 < size <= 255 or name == "." or ".." in name:
        return False
    if any(ord(c) <= 0x1F or 0x7F <= ord(c) <= 0x9F or ord(c) in FORBIDDEN for c in name):
        return False
    return not (name[0] == " " or name[-1] in " .")


def slot_action(slots, index: int, action: str, folder: str, filename: str | None) -> dict:
    """Run the action on slot `index` once no generation runs in it; llama-server's answer."""
    if not 0 <= index < len(slots):
        raise APIError(400, f"Invalid slot ID: {index} (this server has slots 0 to {len(slots) - 1}: -np)",
                       param="id_slot")
    if action == "erase":
        return erase(slots, index)
    if not isinstance(filename, str) or not valid_filename(filename):
        raise APIError(400, f"Invalid filename: {filename!r} (a plain file name in --slot-save-path: no /, \\, .., "
                            f"control characters, leading or trailing space)", param="filename")
    if action == "save":
        check_saved_name(filename)
    path = os.path.join(folder, filename)
    return save(slots, index, path, filename) if action == "save" else restore(slots, index, path, filename)


def check_saved_name(filename: str) -> None:
    """400 for a name that is, or is too long to have, a slot file's sidecars (FILENAME.draft, .setup):
    saving "x.setup" would be overwritten by the next save of "x"."""
    if filename.endswith((DRAFT_SUFFIX, SETUP_SUFFIX)):
        raise APIError(400, f"Invalid filename: {filename!r} ends in {DRAFT_SUFFIX} or {SETUP_SUFFIX}, the names of "
                            f"the files ggufspec keeps beside a slot file: choose another name", param="filename")
    if len(filename.encode()) > NAME_MAX:
        raise APIError(400, f"Invalid filename: {filename!r} is longer than {NAME_MAX} bytes, which leaves no room "
                            f"for FILENAME{SETUP_SUFFIX} beside it", param="filename")


def save(slots, index: int, path: str, filename: str) -> dict:
    with slots.hold(index) as slot:
        started = time.perf_counter()
        draft = own_draft(slot)
        setup = slotsetup.setup_of(slot.target, draft)
        slotsetup.make_room(path + SETUP_SUFFIX, filename)
        written = write_state(slot.target, path)
        if not written:
            raise APIError(500, f"Unable to save slot {index} to {filename} (the folder of --slot-save-path "
                                f"cannot take it?)", "server_error")
        if not (draft is not None and draft.tokens and write_state(draft, path + DRAFT_SUFFIX)):
            setup["draft"] = None  # no draft file: the draft catches up after a restore
            if os.path.exists(path + DRAFT_SUFFIX):
                os.remove(path + DRAFT_SUFFIX)  # an earlier save's: not this conversation's draft
        write_setup(path + SETUP_SUFFIX, setup, index, filename)
        return {"id_slot": index, "filename": filename, "n_saved": len(slot.target.tokens), "n_written": written,
                "n_saved_draft": len(draft.tokens) if setup["draft"] is not None else 0,
                "timings": {"save_ms": (time.perf_counter() - started) * 1000}}


def write_setup(path: str, setup: dict, index: int, filename: str) -> None:
    try:
        slotsetup.write(path, setup)
    except OSError as exc:
        raise APIError(500, f"Slot {index} was saved to {filename} but not its setup, {filename}{SETUP_SUFFIX} "
                            f"({exc.strerror or exc}): a restore would not check it; save it again",
                       "server_error") from None


def write_state(ctx, path: str) -> int:
    """The context's sequence to `path` (llama.cpp's sequence state file, the tokens in llama-server's
    layout); the bytes written, 0 where it could not."""
    packed = pack(ctx.tokens)
    return llama_cpp.llama_state_seq_save_file(ctx.ctx, path.encode(), ctx.seq,
                                               (llama_cpp.llama_token * len(packed))(*packed), len(packed))


def own_draft(slot) -> Context | None:
    """The slot's draft model context where its cache can be saved as the target's: a draft of the
    target's vocabulary (a bridged draft's tokens are its own; an MTP head's cache follows the
    target's states)."""
    return slot.draft if type(slot.draft) is Context else None


def restore(slots, index: int, path: str, filename: str) -> dict:
    if not os.path.isfile(path):
        raise APIError(400, f"Unable to restore slot: no file {filename} in --slot-save-path", param="filename")
    if filename.endswith(SETUP_SUFFIX) and slotsetup.read(path) is not None:
        raise APIError(400, f"Unable to restore slot: {filename} is the setup of the slot file "
                            f"{filename.removesuffix(SETUP_SUFFIX)}, not a slot file: restore that", param="filename")
    with slots.hold(index) as slot:
        started = time.perf_counter()
        draft = own_draft(slot)
        here = slotsetup.setup_of(slot.target, draft)
        saved = slotsetup.checked(path + SETUP_SUFFIX, filename, here)  # before the slot is touched
        for ctx in slot.contexts():
            ctx.keep(0)
        slot.last_stats = None  # what the slot caches is no longer what its last answer left
        try:
            tokens, read = load_state(slot.target, path)
        except ValueError as exc:
            raise APIError(400, f"Unable to restore slot: {exc}") from None
        fitting_draft = draft if slotsetup.same_draft(saved, here) else None  # else it catches up
        n_draft = restore_draft(fitting_draft, path + DRAFT_SUFFIX, tokens)
        return {"id_slot": index, "filename": filename, "n_restored": len(tokens), "n_read": read,
                "n_restored_draft": n_draft, "setup_checked": saved is not None,
                "timings": {"restore_ms": (time.perf_counter() - started) * 1000}}


def restore_draft(draft: Context | None, path: str, target_tokens: list[int]) -> int:
    """The draft's cache from its file, where there is one that fits: a state of this draft model
    holding a prefix of the target's tokens. The tokens restored (0: it catches up on the next prompt)."""
    if draft is None or not os.path.isfile(path):
        return 0
    try:
        tokens, _ = load_state(draft, path)
    except ValueError:
        return 0
    if tokens != target_tokens[:len(tokens)]:
        draft.keep(0)
        return 0
    return len(tokens)


def load_state(ctx, path: str) -> tuple[list[int], int]:
    """The file's state into the context's (emptied) sequence; its tokens and the bytes read. ValueError
    where it cannot be: not a state file of this model and cache layout, too long, tokens out of range
    (the sequence is left empty then)."""
    try:
        tokens, read = _load_state(ctx, path)
    except ValueError:
        llama_cpp.llama_memory_seq_rm(ctx.memory, ctx.seq, 0, -1)
        raise
    ctx.tokens.extend(tokens)
    # the last decode's size, which llama.cpp's recurrent rollback (n_rs_seq) relies on, is not this
    # sequence's any more (native.py is at its size limit: set here)
    ctx._last_batch = 0
    return tokens, read


def _load_state(ctx, path: str) -> tuple[list[int], int]:
    n_packed = ctypes.c_size_t(0)
    seq, name = ctx.seq, path.encode()
    if not llama_cpp.llama_state_seq_load_file(ctx.ctx, name, seq, None, 0, ctypes.byref(n_packed)):
        raise ValueError("not a sequence state file")
    if n_packed.value > ctx.n_ctx + 4:
        raise ValueError(f"it holds {n_packed.value} tokens, more than a slot's context ({ctx.n_ctx}, -c)")
    buffer = (llama_cpp.llama_token * max(1, n_packed.value))()
    read = llama_cpp.llama_state_seq_load_file(ctx.ctx, name, seq, buffer, len(buffer), ctypes.byref(n_packed))
    if not read:
        raise ValueError("No available space in KV cache or invalid slot save file (another model, or other "
                         "cache settings: -np, -ctk/-ctv, --swa-full?)")
    tokens = unpack(list(buffer[:n_packed.value]))
    if len(tokens) > ctx.n_ctx:
        raise ValueError(f"Restored prompt does not fit in the slot context ({len(tokens)} > {ctx.n_ctx})")
    if any(not 0 <= token < ctx.n_vocab for token in tokens):
        raise ValueError("Invalid tokens in slot save file")
    held = llama_cpp.llama_memory_seq_pos_max(ctx.memory, seq) + 1
    if held != len(tokens):
        raise ValueError(f"the file's state holds {held} positions for its {len(tokens)} tokens")
    return tokens, read


def erase(slots, index: int) -> dict:
    with slots.hold(index) as slot:
        n_erased = slot.target.n_past
        for ctx in slot.contexts():
            ctx.keep(0)
        return {"id_slot": index, "n_erased": n_erased}


def pack(tokens: list[int]) -> list[int]:
    """The tokens as llama-server writes them into a slot file: marker, version, count, tokens, no media."""
    return [TOKENS_MARKER, TOKENS_VERSION, len(tokens), *tokens, 0]


def unpack(packed: list[int]) -> list[int]:
    """A slot file's tokens: llama-server's layout, or a plain token list (older llama-server, and files
    written by llama.cpp's own examples)."""
    if not packed or packed[0] != TOKENS_MARKER:
        return packed
    if len(packed) < 4 or packed[1] != TOKENS_VERSION:
        raise ValueError("Unsupported server tokens state version")
    n = packed[2]
    if n < 0 or len(packed) != n + 4:
        raise ValueError("a malformed token list in the slot file")
    if packed[3 + n] != 0:
        raise ValueError("Cannot restore media tokens without an mmproj")
    return packed[3:3 + n]
