"""ggml's own GGUF reader (libggml-base, shipped with llama-cpp-python), typed once, through ctypes: a file's
header in tens of milliseconds (the gguf package's GGUFReader builds a Python object per vocabulary entry: seconds),
no tensor data read (no_alloc, no ggml context), and ggml's log while it reads kept for the error instead of the
terminal. The planner's shapes (`plan.gguf_header`), MTP blocks (`mtp`) and the layer count that bounds -ncmoe's
patterns (`placement`) read headers here.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os

import llama_cpp

from .backends import find_lib
from .llamalog import FD2_SWAP


class HeaderError(ValueError):
    """A GGUF header ggml's reader refused: its reason, as ggml logged it."""


class _GGUFInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


_LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
GGUF_STRING, GGUF_ARRAY = 8, 9
GGUF_SCALARS = {  # gguf_type -> (getter suffix, ctypes type)
    0: ("u8", ctypes.c_uint8), 1: ("i8", ctypes.c_int8), 2: ("u16", ctypes.c_uint16), 3: ("i16", ctypes.c_int16),
    4: ("u32", ctypes.c_uint32), 5: ("i32", ctypes.c_int32), 6: ("f32", ctypes.c_float), 7: ("bool", ctypes.c_bool),
    10: ("u64", ctypes.c_uint64), 11: ("i64", ctypes.c_int64), 12: ("f64", ctypes.c_double)}


def _signatures() -> dict:
    """gguf.h / ggml.h function -> (argtypes, restype), for the calls the reader makes."""
    ctx, i64, c_char_p = ctypes.c_void_p, ctypes.c_int64, ctypes.c_char_p
    return {
        "gguf_init_from_file": ([c_char_p, _GGUFInitParams], ctx), "gguf_free": ([ctx], None),
        "gguf_init_from_buffer": ([ctypes.c_void_p, ctypes.c_size_t, _GGUFInitParams], ctx),
        "gguf_find_key": ([ctx, c_char_p], i64), "gguf_get_kv_type": ([ctx, i64], ctypes.c_int),
        "gguf_get_arr_type": ([ctx, i64], ctypes.c_int), "gguf_get_arr_n": ([ctx, i64], ctypes.c_size_t),
        "gguf_get_arr_data": ([ctx, i64], ctypes.c_void_p), "gguf_get_val_str": ([ctx, i64], c_char_p),
        "gguf_get_n_tensors": ([ctx], i64), "gguf_get_tensor_name": ([ctx, i64], c_char_p),
        "gguf_get_tensor_type": ([ctx, i64], ctypes.c_int), "gguf_get_tensor_size": ([ctx, i64], ctypes.c_size_t),
        "gguf_find_tensor": ([ctx, c_char_p], i64), "gguf_get_data_offset": ([ctx], ctypes.c_size_t),
        "gguf_get_tensor_offset": ([ctx, i64], ctypes.c_size_t),
        "ggml_log_get": ([ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)], None),
        "ggml_log_set": ([ctypes.c_void_p, ctypes.c_void_p], None),
        **{f"gguf_get_val_{suffix}": ([ctx, i64], ctype) for suffix, ctype in GGUF_SCALARS.values()}}


@functools.lru_cache(maxsize=None)
def ggml_base():
    """libggml-base with the gguf functions typed (or libllama, which resolves them from it where no separate
    file is found), or None where neither can be loaded or one lacks a function."""
    for path in (find_lib("ggml-base"), getattr(getattr(llama_cpp.llama_cpp, "_lib", None), "_name", None)):
        try:
            lib = ctypes.CDLL(str(path)) if path is not None else None
            for fn, (argtypes, restype) in (_signatures().items() if lib is not None else ()):
                getattr(lib, fn).argtypes, getattr(lib, fn).restype = argtypes, restype
        except (OSError, AttributeError):  # not loadable, or an older or newer libggml without one of these
            continue
        if lib is not None:
            return lib
    return None  # the callers' fallbacks


@contextlib.contextmanager
def ggml_log_captured(lib):
    """ggml's log lines while inside, in the list it yields (ggml logs its reasons for refusing a
    file: they make our error message); the previous log callback is restored after."""
    lines: list[str] = []
    callback = _LOG_CALLBACK(lambda level, text, _: lines.append(text.decode(errors="replace").strip()))
    saved_cb, saved_data = ctypes.c_void_p(), ctypes.c_void_p()
    with FD2_SWAP:  # the process's logger: two swaps at once could leave it on a callback freed since
        lib.ggml_log_get(ctypes.byref(saved_cb), ctypes.byref(saved_data))
        lib.ggml_log_set(ctypes.cast(callback, ctypes.c_void_p), None)
        try:
            yield lines
        finally:
            lib.ggml_log_set(saved_cb, saved_data)


class GGMLHeader:
    """An open gguf_context, from a file or from a file's first bytes (a header that ends inside
    them reads whole; one cut short fails, never reads past them): values by key, the token
    list's length, tensor (name, bytes). HeaderError where ggml refuses it."""

    def __init__(self, lib, path: str | os.PathLike | None = None, data: bytes | None = None):
        self.lib = lib
        with ggml_log_captured(lib) as errors:
            params = _GGUFInitParams(True, None)  # no_alloc, no ggml context: the header only
            self.ctx = (lib.gguf_init_from_file(os.fsencode(path), params) if data is None
                        else lib.gguf_init_from_buffer(data, len(data), params))
        if not self.ctx:
            raise HeaderError(errors[-1] if errors else "not a GGUF file")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if self.ctx:
            self.lib.gguf_free(self.ctx)
            self.ctx = None

    def value(self, key: str, default=None):
        lib, ctx = self.lib, self.ctx
        kid = lib.gguf_find_key(ctx, key.encode())
        if kid < 0:
            return default
        kind = lib.gguf_get_kv_type(ctx, kid)
        if kind == GGUF_STRING:
            return lib.gguf_get_val_str(ctx, kid).decode(errors="replace")
        if kind in GGUF_SCALARS:
            return getattr(lib, f"gguf_get_val_{GGUF_SCALARS[kind][0]}")(ctx, kid)
        if kind == GGUF_ARRAY and lib.gguf_get_arr_type(ctx, kid) in GGUF_SCALARS:  # per-layer lists
            ctype = GGUF_SCALARS[lib.gguf_get_arr_type(ctx, kid)][1]
            n = lib.gguf_get_arr_n(ctx, kid)
            return list((ctype * n).from_address(lib.gguf_get_arr_data(ctx, kid))) if n else []
        return default

    def array_length(self, key: str) -> int | None:
        kid = self.lib.gguf_find_key(self.ctx, key.encode())
        if kid < 0 or self.lib.gguf_get_kv_type(self.ctx, kid) != GGUF_ARRAY:
            return None
        return self.lib.gguf_get_arr_n(self.ctx, kid)

    def tensors(self) -> list[tuple[str, int]]:
        lib, ctx = self.lib, self.ctx
        return [(lib.gguf_get_tensor_name(ctx, i).decode(errors="replace"), lib.gguf_get_tensor_size(ctx, i))
                for i in range(lib.gguf_get_n_tensors(ctx))]

    def has_tensor(self, name: str) -> bool:
        return self.lib.gguf_find_tensor(self.ctx, name.encode()) >= 0

    def file_size(self) -> int:
        """The bytes a whole file of this header holds: its tensor data's end (one shard's, for a split model)."""
        lib, ctx = self.lib, self.ctx
        ends = [lib.gguf_get_tensor_offset(ctx, i) + lib.gguf_get_tensor_size(ctx, i)
                for i in range(lib.gguf_get_n_tensors(ctx))]
        return lib.gguf_get_data_offset(ctx) + max(ends, default=0)

    def block_count(self) -> int | None:
        """ARCH.block_count, the model's repeating layers; None where the header has none."""
        count = self.value(f"{self.value('general.architecture', '')}.block_count")
        return count if isinstance(count, int) else None


def local_header(path: str | os.PathLike) -> GGMLHeader | None:
    """A local file's header, or None where ggml cannot be loaded or refuses the file (the caller's own
    check says why, once, where it matters)."""
    lib = ggml_base()
    if lib is None:
        return None
    try:
        return GGMLHeader(lib, path)
    except HeaderError:
        return None


def cut_short(path: str | os.PathLike) -> tuple[int, int] | None:
    """(bytes on disk, bytes its header needs) for a local GGUF shorter than its tensor data's end (a download
    cut short); None where it is whole or its header cannot be read (the loader says why)."""
    header = local_header(path)
    if header is None:
        return None
    with header:
        needed, held = header.file_size(), os.path.getsize(path)
    return (held, needed) if held < needed else None
