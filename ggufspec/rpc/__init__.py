"""llama.cpp's RPC backend (ggml-rpc) through the libraries llama-cpp-python ships: workers and host side.

A worker (`start_worker`) runs llama.cpp's own RPC server in this process and exposes this machine's
device (its GPUs, else its CPU) over TCP. The host checks each worker (`probe`), turns it into ggml
devices (`register_workers`) and the target is loaded onto them (`load.load_on_devices`).

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
clear line and exit code 1 (`serve --rpc` runs its model in a child process, which a supervisor
restarts: ggufspec.server.supervisor); `keepalive` makes a silently cut connection fail within a bound time.
Workers serve one host at a time and are unauthenticated: keep them on a private network.

    native.py     ggml-rpc's C functions, the protocol's constants, the errors
    endpoints.py  HOST:PORT parsing and probing workers from Python
    devices.py    workers as ggml devices; which device each target layer lands on
    faults.py     a worker lost mid-run (or hung: StallWatch) as one line and exit code 1; keepalive
    worker.py     `ggufspec worker`
Loading a model onto ggml devices is a loading concern: `ggufspec.load.load_on_devices`.
"""
from .devices import (GgmlDevice, layer_devices, layer_placement, local_devices, register_workers, target_devices,
                      worker_memory)
from .endpoints import (Endpoint, WorkerInfo, parse_endpoint, parse_endpoints, probe, probe_all, round_trip_time,
                        worker_key)
from .faults import (DEFAULT_STALL_S, StallWatch, abort_message, error_lines_on_a_new_line, exit_when_a_worker_leaves,
                     install_abort_message, keepalive)
from .native import (ABORT_EXIT_CODE, DEFAULT_HOST, DEFAULT_PORT, REBUILD_COMMAND, RPC_PROTO_MAJOR_VERSION,
                     RPC_PROTO_MINOR_VERSION, RpcError, RpcUnsupportedError, WorkerUnreachableError, _Native,
                     require_rpc, rpc_supported)
from .worker import network_warning, start_worker

__all__ = [
    "ABORT_EXIT_CODE", "DEFAULT_HOST", "DEFAULT_PORT", "DEFAULT_STALL_S", "Endpoint", "GgmlDevice", "REBUILD_COMMAND",
    "RPC_PROTO_MAJOR_VERSION", "RPC_PROTO_MINOR_VERSION", "RpcError", "RpcUnsupportedError", "StallWatch", "WorkerInfo",
    "WorkerUnreachableError", "_Native", "abort_message", "error_lines_on_a_new_line", "exit_when_a_worker_leaves",
    "install_abort_message", "keepalive", "layer_devices", "layer_placement", "local_devices", "network_warning",
    "parse_endpoint", "parse_endpoints", "probe", "probe_all", "register_workers", "require_rpc", "round_trip_time",
    "rpc_supported", "start_worker", "target_devices", "worker_key", "worker_memory",
]
