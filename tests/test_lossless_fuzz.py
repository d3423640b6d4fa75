"""A short run of benchmarks/lossless_fuzz.py, the differential fuzz of the lossless promise (random prompts,
samplers, constraints and drafters on the tiny models of five architectures, in the slots too, under strict:
each answer with drafts the target alone's, or the same error): a fixed seed, so the same requests each time."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_short_differential_fuzz_finds_no_difference():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lossless_fuzz.py"), "--trials", "60", "--seed", "7"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "60 trials, 0 violations" in run.stderr
