"""llama.cpp's RPC backend (ggml-rpc) through the libraries llama-cpp-python ships: workers and host side.

A worker (`start_worker`) runs llama.cpp's own RPC server in this process and exposes this machine's
device (its GPUs, else its CPU) over TCP. The host checks each worker (`probe`), turns it into ggml
devices (`register_workers`) and loads the target onto them (`load_llama(..., devices=...)`).

How models are placed (llama.cpp 0.3.36's `llama_prepare_model_devices` / `load_tensors`):
- A model loaded with `llama_model_params.devices == NULL` uses every *registered* GPU-type device,
  RPC devices first. We never add the workers to ggml's global registry, so a model loaded the
  ordinary way (the draft) stays on the local devices; the target gets an explicit, NULL-terminated
  device list (`target_devices`: the workers, then the local GPUs). The local CPU is never in the
  list: it is where the layers that are not offloaded go.
- `n_gpu_layers` counts from the end: the last `n_gpu_layers` of the n_layer + 1 blocks (the +1 is
  the output layer) go to the listed devices, the first ones stay on the local CPU. Among the
  listed devices layers are cut by `tensor_split` (one weight per device, in list order), or by
  each device's free memory when it is None. An RPC worker always counts as a GPU, even when it
  serves a CPU. `layer_devices` computes the same assignment, for plans and stats.

Faults: ggml-rpc calls GGML_ABORT (process abort) when a worker cannot be reached, answers with
another protocol, or dies mid-call. `probe` checks reachability and the protocol version from
Python before any native call can abort; `install_abort_message` turns a mid-run abort into one
clear line and exit code 1; `keepalive` makes a silently cut connection fail within a bound time.
Workers serve one host at a time and are unauthenticated: keep them on a private network.
"""
from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Callable, Iterator, Sequence

from .backends import find_lib, llama_cpp_lib_dir
from .errors import GgufspecError
from .netaddr import is_loopback
from .load import default_threads

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
_DEV_CPU, _DEV_GPU, _DEV_ACCEL, _DEV_IGPU = 0, 1, 2, 3
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


# -- addresses ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoint(text: str) -> Endpoint:
    item = text.strip()
    if item.startswith("[") or item.count(":") > 1:
        raise RpcError(f"RPC worker {item!r}: IPv6 addresses are not supported by llama.cpp's RPC backend; use IPv4 or a host name")
    host, sep, port_text = item.rpartition(":")
    if not sep or not host:
        raise RpcError(f"RPC worker {item!r}: write it as HOST:PORT, e.g. 192.168.1.10:{DEFAULT_PORT}")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise RpcError(f"RPC worker {item!r}: the port must be a number from 1 to 65535")
    return Endpoint(host, int(port_text))


def parse_endpoints(text: str) -> list[Endpoint]:
    """'host:port,host:port' -> endpoints, in order (the order the target's layers go to them)."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise RpcError(f"--rpc {text!r}: give HOST:PORT[,HOST:PORT...] with no empty entries")
    endpoints = [parse_endpoint(item) for item in items]
    seen = set()
    for endpoint in endpoints:
        if str(endpoint) in seen:
            raise RpcError(f"RPC worker {endpoint} is listed twice")
        seen.add(str(endpoint))
    if len(endpoints) > GGML_RPC_MAX_SERVERS:
        raise RpcError(f"--rpc lists {len(endpoints)} workers; llama.cpp takes at most {GGML_RPC_MAX_SERVERS}")
    return endpoints


def _as_endpoint(endpoint: Endpoint | str) -> Endpoint:
    return endpoint if isinstance(endpoint, Endpoint) else parse_endpoint(endpoint)


# -- probing ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WorkerInfo:
    endpoint: Endpoint
    version: tuple[int, int, int]  # the worker's RPC protocol version
    rtt_s: float  # one HELLO request/response over an open connection: a network round trip


def _ipv4_address(endpoint: Endpoint) -> str:
    try:  # ggml-rpc resolves with gethostbyname: IPv4 only
        return socket.getaddrinfo(endpoint.host, endpoint.port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror:
        raise WorkerUnreachableError(f"RPC worker {endpoint}: cannot resolve the host name {endpoint.host!r}") from None


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def probe(endpoint: Endpoint | str, timeout: float = 3.0) -> WorkerInfo:
    """Connect and do ggml-rpc's HELLO from Python: reachable and compatible, or a one-line error.

    Native calls on an unreachable or incompatible worker abort the process, hence this check
    first. A worker serves one host at a time, so a busy worker accepts the TCP connection but
    does not answer the HELLO: that is reported too (after `timeout` seconds).
    """
    endpoint = _as_endpoint(endpoint)
    address = _ipv4_address(endpoint)
    try:
        sock = socket.create_connection((address, endpoint.port), timeout=timeout)
    except ConnectionRefusedError:
        raise WorkerUnreachableError(f"RPC worker {endpoint} is not reachable: connection refused "
                                     f"(is `ggufspec worker --port {endpoint.port}` running there?)") from None
    except (socket.timeout, TimeoutError):
        raise WorkerUnreachableError(f"RPC worker {endpoint} is not reachable: no answer within {timeout:g} s") from None
    except OSError as exc:
        raise WorkerUnreachableError(f"RPC worker {endpoint} is not reachable: {exc.strerror or exc}") from None
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            start = time.perf_counter()
            sock.sendall(struct.pack("<BQ", _RPC_CMD_HELLO, _CONN_CAPS_SIZE) + bytes(_CONN_CAPS_SIZE))
            (size,) = struct.unpack("<Q", _recv_exactly(sock, 8))
            if size != _HELLO_RSP_SIZE:
                raise EOFError
            major, minor, patch = _recv_exactly(sock, size)[:3]
            rtt = time.perf_counter() - start
        except (socket.timeout, TimeoutError):
            raise WorkerUnreachableError(
                f"RPC worker {endpoint} accepted the connection but did not answer the handshake within {timeout:g} s: "
                f"it is serving another host (a worker serves one at a time) or is not a ggml-rpc worker") from None
        except (EOFError, ConnectionError):
            raise WorkerUnreachableError(
                f"RPC worker {endpoint} ended the handshake: it speaks another RPC protocol than this build's "
                f"v{RPC_PROTO_MAJOR_VERSION}.{RPC_PROTO_MINOR_VERSION} or is not a ggml-rpc worker; "
                f"run the same llama-cpp-python version on both ends") from None
    if major != RPC_PROTO_MAJOR_VERSION or minor > RPC_PROTO_MINOR_VERSION:
        raise WorkerUnreachableError(
            f"RPC worker {endpoint} speaks RPC protocol v{major}.{minor}.{patch}, this build needs "
            f"v{RPC_PROTO_MAJOR_VERSION}.{RPC_PROTO_MINOR_VERSION} or an older minor: run the same llama-cpp-python version on both ends")
    return WorkerInfo(endpoint, (major, minor, patch), rtt)


def round_trip_time(endpoint: Endpoint | str, repeat: int = 3, timeout: float = 3.0) -> float:
    """The smallest HELLO round trip over `repeat` probes, in seconds (for the planner's cost model)."""
    return min(probe(endpoint, timeout).rtt_s for _ in range(max(1, repeat)))


# -- devices ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GgmlDevice:
    """A ggml device handle (ggml_backend_dev_t) that a model's layers can be placed on."""
    handle: int  # ggml_backend_dev_t
    name: str  # "RPC0", "CUDA0", ...
    description: str  # for an RPC device, its endpoint
    endpoint: Endpoint | None = None  # set for RPC devices

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes, as llama.cpp sees them (asks the worker for an RPC device)."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        _native().backend_dev_memory(self.handle, ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value


def _device(handle: int, endpoint: Endpoint | None = None) -> GgmlDevice:
    native = _native()
    return GgmlDevice(handle, native.backend_dev_name(handle).decode(),
                      (native.backend_dev_description(handle) or b"").decode(), endpoint)


def register_workers(endpoints: Sequence[Endpoint | str], timeout: float = 3.0) -> list[GgmlDevice]:
    """The workers' devices, in order. Probes every worker first: any error comes before a native call.

    Uses ggml_backend_rpc_add_server (one ggml device per device the worker serves). The devices
    are NOT added to ggml's global registry, so only a model given them explicitly
    (`load_llama(devices=...)`) uses them; calling this twice for an endpoint returns the same devices.
    """
    endpoints = [_as_endpoint(e) for e in endpoints]
    for endpoint in endpoints:
        probe(endpoint, timeout)
    native = _native()
    devices = []
    for endpoint in endpoints:
        reg = native.backend_rpc_add_server(str(endpoint).encode())
        if not reg:
            raise WorkerUnreachableError(f"RPC worker {endpoint} serves no devices")
        devices += [_device(native.backend_reg_dev_get(reg, i), endpoint)
                    for i in range(native.backend_reg_dev_count(reg))]
    return devices


def worker_memory(endpoint: Endpoint | str, timeout: float = 3.0) -> tuple[int, int]:
    """(free, total) bytes the worker reports, summed over the devices it serves (probes it first)."""
    devices = register_workers([endpoint], timeout)
    memories = [device.memory() for device in devices]
    return sum(m[0] for m in memories), sum(m[1] for m in memories)


def local_devices() -> list[GgmlDevice]:
    """This machine's GPUs (what llama.cpp offloads to by default), never the CPU nor RPC workers."""
    native = _native()
    devices = []
    for i in range(native.backend_dev_count()):
        handle = native.backend_dev_get(i)
        reg_name = native.backend_reg_name(native.backend_dev_backend_reg(handle)).decode()
        if native.backend_dev_type(handle) in (_DEV_GPU, _DEV_IGPU) and reg_name != "RPC":
            devices.append(_device(handle))
    return devices


def target_devices(worker_devices: Sequence[GgmlDevice]) -> list[GgmlDevice]:
    """The target's device list: the workers first (as llama.cpp orders them), then the local GPUs."""
    return list(worker_devices) + local_devices()


def layer_devices(n_layer: int, n_gpu_layers: int, splits: Sequence[float]) -> list[int | None]:
    """Device index for each of the n_layer repeating layers and then the output layer (None = local CPU).

    The rule of llama.cpp's load_tensors: the last n_gpu_layers of the n_layer + 1 blocks are
    offloaded; block i goes to the first device whose cumulative split share exceeds
    (i - first offloaded) / n_offloaded. `splits` is tensor_split, or the devices' free memory.
    """
    if not splits or sum(splits) <= 0:
        return [None] * (n_layer + 1)
    total, cumulative, running = float(sum(splits)), [], 0.0
    for share in splits:
        running += share
        cumulative.append(running / total)
    first = max(n_layer + 1 - n_gpu_layers, 0)
    n_offloaded = min(n_gpu_layers, n_layer + 1)
    placement: list[int | None] = []
    for block in range(n_layer + 1):
        if block < first or block - first >= n_offloaded:
            placement.append(None)
            continue
        fraction = (block - first) / n_offloaded
        placement.append(min(next((i for i, c in enumerate(cumulative) if c > fraction), len(splits) - 1), len(splits) - 1))
    return placement


def layer_placement(devices: Sequence[GgmlDevice], n_layer: int, n_gpu_layers: int,
                    tensor_split: Sequence[float] | None = None) -> dict[str, int]:
    """Blocks (n_layer repeating layers + the output layer) per place: "CPU" (this machine's), each
    worker's endpoint (its devices summed: one entry per host) and each local GPU's name.

    With no tensor_split, llama.cpp splits by the devices' free memory, which this asks them for.
    To apply a planned split exactly, pass tensor_split = the planned block count per device.
    """
    splits = list(tensor_split) if tensor_split and any(tensor_split) else [d.memory()[0] for d in devices]
    labels = [str(d.endpoint) if d.endpoint else d.name for d in devices]
    counts: dict[str, int] = {}
    for index in layer_devices(n_layer, n_gpu_layers, splits[:len(devices)]):
        label = "CPU" if index is None else labels[index]
        counts[label] = counts.get(label, 0) + 1
    return counts


@contextlib.contextmanager
def model_devices(devices: Sequence[GgmlDevice]) -> Iterator[ctypes.Array]:
    """Within it, every llama_cpp.Llama(...) loads onto exactly `devices` (plus the local CPU).

    llama-cpp-python's Llama has no devices argument; it builds its params from
    llama_model_default_params(), which we wrap to fill in the NULL-terminated device array.
    Not thread-safe: load one model at a time inside it.
    """
    import llama_cpp.llama_cpp as low_level
    array = (ctypes.c_void_p * (len(devices) + 1))(*[d.handle for d in devices], None)
    original = low_level.llama_model_default_params

    def params_with_devices():
        params = original()
        params.devices = ctypes.cast(array, ctypes.c_void_p).value
        return params

    low_level.llama_model_default_params = params_with_devices
    try:
        yield array
    finally:
        low_level.llama_model_default_params = original


def load_llama(model_path: str | os.PathLike, devices: Sequence[GgmlDevice], **llama_kwargs):
    """A llama_cpp.Llama on `devices` (e.g. target_devices(register_workers(...))) and the local CPU.

    n_gpu_layers (in llama_kwargs) says how many blocks leave the CPU; tensor_split (one weight
    per device, same order) how they are shared; by default llama.cpp shares by free memory.
    """
    import llama_cpp
    with model_devices(devices) as array:
        llm = llama_cpp.Llama(model_path=str(model_path), **llama_kwargs)
    llm._ggufspec_devices = array  # llama.cpp copied the pointers; keep the array anyway
    return llm


# -- faults -------------------------------------------------------------------------------------------

_ABORT_CALLBACK_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_installed_abort_callback = None  # kept alive: ggml holds only the raw pointer


def _dead_workers(endpoints: Sequence[Endpoint], timeout: float = 0.5) -> list[Endpoint]:
    """The workers whose port refuses connections. A killed worker's kernel may close the connection
    we were using a moment before its listening port, so look again briefly before saying none."""
    for delay in (0.0, 0.2, 0.5):
        time.sleep(delay)
        dead = []
        for endpoint in endpoints:
            try:
                socket.create_connection((endpoint.host, endpoint.port), timeout=timeout).close()
            except ConnectionRefusedError:
                dead.append(endpoint)
            except OSError:  # a busy worker's full accept queue times out: alive, as far as we know
                pass
        if dead:
            return dead
    return []


def abort_message(ggml_message: str, endpoints: Sequence[Endpoint]) -> str | None:
    """The line to print for a GGML_ABORT, or None when it is not about RPC."""
    if "ggml-rpc" not in ggml_message and "RPC" not in ggml_message:
        return None
    dead = _dead_workers(endpoints)
    if dead:
        who = ", ".join(map(str, dead))
        return (f"ggufspec: error: lost the RPC worker{'s' if len(dead) > 1 else ''} {who} mid-run "
                f"(it stopped or its port closed); the run cannot go on")
    who = ", ".join(map(str, endpoints)) or "(unknown)"
    return (f"ggufspec: error: lost the connection to the RPC worker(s) {who} mid-run (the worker crashed, "
            f"restarted or the network failed); the run cannot go on")


def install_abort_message(endpoints: Sequence[Endpoint | str] = (),
                          on_abort: Callable[[str], None] | None = None) -> None:
    """Make a GGML_ABORT from ggml-rpc end the process with one clear line and exit code 1.

    ggml_abort calls this callback, then abort(): the process cannot continue (the failed call
    never returns), but the callback can explain and leave first. It names the worker(s) that no
    longer accept connections, calls `on_abort(ggml_message)` (e.g. to print partial stats; it
    runs on ggml's thread while the main thread is blocked inside llama.cpp), and exits with
    os._exit(1). Aborts unrelated to RPC get their message printed and abort as before.
    """
    global _installed_abort_callback
    known = [_as_endpoint(e) for e in endpoints]
    # llama-cpp-python points fd 2 at /dev/null while it loads a model: write to a copy made now
    stderr_fd = os.dup(2)

    def callback(raw: bytes | None) -> None:
        text = (raw or b"").decode("utf-8", errors="replace").strip()
        line = abort_message(text, known)
        os.write(stderr_fd, ((line or f"ggufspec: error: llama.cpp aborted: {text}") + "\n").encode())
        if line is None:
            return  # ggml_abort goes on to abort()
        if on_abort is not None:
            try:
                on_abort(text)
            except BaseException:  # the process is ending: nothing may stop that
                pass
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(ABORT_EXIT_CODE)

    _installed_abort_callback = _ABORT_CALLBACK_TYPE(callback)
    _native().set_abort_callback(ctypes.cast(_installed_abort_callback, ctypes.c_void_p))


def keepalive(endpoints: Sequence[Endpoint | str], timeout_s: float = 30.0) -> int:
    """Make this process's open connections to the workers fail within ~timeout_s when the network is cut.

    ggml-rpc sets no timeouts: a worker whose machine vanishes without closing the connection
    would leave a call waiting forever. TCP keepalive (while waiting for an answer) and
    TCP_USER_TIMEOUT (for unacknowledged data) make the kernel drop such a connection, and
    ggml-rpc then aborts (see install_abort_message). A slow but live worker is not affected: its
    kernel keeps acknowledging. Call it after the target has loaded (the connection then exists).
    Returns the number of connections set; Linux-only options are skipped elsewhere.
    """
    import psutil
    wanted = {(_ipv4_address(e), e.port) for e in map(_as_endpoint, endpoints)}
    process = psutil.Process()
    connections = process.net_connections("tcp") if hasattr(process, "net_connections") else process.connections("tcp")
    count = 0
    for conn in connections:
        if conn.raddr and (conn.raddr.ip, conn.raddr.port) in wanted and conn.fd >= 0:
            with socket.socket(fileno=os.dup(conn.fd)) as sock:  # options live on the socket, not the fd
                _set_keepalive(sock, timeout_s)
            count += 1
    return count


def _set_keepalive(sock: socket.socket, timeout_s: float) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval = max(1, int(timeout_s / 3)), max(1, int(timeout_s / 9))
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", int(timeout_s * 1000))):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


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
        cpu = native.backend_dev_by_type(_DEV_CPU)
        if cpu not in devices:
            raise RpcError("--mem applies to a CPU worker; this machine serves its GPUs, which report their own memory")
        _advertise_memory(cpu, mem)
    cache = None
    if cache_dir is not None:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        cache = str(Path(cache_dir).resolve()).encode()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # the server loop never returns to Python
    sys.stdout.flush()
    array = (ctypes.c_void_p * len(devices))(*devices)
    native.backend_rpc_start_server(f"{address}:{port}".encode(), cache, threads, len(devices), array)
    raise RpcError(f"the RPC server on {address}:{port} stopped: it could not listen or accept connections")
