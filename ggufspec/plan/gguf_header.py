"""Reading a model's shape from its GGUF header: a local file, or a hub file's first bytes over an
HTTP range request (so a plan can be made before a model is downloaded), remembered per file.

The header is parsed by ggml's own GGUF reader (libggml-base, shipped with llama-cpp-python),
through ctypes: it reads the header in C++ in tens of milliseconds where the gguf package's
GGUFReader spends seconds in Python building an object per vocabulary entry; no tensor data is
read (no_alloc, no ggml context). GGUFReader remains the fallback where libggml-base cannot be
loaded or lacks one of the functions.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import tempfile
from dataclasses import asdict, fields
from pathlib import Path

from ..backends import find_lib
from ..home import read_json, write_json
from .shape import ModelShape, shape_from_header, shape_from_reader, with_host_tensors
from .units import MiB, PlanError

# ---------------------------------------------------------------- ggml's reader, through ctypes


class _GGUFInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


_LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_SCALARS = {  # gguf_type -> (getter suffix, ctypes type)
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
        "ggml_log_get": ([ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)], None),
        "ggml_log_set": ([ctypes.c_void_p, ctypes.c_void_p], None),
        **{f"gguf_get_val_{suffix}": ([ctx, i64], ctype) for suffix, ctype in _GGUF_SCALARS.values()}}


@functools.lru_cache(maxsize=None)
def _ggml_base():
    """libggml-base with the gguf functions typed, or None where it cannot be loaded."""
    path = find_lib("ggml-base")
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None
    try:
        for fn, (argtypes, restype) in _signatures().items():
            getattr(lib, fn).argtypes, getattr(lib, fn).restype = argtypes, restype
    except AttributeError:  # an older or newer libggml without one of these: use the gguf package
        return None
    return lib


@contextlib.contextmanager
def _ggml_log_captured(lib):
    """ggml's log lines while inside, in the list it yields (ggml logs its reasons for refusing a
    file: they make our error message); the previous log callback is restored after."""
    lines: list[str] = []
    callback = _LOG_CALLBACK(lambda level, text, _: lines.append(text.decode(errors="replace").strip()))
    saved_cb, saved_data = ctypes.c_void_p(), ctypes.c_void_p()
    lib.ggml_log_get(ctypes.byref(saved_cb), ctypes.byref(saved_data))
    lib.ggml_log_set(ctypes.cast(callback, ctypes.c_void_p), None)
    try:
        yield lines
    finally:
        lib.ggml_log_set(saved_cb, saved_data)


class _GGMLHeader:
    """An open gguf_context, from a file or from a file's first bytes (a header that ends inside
    them reads whole; one cut short fails, never reads past them): values by key, the token
    list's length, tensor (name, bytes)."""

    def __init__(self, lib, path: str | None = None, data: bytes | None = None):
        self.lib = lib
        with _ggml_log_captured(lib) as errors:
            params = _GGUFInitParams(True, None)  # no_alloc, no ggml context: the header only
            self.ctx = (lib.gguf_init_from_file(os.fsencode(path), params) if data is None
                        else lib.gguf_init_from_buffer(data, len(data), params))
        if not self.ctx:
            raise PlanError(errors[-1] if errors else "not a GGUF file")

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
        if kind == _GGUF_STRING:
            return lib.gguf_get_val_str(ctx, kid).decode(errors="replace")
        if kind in _GGUF_SCALARS:
            return getattr(lib, f"gguf_get_val_{_GGUF_SCALARS[kind][0]}")(ctx, kid)
        if kind == _GGUF_ARRAY and lib.gguf_get_arr_type(ctx, kid) in _GGUF_SCALARS:  # per-layer lists
            ctype = _GGUF_SCALARS[lib.gguf_get_arr_type(ctx, kid)][1]
            n = lib.gguf_get_arr_n(ctx, kid)
            return list((ctype * n).from_address(lib.gguf_get_arr_data(ctx, kid))) if n else []
        return default

    def array_length(self, key: str) -> int | None:
        kid = self.lib.gguf_find_key(self.ctx, key.encode())
        if kid < 0 or self.lib.gguf_get_kv_type(self.ctx, kid) != _GGUF_ARRAY:
            return None
        return self.lib.gguf_get_arr_n(self.ctx, kid)

    def tensors(self) -> list[tuple[str, int]]:
        lib, ctx = self.lib, self.ctx
        return [(lib.gguf_get_tensor_name(ctx, i).decode(errors="replace"), lib.gguf_get_tensor_size(ctx, i))
                for i in range(lib.gguf_get_n_tensors(ctx))]


def _read_shape_uncached(path: str | None, name: str, data: bytes | None = None) -> ModelShape:
    """The shape from a file's header, or from `data`, a file's first bytes (ggml's reader only)."""
    lib = _ggml_base()
    if lib is None:
        return _read_shape_with_gguf_package(path, name)
    header = _open_header(lib, path, data, name)
    try:
        tensors = header.tensors() + _other_shards_tensors(lib, path, header.value("split.count", 1), name)
        return shape_from_header(header.value, tensors, header.array_length("tokenizer.ggml.tokens"), name)
    finally:
        header.close()


def _open_header(lib, path: str | None, data: bytes | None, name: str) -> "_GGMLHeader":
    try:
        return _GGMLHeader(lib, path, data)
    except PlanError as exc:
        raise PlanError(f"{name}: cannot read the GGUF header ({exc}); the file may be truncated") from None


SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")  # NAME-00001-of-00003.gguf, llama.cpp's split files


def _other_shards_tensors(lib, path: str | None, n_shards, name: str) -> list[tuple[str, int]]:
    """A split GGUF's other shards' tensors (the first holds the metadata, each its share of the
    weights): a plan from the first shard alone would count a fraction of the model's bytes."""
    tensors = []
    for shard in _other_shards(path, n_shards, name):
        header = _open_header(lib, shard, None, Path(shard).name)
        try:
            tensors += header.tensors()
        finally:
            header.close()
    return tensors


def _other_shards(path: str | None, n_shards, name: str) -> list[str]:
    """The paths of a split GGUF's other shards, each checked to be there ([] for a single file)."""
    if path is None or not isinstance(n_shards, int) or n_shards <= 1:
        return []
    found = SHARD.search(path)
    if found is None:
        raise PlanError(f"{name} is one of {n_shards} shards of a split GGUF, but its name is not "
                        f"NAME-00001-of-{n_shards:05d}.gguf: the other shards cannot be found")
    shards = [f"{path[:found.start()]}-{i:05d}-of-{n_shards:05d}.gguf" for i in range(1, n_shards + 1)
              if i != int(found[1])]
    for shard in shards:
        if not os.path.isfile(shard):
            raise PlanError(f"{name}: shard {Path(shard).name} of a split GGUF is missing beside it")
    return shards


def _read_shape_with_gguf_package(path: str, name: str) -> ModelShape:
    def tensors_of(shard: str) -> list[tuple[str, int]]:
        return [(t.name, int(t.n_bytes)) for t in _gguf_reader(shard, Path(shard).name).tensors]
    return shape_from_reader(_gguf_reader(path, name), name,
                             lambda n_shards: [t for shard in _other_shards(path, n_shards, name)
                                               for t in tensors_of(shard)])


def _gguf_reader(path: str, name: str):
    from gguf import GGUFReader
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, OSError, KeyError) as exc:
        raise PlanError(f"{name}: cannot read the GGUF header ({exc}); the file may be truncated") from None


# ---------------------------------------------------------------- remembered shapes

# Shapes are remembered per file (GGUFSPEC_HOME/shapes.json): a second plan reads no header at all.
SHAPES_FILE = "shapes.json"
SHAPES_KEPT = 64


def _remember_shape(key: str, shape: ModelShape) -> None:
    data = read_json(SHAPES_FILE)
    data.pop(key, None)
    data[key] = {k: v for k, v in asdict(shape).items() if k != "name"}
    write_json(SHAPES_FILE, dict(list(data.items())[-SHAPES_KEPT:]))  # the most recently read files


def _cached_shape(key: str, name: str, read) -> ModelShape:
    known = read_json(SHAPES_FILE).get(key)
    if known is not None and set(known) == {f.name for f in fields(ModelShape)} - {"name"}:
        try:
            remembered = ModelShape(name=name, **known)
            remembered.weight_bytes, remembered.kv_bytes(1)  # a damaged entry ("2" for 2) fails here
            return remembered
        except (TypeError, ValueError, PlanError):  # another version's ModelShape, or damaged: read again
            pass
    shape = read()
    _remember_shape(key, shape)
    return shape


def read_shape(path: str | os.PathLike, name: str | None = None) -> ModelShape:
    """A local GGUF file's shape from its header (the tensor data is not touched), remembered per
    file by its absolute path, size and modification time."""
    name = name or Path(path).name
    try:
        stat = os.stat(path)
    except OSError as exc:
        raise PlanError(f"{name}: cannot read the GGUF header ({exc.strerror})") from None
    if os.path.isdir(path):
        raise PlanError(f"{path} is a folder: give a .gguf file")
    # "shards": a split file's shape counts every shard since; one remembered before counted the first
    key = f"shards|{os.path.abspath(os.fspath(path))}|{stat.st_size}|{stat.st_mtime_ns}"
    return _cached_shape(key, name, lambda: _read_shape_uncached(os.fspath(path), name))


def read_tensor_sizes(path: str | os.PathLike) -> list[tuple[str, int]]:
    """(name, bytes) of a local GGUF's tensors, every shard's (not remembered: ggml reads them in milliseconds)."""
    path, name = os.fspath(path), Path(path).name
    lib = _ggml_base()
    if lib is None:  # the gguf package's reader, slower
        field = _gguf_reader(path, name).fields.get("split.count")
        shards = [path, *_other_shards(path, field.contents() if field else 1, name)]
        return [(t.name, int(t.n_bytes)) for shard in shards for t in _gguf_reader(shard, Path(shard).name).tensors]
    header = _open_header(lib, path, None, name)
    try:
        return header.tensors() + _other_shards_tensors(lib, path, header.value("split.count", 1), name)
    finally:
        header.close()


def kept_on_host(shape: ModelShape, path: str | os.PathLike, overrides) -> ModelShape:
    """The shape with the tensors its overrides (`placement`: -ot ...=CPU, --cpu-moe, --n-cpu-moe) put on
    the CPU counted in host memory, not in the layers -ngl offloads: the plan then offloads more layers."""
    if not overrides:
        return shape
    from ..placement import host_tensor_bytes
    return with_host_tensors(shape, host_tensor_bytes(read_tensor_sizes(path), overrides))


# ---------------------------------------------------------------- a hub file's header

def read_remote_shape(url: str, size: int, name: str, first_bytes: int = 8 * MiB,
                      shards: tuple[tuple[str, int], ...] = ()) -> ModelShape:
    """The header of a hub file, without downloading the file: a range request for its first bytes,
    parsed by ggml's reader from memory (without it: placed in a sparse file of the full size for the
    gguf package's reader). `shards`: a split GGUF's other shards (url, size), whose tensors count
    too. Remembered per URL and size."""
    key = "|".join([url, str(size), *(shard_url for shard_url, _ in shards)])
    return _cached_shape(key, name, lambda: _read_remote_shape(url, size, name, first_bytes, shards))


def _read_remote_shape(url: str, size: int, name: str, first_bytes: int,
                       shards: tuple[tuple[str, int], ...] = ()) -> ModelShape:
    def shape(header) -> ModelShape:
        return shape_from_header(header.value, header.tensors() + others,
                                 header.array_length("tokenizer.ggml.tokens"), name)
    others = [t for shard_url, shard_size in shards
              for t in _from_first_bytes(shard_url, shard_size, first_bytes, name, lambda header: header.tensors())]
    return _from_first_bytes(url, size, first_bytes, name, shape)


def _from_first_bytes(url: str, size: int, first_bytes: int, name: str, read):
    """read(the header) of a hub file, from its first bytes, asked for again, more of them, while the
    header does not fit in them."""
    from huggingface_hub.utils import http_backoff

    from ..huberrors import download_headers  # the token to the hub only, never to its CDN
    while True:
        response = http_backoff("GET", url, headers={**download_headers(url), "Range": f"bytes=0-{first_bytes - 1}"})
        response.raise_for_status()
        try:
            return _parsed(response.content, size, name, read)
        except PlanError:
            if first_bytes >= min(size, 256 * MiB):
                raise
        first_bytes *= 4  # a header bigger than we asked for (large vocabularies): ask for more


class _ReaderHeader:
    """The gguf package's reader behind _GGMLHeader's methods (where libggml-base cannot be loaded)."""

    def __init__(self, reader):
        self.reader = reader

    def value(self, key, default=None):
        found = self.reader.fields.get(key)
        return default if found is None else found.contents()

    def array_length(self, key):
        found = self.reader.fields.get(key)
        return None if found is None else len(found.data)

    def tensors(self):
        return [(t.name, int(t.n_bytes)) for t in self.reader.tensors]


def _parsed(data: bytes, size: int, name: str, read):
    """read(header) of a file of `size` bytes whose first bytes are `data`."""
    lib = _ggml_base()
    if lib is not None:
        header = _open_header(lib, None, data, name)
        try:
            return read(header)
        finally:
            header.close()
    with tempfile.NamedTemporaryFile(suffix=".gguf") as sparse:  # the gguf package reads files only
        sparse.write(data)
        sparse.truncate(size)
        sparse.flush()
        return read(_ReaderHeader(_gguf_reader(sparse.name, name)))
