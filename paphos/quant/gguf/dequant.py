"""Torch dequantizers for every GGUF tensor type we load: raw blocks (uint8) -> float32 values.

Data flow: `GGUFLinearMethod` (linear.py) keeps each checkpoint tensor's raw bytes, `[rows,
row_bytes]` uint8; its kernels call `dequantize(raw, ggml_type)` to get `[rows, row_elems]`
float32 (on the device of `raw`), either once at load (repacking) or per call. Each function here
maps `[n_blocks, type_size]` bytes to `[n_blocks, block_size]` values with the same float32
operations, in the same order, as `gguf`'s numpy reference dequantizers, so results are bit-exact
(tests/quant/test_gguf_dequant.py). All of it is vectorised over blocks: no Python loop per block.

Block layouts (little-endian; "d" is an fp16 scale; K-quants and IQ types have 256-value
super-blocks, the others 32-value blocks). These are what a Triton kernel taking the same raw
blocks reads:

  Q4_0  18 B: d, qs[16]                  w = d * (nibble - 8); low nibbles are values 0-15, high 16-31
  Q4_1  20 B: d, m, qs[16]               w = d * nibble + m
  Q5_0  22 B: d, qh[4], qs[16]           5th bit of value j is bit j of qh (u32); w = d * (q - 16)
  Q5_1  24 B: d, m, qh[4], qs[16]        w = d * q + m
  Q8_0  34 B: d, qs[32] int8             w = d * q
  Q2_K  84 B: scales[16], qs[64], d, dmin       16 groups of 16; scale/min nibbles; 2-bit q
  Q3_K 110 B: hmask[32], qs[64], scales[12], d  16 groups; 6-bit signed scales; 2+1-bit q - 4
  Q4_K 144 B: d, dmin, scales[12], qs[128]      8 groups of 32; 6-bit scale and min each
  Q5_K 176 B: d, dmin, scales[12], qh[32], qs[128]
  Q6_K 210 B: ql[128], qh[64], scales[16] int8, d   16 groups of 16; w = d * sc * (q - 32)
  Q8_K 292 B: d (fp32), qs[256] int8, bsums[16] int16 (bsums only feed integer dot products)
  IQ4_NL 18 B: d, qs[16]                 w = d * KVALUES[nibble]
  IQ4_XS 136 B: d, scales_h (u16), scales_l[4], qs[128]   8 groups of 32, 6-bit scales - 32
  IQ2_XXS 66 B, IQ2_XS 74 B, IQ2_S 82 B, IQ3_XXS 98 B, IQ3_S 110 B, IQ1_S 50 B, IQ1_M 56 B:
        indices into lattice grids with sign masks and group scales (dequant_iq.py)
  TQ1_0 54 B: qs[48], qh[4], d           ternary digits packed 5 (qs) or 4 (qh) per byte as
                                         fixed-point fractions of 243 / 81; w = d * (digit - 1)
  TQ2_0 66 B: qs[64], d                  2-bit codes; w = d * (code - 1)
  MXFP4 17 B: e (E8M0), qs[16]           w = 2^(e - 128) * E2M1 value (doubled table) of each nibble
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from paphos.quant.gguf.blocks import bits, const, f16_at, nibbles, u16, u32
from paphos.quant.gguf.dequant_iq import iq1_m, iq1_s, iq2_s, iq2_xs, iq2_xxs, iq3_s, iq3_xxs

QK_K = 256
# Non-linear 4-bit levels of IQ4_NL / IQ4_XS.
IQ4_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

_Dequant = Callable[[torch.Tensor], torch.Tensor]  # [n, type_size] uint8 -> [n, block] float32


# ---- float types ---------------------------------------------------------------------------


def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


def _f16_type(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).float()


# ---- 32-value block types ---------------------------------------------------------------------


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return f16_at(b, 0) * (nibbles(b[:, 2:]) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return f16_at(b, 0) * nibbles(b[:, 4:]).float() + f16_at(b, 2)


def _q5(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    high = bits(u32(qh)[:, 0], 1, 32).to(torch.int32)
    return nibbles(qs) | (high << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return f16_at(b, 0) * (_q5(b[:, 2:6], b[:, 6:]) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return f16_at(b, 0) * _q5(b[:, 4:8], b[:, 8:]).float() + f16_at(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * f16_at(b, 0)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return f16_at(b, 0) * const(IQ4_KVALUES, torch.float32, b.device)[nibbles(b[:, 2:])]


# ---- K-quants (256-value super-blocks) ----------------------------------------------------


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, :16].to(torch.int32)
    d, dmin = f16_at(b, 80), f16_at(b, 82)
    dl = (d * (scales & 0xF).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    # byte h*32 + j holds values h*128 + s*32 + j at bits 2s.
    q = bits(b[:, 16:80].reshape(n, 2, 32), 2, 4).transpose(-1, -2)
    return (dl * q.reshape(n, 16, 16).float() - ml).reshape(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, packed = b[:, :32], b[:, 32:96], b[:, 96:108].to(torch.int32)
    d = f16_at(b, 108)
    low = torch.cat([packed[:, :8] & 0xF, packed[:, :8] >> 4], dim=1)  # scales 0-7, 8-15
    high = bits(packed[:, 8:12], 2, 4).transpose(1, 2).reshape(n, 16)  # 2 bits of scale 4k+i at 2k
    scales = ((low | (high << 4)) - 32).float()
    dl = (d * scales).reshape(n, 16, 1)
    ql = bits(qs.reshape(n, 2, 32), 2, 4).permute(0, 1, 3, 2).reshape(n, 16, 16)
    qh = bits(hmask, 1, 8).transpose(1, 2).reshape(n, 16, 16) ^ 1  # a set bit means no offset
    return (dl * (ql - (qh << 2)).float()).reshape(n, QK_K)


def _k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of Q4_K/Q5_K from their 12 packed bytes, as int32 [n, 8]."""
    p = packed.to(torch.int32)
    d, m, md = p[:, 0:4], p[:, 4:8], p[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0xF) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _k_groups(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """d * sc * q - dmin * m over 8 groups of 32 (Q4_K, Q5_K); q int32 [n, 8, 32]."""
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (f16_at(b, 0) * sc.float()).reshape(n, 8, 1)
    dm = (f16_at(b, 2) * mn.float()).reshape(n, 8, 1)
    return (d * q.float() - dm).reshape(n, QK_K)


def _q4_k_values(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> int32 [n, 8, 32]: group 2i is the low nibbles of bytes 32i.., 2i+1 the high."""
    return nibbles(qs.reshape(qs.shape[0], 4, 32)).reshape(qs.shape[0], 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_groups(b, _q4_k_values(b[:, 16:]))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    qh = bits(b[:, 16:48], 1, 8).transpose(1, 2)  # [n, 8, 32]: bit g of byte j -> group g
    return _k_groups(b, _q4_k_values(b[:, 48:]) | (qh << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (f16_at(b, 208) * scales).reshape(n, 16, 1)
    ql = nibbles(b[:, :128].reshape(n, 2, 64)).reshape(n, 8, 32)
    qh = bits(b[:, 128:192].reshape(n, 2, 32), 2, 4).permute(0, 1, 3, 2).reshape(n, 8, 32)
    q = ((ql | (qh << 4)) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, QK_K)


def _q8_k(b: torch.Tensor) -> torch.Tensor:
    d = b[:, :4].contiguous().view(torch.float32)
    return d * b[:, 4:260].contiguous().view(torch.int8).float()


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    high = bits(u16(b[:, 2:4])[:, 0], 2, 8)
    low = bits(b[:, 4:8], 4, 2).reshape(n, 8)
    dl = (f16_at(b, 0) * ((low | (high << 4)) - 32).float()).reshape(n, 8, 1)
    q = nibbles(b[:, 8:].reshape(n, 8, 16))
    return (dl * const(IQ4_KVALUES, torch.float32, b.device)[q]).reshape(n, QK_K)


# ---- ternary and microscaling types ------------------------------------------------------------

# Powers of 3 that bring each base-3 digit of a TQ1_0 byte to the top (the byte is a fixed-point
# fraction digits / 3^5); then digit = (byte * 3) >> 8. uint8 products wrap, as in the format.
_POW3 = (1, 3, 9, 27, 81)
# E2M1 values doubled (ggml's kvalues_mxfp4); the E8M0 scale is halved to match.
MXFP4_KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _ternary_digits(qs: torch.Tensor, count: int) -> torch.Tensor:
    """[n, ..., k] bytes -> int32 [n, ..., count, k] ternary digits (0, 1, 2) of TQ1_0."""
    wrapped = (
        qs.to(torch.int32).unsqueeze(-2) * const(_POW3[:count], torch.int32, qs.device).unsqueeze(-1)
    ) & 0xFF
    return (wrapped * 3) >> 8


def _tq1_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    head = _ternary_digits(b[:, :32], 5).reshape(n, 160)
    tail = _ternary_digits(b[:, 32:48], 5).reshape(n, 80)
    high = _ternary_digits(b[:, 48:52], 4).reshape(n, 16)
    return f16_at(b, 52) * (torch.cat([head, tail, high], dim=1) - 1).float()


def _tq2_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    q = bits(b[:, :64].reshape(n, 2, 32), 2, 4).transpose(-1, -2).reshape(n, QK_K)
    return f16_at(b, 64) * (q - 1).float()


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    e = b[:, :1].to(torch.int32)
    # 2^(e - 127) / 2 as fp32 bits; e < 2 gives subnormals (ggml_e8m0_to_fp32_half).
    d_bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    d = d_bits.view(torch.float32)
    return d * const(MXFP4_KVALUES, torch.float32, b.device)[nibbles(b[:, 1:])]


# ggml type name -> (values per block, bytes per block, dequantizer)
_TYPES: dict[str, tuple[int, int, _Dequant]] = {
    "F32": (1, 4, _f32),
    "F16": (1, 2, _f16_type),
    "BF16": (1, 2, _bf16),
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "Q8_0": (32, 34, _q8_0),
    "Q2_K": (QK_K, 84, _q2_k),
    "Q3_K": (QK_K, 110, _q3_k),
    "Q4_K": (QK_K, 144, _q4_k),
    "Q5_K": (QK_K, 176, _q5_k),
    "Q6_K": (QK_K, 210, _q6_k),
    "Q8_K": (QK_K, 292, _q8_k),
    "IQ4_NL": (32, 18, _iq4_nl),
    "IQ4_XS": (QK_K, 136, _iq4_xs),
    "IQ2_XXS": (QK_K, 66, iq2_xxs),
    "IQ2_XS": (QK_K, 74, iq2_xs),
    "IQ2_S": (QK_K, 82, iq2_s),
    "IQ3_XXS": (QK_K, 98, iq3_xxs),
    "IQ3_S": (QK_K, 110, iq3_s),
    "IQ1_S": (QK_K, 50, iq1_s),
    "IQ1_M": (QK_K, 56, iq1_m),
    "TQ1_0": (QK_K, 54, _tq1_0),
    "TQ2_0": (QK_K, 66, _tq2_0),
    "MXFP4": (32, 17, _mxfp4),
}

SUPPORTED_TYPES: tuple[str, ...] = tuple(_TYPES)


def dequantize(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """Raw GGUF data `[..., row_bytes]` uint8 of type `type_name` -> float32 `[..., row_elems]`."""
    if type_name not in _TYPES:
        raise NotImplementedError(
            f"GGUF type {type_name} cannot be dequantized (supported: {', '.join(_TYPES)})"
        )
    values, size, fn = _TYPES[type_name]
    if raw.dtype != torch.uint8 or raw.shape[-1] % size:
        raise ValueError(
            f"{type_name}: expected uint8 rows of whole {size}-byte blocks, got {raw.dtype} {list(raw.shape)}"
        )
    lead = raw.shape[:-1]
    blocks = raw.reshape(-1, size)
    return fn(blocks).reshape(*lead, raw.shape[-1] // size * values)


# Types whose values are 4-bit codes times a scale plus an offset per group of 32 (the layout of
# 4-bit affine GEMM kernels such as torch's int4pack).
Q4_AFFINE_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def q4_affine_groups(raw: torch.Tensor, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of a Q4_0/Q4_1/Q4_K tensor as `w = scale * q + offset` per group of 32 values:
    (q int32 [rows, K] in 0..15, scale float32 [rows, K/32], offset float32 [rows, K/32])."""
    rows = raw.shape[0]
    values, size, _ = _TYPES[type_name]
    b = raw.reshape(-1, size)
    n = b.shape[0]
    if type_name == "Q4_K":
        sc, mn = _k_scale_min(b[:, 4:16])
        q = _q4_k_values(b[:, 16:])
        scale, offset = f16_at(b, 0) * sc.float(), -(f16_at(b, 2) * mn.float())
    elif type_name in ("Q4_0", "Q4_1"):
        d = f16_at(b, 0)
        q = nibbles(b[:, 2:] if type_name == "Q4_0" else b[:, 4:])
        scale, offset = d, (-8.0 * d if type_name == "Q4_0" else f16_at(b, 2))
    else:
        raise ValueError(f"{type_name} is not a 4-bit affine type ({', '.join(Q4_AFFINE_TYPES)})")
    groups = n * values // 32
    return (
        q.reshape(rows, -1),
        scale.reshape(groups).reshape(rows, -1),
        offset.reshape(groups).reshape(rows, -1),
    )


# Symmetric types whose codes fit int8: type -> values per scale.
INT8_GROUP_TYPES = {"Q8_0": 32, "Q5_0": 32, "Q6_K": 16}


def int8_groups(raw: torch.Tensor, type_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a Q8_0/Q5_0/Q6_K tensor as `w = scale * q` per group of INT8_GROUP_TYPES[type]
    values: (q int8 [rows, K], scale float32 [rows, K / group]); the products are `dequantize`'s."""
    rows = raw.shape[0]
    _, size, _ = _TYPES[type_name]
    b = raw.reshape(-1, size)
    n = b.shape[0]
    if type_name == "Q8_0":
        q, scale = b[:, 2:].contiguous().view(torch.int8), f16_at(b, 0)
    elif type_name == "Q5_0":
        q, scale = (_q5(b[:, 2:6], b[:, 6:]) - 16).to(torch.int8), f16_at(b, 0)
    elif type_name == "Q6_K":
        ql = nibbles(b[:, :128].reshape(n, 2, 64)).reshape(n, 8, 32)
        qh = bits(b[:, 128:192].reshape(n, 2, 32), 2, 4).permute(0, 1, 3, 2).reshape(n, 8, 32)
        q = ((ql | (qh << 4)) - 32).to(torch.int8)
        scale = f16_at(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()
    else:
        raise ValueError(f"{type_name} has no int8 group form ({', '.join(INT8_GROUP_TYPES)})")
    return q.reshape(rows, -1), scale.reshape(rows, -1)
