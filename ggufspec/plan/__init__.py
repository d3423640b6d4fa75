"""Offload planning: what the machine has, what each model needs, and -ngl / -ngld for the pair.

Everything is computed from GGUF headers (tensor shapes and types), so a plan can be made before a
model is downloaded: for a registry entry not on disk, the header is read over an HTTP range request.

The package, by concern:
- `units`: MiB / GiB, `parse_size` ("24GiB" -> bytes), `PlanError`.
- `shape`: `ModelShape` (bytes per layer, KV cache and compute buffer sizes) from a header's keys.
- `gguf_header`: reading that header (ggml's C reader through ctypes, the gguf package as the
  fallback; local files or a hub file's first bytes) and remembering shapes per file.
- `devices`: `DeviceMemory` (memory and bandwidth) of the GPUs and the host; detection and parsers.
- `estimate`: the memory and speed model: `placement` of a model for an -ngl, `token_seconds`,
  `batch_seconds` (T(n): on a GPU near flat where bytes bound it, dearer where launches do; growing on a CPU).
- `measured`: the step costs this machine remembered (costs.json), marked with the build.
- `speculation`: what the draft is worth here (the simulator over the pair's traces), for `plan`.
- `offload`: `make_plan`, choosing -ngl / -ngld (and -c) by predicted speed; `plan_table`.
- `rpc_split`: the target's blocks across RPC workers, and that split's speed.
The speculative rate itself is `ggufspec.costmodel`'s; the build's backends, `ggufspec.backends`'.
"""
from __future__ import annotations

from ..backends import build_backends, gpu_offload_supported, llama_cpp_lib_dir
from .devices import (DEFAULT_GPU_BANDWIDTH_GBS, DEFAULT_RAM_BANDWIDTH_GBS, GPU_BANDWIDTH_GBS, DeviceMemory,
                      bandwidth_for, detect_gpus, detect_ram, measure_ram_bandwidth, parse_apple_sysctl,
                      parse_nvidia_smi, parse_rocm_smi)
from .estimate import (CPU_LAYER_SECONDS, GPU_BANDWIDTH_EFFICIENCY, GPU_LAYER_SECONDS, GPU_OVERHEAD, MARGIN,
                       Placement, batch_seconds, max_layers, placement, token_seconds)
from .gguf_header import SHAPES_KEPT, kept_on_host, read_remote_shape, read_shape, read_tensor_sizes
from .offload import DEFAULT_ACCEPTANCE, Plan, around_given, gpu_budget, make_plan, plan_table
from .rpc_split import HostShare, parse_host_sizes, rpc_token_seconds, split_across_hosts
from .shape import (KV_BYTES, ModelShape, cache_bytes, loaded_as, shape_from_header, shape_from_reader,
                    with_host_tensors)
from .units import GiB, MiB, PlanError, parse_size


__all__ = [
    "CPU_LAYER_SECONDS", "DEFAULT_ACCEPTANCE", "DEFAULT_GPU_BANDWIDTH_GBS", "DEFAULT_RAM_BANDWIDTH_GBS",
    "DeviceMemory", "GPU_BANDWIDTH_EFFICIENCY", "GPU_BANDWIDTH_GBS", "GPU_LAYER_SECONDS",
    "GPU_OVERHEAD", "GiB", "HostShare", "KV_BYTES", "MARGIN", "MiB", "ModelShape", "Placement", "Plan",
    "PlanError", "SHAPES_KEPT", "around_given", "bandwidth_for", "batch_seconds", "build_backends", "cache_bytes",
    "detect_gpus", "detect_ram", "kept_on_host", "loaded_as", "read_tensor_sizes", "with_host_tensors",
    "gpu_budget", "gpu_offload_supported", "llama_cpp_lib_dir", "make_plan", "max_layers",
    "measure_ram_bandwidth", "parse_apple_sysctl", "parse_host_sizes", "parse_nvidia_smi", "parse_rocm_smi",
    "parse_size", "placement", "plan_table", "read_remote_shape", "read_shape", "rpc_token_seconds",
    "shape_from_header", "shape_from_reader", "split_across_hosts", "token_seconds"]
