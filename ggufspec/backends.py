"""What the installed llama-cpp-python build has: where its shared libraries live, and which ggml
backends (CUDA, Metal, RPC, CPU...) it was built with.

Used by the planner (its GGUF header reader, the `plan` table), the RPC layer (the ggml-rpc
library) and `--version` / the server's /props (the backend list).
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import re
from pathlib import Path

# ggml's backend names (registry name or library file stem) -> what a user calls them
_BACKEND_NAMES = {"cpu": "CPU", "cuda": "CUDA", "hip": "ROCm", "rocm": "ROCm", "musa": "MUSA", "mtl": "Metal",
                  "metal": "Metal", "vulkan": "Vulkan", "sycl": "SYCL", "opencl": "OpenCL", "blas": "BLAS",
                  "rpc": "RPC", "cann": "CANN", "webgpu": "WebGPU", "zdnn": "zDNN"}


def llama_cpp_lib_dir() -> Path | None:
    """Where llama-cpp-python keeps its shared libraries ($LLAMA_CPP_LIB_PATH, as llama_cpp itself
    honours), found without importing llama_cpp; None when it is not installed."""
    if os.environ.get("LLAMA_CPP_LIB_PATH"):
        return Path(os.environ["LLAMA_CPP_LIB_PATH"])
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


def find_lib(stem: str) -> Path | None:
    """The shared library `stem` (e.g. "ggml-base") in llama-cpp-python's folder, under this
    platform's file name, or None."""
    folder = llama_cpp_lib_dir()
    if folder is None:
        return None
    for name in (f"lib{stem}.so", f"lib{stem}.dylib", f"{stem}.dll", f"lib{stem}.dll"):
        if (folder / name).is_file():
            return folder / name
    return None


@functools.lru_cache(maxsize=1)
def build_backends() -> list[str]:
    """The ggml backends the installed llama-cpp-python build has, e.g. ['CUDA', 'RPC', 'CPU']: ggml's
    own backend registry (libggml, through ctypes), plus any backend library beside it that the
    registry has not loaded (builds with dynamically loaded backends)."""
    names = _registered_backends() + _backend_library_files()
    pretty = [_BACKEND_NAMES.get(n.lower(), n) for n in names]
    return list(dict.fromkeys(pretty))


def _registered_backends() -> list[str]:
    """The names in libggml's backend registry ([] when the library cannot be loaded here)."""
    lib_path = find_lib("ggml")
    if lib_path is None:
        return []
    names = []
    try:
        lib = ctypes.CDLL(str(lib_path))
        lib.ggml_backend_reg_count.restype = ctypes.c_size_t
        lib.ggml_backend_reg_get.argtypes, lib.ggml_backend_reg_get.restype = [ctypes.c_size_t], ctypes.c_void_p
        lib.ggml_backend_reg_name.argtypes, lib.ggml_backend_reg_name.restype = [ctypes.c_void_p], ctypes.c_char_p
        for i in range(lib.ggml_backend_reg_count()):
            names.append(lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i)).decode())
    except (OSError, AttributeError):
        pass  # not loadable here: the library files still say what was built
    return names


def _backend_library_files() -> list[str]:
    """Backend stems of the libggml-<name> files beside llama-cpp-python (ggml-base is not one)."""
    folder = llama_cpp_lib_dir()
    if folder is None or not folder.is_dir():
        return []
    names = []
    for file in sorted(folder.iterdir()):
        if (m := re.fullmatch(r"(?:lib)?ggml-(\w+)\.(?:so|dylib|dll)", file.name)) and m[1] != "base":
            names.append(m[1])
    return names


def gpu_offload_supported() -> bool:
    """Whether this build can offload layers to a GPU at all (llama.cpp's own answer)."""
    import llama_cpp
    return bool(llama_cpp.llama_supports_gpu_offload())
