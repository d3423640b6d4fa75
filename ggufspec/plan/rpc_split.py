"""The target across RPC workers: how many of its blocks each worker takes, as llama.cpp places
them, and the speed that split should reach (see `ggufspec.rpc` for the placement rule)."""
from __future__ import annotations

from dataclasses import dataclass

from .devices import DEFAULT_RAM_BANDWIDTH_GBS, DeviceMemory
from .estimate import CPU_LAYER_SECONDS, MARGIN
from .shape import ModelShape
from .units import PlanError, parse_size


@dataclass
class HostShare:
    host: str          # the worker's HOST:PORT, or "CPU" for this machine
    blocks: int        # target blocks it holds (repeating layers; the output layer counts as one)
    bytes: int         # their weights and KV cache
    free: int = 0      # the memory it offered
    rtt_ms: float = 0.0


def _block_bytes(shape: ModelShape, n_ctx: int) -> list[int]:
    """Weights + KV cache of each block as llama.cpp offloads them: the layers, then the output layer
    (with -nkvo the KV cache stays here, in host memory: `split_across_hosts` counts it on the CPU)."""
    kv_per_layer = shape.kv_bytes(n_ctx, 1) if shape.kv_offload else 0
    return [b + kv_per_layer for b in shape.layer_bytes] + [shape.output_bytes]


def _fill_in_order(sizes: list[int], budgets: list[int]) -> tuple[list[int], list[int]] | None:
    """Blocks (and bytes) per host when `sizes` go to the hosts in order, each host taking blocks
    until the next would pass its budget; None when they do not all fit."""
    counts, used, host = [0] * len(budgets), [0] * len(budgets), 0
    for size in sizes:
        while host < len(budgets) and used[host] + size > budgets[host]:
            host += 1
        if host == len(budgets):
            return None
        counts[host] += 1
        used[host] += size
    return counts, used


def split_across_hosts(shape: ModelShape, n_ctx: int, hosts: list[tuple[str, int]],
                       rtt_ms: dict[str, float] | None = None) -> tuple[list[HostShare], int]:
    """Share the target's blocks among RPC workers, in the --rpc order, as llama.cpp places them:
    the last n_gpu_layers blocks are offloaded, the first of those to the first worker. The most
    blocks that fit (each worker's free memory, less the margin and a compute buffer) wins; what is
    left stays on this machine's CPU. Returns the shares (CPU first) and n_gpu_layers."""
    sizes = _block_bytes(shape, n_ctx)
    budgets = [int(free * (1 - MARGIN)) - shape.compute_bytes(n_ctx) for _, free in hosts]
    for n_offloaded in range(len(sizes), -1, -1):  # zero blocks always fit: the loop ends with a split
        if (split := _fill_in_order(sizes[len(sizes) - n_offloaded:], budgets)) is not None:
            break
    counts, used = split
    local = len(sizes) - n_offloaded
    kept_kv = 0 if shape.kv_offload else shape.kv_bytes(n_ctx)
    shares = [HostShare("CPU", local, sum(sizes[:local]) + kept_kv)]
    shares += [HostShare(name, counts[i], used[i], free, (rtt_ms or {}).get(name, 0.0))
               for i, (name, free) in enumerate(hosts)]
    return shares, n_offloaded


def rpc_token_seconds(shape: ModelShape, shares: list[HostShare], ram: DeviceMemory,
                      worker_bandwidth_gbs: float = DEFAULT_RAM_BANDWIDTH_GBS) -> float:
    """An estimate of one target token across hosts: each host reads its blocks' weights and pays
    its layers' fixed cost; each worker adds a network round trip (ggml-rpc synchronises per graph)."""
    seconds = 0.0
    for share in shares:
        bandwidth = ram.bandwidth_gbs if share.host == "CPU" else worker_bandwidth_gbs
        seconds += share.bytes / (bandwidth * 1e9) + share.blocks * CPU_LAYER_SECONDS
        if share.host != "CPU" and share.blocks:
            seconds += share.rtt_ms / 1e3
    return seconds


def parse_host_sizes(items) -> dict[str, int]:
    """--rpc-mem HOST:PORT=SIZE (repeatable): memory to plan with instead of asking the worker."""
    sizes = {}
    for item in items or ():
        host, sep, size = item.partition("=")
        if not sep or not host:
            raise PlanError(f"--rpc-mem takes HOST:PORT=SIZE (e.g. 10.0.0.2:50052=24GiB), got {item!r}")
        if host.strip() in sizes:
            raise PlanError(f"--rpc-mem names {host.strip()} twice")
        sizes[host.strip()] = parse_size(size)
        if not sizes[host.strip()]:
            raise PlanError(f"--rpc-mem {item}: a worker with no memory takes no layer; leave it out of --rpc")
    return sizes
