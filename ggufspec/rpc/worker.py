"""`ggufspec worker`: llama.cpp's RPC server in this process, serving this machine's GPUs (else its CPU)."""
from __future__ import annotations

import ctypes
import ipaddress
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from ..load import default_threads
from ..netaddr import is_loopback
from .devices import local_devices
from .native import _DEV_CPU, DEFAULT_HOST, DEFAULT_PORT, RpcError, _native, require_rpc


# -- the worker ---------------------------------------------------------------------------------------

_memory_callbacks: list = []  # kept alive while the server runs
_GET_MEMORY_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t))


def network_warning(host: str) -> str:
    return (f"ggufspec: warning: the RPC worker listens on {host}, beyond this machine. RPC workers are "
            f"unauthenticated: anyone who can reach the port can run computations and read or write its memory. "
            f"Keep it on a private network.")


def _bind_address(host: str) -> str:
    """ggml-rpc's server binds an IPv4 address given as text (inet_addr): resolve names to one."""
    if host == "localhost":
        return "127.0.0.1"
    if not host.strip():
        raise RpcError("--host is empty: give an address (127.0.0.1, the default, or 0.0.0.0 for every interface)")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:
            return socket.gethostbyname(host)
        except OSError:
            raise RpcError(f"--host {host!r}: cannot resolve it to an IPv4 address") from None
    if address.version == 6:
        raise RpcError(f"--host {host}: llama.cpp's RPC server listens on IPv4 only; use 127.0.0.1 or 0.0.0.0")
    return host


def _check_port_free(address: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server does
        try:
            sock.bind((address, port))
        except OSError as exc:
            raise RpcError(f"cannot listen on {address}:{port}: {exc.strerror or exc}") from None


def _worker_devices() -> list[int]:
    """As llama.cpp's rpc-server: this machine's GPUs, else its CPU."""
    gpus = [d.handle for d in local_devices()]
    return gpus or [_native().backend_dev_by_type(_DEV_CPU)]


def _advertise_memory(device: int, mem: int) -> None:
    """Make the CPU device report `mem` bytes free and total (what hosts split layers by).

    ggml_backend_device starts with its interface, a struct of function pointers whose third
    member is get_memory; the CPU device is a static, writable struct, so we point that member
    at our callback (this process is the worker: nothing else here asks the CPU its memory).
    """
    @_GET_MEMORY_TYPE
    def get_memory(dev, free, total):
        free[0] = total[0] = mem
    _memory_callbacks.append(get_memory)
    slot = ctypes.c_void_p.from_address(device + 2 * ctypes.sizeof(ctypes.c_void_p))
    slot.value = ctypes.cast(get_memory, ctypes.c_void_p).value


def start_worker(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, threads: int | None = None,
                 mem: int | None = None, cache_dir: str | os.PathLike | None = None) -> None:
    """Run llama.cpp's RPC server in this process until it is killed (blocking; Ctrl-C ends it).

    Serves this machine's GPUs, else its CPU with `threads` threads (default: physical cores).
    `mem` (bytes) is what a CPU worker tells hosts it has (default: all its RAM). `cache_dir` keeps
    large tensors the host sent, by hash, so a restarted host loads faster. Prints a warning for
    any address other than loopback: workers are unauthenticated.
    """
    require_rpc()
    if not 1 <= int(port) <= 65535:
        raise RpcError(f"--port {port}: must be from 1 to 65535")
    address = _bind_address(host)
    if not is_loopback(host) and not is_loopback(address):
        print(network_warning(host), file=sys.stderr, flush=True)
    _check_port_free(address, port)
    if threads is None:
        threads = default_threads()
    if threads < 1:
        raise RpcError(f"--threads {threads}: must be at least 1")
    native = _native()
    devices = _worker_devices()
    if mem is not None:
        if mem <= 0:
            raise RpcError(f"--mem {mem}: must be positive")
        if mem >= 1 << 60:  # ggml counts bytes in a size_t: an exabyte is no machine's memory (and wraps past 16 EiB)
            raise RpcError(f"--mem {mem} bytes: more memory than any machine has; give e.g. 24GiB")
        cpu = native.backend_dev_by_type(_DEV_CPU)
        if cpu not in devices:
            raise RpcError("--mem applies to a CPU worker; this machine serves its GPUs, which report their own memory")
        _advertise_memory(cpu, mem)
    cache = None
    if cache_dir is not None and not str(cache_dir).strip():  # Path("") is the current folder: filled with tensors
        raise RpcError("--cache is empty: give the folder to keep tensors in")
    if cache_dir is not None:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        cache = str(Path(cache_dir).resolve()).encode()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # the server loop never returns to Python
    sys.stdout.flush()
    array = (ctypes.c_void_p * len(devices))(*devices)
    native.backend_rpc_start_server(f"{address}:{port}".encode(), cache, threads, len(devices), array)
    raise RpcError(f"the RPC server on {address}:{port} stopped: it could not listen or accept connections")
