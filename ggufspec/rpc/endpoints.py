"""Workers' addresses (HOST:PORT) and probing them from Python before any native call can abort: reachable, same protocol, memory, round trip."""
from __future__ import annotations

import select
import socket
import struct
import time
from dataclasses import dataclass

from .native import (_CONN_CAPS_SIZE, GGML_RPC_MAX_SERVERS, _HELLO_RSP_SIZE, _RPC_CMD_HELLO, DEFAULT_PORT, RPC_PROTO_MAJOR_VERSION,
                     RPC_PROTO_MINOR_VERSION, RpcError, WorkerUnreachableError)


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
    if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:  # not '²'
        raise RpcError(f"RPC worker {item!r}: the port must be a number from 1 to 65535")
    return Endpoint(host, int(port_text))


def parse_endpoints(text: str) -> list[Endpoint]:
    """'host:port,host:port' -> endpoints, in order (the order the target's layers go to them)."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise RpcError(f"--rpc {text!r}: give HOST:PORT[,HOST:PORT...] with no empty entries")
    endpoints = [parse_endpoint(item) for item in items]
    seen: dict[tuple[str, int], Endpoint] = {}
    for endpoint in endpoints:  # one worker serves one host at a time: listed twice, the load would hang
        key = worker_key(endpoint)
        if key in seen:
            also = f" (as {seen[key]} too)" if str(seen[key]) != str(endpoint) else ""
            raise RpcError(f"RPC worker {endpoint} is listed twice{also}")
        seen[key] = endpoint
    if len(endpoints) > GGML_RPC_MAX_SERVERS:
        raise RpcError(f"--rpc lists {len(endpoints)} workers; llama.cpp takes at most {GGML_RPC_MAX_SERVERS}")
    return endpoints


def worker_key(endpoint: Endpoint) -> tuple[str, int]:
    """Which worker an address names, as --rpc compares them: localhost, LOCALHOST and 127.1 are 127.0.0.1."""
    return _address_or_name(endpoint), endpoint.port


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


def _address_or_name(endpoint: Endpoint) -> str:
    """The IPv4 address ggml-rpc would connect to (localhost and 127.1 are 127.0.0.1), else the name."""
    try:
        return _ipv4_address(endpoint)
    except WorkerUnreachableError:  # the probe says so, in its own words
        return endpoint.host.lower()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _connect(endpoint: Endpoint, timeout: float) -> socket.socket:
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
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _busy(endpoint: Endpoint, timeout: float) -> WorkerUnreachableError:
    return WorkerUnreachableError(
        f"RPC worker {endpoint} accepted the connection but did not answer the handshake within {timeout:g} s: "
        f"it is serving another host (a worker serves one at a time), is stopped or frozen, or is not a ggml-rpc worker")


def _answers(sock: socket.socket, timeout: float) -> bool:
    """Whether the worker's answer starts arriving within `timeout` (nothing is read)."""
    return bool(select.select([sock], [], [], timeout)[0])


def _ended(endpoint: Endpoint) -> WorkerUnreachableError:
    return WorkerUnreachableError(
        f"RPC worker {endpoint} ended the handshake: it speaks another RPC protocol than this build's "
        f"v{RPC_PROTO_MAJOR_VERSION}.{RPC_PROTO_MINOR_VERSION} or is not a ggml-rpc worker; "
        f"run the same llama-cpp-python version on both ends")


def _send_hello(sock: socket.socket, endpoint: Endpoint, timeout: float) -> float:
    """Send ggml-rpc's HELLO; the time it left (for the round trip)."""
    try:
        sock.sendall(struct.pack("<BQ", _RPC_CMD_HELLO, _CONN_CAPS_SIZE) + bytes(_CONN_CAPS_SIZE))
    except (socket.timeout, TimeoutError):
        raise _busy(endpoint, timeout) from None
    except ConnectionError:
        raise _ended(endpoint) from None
    return time.perf_counter()


def _hello_reply(sock: socket.socket, endpoint: Endpoint, start: float, timeout: float) -> WorkerInfo:
    try:
        (size,) = struct.unpack("<Q", _recv_exactly(sock, 8))
        if size != _HELLO_RSP_SIZE:
            raise EOFError
        major, minor, patch = _recv_exactly(sock, size)[:3]
        rtt = time.perf_counter() - start
    except (socket.timeout, TimeoutError):
        raise _busy(endpoint, timeout) from None
    except (EOFError, ConnectionError):
        raise _ended(endpoint) from None
    if major != RPC_PROTO_MAJOR_VERSION or minor > RPC_PROTO_MINOR_VERSION:
        raise WorkerUnreachableError(
            f"RPC worker {endpoint} speaks RPC protocol v{major}.{minor}.{patch}, this build needs "
            f"v{RPC_PROTO_MAJOR_VERSION}.{RPC_PROTO_MINOR_VERSION} or an older minor: run the same llama-cpp-python version on both ends")
    return WorkerInfo(endpoint, (major, minor, patch), rtt)


def probe(endpoint: Endpoint | str, timeout: float = 3.0) -> WorkerInfo:
    """Connect and do ggml-rpc's HELLO from Python: reachable and compatible, or a one-line error.

    Native calls on an unreachable or incompatible worker abort the process, hence this check
    first. A worker serves one host at a time, so a busy worker accepts the TCP connection but
    does not answer the HELLO: that is reported too (after `timeout` seconds).
    """
    endpoint = _as_endpoint(endpoint)
    with _connect(endpoint, timeout) as sock:
        return _hello_reply(sock, endpoint, _send_hello(sock, endpoint, timeout), timeout)


def probe_all(endpoints, timeout: float = 3.0) -> list[WorkerInfo]:
    """`probe` each worker in order, the connections to the ones before it still open.

    A worker serves one connection at a time: an entry that reaches a worker listed before it under
    another address (0.0.0.0 or this machine's own address for 127.0.0.1, another name) would wait
    for it for ever inside ggml-rpc. Here such an entry does not answer while the earlier connections
    are open, and answers once the one to the same worker closes: it is named instead.
    """
    held: list[tuple[Endpoint, socket.socket]] = []
    infos = []
    try:
        for endpoint in map(_as_endpoint, endpoints):
            sock = _connect(endpoint, timeout)
            held.append((endpoint, sock))
            start = _send_hello(sock, endpoint, timeout)
            if not _answers(sock, timeout):
                for earlier, other in held[:-1]:  # which open connection keeps it waiting?
                    other.close()
                    if _answers(sock, min(timeout, 1.0)):
                        raise RpcError(f"RPC worker {endpoint} is the worker {earlier} again (another address of the "
                                       f"same machine and port): list each worker once")
                raise _busy(endpoint, timeout)
            infos.append(_hello_reply(sock, endpoint, start, timeout))
    finally:
        for _, sock in held:
            sock.close()
    return infos


def round_trip_time(endpoint: Endpoint | str, repeat: int = 3, timeout: float = 3.0) -> float:
    """The smallest HELLO round trip over `repeat` probes, in seconds (for the planner's cost model)."""
    return min(probe(endpoint, timeout).rtt_s for _ in range(max(1, repeat)))
