"""Control vectors on the target: llama.cpp's --control-vector FNAME, --control-vector-scaled FNAME:SCALE and
--control-vector-layer-range START END (common/arg.cpp), read and summed as common_control_vector_load does
(common/common.cpp), and set on the target's context with llama_set_adapter_cvec.

A control vector file is a GGUF of F32 tensors `direction.N`, n_embd elements each: llama.cpp adds
direction N to the output of layer N (never to layer 0's), for the layers of the range (START to END
inclusive; 0 or less: 1 and the last layer). The files are summed, each scaled (--control-vector: 1),
and so are two directions for one layer in a file.

Who gets them is llama.cpp's: the target's context alone (common_init_from_params sets them on it after
creating it; the draft's context, and the MTP head's, are made with llama_init_from_model, which never
does). The draft only proposes: the steered target decides every token, so speculation stays lossless.
The MTP head drafts from the target's hidden states, which are steered already; llama.cpp's MTP graphs
apply a vector at the MTP block's index only, past the last layer a vector has a tensor for, so setting
one on the MTP context would change nothing. Parallel slots are sequences of the one target context.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from .errors import GgufspecError
from .gguffiles import check_gguf, file_list, scaled_item, scaled_pair

GENERATOR = "llama.cpp's llama-cvector-generator writes them"
# std::stoi's reading of what follows "direction.": blanks, a sign, digits (the rest ignored)
LAYER_INDEX = re.compile(r"\s*([+-]?\d+)")
MAX_LAYER = 10_000  # a sanity bound on a direction's layer (the largest models have a few hundred)
# architectures whose llama.cpp graph adds no control vector (no build_cvec in src/models/*.cpp, nor in the
# graph they reuse): a vector set on them would be silently ignored, so it is refused
UNSTEERED_ARCHITECTURES = frozenset({
    "plamo2", "hy_v4", "qwen3tts", "bert", "modern-bert", "nomic-bert", "nomic-bert-moe", "neo-bert",
    "jina-bert-v2", "jina-bert-v3", "eurobert", "t5encoder", "wavtokenizer-dec", "clip", "eagle3", "dflash",
    "gemma4-assistant"})


@dataclass(frozen=True)
class Steering:
    """The control vectors as llama.cpp sets them: n_embd floats per layer from layer 1 on (`data`),
    the files summed; `layers`: those some file has a direction for; `layer_range` as given."""

    vectors: tuple[tuple[str, float], ...]
    n_embd: int
    data: np.ndarray = field(repr=False, compare=False)
    layers: tuple[int, ...]
    layer_range: tuple[int, int] | None = None


@dataclass(frozen=True)
class Applied:
    """What a context was steered with: the files and scales, and the layers start..end (inclusive)."""

    vectors: tuple[tuple[str, float], ...]
    start: int
    end: int


# ---------------------------------------------------------------- the flags, as llama.cpp takes them

def requested(control_vector: Sequence | str = (), control_vector_scaled: Sequence | str = ()) -> tuple:
    """(path, scale) pairs: --control-vector's values (paths, each a comma-separated list, scale 1), then
    --control-vector-scaled's (FNAME:SCALE,... texts, or (path, scale) pairs)."""
    vectors = [(name, 1.0) for value in _values(control_vector) for name in file_list("--control-vector", value)]
    for value in _values(control_vector_scaled):
        if isinstance(value, (tuple, list)):
            vectors.append(scaled_pair("scaled control vector", value))
        else:
            vectors += [scaled_item("--control-vector-scaled", item, "happy.gguf:0.8")
                        for item in file_list("--control-vector-scaled", value)]
    return tuple(vectors)


def _values(given) -> list:
    return [given] if isinstance(given, (str, os.PathLike)) else list(given or ())


def layer_range(given) -> tuple[int, int] | None:
    """--control-vector-layer-range START END as given (None: not given); 0 or less is llama.cpp's default
    for that end (1, the last layer). A START past END would steer no layer: refused."""
    if given is None:
        return None
    if (not isinstance(given, (tuple, list)) or len(given) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and abs(n) < 2 ** 31 for n in given)):
        raise GgufspecError(f"--control-vector-layer-range takes START END, two whole numbers (layers), got {given!r}")
    start, end = given
    if start > 0 and end > 0 and start > end:
        raise GgufspecError(f"--control-vector-layer-range {start} {end}: START is past END, so no layer would be "
                            f"steered (both are inclusive: {end} {start}?)")
    return start, end


def steering(control_vector=(), control_vector_scaled=(), control_vector_layer_range=None) -> Steering | None:
    """The flags' control vectors, read and summed (`summed`); None where none is given. Every file is
    checked here, before any model loads."""
    vectors = requested(control_vector, control_vector_scaled)
    layers = layer_range(control_vector_layer_range)
    if not vectors:
        if layers is not None:
            raise GgufspecError("--control-vector-layer-range says where control vectors apply: give them too "
                                "(--control-vector FNAME or --control-vector-scaled FNAME:SCALE)")
        return None
    return summed(vectors, layers)


# ---------------------------------------------------------------- the files (common_control_vector_load)

def summed(vectors: Sequence[tuple[str, float]], layer_range: tuple[int, int] | None = None) -> Steering:
    """The files' directions, each scaled, summed per layer; every file as wide as the first."""
    total: np.ndarray | None = None
    n_embd, first, layers = 0, "", set()
    for path, scale in vectors:
        width, data, held = read_vector(path, scale)
        layers |= held
        if total is None:
            total, n_embd, first = data, width, path
            continue
        if width != n_embd:
            raise GgufspecError(f"control vector {path} is {width} wide, but {first} is {n_embd}: the vectors "
                                f"summed must be of one width (a model's n_embd)")
        grown = np.zeros(max(total.size, data.size), np.float32)
        grown[:total.size] = total
        grown[:data.size] += data
        total = grown
    return Steering(tuple(vectors), n_embd, total, tuple(sorted(layers)), layer_range)


def read_vector(path: str, scale: float) -> tuple[int, np.ndarray, set[int]]:
    """(n_embd, the scaled directions from layer 1 on, zeros where the file has none, the layers it has
    one for): llama.cpp's
    common_control_vector_load_one, its refusals in one line each."""
    reader = _reader(path)
    if not reader.tensors:
        raise GgufspecError(f"control vector {path} has no direction tensors (direction.1, direction.2...: one "
                            f"per layer; {GENERATOR})")
    n_embd, directions = 0, {}
    for tensor in reader.tensors:
        layer, values = _direction(path, tensor)
        if n_embd and values.size != n_embd:
            raise GgufspecError(f"control vector {path}: {tensor.name} has {values.size} elements and the "
                                f"directions before it {n_embd}")
        n_embd = values.size
        scaled = values * np.float32(scale)  # in float, as llama.cpp's src[j] * strength
        directions[layer] = directions[layer] + scaled if layer in directions else scaled
    data = np.zeros(n_embd * max(directions), np.float32)
    for layer, values in directions.items():
        data[n_embd * (layer - 1):n_embd * layer] = values
    return n_embd, data, set(directions)


def _reader(path: str):
    """The file's GGUF reader, after the checks that need no parsing (there, a GGUF)."""
    where = check_gguf(path, "control vector", hint=GENERATOR)
    from gguf import GGUFReader
    try:
        return GGUFReader(where)
    except Exception as exc:  # a damaged file: numpy's and struct's errors as much as gguf's own
        raise GgufspecError(f"control vector {path}: its GGUF cannot be read ({exc})") from None


def _direction(path: str, tensor) -> tuple[int, np.ndarray]:
    """A tensor's layer and its values, where it is a direction as llama.cpp reads one."""
    prefix, dot, rest = tensor.name.partition(".")
    index = LAYER_INDEX.match(rest) if prefix == "direction" and dot else None
    layer = int(index[1]) if index else -1
    if layer < 0:
        raise GgufspecError(f"control vector {path}: its tensor {tensor.name!r} is not a direction.N (N: a layer); "
                            f"is it a control vector? ({GENERATOR})")
    if layer > MAX_LAYER:
        raise GgufspecError(f"control vector {path}: {tensor.name} is for layer {layer}, past any model's (at most "
                            f"{MAX_LAYER})")
    if layer == 0:
        raise GgufspecError(f"control vector {path}: {tensor.name} is for layer 0, which llama.cpp never steers "
                            f"(directions start at direction.1)")
    if tensor.tensor_type.name != "F32":
        raise GgufspecError(f"control vector {path}: {tensor.name} is {tensor.tensor_type.name}; llama.cpp reads "
                            f"F32 directions only")
    dims = [int(n) for n in tensor.shape]
    while len(dims) > 1 and dims[-1] == 1:  # ggml_n_dims: trailing sizes of 1 are no dimension
        dims.pop()
    if len(dims) != 1:
        raise GgufspecError(f"control vector {path}: {tensor.name} has the shape {dims}, not one dimension (n_embd)")
    return layer, np.array(tensor.data, np.float32).reshape(-1)


# ---------------------------------------------------------------- on the model (llama_set_adapter_cvec)

def check_architecture(arch: str, what: str) -> None:
    """A model whose llama.cpp graph never adds a vector is refused, not silently left unsteered."""
    if arch in UNSTEERED_ARCHITECTURES:
        raise GgufspecError(f"control vectors on {what}, a {arch} model: llama.cpp's graph for {arch} adds none, so "
                            f"they would do nothing; leave --control-vector out")


def check_width(found: Steering, n_embd: int, what: str) -> None:
    """llama.cpp's check (llama_adapter_cvec::apply): the vectors are as wide as the model."""
    if found.n_embd != n_embd:
        raise GgufspecError(f"control vector {found.vectors[0][0]} is {found.n_embd} wide, but {what} is {n_embd} "
                            f"(n_embd): it was made for another model")


def applied_layers(found: Steering, n_layer: int, what: str) -> tuple[int, int]:
    """The range as llama.cpp applies it (0 or less: 1, and n_layer), refused where it steers no layer:
    llama.cpp has a direction for layers 1 to n_layer - 1, where the files have one."""
    start, end = found.layer_range or (0, 0)
    start, end = start if start > 0 else 1, end if end > 0 else n_layer
    if not any(start <= layer <= end and layer < n_layer for layer in found.layers):
        given = (f"--control-vector-layer-range {found.layer_range[0]} {found.layer_range[1]}"
                 if found.layer_range else "the default range")
        held = f"{found.layers[0]} to {found.layers[-1]}"
        raise GgufspecError(f"the control vectors steer no layer: their directions are for layers {held}, "
                            f"{given} is {start} to {end}, and {what} has layers 1 to {n_layer - 1} to steer")
    return start, end


def check_model(found: Steering | None, path: str) -> None:
    """Before the model loads: its width, and a layer to steer, from its GGUF header (where readable;
    a block count holding MTP blocks is an upper bound: `attach` checks again)."""
    if found is None:
        return
    from . import plan as P
    try:
        shape = P.read_shape(path)
    except P.PlanError:
        return  # llama.cpp will say, as it loads
    what = f"the target {Path(path).name}"
    check_architecture(shape.arch, what)
    check_width(found, shape.n_embd, what)
    applied_layers(found, shape.n_layer, what)


def attach(llm, found: Steering, what: str = "the target") -> Applied:
    """Set `found` on `llm`'s context (llama.cpp copies the data), the range checked against its layers."""
    import ctypes
    import llama_cpp
    model = llm._model.model
    check_architecture(llm.metadata.get("general.architecture", ""), what)
    check_width(found, llama_cpp.llama_model_n_embd(model), what)
    start, end = applied_layers(found, llama_cpp.llama_model_n_layer(model), what)
    data = np.ascontiguousarray(found.data, np.float32)
    pointer = data.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    if llama_cpp.llama_set_adapter_cvec(llm._ctx.ctx, pointer, data.size, found.n_embd, start, end):
        raise GgufspecError(f"llama.cpp could not set the control vectors on {what} (GGUFSPEC_VERBOSE=1: its log)")
    llm._ggufspec_cvec = Applied(found.vectors, start, end)
    return llm._ggufspec_cvec


def steer(decoder, found: Steering | None) -> None:
    """The decoder's target steered by `found` (llama.cpp's common_init_from_params: after the context is
    made, before any token); on failure the decoder is closed and the reason is one line."""
    if found is None:
        return
    try:
        attach(decoder.target_llm, found)
    except BaseException:
        decoder.close()
        raise


def applied_to(llm) -> Applied | None:
    """The control vectors set on `llm`'s context (None: none; the draft never has any)."""
    return getattr(llm, "_ggufspec_cvec", None)
