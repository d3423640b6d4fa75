"""Reading a model's shape from its GGUF header: a local file, or a hub file's first bytes over an
HTTP range request (so a plan can be made before a model is downloaded), remembered per file.

The header is parsed by ggml's own GGUF reader (`ggufheader`), in tens of milliseconds where the gguf
package's GGUFReader spends seconds in Python building an object per vocabulary entry. GGUFReader remains
the fallback where libggml-base cannot be loaded or lacks one of the functions.
"""
from __future__ import annotations

import os
import re
import tempfile
from dataclasses import asdict, fields
from pathlib import Path

from ..ggufheader import GGMLHeader as _GGMLHeader, HeaderError, ggml_base as _ggml_base
from ..home import read_json, write_json
from .shape import ModelShape, shape_from_header, shape_from_reader, with_host_tensors
from .units import MiB, PlanError

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
    except HeaderError as exc:
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
