"""The repacked layout of GGUF weights for the Triton kernels (triton_gguf.py, triton_gemv.py):
`FORMATS` describes each type's planes, `repack` turns a tensor's raw blocks into them at load,
`reference_matmul` is the torch reference every kernel is tested against.

Planes (the repacked layout; every plane [N, ...], one row per output feature; where K is a
multiple of `tile_values` (a K-quant's 256, else 128) and N of ROW_TILE, rows are stored in
tiles of ROW_TILE rows x `tile_values` values: a tile's rows one after another, tiles along K,
then the next ROW_TILE rows (`tile_rows`, paphos/quant/kernels/int_layout.py's `plane_offset`
with BLOCK the plane's elements per tile; the kernels' TT and TILE), so a K step of a tensor-core
kernel over 64 rows reads 16 runs of a tile's bytes instead of 64 short ones (H100, Q4_K at 16
tokens: gate|up 53.0 -> 38.6 us, down 29.4 -> 22.0); row-major otherwise):
  lo    the low LO bits of each code: int32 words of 32/LO codes (code i of a word at bits LO*i),
        or int8 codes themselves when LO == 8 (Q8_0); codes in "tile order": K is cut into tile
        groups of T = `tile_words` words (T = 4, or fewer when a scale group has fewer words),
        and code p of word w of a group is value p * T + w of the group (`_tile_order`)
  hi    the HI high bits (HI = 1 or 2) as int32 words in the same order as lo's codes, placed
        above lo: code = lo | hi << LO
  sc    per group of SG values: the fp16 scale d (SCALE 0), or an int8 (SCALE 1) / uint8 (SCALE 2)
        integer scale multiplied by the per-256 fp16 super-scale `sd`; Q2_K packs scale (low
        nibble) and min (high nibble) in this byte (SCMIN_NIB)
  mn    per group: fp16 min added (MINK 1: Q4_1, Q5_1), or uint8 min times the per-256 fp16 `smin`,
        subtracted (MINK 2: K-quants)
  value = scale * (code - OFF) [+/- min], or scale * IQ4_KVALUES[code] for IQ4 (LUT).
The bytes are the file's, rearranged: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q6_K, Q3_K, Q2_K, IQ4_NL the
same; Q4_K and Q5_K +4 bytes per 256 values (their 6-bit scales/mins unpacked to bytes: +2.8% /
+2.3%); IQ4_XS +2 (+1.5%). The torch reference of every kernel is `dequantize` (dequant.py) then
a float32 matmul (`reference_matmul`), what the tests and the GPU benchmark compare against.
Types without a format here (Q8_K, IQ1-3, TQ*, MXFP4, float types) are dequantized at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paphos.quant.gguf.blocks import bits, nibbles, u16, u32
from paphos.quant.gguf.dequant import _TYPES, _k_scale_min, _q4_k_values, dequantize
from paphos.quant.kernels.int_layout import to_tiles

QK_K = 256


@dataclass(frozen=True)
class Format:
    """How one GGUF type's planes are laid out and decoded (see the module docstring)."""

    lo: int  # bits of the low code plane: 2, 4, or 8 (int8 codes)
    hi: int = 0  # bits of the high code plane: 0, 1 or 2
    off: int = 0  # value = scale * (code - off)
    sg: int = 32  # values per scale group
    scale: int = 0  # 0: fp16 per group; 1: int8 x sd; 2: uint8 x sd
    mink: int = 0  # 0: none; 1: + fp16 per group; 2: - uint8 x smin
    lut: bool = False  # IQ4 non-linear levels
    scmin_nib: bool = False  # Q2_K: scale and min nibbles share the sc byte
    block: int = 32  # values per GGUF block (K must be a multiple)

    @property
    def tile_words(self) -> int:
        """Low-plane words of a tile group (at most 16 bytes: one vector load per thread)."""
        return max(1, min(4, self.sg * self.lo // 32))

    @property
    def tile_values(self) -> int:
        return self.tile_words * 32 // self.lo


FORMATS: dict[str, Format] = {
    "Q8_0": Format(lo=8),
    "Q4_0": Format(lo=4, off=8),
    "Q4_1": Format(lo=4, mink=1),
    "Q5_0": Format(lo=4, hi=1, off=16),
    "Q5_1": Format(lo=4, hi=1, mink=1),
    "IQ4_NL": Format(lo=4, lut=True),
    "Q4_K": Format(lo=4, scale=2, mink=2, block=QK_K),
    "Q5_K": Format(lo=4, hi=1, scale=2, mink=2, block=QK_K),
    "Q6_K": Format(lo=4, hi=2, off=32, sg=16, scale=1, block=QK_K),
    "IQ4_XS": Format(lo=4, lut=True, scale=1, block=QK_K),
    "Q3_K": Format(lo=2, hi=1, off=4, sg=16, scale=1, block=QK_K),
    "Q2_K": Format(lo=2, sg=16, scale=2, mink=2, scmin_nib=True, block=QK_K),
}

PLANES = ("lo", "hi", "sc", "sd", "mn", "smin")
ROW_TILE = 4  # rows per tile of every plane (module docstring)


def tile_values(type_name: str) -> int:
    """K values per tile: a K-quant's super-block (256), else 128 (four blocks of 32: the Q8_0
    int8 kernel's K step)."""
    return QK_K if FORMATS[type_name].block == QK_K else 128


def row_tile(type_name: str, rows: int, k: int) -> int:
    """Rows per tile of the planes of `rows` rows of K = k values: ROW_TILE, or 1 (row-major)."""
    return ROW_TILE if k % tile_values(type_name) == 0 and rows % ROW_TILE == 0 else 1


def tile_rows(planes: dict[str, torch.Tensor], type_name: str, rows: int, k: int) -> dict[str, torch.Tensor]:
    """Row-major planes [rows, elements] -> the tiled order of `row_tile` (same shapes)."""
    tt = row_tile(type_name, rows, k)
    return {name: to_tiles(t, tt, t.shape[1] * tile_values(type_name) // k) for name, t in planes.items()}


# ---------------------------------------------------------------------------- repacking (torch)


def _pack(codes: torch.Tensor, width: int) -> torch.Tensor:
    """int codes [R, K] (each < 2^width) -> int32 words [R, K * width / 32], code i of a word at
    bits width * i."""
    per = 32 // width
    r = codes.shape[0]
    shifts = torch.arange(0, 32, width, device=codes.device, dtype=torch.int64)
    words = (codes.reshape(r, -1, per).to(torch.int64) << shifts).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    return b[:, at : at + 2].contiguous().view(torch.float16)[:, 0]


def _codes_and_scales(b: torch.Tensor, type_name: str) -> dict[str, torch.Tensor]:
    """Blocks [n, type_size] of one type -> per-block planes: 'q' codes int32 [n, values]
    (natural order, lo | hi << LO), 'sc' [n, groups], 'sd' [n], 'mn' [n, groups], 'smin' [n]."""
    n = b.shape[0]
    if type_name == "Q8_0":
        return {"q": b[:, 2:].contiguous().view(torch.int8), "sc": _f16(b, 0)[:, None]}
    if type_name in ("Q4_0", "IQ4_NL"):
        return {"q": nibbles(b[:, 2:]), "sc": _f16(b, 0)[:, None]}
    if type_name == "Q4_1":
        return {"q": nibbles(b[:, 4:]), "sc": _f16(b, 0)[:, None], "mn": _f16(b, 2)[:, None]}
    if type_name in ("Q5_0", "Q5_1"):
        at = 2 if type_name == "Q5_0" else 4
        high = bits(u32(b[:, at : at + 4])[:, 0], 1, 32).to(torch.int32)
        out = {"q": nibbles(b[:, at + 4 :]) | (high << 4), "sc": _f16(b, 0)[:, None]}
        if type_name == "Q5_1":
            out["mn"] = _f16(b, 2)[:, None]
        return out
    if type_name in ("Q4_K", "Q5_K"):
        sc, mn = _k_scale_min(b[:, 4:16])
        if type_name == "Q4_K":
            q = _q4_k_values(b[:, 16:])
        else:
            q = _q4_k_values(b[:, 48:]) | (bits(b[:, 16:48], 1, 8).transpose(1, 2) << 4)
        return {
            "q": q.reshape(n, QK_K), "sc": sc.to(torch.uint8), "mn": mn.to(torch.uint8),
            "sd": _f16(b, 0), "smin": _f16(b, 2),
        }  # fmt: skip
    if type_name == "Q6_K":
        ql = nibbles(b[:, :128].reshape(n, 2, 64)).reshape(n, QK_K)
        qh = bits(b[:, 128:192].reshape(n, 2, 32), 2, 4).permute(0, 1, 3, 2).reshape(n, QK_K)
        return {"q": ql | (qh << 4), "sc": b[:, 192:208].contiguous().view(torch.int8), "sd": _f16(b, 208)}
    if type_name == "IQ4_XS":
        high = bits(u16(b[:, 2:4])[:, 0], 2, 8)
        low = bits(b[:, 4:8], 4, 2).reshape(n, 8)
        q = nibbles(b[:, 8:].reshape(n, 8, 16)).reshape(n, QK_K)
        return {"q": q, "sc": ((low | (high << 4)) - 32).to(torch.int8), "sd": _f16(b, 0)}
    if type_name == "Q3_K":
        hmask, qs, packed = b[:, :32], b[:, 32:96], b[:, 96:108].to(torch.int32)
        low = torch.cat([packed[:, :8] & 0xF, packed[:, :8] >> 4], dim=1)
        high = bits(packed[:, 8:12], 2, 4).transpose(1, 2).reshape(n, 16)
        ql = bits(qs.reshape(n, 2, 32), 2, 4).permute(0, 1, 3, 2).reshape(n, QK_K)
        qh = bits(hmask, 1, 8).transpose(1, 2).reshape(n, QK_K)
        return {"q": ql | (qh << 2), "sc": ((low | (high << 4)) - 32).to(torch.int8), "sd": _f16(b, 108)}
    if type_name == "Q2_K":
        q = bits(b[:, 16:80].reshape(n, 2, 32), 2, 4).transpose(-1, -2).reshape(n, QK_K)
        return {"q": q, "sc": b[:, :16].contiguous(), "sd": _f16(b, 80), "smin": _f16(b, 82)}
    raise ValueError(f"no Triton format for GGUF type {type_name}")


def repack(
    raw: torch.Tensor, type_name: str, chunk_rows: int = 4096, tile: bool = True
) -> dict[str, torch.Tensor]:
    """Raw blocks [rows, row_bytes] of `type_name` -> the planes of its `Format` (module
    docstring), on raw's device; converted `chunk_rows` rows at a time to bound temporaries.
    `tile` False: row-major (for shards joined into one segment, tiled together)."""
    fmt = FORMATS[type_name]
    rows = raw.shape[0]
    parts: dict[str, list[torch.Tensor]] = {}
    for r0 in range(0, rows, chunk_rows):
        chunk = raw[r0 : r0 + chunk_rows]
        r = chunk.shape[0]
        fields = _codes_and_scales(chunk.reshape(-1, type_size(type_name)), type_name)
        q = _tile_order(fields["q"].reshape(r, -1), fmt)
        planes = {}
        if fmt.lo == 8:
            planes["lo"] = q.to(torch.int8)
        else:
            planes["lo"] = _pack(q & ((1 << fmt.lo) - 1), fmt.lo)
        if fmt.hi:
            planes["hi"] = _pack(q >> fmt.lo, fmt.hi)
        for name in ("sc", "sd", "mn", "smin"):
            if name in fields:
                planes[name] = fields[name].reshape(r, -1).contiguous()
        for name, t in planes.items():
            parts.setdefault(name, []).append(t)
    planes = {name: torch.cat(ts) for name, ts in parts.items()}
    k = raw.shape[1] // type_size(type_name) * fmt.block
    return tile_rows(planes, type_name, rows, k) if tile else planes


def _tile_order(q: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Codes [R, K] in natural order -> stored order: in each tile group of T = tile_words words,
    stored code p of word w is value p * T + w of the group, so that for a fixed p the T words
    of a group hold T consecutive values (one vector of x per code position, see triton_gemv)."""
    t = fmt.tile_words
    if t == 1:
        return q
    r, k = q.shape
    return q.reshape(r, k // fmt.tile_values, 32 // fmt.lo, t).transpose(-1, -2).reshape(r, k)


def type_size(type_name: str) -> int:
    """Bytes per block of a GGUF type."""
    return _TYPES[type_name][1]


def reference_matmul(raw: torch.Tensor, type_name: str, x: torch.Tensor) -> torch.Tensor:
    """The torch reference of the kernels: dequantize (dequant.py, bit-exact vs gguf) then a
    float32 matmul; x [M, K] -> fp32 [M, rows]."""
    return x.float() @ dequantize(raw, type_name).t()
