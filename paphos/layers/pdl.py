"""Programmatic dependent launch (PDL, sm_90 and later) for the Triton kernels of a decode step.

Where it sits: every kernel on the batch-1 decode path (the GGUF GEMVs and the quantization of
their x, residual add + RMSNorm, SiLU x mul, RoPE + K/V store, split-KV decode and its merge)
is launched through `options(x)`. Inside a CUDA graph a kernel normally starts only when the one
before it has finished and its memory is flushed: at batch 1 the step is ~300 kernels of a few
microseconds, so that gap and each kernel's ramp-up are a large share of the step. A PDL kernel
is launched as soon as every program of the kernel before it has run `release` (each calls it
first thing), runs what does not depend on earlier kernels (a GEMV issues its first weight
loads: the weights never change during a step) and then `wait`s, which returns once the kernels
before it have completed and their writes are visible.

The rule every kernel here keeps: nothing before `wait` reads memory an earlier kernel writes or
writes memory at all. Since each kernel completes only after its own `wait`, a kernel's `wait`
also covers every kernel before the previous one. A kernel launched without PDL (torch, cuBLAS)
starts after its predecessor has finished as always, and a PDL kernel after it simply starts then.

`PAPHOS_DISABLE_PDL=1` turns it off (every kernel then starts after the previous one finished).
"""

from __future__ import annotations

import os
from functools import cache

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU-only installs, or a triton without grid dependency control
    triton = None

ENABLED = os.environ.get("PAPHOS_DISABLE_PDL", "0") in ("", "0")


@cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def options(x: torch.Tensor) -> dict[str, bool]:
    """Launch keywords for a kernel taking the `PDL` constexpr, on x's device: PDL on CUDA
    devices of compute capability 9.0 and later (never in the interpreter)."""
    on = ENABLED and triton is not None and x.is_cuda and _supported(
        torch.cuda.current_device() if x.device.index is None else x.device.index
    )
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


if triton is not None:

    @triton.jit
    def release(PDL: tl.constexpr):
        """Lets the next kernel launch once every program of this one has passed here."""
        if PDL:
            gdc_launch_dependents()

    @triton.jit
    def wait(PDL: tl.constexpr):
        """Blocks until the kernels before this one have completed and their writes are visible."""
        if PDL:
            gdc_wait()
