"""llama.cpp's own tools as `bench`'s reference (`--against-llamacpp`, built by scripts/build-llamacpp.sh):
the settings they run with, running one, and the tool that times the target alone."""
from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .errors import GgufspecError
from .load import default_threads


@dataclass(frozen=True)
class NativeSettings:
    """What llama.cpp's tools are run with: the same as the decoder's (llama.cpp's own defaults differ:
    -ngl -1 puts every layer on the GPU, and -fa defaults to auto)."""
    n_threads: int | None
    flash_attn: str
    n_gpu_layers: int
    n_gpu_layers_draft: int
    target_args: tuple = ()  # the load flags given (-b, -ub, -tb, -ctk, -ctv), then the draft's (-td, -ctkd...)
    draft_args: tuple = ()

    def args(self, draft: bool) -> list[str]:
        args = ["-t", str(self.n_threads or default_threads()), "-ngl", str(self.n_gpu_layers), "-fa", self.flash_attn]
        return args + [*self.target_args] + (["-ngld", str(self.n_gpu_layers_draft), *self.draft_args] if draft else [])


def run_tool(cmd: list[str], what: str, expect: str, attempts: int = 3) -> str:
    """The tool's log, run again (up to `attempts` runs) where it exited 0 without a line matching the regex
    `expect`: llama.cpp's logger writes from a thread of its own that the process's exit can cut short (a
    third of llama-completion's runs on the tiny models lose their timings)."""
    for _ in range(max(attempts, 1)):
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=3600,
                              stdin=subprocess.DEVNULL)
        found = re.search(expect, proc.stderr + proc.stdout) is not None
        if proc.returncode != 0 or found:
            break
    if proc.returncode != 0 or not found:
        log = proc.stderr.strip() or proc.stdout.strip()
        raise GgufspecError(f"{what} failed ({proc.returncode}): {log.splitlines()[-1] if log else 'no output'}")
    return proc.stderr + "\n" + proc.stdout  # llama.cpp logs to stderr; the text, on stdout, comes last


def target_alone_tool(binary: str) -> Path:
    """llama.cpp's tool for the target alone, from the same build as `binary` (its directory):
    llama-completion (the same prompt, timed by llama.cpp itself), else llama-bench (text generation
    from an empty context: the prompt is not used)."""
    folder = Path(binary).resolve().parent
    for name in ("llama-completion", "llama-bench"):
        for candidate in (folder / name, folder / f"{name}.exe"):
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
    raise GgufspecError(f"--against-llamacpp: no llama-completion or llama-bench next to {binary} for llama.cpp's "
                        f"own target-alone speed (scripts/build-llamacpp.sh builds both)")
