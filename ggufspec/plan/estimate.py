"""The memory and speed model: where a model's bytes go for a given -ngl, and how long a token takes.

Placement follows llama.cpp: -ngl counts blocks from the end, so the last n layers go to the GPU
(and the output layer too when ngl > n_layer); the token embedding always stays in host memory
(llama.cpp keeps the input layer there). Each layer's KV cache lives where the layer does (with -nkvo, in
host memory); the compute buffer goes to the GPU as soon as anything is offloaded (the host keeps about
an eighth).
"""
from __future__ import annotations

from dataclasses import dataclass

from .devices import DeviceMemory
from .shape import ModelShape
from .units import MiB

GPU_OVERHEAD = 512 * MiB      # CUDA/Metal context, cuBLAS workspace: measured 300-500 MiB, rounded up
MARGIN = 0.05                 # of the device budget, kept free
# The speed model (token_seconds) is an estimate, fitted to measured decode speeds:
# - GPU: llama-bench tg on an H100 (3350 GB/s), Q4_K_M, 0.5B / 1.5B / 7B (24 / 28 / 28 layers, 0.39 /
#   0.98 / 4.4 GB read per token): 811 / 543 / 269 tok/s. Small models there are bound by kernel
#   launches, not bandwidth: a fixed 45 us per layer per token, and 55% of the vendor's bandwidth for
#   the bytes, reproduce all three within 5% (773 / 558 / 275). An H200 (4800 GB/s) decoded the 1.5B
#   and 7B shapes no faster (537 / 274 tok/s): its decode kernels reached no more bytes a second than
#   the H100's, so the share is capped at what they reached there (GPU_DECODE_GBS_MAX).
# - CPU: the measured copy bandwidth as is, and 20 us per layer (thread synchronisation: tiny models
#   with 2 to 24 layers, 15-18 us a layer at 1 and 2 threads on a 2-core EPYC). The demo pair there:
#   1.5B target 39 ms/token (estimate 50), 0.5B draft 23 ms (estimate 20).
GPU_LAYER_SECONDS = 45e-6
GPU_BANDWIDTH_EFFICIENCY = 0.55
GPU_DECODE_GBS_MAX = 0.55 * 3350  # 1,842 GB/s: the H100's share, which the H200's kernels did not pass
CPU_LAYER_SECONDS = 20e-6


@dataclass
class Placement:
    n_gpu_layers: int        # llama.cpp's -ngl: n_layer + 1 puts the output layer there too
    gpu_bytes: int
    cpu_bytes: int
    weights_gpu: int
    kv_gpu: int
    compute_gpu: int


def placement(shape: ModelShape, ngl: int, n_ctx: int) -> Placement:
    """The bytes on the GPU and in host memory for -ngl ngl at context n_ctx."""
    ngl = max(0, min(ngl, shape.n_layer + 1))
    layers_on_gpu = min(ngl, shape.n_layer)
    weights_gpu = sum(shape.layer_bytes[shape.n_layer - layers_on_gpu:])  # llama.cpp offloads the last layers
    if ngl > shape.n_layer:
        weights_gpu += shape.output_bytes
    kv_gpu = shape.kv_bytes(n_ctx, layers_on_gpu) if shape.kv_offload else 0  # -nkvo: all of it on the host
    compute = shape.compute_bytes(n_ctx)
    compute_gpu = compute if ngl > 0 else 0
    gpu = weights_gpu + kv_gpu + compute_gpu
    cpu = shape.weight_bytes - weights_gpu + shape.kv_bytes(n_ctx) - kv_gpu + (compute if ngl == 0 else compute // 8)
    return Placement(ngl, gpu, cpu, weights_gpu, kv_gpu, compute_gpu)


def max_layers(shape: ModelShape, n_ctx: int, budget: int) -> int:
    """The largest -ngl whose GPU bytes fit in `budget` (0 when none does)."""
    best = 0
    for ngl in range(shape.n_layer + 2):
        if placement(shape, ngl, n_ctx).gpu_bytes <= budget:
            best = ngl
    return best


def token_seconds_by_device(shape: ModelShape, p: Placement, gpu: DeviceMemory | None,
                            ram: DeviceMemory) -> tuple[float, float]:
    """(host seconds, GPU seconds) of one decoded token: every weight byte read once, on the device
    that holds it, at the share of its bandwidth that decode kernels reach, plus a fixed cost per
    layer (kernel launches and synchronisation: what bounds small models on a GPU, see GPU_LAYER_SECONDS)."""
    gpu_layers = min(p.n_gpu_layers, shape.n_layer) if gpu is not None else 0
    cpu_weights = shape.weight_bytes - shape.embd_bytes - p.weights_gpu
    host = cpu_weights / (ram.bandwidth_gbs * 1e9) + (shape.n_layer - gpu_layers) * CPU_LAYER_SECONDS
    on_gpu = 0.0
    if gpu is not None:
        decode_gbs = min(gpu.bandwidth_gbs * GPU_BANDWIDTH_EFFICIENCY, GPU_DECODE_GBS_MAX)
        on_gpu = (p.weights_gpu / (decode_gbs * 1e9)
                  + gpu_layers * GPU_LAYER_SECONDS)
    return host, on_gpu


def token_seconds(shape: ModelShape, p: Placement, gpu: DeviceMemory | None, ram: DeviceMemory) -> float:
    """An estimate of one decoded token's time (see token_seconds_by_device)."""
    return sum(token_seconds_by_device(shape, p, gpu, ram))


# A batch of n tokens, T(n), against one token, T(1) (what speculation lives on: verifying K drafts
# costs T(K + 1)). A GPU reads the weights once for the whole batch: up to GPU_FLAT_BATCH tokens the
# bytes cost about one token's, beyond that the work grows with n. But a small model there is bound
# by launches, not bytes, and a batch pays more of them: llama.cpp replays a single token's kernels
# as a CUDA graph and launches a batch's one by one (GPU_UNGRAPHED times the per-layer cost), and
# each extra token adds GPU_LAYER_TOKEN_SECONDS a layer. Measured with llama-bench on an H100 (the
# demo target's shape, 1.5B Q4_K_M, 28 layers): T(1) 1.88 ms (tg), a batch of 2 2.84, of 4 3.38
# (1.8 T(1)), of 8 4.32; the estimate says 1.79 / 2.67 / 3.18 / 4.19 (the draft's shape, 0.5B: T(4)
# 2.16 measured, 2.48 estimated). A 70B (80 layers, 31 GB a token), bound by its bytes, stays near
# flat: T(4) about 1.2 T(1). A CPU also reads the weights once, but
# does each token's arithmetic on its few cores: every extra token adds the weights' bytes times
# CPU_SECONDS_PER_BYTE_CORE over the cores. Measured (`bench`, target batches of 1..9) with the
# demo target (0.98 GB read a token) on 2-core cloud VMs: T(4) = 5.8 T(1) on an AVX2 EPYC, 3.2 T(1)
# on an AVX-512 EPYC (T(1) 37.7 ms: 27 ms an extra token, 2.8e-11 s a byte on 2 cores); see
# docs/benchmarks.md for this Xeon's. A 16-core desktop would add an eighth of that per token.
GPU_FLAT_BATCH = 8
GPU_UNGRAPHED = 1.5
GPU_LAYER_TOKEN_SECONDS = 9e-6
CPU_SECONDS_PER_BYTE_CORE = 5.6e-11
DEFAULT_CORES = 8  # where the host's cores are not known (a desktop beside a discrete GPU)


def batch_seconds(shape: ModelShape, p: Placement, gpu: DeviceMemory | None, ram: DeviceMemory, n: int) -> float:
    """T(n): on the GPU the bytes flat up to GPU_FLAT_BATCH tokens and the launches dearer for a
    batch; on the host each extra token's arithmetic (see the note above)."""
    host, on_gpu = token_seconds_by_device(shape, p, gpu, ram)
    host_bytes = shape.weight_bytes - shape.embd_bytes - p.weights_gpu
    extra_token = host_bytes * CPU_SECONDS_PER_BYTE_CORE / (ram.cores or DEFAULT_CORES)
    if n > 1 and on_gpu > 0:
        layers = min(p.n_gpu_layers, shape.n_layer)
        launches = layers * GPU_LAYER_SECONDS
        on_gpu = ((on_gpu - launches) * max(1.0, n / GPU_FLAT_BATCH) + launches * GPU_UNGRAPHED
                  + (n - 1) * layers * GPU_LAYER_TOKEN_SECONDS)
    return host + (n - 1) * extra_token + on_gpu
