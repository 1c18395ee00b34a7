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

Only steps of up to `MAX_TOKENS` (2) tokens launch with PDL. Measured with PDL everywhere against
nowhere in one lease (GPTQ 4-bit, Llama-3-8B shape, one H100): batch 1 +9.9 % and 2 +3.3 % with it,
4 / 8 / 16 tokens -1.6 / -4.0 / -3.7 % (on an H200 16 tokens -7 %), 32 and 64 within 1.2 %, bf16
within 2 % at every size. (Which kernels lose at 4-16 tokens was not isolated; the int8 GEMM's own
launch without PDL changed nothing, benchmarks/README.md "PDL by step size".) Kernels take
the step's tokens as their first dimension, so one launch rule covers them all, and each CUDA
graph, captured at one batch size, launches its kernels alike. `PAPHOS_PDL_MAX_TOKENS` moves the
bound; `PAPHOS_DISABLE_PDL=1` turns PDL off (every kernel then starts after the previous one
finished).
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
MAX_TOKENS = int(os.environ.get("PAPHOS_PDL_MAX_TOKENS", "2"))


@cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def options(x: torch.Tensor) -> dict[str, bool]:
    """Launch keywords for a kernel taking the `PDL` constexpr, x [tokens, ...] on its device: PDL
    on CUDA devices of compute capability 9.0 and later for steps of up to MAX_TOKENS tokens
    (never in the interpreter)."""
    on = ENABLED and triton is not None and x.is_cuda and x.shape[0] <= MAX_TOKENS and _supported(
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
