"""ggml-rpc's C functions from the libraries llama-cpp-python ships, wrapped once; the protocol's constants and errors."""
from __future__ import annotations

import ctypes
from functools import cache

from ..backends import find_lib, llama_cpp_lib_dir
from ..errors import GgufspecError


REBUILD_COMMAND = 'CMAKE_ARGS="-DGGML_RPC=ON" pip install --force-reinstall --no-cache-dir llama-cpp-python==0.3.36'
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50052
# ggml/include/ggml-rpc.h of the vendored llama.cpp. A client accepts a server with the same major
# and a minor no newer than its own (negotiate_hello in ggml-rpc.cpp).
RPC_PROTO_MAJOR_VERSION = 7
RPC_PROTO_MINOR_VERSION = 0
GGML_RPC_MAX_SERVERS = 16
# The HELLO exchange (ggml-rpc.cpp): | cmd u8 = 14 | size u64 = 24 | conn_caps[24] | ->
# | size u64 = 28 | major u8 | minor u8 | patch u8 | pad u8 | conn_caps[24] |. All-zero caps = plain TCP.
_RPC_CMD_HELLO = 14
_CONN_CAPS_SIZE = 24
_HELLO_RSP_SIZE = 4 + _CONN_CAPS_SIZE
# enum ggml_backend_dev_type
_DEV_CPU, _DEV_GPU, _DEV_IGPU, _DEV_ACCEL = 0, 1, 2, 3  # ggml-backend.h's order
ABORT_EXIT_CODE = 1


class RpcError(GgufspecError):
    """A bad worker address, or a worker that cannot be used."""


class RpcUnsupportedError(RpcError):
    """The installed llama-cpp-python was built without the RPC backend."""


class WorkerUnreachableError(RpcError):
    """A worker that does not answer, answers slowly, or speaks another protocol."""

    exit_code = 1


# -- the native libraries --------------------------------------------------------------------------

class _Native:
    """ctypes prototypes for the ggml calls we make (ggml-rpc.h, ggml-backend.h, ggml.h), on the
    libraries llama_cpp has loaded already (the same handles: see _native)."""

    def __init__(self):
        rpc_path = find_lib("ggml-rpc")
        if rpc_path is None:
            raise RpcUnsupportedError(
                f"this llama-cpp-python build has no RPC backend (no ggml-rpc library in {llama_cpp_lib_dir()}); "
                f"rebuild it: {REBUILD_COMMAND} (or ./scripts/install)")
        self.rpc = ctypes.CDLL(str(rpc_path))
        libs = [ctypes.CDLL(str(p)) for p in (find_lib("ggml"), find_lib("ggml-base")) if p]
        vp, sz, u32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32
        size_p = ctypes.POINTER(ctypes.c_size_t)
        self._bind(self.rpc, "ggml_backend_rpc_add_server", vp, [ctypes.c_char_p])
        self._bind(self.rpc, "ggml_backend_rpc_get_device_memory", None, [ctypes.c_char_p, u32, size_p, size_p])
        self._bind(self.rpc, "ggml_backend_rpc_start_server", None,
                   [ctypes.c_char_p, ctypes.c_char_p, sz, sz, ctypes.POINTER(vp)])
        for name, restype, argtypes in (
                ("ggml_backend_dev_count", sz, []),
                ("ggml_backend_dev_get", vp, [sz]),
                ("ggml_backend_dev_by_type", vp, [ctypes.c_int]),
                ("ggml_backend_dev_name", ctypes.c_char_p, [vp]),
                ("ggml_backend_dev_description", ctypes.c_char_p, [vp]),
                ("ggml_backend_dev_type", ctypes.c_int, [vp]),
                ("ggml_backend_dev_memory", None, [vp, size_p, size_p]),
                ("ggml_backend_dev_backend_reg", vp, [vp]),
                ("ggml_backend_reg_name", ctypes.c_char_p, [vp]),
                ("ggml_backend_reg_dev_count", sz, [vp]),
                ("ggml_backend_reg_dev_get", vp, [vp, sz]),
                ("ggml_set_abort_callback", vp, [vp])):
            lib = next((lib for lib in libs if hasattr(lib, name)), None)
            if lib is None:
                raise RpcUnsupportedError(
                    f"the ggml libraries in {llama_cpp_lib_dir()} lack {name}; rebuild: {REBUILD_COMMAND}")
            self._bind(lib, name, restype, argtypes)

    def _bind(self, lib, name, restype, argtypes):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
        setattr(self, name.removeprefix("ggml_"), fn)


@cache
def _native() -> _Native:
    import llama_cpp  # loads libllama and, through it, libggml*: our handles are then the same ones
    if not llama_cpp.llama_supports_rpc():
        raise RpcUnsupportedError(
            f"this llama-cpp-python build has no RPC backend; rebuild it: {REBUILD_COMMAND} (or ./scripts/install)")
    return _Native()


def rpc_supported() -> bool:
    try:
        _native()
        return True
    except RpcUnsupportedError:
        return False


def require_rpc() -> None:
    """Raise RpcUnsupportedError (one line, with the rebuild command) when the build lacks RPC."""
    _native()
