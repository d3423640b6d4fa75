"""What the machine has: each GPU's memory (total, free now) and bandwidth, and the host's RAM and
measured copy bandwidth. NVIDIA through NVML (else nvidia-smi), Apple Silicon through sysctl, AMD
through rocm-smi; the parsers of those tools' output are separate, so tests can feed them fixtures.
"""
from __future__ import annotations

import functools
import json
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass

from .units import MiB

GPU_BANDWIDTH_GBS = {         # memory bandwidth, GB/s (vendor figures)
    "H200": 4800, "H100": 3350, "A100": 2039, "L40S": 864, "A6000": 768, "A10": 600,
    "RTX 5090": 1792, "RTX 4090": 1008, "RTX 4080": 717, "RTX 4070": 504, "RTX 3090": 936,
    "RTX 3080": 760, "RTX 3060": 360, "T4": 320, "V100": 900,
    "M1": 68, "M1 Pro": 200, "M1 Max": 400, "M1 Ultra": 800, "M2": 100, "M2 Pro": 200, "M2 Max": 400,
    "M2 Ultra": 800, "M3": 100, "M3 Pro": 150, "M3 Max": 400, "M4": 120, "M4 Pro": 273, "M4 Max": 546,
}
DEFAULT_GPU_BANDWIDTH_GBS = 300
DEFAULT_RAM_BANDWIDTH_GBS = 40  # when a measurement fails


@dataclass
class DeviceMemory:
    """A device's memory as the planner sees it: how much, how much is usable now, how fast."""
    kind: str            # cuda | metal | rocm | cpu
    name: str
    total: int           # bytes
    free: int            # bytes usable now
    bandwidth_gbs: float
    cores: int = 0       # physical cores (a CPU's batch cost); 0: not known


def bandwidth_for(name: str) -> float:
    """The vendor bandwidth of the longest known model name within `name` ("RTX 4090" before "A10")."""
    best = None
    for key, gbs in GPU_BANDWIDTH_GBS.items():
        if key.lower() in name.lower() and (best is None or len(key) > len(best[0])):
            best = (key, gbs)
    return best[1] if best else DEFAULT_GPU_BANDWIDTH_GBS


def _cuda(name: str, total: int, free: int) -> DeviceMemory:
    return DeviceMemory("cuda", name, total, free, bandwidth_for(name))


def parse_nvidia_smi(text: str) -> list[DeviceMemory]:
    """`nvidia-smi --query-gpu=name,memory.total,memory.free --format=csv,noheader,nounits` (MiB).
    A GPU whose memory it does not report ("[N/A]": unified memory, like the GB10's) is left out, as
    is a line it cannot read: the planner knows nothing of its memory (--vram says it)."""
    devices = []
    for line in text.strip().splitlines():
        try:
            name, total, free = [part.strip() for part in line.rsplit(",", 2)]
            total_mib, free_mib = float(total), float(free)
        except ValueError:
            continue
        if 0 <= free_mib <= total_mib < 1 << 40:  # and neither is NaN
            devices.append(_cuda(name, int(total_mib) * MiB, int(free_mib) * MiB))
    return devices


def parse_apple_sysctl(memsize: str, wired_limit_mb: str | None, chip: str = "Apple") -> DeviceMemory:
    """Metal can wire `iogpu.wired_limit_mb` when set (non-zero), else the default working set:
    about 2/3 of unified memory up to 36 GB, 3/4 above (recommendedMaxWorkingSetSize)."""
    total = int(memsize)
    limit = int(wired_limit_mb or 0) * MiB
    if not limit:
        limit = int(total * (0.75 if total > 36 * 10**9 else 2 / 3))
    return DeviceMemory("metal", chip, total, limit, bandwidth_for(chip))


def parse_rocm_smi(text: str) -> list[DeviceMemory]:
    """`rocm-smi --showmeminfo vram --showproductname --json`."""
    devices = []
    for card, info in json.loads(text).items():
        total = int(info.get("VRAM Total Memory (B)", 0))
        used = int(info.get("VRAM Total Used Memory (B)", 0))
        name = info.get("Card Series") or info.get("Card series") or card
        devices.append(DeviceMemory("rocm", name, total, total - used, DEFAULT_GPU_BANDWIDTH_GBS))
    return devices


def _nvml_devices() -> list[DeviceMemory]:
    import pynvml
    pynvml.nvmlInit()
    try:
        devices = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            devices.append(_cuda(name, int(mem.total), int(mem.free)))
        return devices
    finally:
        pynvml.nvmlShutdown()


def _run(cmd: list[str]) -> str | None:
    """A tool's standard output, or None when it is not installed or fails."""
    if not shutil.which(cmd[0]):
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return None


def _apple_gpu() -> list[DeviceMemory]:
    memsize = _run(["sysctl", "-n", "hw.memsize"])
    if not memsize:
        return []
    chip = (_run(["sysctl", "-n", "machdep.cpu.brand_string"]) or "Apple").strip()
    return [parse_apple_sysctl(memsize, _run(["sysctl", "-n", "iogpu.wired_limit_mb"]), chip)]


def _rocm_gpus() -> list[DeviceMemory]:
    if not (out := _run(["rocm-smi", "--showmeminfo", "vram", "--showproductname", "--json"])):
        return []
    try:
        return parse_rocm_smi(out)
    except (ValueError, AttributeError, TypeError):
        return []


def detect_gpus() -> list[DeviceMemory]:
    """NVIDIA (NVML, else nvidia-smi), Apple Silicon (sysctl), AMD (rocm-smi); [] when none answers.
    A source whose answer cannot be read is passed over: a GPU not detected, never a crash."""
    try:
        return _nvml_devices()
    except Exception:  # no driver, no library, memory not reported (unified): try the next source
        pass
    if out := _run(["nvidia-smi", "--query-gpu=name,memory.total,memory.free", "--format=csv,noheader,nounits"]):
        try:
            if nvidia := parse_nvidia_smi(out):
                return nvidia
        except Exception:  # an answer of another form: no GPU known from it
            pass
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        try:
            if apple := _apple_gpu():
                return apple
        except ValueError:  # sysctl answered something else than a number
            pass
    return _rocm_gpus()


def detect_ram() -> DeviceMemory:
    import psutil
    mem = psutil.virtual_memory()
    return DeviceMemory("cpu", "system RAM", mem.total, mem.available, measure_ram_bandwidth(),
                        psutil.cpu_count(logical=False) or os.cpu_count() or 0)


@functools.lru_cache(maxsize=1)
def measure_ram_bandwidth(size: int = 64 * MiB) -> float:
    """GB/s of a large memory copy (read + write counted), best of three: what decoding on the CPU
    can stream weights at, give or take the kernels' efficiency."""
    import time

    import numpy as np
    src = np.ones(size // 8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * size / best / 1e9 if best > 0 else DEFAULT_RAM_BANDWIDTH_GBS
