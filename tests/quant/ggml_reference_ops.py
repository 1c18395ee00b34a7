"""Torch reference of ggml-cpu's float arithmetic outside the matmuls (x86 build with AVX512).

Once the matmul inputs are rounded as llama.cpp rounds them (`activations.py`), the next largest
source of disagreement is the elementwise ops: a one-ulp difference in a norm, SiLU or softmax
output moves a value across a rounding boundary of the following activation quantization (or
of the f16 attention operands) now and then, and each such flip perturbs everything downstream
by ~0.4% of a block's range. These functions reproduce ggml's results bit for bit (checked
against tensors dumped from llama.cpp), so a model can use them where exact llama.cpp parity
matters:

- `rms_norm`: `ggml_compute_forward_rms_norm_f32` (ops.cpp): sum of fp32 squares accumulated in
  double, mean cast to fp32, scale = 1.0f / sqrtf(mean + eps), y = x * scale (then * weight).
- `expf` / `silu` / `swiglu`: `ggml_v_expf` / `ggml_v_silu` (vec.h, AVX512 branch): a
  degree-5 polynomial with FMAs and scalef, silu = x / (1 + expf(-x)); `ggml_vec_swiglu_f32`.
- `soft_max`: `ggml_compute_forward_soft_max_f32`: scaled scores plus the mask, `ggml_v_expf`
  of (x - max), the sum accumulated per 16 lanes (`_mm512_reduce_add_ps`) into a double, then
  scaled by the fp32 reciprocal.
- `rope_cos_sin` / `rope_rotate`: `ggml_rope_cache_init`: theta_scale = powf(base, -2/n_dims),
  theta updated by repeated fp32 multiplication, libm cosf/sinf of it (no YaRN / frequency
  factors); `rotate_pairs` with the FMA contraction GCC applied.
- `attention_no_fa`: the attention of llama.cpp's graph without flash attention and an F16 KV
  cache: q, k, v and the softmax probabilities rounded to f16 (reduction order not reproduced).

What none of this reproduces is the reduction order of the matmuls (ggml's 8- or 16-lane
accumulators, llamafile's tiles): llama.cpp's Q4_1 model is chaotic at that level (see
`llamacpp.py`), so bit-identical outputs over a sequence need kernels written to that order.
These references are the specification such kernels can be tested against.

FMA is emulated in float64: the product of two fp32 values is exact in float64, so
fp32(a * b + c) differs from a fused multiply-add only when the float64 sum rounds onto an fp32
tie (probability ~2^-29).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

import torch

_VEC = 16  # fp32 lanes of an AVX512 register: the chunking of ggml's vector loops


def _f(hexstr: str) -> float:
    return float.fromhex(hexstr)


_SHIFT = _f("0x1.8p23")  # 1.5 * 2^23: adding it rounds to an integer
_LOG2E = _f("0x1.715476p+0")
_LN2_HI = _f("0x1.62e4p-1")
_LN2_LO = _f("0x1.7f7d1cp-20")
_C5, _C4, _C3, _C2, _C1 = (
    _f("0x1.0e4020p-7"),
    _f("0x1.573e2ep-5"),
    _f("0x1.555e66p-3"),
    _f("0x1.fffdb6p-2"),
    _f("0x1.ffffecp-1"),
)


def fma(a: torch.Tensor | float, b: torch.Tensor | float, c: torch.Tensor | float) -> torch.Tensor:
    """fp32(a * b + c) with one rounding, for fp32 operands (see the module docstring)."""
    a64 = a.double() if isinstance(a, torch.Tensor) else a
    b64 = b.double() if isinstance(b, torch.Tensor) else b
    c64 = c.double() if isinstance(c, torch.Tensor) else c
    out = a64 * b64 + c64
    assert isinstance(out, torch.Tensor)
    return out.float()


def expf(x: torch.Tensor) -> torch.Tensor:
    """`ggml_v_expf` (AVX512): e^x = 2^n * p(b), n = round(x / ln 2), b = x - n ln 2 (two-part
    ln 2), max error ~1.5 ulp; |n| > 192 saturates to 0 or inf."""
    x = x.float()
    z = fma(x, _LOG2E, _SHIFT)
    n = z - _SHIFT
    b = fma(-n, _LN2_LO, fma(-n, _LN2_HI, x))  # fnmadd(n, c, x) = -(n * c) + x
    u = b * b
    j = fma(fma(fma(_C5, b, _C4), u, fma(_C3, b, _C2)), u, fma(_C1, b, 1.0))
    res = torch.ldexp(j.double(), n.double()).float()  # _mm512_scalef_ps
    saturated = torch.where(n <= 0, torch.zeros_like(res), torch.full_like(res, float("inf")))
    return torch.where(n.abs() > 192, saturated, res)


def _libm_expf(x: torch.Tensor) -> torch.Tensor:
    # glibc's expf is correctly rounded in practice; float64 exp then one rounding matches it.
    return torch.exp(x.double()).float()


def _vector_part(n: int) -> int:
    return n - n % _VEC


def silu(x: torch.Tensor) -> torch.Tensor:
    """`ggml_v_silu` on the 16-wide vector part of the last axis, the scalar
    `ggml_silu_f32` (libm expf) on the remainder, as `ggml_vec_swiglu_f32` loops."""
    x = x.float()
    k = _vector_part(x.shape[-1])
    e = expf(torch.zeros_like(x) - x)
    if k < x.shape[-1]:
        e[..., k:] = _libm_expf(-x[..., k:])
    return x / (1.0 + e)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`ggml_vec_swiglu_f32`: silu(gate) * up."""
    return silu(gate) * up.float()


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """`ggml_compute_forward_rms_norm_f32`, then the `ggml_mul` by the norm weight."""
    x = x.float()
    # Squares in fp32, summed in double (sequential in C; any double order gives the same fp32
    # mean except on a float64 tie).
    mean = ((x * x).double().sum(-1, keepdim=True) / x.shape[-1]).float()
    # sqrtf is correctly rounded; torch's fp32 sqrt is not (it differs for ~15% of inputs), the
    # float64 root rounded to fp32 is.
    root = torch.sqrt((mean + torch.tensor(eps, dtype=torch.float32)).double()).float()
    scale = torch.ones_like(mean) / root
    y = x * scale
    return y if weight is None else y * weight.float()


def _reduce_add_16(v: torch.Tensor) -> torch.Tensor:
    """`_mm512_reduce_add_ps` on [..., 16] as GCC expands it: halves 8+8, 4+4, then (0+2)+(1+3)."""
    a = v[..., 8:] + v[..., :8]
    b = a[..., 4:] + a[..., :4]
    return (b[..., 0] + b[..., 2]) + (b[..., 1] + b[..., 3])


def soft_max(scores: torch.Tensor, scale: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """`ggml_compute_forward_soft_max_f32` over the last axis of fp32 `scores`; `mask` is bool
    (True = attend), llama.cpp's 0 / -inf f16 mask. Fully masked rows are not supported (ggml
    asserts against them too)."""
    w = scores.float() * torch.tensor(scale, dtype=torch.float32)
    if mask is not None:
        w = w.masked_fill(~mask, float("-inf"))
    length = w.shape[-1]
    pad = (-length) % _VEC
    if pad:
        # llama.cpp's rows are padded KV cells masked to -inf: they add exact zeros.
        w = torch.cat([w, w.new_full((*w.shape[:-1], pad), float("-inf"))], dim=-1)
    mx = w.amax(-1, keepdim=True)
    e = expf(w - mx)
    chunks = _reduce_add_16(e.unflatten(-1, (-1, _VEC)))  # [..., L/16] fp32
    total = chunks.double().sum(-1, keepdim=True)
    inv = (1.0 / total).float()  # ggml_vec_scale_f32 takes the reciprocal as a float
    return (e * inv)[..., :length]


def _libm_sincos() -> tuple[Callable[[float], float], Callable[[float], float]] | None:
    try:
        libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        cosf, sinf = libm.cosf, libm.sinf
    except (OSError, AttributeError):
        return None
    for fn in (cosf, sinf):
        fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return cosf, sinf


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`ggml_rope_cache_init` without scaling: fp32 cos and sin [T, rotary_dim / 2] of theta_i =
    p * theta_scale^i, the power built by repeated fp32 multiplication as ggml does.

    ggml calls the C library's cosf/sinf; glibc's are not correctly rounded (about 0.5% of the
    entries differ by one ulp from the rounded true value), so they are called through ctypes
    where available (one call per entry: fine for a table built once), else the correctly
    rounded value is used.
    """
    theta_scale = torch.tensor(base, dtype=torch.float64).pow(-2.0 / rotary_dim).float()
    theta = positions.float()
    cols = []
    for _ in range(rotary_dim // 2):
        cols.append(theta)
        theta = theta * theta_scale
    thetas = torch.stack(cols, dim=-1)
    libm = _libm_sincos()
    if libm is None:
        return torch.cos(thetas.double()).float(), torch.sin(thetas.double()).float()
    cosf, sinf = libm
    flat = thetas.flatten().tolist()
    cos = torch.tensor([cosf(t) for t in flat], dtype=torch.float32).view_as(thetas)
    sin = torch.tensor([sinf(t) for t in flat], dtype=torch.float32).view_as(thetas)
    return cos, sin


def rope_rotate(
    x0: torch.Tensor, x1: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotate_pairs` (ops.cpp) on the two members of each rotated pair, as this build compiled it:
    GCC contracts `x0*cos - x1*sin` to fma(x0, cos, -(x1*sin)) and `x0*sin + x1*cos` to
    fma(x0, sin, x1*cos) (the other pairings are off by an ulp for ~10% of the values)."""
    return fma(x0, cos, -(x1 * sin)), fma(x0, sin, x1 * cos)


def attention_no_fa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> torch.Tensor:
    """llama.cpp's attention without flash attention, F16 KV cache: q [Hq, Lq, D], k/v
    [Hkv, L, D] fp32, mask bool [Lq, L] (True = attend) -> fp32 [Hq, Lq, D].

    kq = mul_mat(k_f16, q) converts q to f16 (the `vec_dot_type` of F16) and accumulates the
    exact f16 products in fp32; `soft_max`; kqv = mul_mat(v_f16, kq) converts the probabilities to
    f16 as well. The accumulation order of the two products is not reproduced (torch matmul).
    """
    h = lambda t: t.float().half().float()  # noqa: E731
    q16, k16, v16 = h(q), h(k), h(v)
    hq, lq, d = q16.shape
    hkv, length = k16.shape[0], k16.shape[1]
    group = hq // hkv  # GQA: query head i reads KV head i // group (ggml's broadcast)
    kq = torch.matmul(q16.reshape(hkv, group * lq, d), k16.transpose(-1, -2)).view(hq, lq, length)
    p = soft_max(kq, scale, None if mask is None else mask.expand(hq, lq, length))
    out = torch.matmul(h(p).reshape(hkv, group * lq, length), v16)
    return out.view(hq, lq, d)
