"""Every sampler Triton kernel compiles for sm_90 (H100/H200) on this machine, no GPU needed: the
interpreter runs of the other tests accept code that may not lower for the GPU.

The compile runs benchmarks/sampler_kernels_compile_check.py (it lists the kernels and their launch
shapes) in a fresh process: under pytest on a CPU-only machine tests/conftest.py sets
TRITON_INTERPRET before triton is imported, which turns triton.language's own jit helpers (tl.sort,
tl.cumsum, ...) into interpreted functions that cannot be compiled in this process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.device_triton import TRITON_IDS, TRITONS, compile_env

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sampler_kernels_compile_check.py"


@pytest.mark.parametrize("triton_path", TRITONS, ids=TRITON_IDS)
def test_every_kernel_compiles_for_sm90_without_spills_in_loops(triton_path: Path | None) -> None:
    env = compile_env(triton_path)
    done = subprocess.run([sys.executable, str(_SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("ok ")]
    assert lines, done.stdout
    for line in lines:
        loop_spills = int(line.split("spill accesses in loops")[1].split()[0])
        assert loop_spills == 0, line
