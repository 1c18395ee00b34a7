"""Int8 codes with a float scale per group of 16 or 32 values, on the CPU: GGUF Q8_0, Q5_0 and Q6_K
weights of bf16 models kept at ~1 byte per value instead of dequantized to 2 at load
(paphos/quant/gguf/kernels.py, `Int8GroupCPUKernel`).

w[n, k] = scale[n, k // group] * q[n, k]: q int8, scale float32, so every product is the GGUF
dequantizer's value bit for bit.

Matmul, by caller:
  * one row inside a compiled decode step (worker/compiled_decode.py): one reduction over the codes
    in fp32, which inductor turns into a single vectorized loop reading each code once (a 49152 x
    576 tied head on 2 cores: 1.8-2.1 ms against 3.2 ms for its bf16 copy and 2.7 ms for torch's
    int8 weight-only matmul run per group);
  * several rows in bf16 on a CPU with AVX512-BF16 (native/cpu.py): blocks of 16 rows dequantized
    into cache and multiplied there (the head at 16 rows: 2.9 ms of a decode step against 5.6 ms);
  * anything else (eager steps, several rows): row chunks dequantized to the activation dtype (by
    the compiled dequantizer when the decode step is compiled, compiled_dequant.py) and a GEMM,
    the numerics of a weight dequantized at load, with the weight's bytes read and written once
    more per call: prefill amortises that over its rows, and eager mode accepts it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paphos.native import cpu as native_cpu
from paphos.quant.kernels import compiled_dequant

CHUNK_ROWS = 8192  # rows dequantized at a time on the GEMM path (bounds its scratch memory)


@torch.library.custom_op("paphos::materialize", mutates_args=())
def materialize(x: torch.Tensor) -> torch.Tensor:
    """x as a buffer of its own. Inductor would otherwise inline the ops that produce x (a norm,
    an activation) into the reduction that reads it, recomputing them for every output row
    (Gemma-3-270M's batch-1 step: a third slower)."""
    return x.clone()


@materialize.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q int8 [R, K], scales float32 [R, G] -> w [R, K] in `dtype`."""
    rows, k = q.shape
    w = q.view(rows, scales.shape[1], -1).float() * scales.unsqueeze(-1)
    return w.view(rows, k).to(dtype)


def matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype."""
    n, k = q.shape
    groups = scales.shape[1]
    if x.shape[0] == 1 and torch.compiler.is_compiling():
        xg = materialize(x.float()).view(1, 1, groups, k // groups)
        per_group = xg * q.view(1, n, groups, k // groups).float()
        return (per_group * scales.view(1, n, groups, 1)).sum((-2, -1)).to(x.dtype)
    if native_cpu.int8_group_supported(x, q, scales):
        return native_cpu.int8_group_mm(x, q, scales, x.dtype)
    return torch.cat(
        [F.linear(x, compiled_dequant.dequantize(dequantize_rows, q[i : i + CHUNK_ROWS], scales[i : i + CHUNK_ROWS],
                                                 x.dtype))
         for i in range(0, n, CHUNK_ROWS)],
        dim=-1,
    )  # fmt: skip
