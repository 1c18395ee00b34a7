"""Torch reference of how llama.cpp's CPU backend rounds a matmul's activations.

ggml-cpu never multiplies a quantized weight with float activations: `ggml_compute_forward_mul_mat`
(ggml-cpu.c) first converts the activation rows to the weight type's `vec_dot_type` (the
`type_traits_cpu` table in ggml-cpu.c), then runs an integer dot product per 32- or 256-element
block. That rounding, not the weight quantization alone, is why llama.cpp's logits differ from
any float32 computation on the same dequantized weights. The formats, as the x86 (AVX/AVX2)
kernels in `ggml-cpu/arch/x86/quants.c` compute them:

- Q8_0 (`quantize_row_q8_0`; for Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4 weights): per 32 values,
  amax = max|x|, d = amax / 127 (stored fp16), q = round_half_even(x * (127 / amax)).
- Q8_1 (`quantize_row_q8_1`; for Q4_1, Q5_1): Q8_0 plus s = fp16(d * sum(q)) with the *unrounded*
  fp32 d. The Q4_1/Q5_1 dot product is sum_blocks d_w * d_x * sum(q_w * q_x) + m_w * s, so the block
  minimum m_w meets this separately rounded s, not d_x * sum(q_x) (see `LlamaCppLinearMethod`).
- Q8_K (`quantize_row_q8_K_ref`, used on x86 too; for K-quants, IQ2/IQ3/IQ1, IQ4_XS, TQ): per 256
  values, iscale = -127 / (the value of largest magnitude), q = nearest_int(iscale * x) (round half
  even), d = 1 / iscale kept in fp32. The sign convention cancels in d * q, so it is not modelled.
- F16 / BF16 weights: activations are converted to that type (round to nearest even).

Every function here returns the dequantized activation (d * q, exactly what the integer kernel
multiplies) so a float GEMM against the dequantized weight reproduces the quantized dot product up
to float32 summation order. Other architectures differ in details (the scalar reference kernels
use round-half-away and 1/d instead of 127/amax, ARM uses 1/d with round-half-even); this module
follows x86, where the reference outputs were produced.
"""

from __future__ import annotations

import torch

QK8 = 32  # block size of Q8_0 / Q8_1
QK_K = 256  # block size of Q8_K


def _div(numerator: float, t: torch.Tensor) -> torch.Tensor:
    """numerator / t correctly rounded, as C's fp32 division. torch computes `scalar / tensor` as
    scalar * reciprocal(t), two roundings: 127.0 / t is off by an ulp for ~25% of inputs, enough to
    move a quantized activation across a rounding boundary."""
    return torch.full_like(t, numerator) / t


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    if x.shape[-1] % size:
        raise ValueError(f"activation width {x.shape[-1]} is not a multiple of the block size {size}")
    return x.float().unflatten(-1, (-1, size))


def _q8_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shared part of Q8_0 and Q8_1: (q [..., nb, 32] integer-valued fp32, unrounded fp32 d
    [..., nb, 1], amax > 0 mask)."""
    xb = _blocks(x, QK8)
    amax = xb.abs().amax(-1, keepdim=True)
    nonzero = amax > 0
    # x * (127 / amax), not x / d: the AVX kernels multiply by this quotient. torch.round is
    # round-half-even, like _mm256_round_ps(_MM_ROUND_NEAREST).
    inv = torch.where(nonzero, _div(127.0, amax), torch.zeros_like(amax))
    q = torch.round(xb * inv)
    return q, amax / 127.0, nonzero


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> the Q8_0-rounded activations d16 * q, fp32 [..., K]."""
    q, d, _ = _q8_blocks(x)
    return (q * d.half().float()).flatten(-2)


def quantize_q8_1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (d16 * q fp32 [..., K], s_err fp32 [..., K/32]).

    s_err = fp16(d * sum(q)) - d16 * sum(q): how far the block sum that the Q4_1/Q5_1 kernels pair
    with the weight's block minimum is from the sum of the rounded activations. A GEMM of the
    rounded activations with the dequantized weight (d_w * q_w + m_w) already contains
    m_w * d16 * sum(q); adding s_err @ m_w^T turns that into llama.cpp's m_w * s.
    """
    q, d, _ = _q8_blocks(x)
    d16 = d.half().float()
    qsum = q.sum(-1, keepdim=True)  # integers of magnitude <= 32 * 127: exact in fp32
    # fp16 of the fp32 product, as GGML_CPU_FP32_TO_FP16(d * sum) rounds it.
    s16 = (d * qsum).half().float()
    return (q * d16).flatten(-2), (s16 - d16 * qsum).squeeze(-1)


def quantize_q8_K(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> the Q8_K-rounded activations d * q (fp32 d), fp32 [..., K]."""
    xb = _blocks(x, QK_K)
    amax = xb.abs().amax(-1, keepdim=True)
    nonzero = amax > 0
    iscale = torch.where(nonzero, _div(127.0, amax), torch.zeros_like(amax))
    # nearest_int() adds 1.5 * 2^23, i.e. rounds half to even; |iscale * x| <= 127 so the
    # kernel's clamp at 127 never binds.
    q = torch.round(xb * iscale).clamp_(-127, 127)
    d = torch.where(nonzero, _div(1.0, iscale), torch.zeros_like(iscale))
    return (q * d).flatten(-2)


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """F16/BF16 weights: ggml converts the activations to the weight's type (round to nearest
    even) and accumulates the exact products in fp32."""
    return x.to(dtype).float()


# Weight type name (gguf.GGMLQuantizationType.name) -> the activation format ggml-cpu rounds the
# other operand to: `vec_dot_type` in ggml-cpu.c's `type_traits_cpu`. Types that are not listed
# (F32, and anything unknown) multiply float32 activations as they are.
ACTIVATION_FORMAT: dict[str, str] = {
    "F16": "F16",
    "BF16": "BF16",
    "Q4_0": "Q8_0",
    "Q5_0": "Q8_0",
    "Q8_0": "Q8_0",
    "Q1_0": "Q8_0",
    "Q2_0": "Q8_0",
    "IQ4_NL": "Q8_0",
    "MXFP4": "Q8_0",
    "NVFP4": "Q8_0",
    "Q4_1": "Q8_1",
    "Q5_1": "Q8_1",
    **{
        name: "Q8_K"
        for name in (
            "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
            "IQ1_S", "IQ1_M", "IQ4_XS", "TQ1_0", "TQ2_0",
        )
    },
}  # fmt: skip

# Weight types whose blocks carry a minimum that the kernel multiplies with the activation's
# separately rounded block sum s (Q8_1); the linear method keeps those minima.
TYPES_WITH_BLOCK_MIN = frozenset({"Q4_1", "Q5_1"})


def activation_format(weight_type: str) -> str:
    """The activation format ('Q8_0', 'Q8_1', 'Q8_K', 'F16', 'BF16' or 'F32') of a weight type."""
    return ACTIVATION_FORMAT.get(weight_type, "F32")


def quantize_activations(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., K] -> (x rounded as format `fmt`, fp32; Q8_1's s_err [..., K/32] or None)."""
    if fmt == "Q8_1":
        return quantize_q8_1(x)
    if fmt == "Q8_0":
        return quantize_q8_0(x), None
    if fmt == "Q8_K":
        return quantize_q8_K(x), None
    if fmt == "F16":
        return round_to(x, torch.float16), None
    if fmt == "BF16":
        return round_to(x, torch.bfloat16), None
    if fmt == "F32":
        return x.float(), None
    raise ValueError(f"unknown activation format {fmt!r}")
