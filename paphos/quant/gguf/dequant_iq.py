"""Torch dequantizers of the lattice (codebook) GGUF types: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
IQ3_S, IQ1_S, IQ1_M. Registered in dequant.py's type table; same contract and bit-exactness as
the types there (raw blocks [n, type_size] -> float32 [n, 256]).

Each 256-value super-block stores, per group of 8 (or 4) values, an index into a lattice grid of
8 (or 4) magnitudes, plus sign masks and group scales. The grids are data of the format
(llama.cpp's `iq2xxs_grid` etc.); we take them from the `gguf` package (`gguf.quants.<TYPE>.grid`)
instead of repeating kilobytes of tables. The IQ2/IQ3 sign table is computed: entry i is the 7
bits of i plus an 8th (parity) bit that makes the number of negative signs even.
"""

from __future__ import annotations

from functools import cache

import torch

from paphos.quant.gguf.blocks import bits, const, f16_at, sign_values, u16, u32

QK_K = 256
IQ1_DELTA = 0.125


@cache
def _grid(name: str, device: torch.device) -> torch.Tensor:
    """The lattice of IQ type `name` as float32 [entries, values per entry], on `device`."""
    from gguf import quants

    cls = getattr(quants, name)
    cls.init_grid()
    return torch.from_numpy(cls.grid.reshape(cls.grid_shape).copy()).to(device)


@cache
def _ksigns(device: torch.device) -> torch.Tensor:
    i = torch.arange(128, dtype=torch.int32)
    parity = bits(i, 1, 7).sum(-1) & 1
    return (i | (parity << 7)).to(device)


def _sign_bits7(words: torch.Tensor) -> torch.Tensor:
    """IQ2_XXS/IQ3_XXS: four 7-bit sign indices at bits 0, 7, 14, 21 of int64 words [n, g] ->
    +-1.0 [n, g, 4, 8]."""
    idx = bits(words, 7, 4).to(torch.int64)
    return sign_values(bits(_ksigns(words.device)[idx], 1, 8))


def iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    words = u32(b[:, 2:]).reshape(n, 8, 2)
    db = (f16_at(b, 0) * (0.5 + (words[..., 1] >> 28).float()) * 0.25).reshape(n, 8, 1, 1)
    grid = _grid("IQ2_XXS", b.device)[b[:, 2:].reshape(n, 8, 8)[:, :, :4].to(torch.int64)]
    return (db * grid * _sign_bits7(words[..., 1])).reshape(n, QK_K)


def _iq2_db(b: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """IQ2_XS/IQ2_S: 16 group scales d * (0.5 + nibble) * 0.25 -> [n, 16, 1, 1]."""
    n = b.shape[0]
    nib = bits(scales, 4, 2).reshape(n, 16)
    return (f16_at(b, 0) * (0.5 + nib.float()) * 0.25).reshape(n, 16, 1, 1)


def iq2_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qs = u16(b[:, 2:66])  # [n, 32]: 9-bit grid index, 7-bit sign index
    signs = sign_values(bits(_ksigns(b.device)[(qs >> 9).to(torch.int64)], 1, 8)).reshape(n, 16, 2, 8)
    grid = _grid("IQ2_XS", b.device)[(qs & 511).to(torch.int64)].reshape(n, 16, 2, 8)
    return (_iq2_db(b, b[:, 66:74]) * grid * signs).reshape(n, QK_K)


def iq2_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qs, sign_bytes, qh = b[:, 2:34], b[:, 34:66], b[:, 66:74]
    signs = sign_values(bits(sign_bytes, 1, 8)).reshape(n, 16, 2, 8)
    idx = qs.to(torch.int32) | (bits(qh, 2, 4).reshape(n, 32) << 8)
    grid = _grid("IQ2_S", b.device)[idx.to(torch.int64)].reshape(n, 16, 2, 8)
    return (_iq2_db(b, b[:, 74:82]) * grid * signs).reshape(n, QK_K)


def iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    words = u32(b[:, 66:98])  # [n, 8]: 4 x 7-bit sign indices, 4-bit scale
    db = (f16_at(b, 0) * (0.5 + (words >> 28).float()) * 0.5).reshape(n, 8, 1, 1)
    grid = _grid("IQ3_XXS", b.device)[b[:, 2:66].to(torch.int64)].reshape(n, 8, 4, 8)
    return (db * grid * _sign_bits7(words)).reshape(n, QK_K)


def iq3_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qs, qh, sign_bytes, scales = b[:, 2:66], b[:, 66:74], b[:, 74:106], b[:, 106:110]
    db = (f16_at(b, 0) * (1 + 2 * bits(scales, 4, 2).reshape(n, 8)).float()).reshape(n, 8, 1, 1)
    signs = sign_values(bits(sign_bytes, 1, 8)).reshape(n, 8, 4, 8)
    idx = qs.to(torch.int32) | (bits(qh, 1, 8).reshape(n, 64) << 8)
    grid = _grid("IQ3_S", b.device)[idx.to(torch.int64)].reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


def iq1_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qh = u16(b[:, 34:50])  # [n, 8]: 4 x 3 index bits, 3-bit scale, delta sign
    dl = (f16_at(b, 0) * (2 * ((qh >> 12) & 7) + 1).float()).reshape(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, IQ1_DELTA, -IQ1_DELTA).reshape(n, 8, 1, 1)
    idx = b[:, 2:34].to(torch.int32) | (bits(qh, 3, 4).reshape(n, 32) << 8)
    grid = _grid("IQ1_S", b.device)[idx.to(torch.int64)].reshape(n, 8, 4, 8)
    return (dl * (grid + delta)).reshape(n, QK_K)


def iq1_m(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    words = u16(b[:, 48:56])  # [n, 4]: 4 x 3-bit scales, and 4 bits of the fp16 d in the top
    top = (words & 0xF000) >> const((12, 8, 4, 0), torch.int32, b.device)
    d_bits = top[:, 0] | top[:, 1] | top[:, 2] | top[:, 3]
    d_bits = torch.where(d_bits >= 0x8000, d_bits - 0x10000, d_bits)  # as int16, to view as fp16
    d = d_bits.to(torch.int16).view(torch.float16).float().reshape(n, 1)
    dl = (d * (2 * bits(words, 3, 4).reshape(n, 16) + 1).float()).reshape(n, 8, 2, 1, 1)
    qh = bits(b[:, 32:48], 4, 2).reshape(n, 32)  # per 8 values: 3 index bits, delta sign
    idx = b[:, :32].to(torch.int32) | ((qh & 7) << 8)
    delta = torch.where((qh & 8) == 0, IQ1_DELTA, -IQ1_DELTA).reshape(n, 8, 2, 2, 1)
    grid = _grid("IQ1_S", b.device)[idx.to(torch.int64)].reshape(n, 8, 2, 2, 8)
    return (dl * (grid + delta)).reshape(n, QK_K)
