"""Workers as ggml devices for the target, and which device each of its layers lands on (as llama.cpp assigns them)."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

from .endpoints import Endpoint, _as_endpoint, probe_all
from .native import _DEV_GPU, _DEV_IGPU, WorkerUnreachableError, _native


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
    (`load.load_on_devices(devices=...)`) uses them; calling this twice for an endpoint returns the same devices.
    """
    endpoints = [_as_endpoint(e) for e in endpoints]
    probe_all(endpoints, timeout)  # one worker under two addresses too: ggml-rpc would wait for it for ever
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
