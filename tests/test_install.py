"""scripts/cmake-args.sh: which backend scripts/install and scripts/build-llamacpp.sh build for, decided
with fake `nvcc` and `nvidia-smi` on PATH (nothing is built)."""
import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "scripts" / "cmake-args.sh"


def fake_tool(folder: Path, name: str, body: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(f"#!/bin/sh\n{body}\n")
    (folder / name).chmod(0o755)


def fake_nvidia_smi(folder: Path, caps=("9.0",)) -> None:
    listing = "\\n".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})" for i in range(len(caps)))
    fake_tool(folder, "nvidia-smi", f'case "$*" in\n  *compute_cap*) printf "{chr(10).join(caps)}\\n" ;;\n'
                                    f'  *) printf "{listing}\\n" ;;\nesac')


def cmake_args(tmp_path, *extra, **env_overrides) -> str:
    """The script's output with PATH = the fake tools and the system's basics only (no real nvcc:
    this machine has a CUDA toolkit in /usr/local/bin but no GPU)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_HOME", "GGUFSPEC_CUDA", "GGUFSPEC_CPU_ONLY", "GGUFSPEC_NATIVE_BUILD")}
    env["PATH"] = f"{tmp_path / 'bin'}:/usr/bin:/bin"
    env.update(env_overrides)
    proc = subprocess.run(["bash", str(SCRIPT), *extra], capture_output=True, text=True, env=env, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


pytestmark = pytest.mark.skipif(os.uname().sysname == "Darwin", reason="Apple Silicon builds Metal: no CUDA choice")


def test_nvcc_and_a_gpu_build_cuda_for_the_gpus_architecture(tmp_path):
    fake_tool(tmp_path / "bin", "nvcc", "echo fake nvcc")
    fake_nvidia_smi(tmp_path / "bin", caps=("9.0",))
    args = cmake_args(tmp_path).split()
    assert "-DGGML_CUDA=on" in args and "-DCMAKE_CUDA_ARCHITECTURES=90" in args
    assert not any(a.startswith("-DCMAKE_CUDA_COMPILER") for a in args)  # nvcc is on PATH
    assert cmake_args(tmp_path, "--backend") == "cuda"


def test_several_gpus_build_for_each_architecture_once(tmp_path):
    fake_tool(tmp_path / "bin", "nvcc", "echo fake nvcc")
    fake_nvidia_smi(tmp_path / "bin", caps=("8.6", "9.0", "8.6"))
    assert "-DCMAKE_CUDA_ARCHITECTURES=86;90" in cmake_args(tmp_path).split()


def test_nvcc_without_a_gpu_builds_for_the_cpu(tmp_path):
    fake_tool(tmp_path / "bin", "nvcc", "echo fake nvcc")
    fake_tool(tmp_path / "bin", "nvidia-smi", "echo 'NVIDIA-SMI has failed' >&2; exit 9")
    assert "GGML_CUDA" not in cmake_args(tmp_path)
    assert cmake_args(tmp_path, "--backend") == "cpu"


def test_a_gpu_without_nvcc_builds_for_the_cpu(tmp_path):
    fake_nvidia_smi(tmp_path / "bin")
    assert "GGML_CUDA" not in cmake_args(tmp_path)


def test_ggufspec_cuda_forces_cuda_for_the_native_architecture(tmp_path):
    fake_tool(tmp_path / "bin", "nvcc", "echo fake nvcc")
    args = cmake_args(tmp_path, GGUFSPEC_CUDA="1").split()
    assert "-DGGML_CUDA=on" in args and "-DCMAKE_CUDA_ARCHITECTURES=native" in args


def test_cuda_home_finds_an_nvcc_off_path(tmp_path):
    fake_tool(tmp_path / "cuda" / "bin", "nvcc", "echo fake nvcc")
    fake_nvidia_smi(tmp_path / "bin")
    args = cmake_args(tmp_path, CUDA_HOME=str(tmp_path / "cuda")).split()
    assert "-DGGML_CUDA=on" in args
    assert f"-DCMAKE_CUDA_COMPILER={tmp_path / 'cuda' / 'bin' / 'nvcc'}" in args


def test_cpu_only_opts_out_of_cuda(tmp_path):
    fake_tool(tmp_path / "bin", "nvcc", "echo fake nvcc")
    fake_nvidia_smi(tmp_path / "bin")
    assert "GGML_CUDA" not in cmake_args(tmp_path, GGUFSPEC_CPU_ONLY="1")
    assert "GGML_CUDA" not in cmake_args(tmp_path, GGUFSPEC_CPU_ONLY="1", GGUFSPEC_CUDA="1")
    assert cmake_args(tmp_path, "--backend", GGUFSPEC_CPU_ONLY="1") == "cpu"


def test_the_cpu_flags_stay_with_cuda(tmp_path):
    """On a VM the x86 flags are spelled out (no -march=native); a CUDA build keeps them."""
    cpu_only = cmake_args(tmp_path)
    fake_tool(tmp_path / "bin", "nvcc", "echo fake nvcc")
    fake_nvidia_smi(tmp_path / "bin")
    assert cmake_args(tmp_path).startswith(cpu_only)


def test_install_and_build_script_use_the_same_choice():
    root = SCRIPT.parent
    assert "scripts/cmake-args.sh" in (root / "install").read_text()
    assert "scripts/cmake-args.sh" in (root / "build-llamacpp.sh").read_text()
