"""The integer-weight family's layout (W4A16 / W8A16: GPTQ, AWQ, compressed-tensors pack-quantized):
`IntSpec` describes a layer, `pack` turns integer codes and their group scales / zero points into
the planes the Triton kernels read (triton_int.py), `dequantize` and `reference_matmul` are the
torch reference every kernel is tested against, `plane_offset` where the kernels find a weight
(and `to_tiles`, shared with the GGUF planes). Pure torch but the Triton helpers at the end:
CPU-only installs use it too.

Data flow: a format module (paphos/quant/<format>.py) unpacks its checkpoint into codes [N, K] in
the order the kernel consumes K (GPTQ act-order: column j multiplies x[:, perm[j]]), scales and
optional zero points [N, G], and calls `pack` once at load; every step then calls
`triton_int.matmul(x, planes, spec)` on CUDA, or the reference elsewhere.

The math: w[n, j] = (q[n, j] - zero[n, g]) * scale[n, g], g = j // group_size, in the kernel's
K order; zero = 2**(bits - 1) when the checkpoint has none (symmetric). K is a multiple of 32 and
need not be a multiple of group_size (the last group is then short).

Planes:
  qweight  int32 [N, K * bits / 32]: row n's codes in K order, K in tile groups of 4 words
           (32 values of 4 bits, 16 of 8 bits); value p * 4 + w of a tile group is code p of
           word w (bits [bits * p, bits * (p + 1))). So a thread's one 16-byte load holds, for
           each code position p, four consecutive values: x for them is one vector too (the
           integer-dot GEMV reads x as paphos/layers/x_int8.py packs it for this layout, the
           tensor-core kernels reorder in registers). 4-bit codes are stored as is (0..15); 8-bit
           codes as the signed byte q - 128, what `dp4a` multiplies. Where K is a multiple of
           BLOCK_VALUES (`row_tile` 4), rows are stored in tiles of ROW_TILE rows x BLOCK_VALUES
           values: a tile's rows one after another (64 bytes each at 4 bits, 128 at 8), tiles
           along K, then the next ROW_TILE rows, so each K step of the tensor-core kernels (128
           rows x 128 values) reads 32 runs of 256 contiguous bytes instead of 128 runs of 64
           (`plane_offset`; H100, 16 tokens: gate|up 33.0 -> 27.7 us, down 20.6 -> 19.0); other
           K are row-major (`row_tile` 1).
  scales   [G, N] in the dtype given (the model dtype): transposed, so a tile's scales are
           contiguous (one vector load the tensor-core kernel's pipeline can issue ahead).
  zeros    [G, N] likewise, only with has_zeros: integer values in [0, 2**bits] (GPTQ, AWQ and
           compressed-tensors zero points are integers), so that the kernels' 16-bit arithmetic
           on (code - zero) is exact.
  perm     int32 [K], only with has_perm.
Memory is the checkpoint's: bits / 8 bytes per weight plus the scale (and zero) planes, and 4
bytes per input feature for perm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch functions serve
    triton = None

TILE_WORDS = 4  # int32 words per tile group: one 16-byte load
ROW_TILE = 4  # rows per tile of the plane where K is a multiple of BLOCK_VALUES
BLOCK_VALUES = 128  # K values per tile: the int8 tensor-core GEMM's K step


@dataclass(frozen=True)
class IntSpec:
    """One linear layer of the family (module docstring)."""

    bits: int  # 4 or 8
    group_size: int  # values per scale group along K: a power of two >= 32, or K (per-channel)
    in_features: int  # K, a multiple of 32
    out_features: int  # N, a multiple of 8
    has_zeros: bool  # False: symmetric, zero = 2**(bits - 1)
    has_perm: bool  # act-order: x is read as x[:, perm]

    def invalid(self) -> str | None:
        """Why the layout cannot hold this layer, or None (`triton_int.supports` is False then,
        `pack` raises)."""
        if self.bits not in (4, 8):
            return f"{self.bits}-bit codes (only 4 and 8)"
        if self.in_features % 32 or self.in_features <= 0:
            return f"in_features {self.in_features} (a positive multiple of 32)"
        if self.out_features % 8 or self.out_features <= 0:
            return f"out_features {self.out_features} (a positive multiple of 8)"
        g = self.group_size
        if g != self.in_features and (g < 32 or g & (g - 1)):
            return f"group_size {g} (a power of two >= 32, or in_features)"
        return None

    @property
    def groups(self) -> int:
        return math.ceil(self.in_features / self.group_size)

    @property
    def codes_per_word(self) -> int:
        return 32 // self.bits

    @property
    def tile_values(self) -> int:
        """Values per tile group of `TILE_WORDS` words (32 at 4 bits, 16 at 8)."""
        return TILE_WORDS * self.codes_per_word

    @property
    def row_tile(self) -> int:
        """Rows per tile of the qweight plane (module docstring): ROW_TILE, or 1 (row-major)."""
        return ROW_TILE if self.in_features % BLOCK_VALUES == 0 else 1

    @property
    def block_words(self) -> int:
        """int32 words of one row in one tile: BLOCK_VALUES values."""
        return BLOCK_VALUES * self.bits // 32

    @property
    def group_shift(self) -> int:
        """k >> group_shift is the scale group of K index k (per-channel: always 0)."""
        return 31 if self.group_size == self.in_features else self.group_size.bit_length() - 1

    @property
    def symmetric_zero(self) -> int:
        return 1 << (self.bits - 1)


def _tile_order(codes: torch.Tensor, spec: IntSpec) -> torch.Tensor:
    """[N, K] in K order -> [N, K / per, per] words' codes: code p of word w of a tile group is
    value p * TILE_WORDS + w of the group."""
    n, k = codes.shape
    per = spec.codes_per_word
    return codes.reshape(n, k // spec.tile_values, per, TILE_WORDS).transpose(-1, -2).reshape(n, -1, per)


def _k_order(word_codes: torch.Tensor, spec: IntSpec) -> torch.Tensor:
    """The inverse of `_tile_order`: [N, K / per, per] -> [N, K]."""
    n = word_codes.shape[0]
    per = spec.codes_per_word
    return word_codes.reshape(n, -1, TILE_WORDS, per).transpose(-1, -2).reshape(n, -1)


def to_tiles(t: torch.Tensor, tt: int, block: int) -> torch.Tensor:
    """A row-major plane [N, elements] -> tiles of `tt` rows x `block` elements, tiles along K
    (`plane_offset`; also the GGUF planes'), same shape; tt 1: as is."""
    if tt == 1:
        return t.contiguous()
    n, w = t.shape
    return t.reshape(n // tt, tt, w // block, block).transpose(1, 2).reshape(n, w)


def from_tiles(t: torch.Tensor, tt: int, block: int) -> torch.Tensor:
    """The inverse of `to_tiles`."""
    if tt == 1:
        return t
    n, w = t.shape
    return t.reshape(n // tt, w // block, tt, block).transpose(1, 2).reshape(n, w)


def pack(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    spec: IntSpec,
    perm: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """Codes [N, K] (any integer dtype, 0 <= code < 2**bits, in the kernel's K order: with a perm,
    codes[:, j] multiplies x[:, perm[j]]), scales [N, G] float, zeros [N, G] float or None -> the
    planes (module docstring) on codes' device. Raises ValueError on inputs outside the layout."""
    if spec.invalid():
        raise ValueError(f"integer weights of {spec}: {spec.invalid()}")
    n, k = spec.out_features, spec.in_features
    g = spec.groups
    if tuple(codes.shape) != (n, k) or codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise ValueError(
            f"codes must be an integer tensor [{n}, {k}], got {codes.dtype} {tuple(codes.shape)}"
        )
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 1 << spec.bits):
        raise ValueError(f"codes outside [0, {1 << spec.bits})")
    if tuple(scales.shape) != (n, g) or not scales.dtype.is_floating_point:
        raise ValueError(
            f"scales must be a float tensor [{n}, {g}], got {scales.dtype} {tuple(scales.shape)}"
        )
    if spec.has_zeros != (zeros is not None) or spec.has_perm != (perm is not None):
        raise ValueError("zeros / perm given must match spec.has_zeros / spec.has_perm")
    device = codes.device
    q = _tile_order(codes.to(torch.int64), spec)
    if spec.bits == 8:
        q = q ^ 0x80  # the signed byte q - 128
    shifts = torch.arange(0, 32, spec.bits, device=device, dtype=torch.int64)
    words = (q << shifts).sum(-1)
    planes = {
        "qweight": to_tiles(torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32), spec.row_tile,
                            spec.block_words),
        "scales": scales.to(device).t().contiguous(),
    }
    if zeros is not None:
        if tuple(zeros.shape) != (n, g) or not zeros.dtype.is_floating_point:
            raise ValueError(
                f"zeros must be a float tensor [{n}, {g}], got {zeros.dtype} {tuple(zeros.shape)}"
            )
        zf = zeros.float()
        if not bool(((zf == zf.round()) & (zf >= 0) & (zf <= 1 << spec.bits)).all()):
            raise ValueError(f"zero points must be integers in [0, {1 << spec.bits}]")
        planes["zeros"] = zeros.to(device).t().contiguous()
    if perm is not None:
        if tuple(perm.shape) != (k,) or not torch.equal(
            torch.sort(perm.to(device=device, dtype=torch.int64)).values, torch.arange(k, device=device)
        ):
            raise ValueError(f"perm must be a permutation of range({k})")
        planes["perm"] = perm.to(device=device, dtype=torch.int32).contiguous()
    return planes


def codes_of(planes: dict[str, torch.Tensor], spec: IntSpec) -> torch.Tensor:
    """The codes [N, K] (int64, 0 <= code < 2**bits) back from the packed plane, in the kernel's K
    order."""
    words = from_tiles(planes["qweight"], spec.row_tile, spec.block_words).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, spec.bits, device=words.device, dtype=torch.int64)
    q = (words[..., None] >> shifts) & ((1 << spec.bits) - 1)
    if spec.bits == 8:
        q = q ^ 0x80
    return _k_order(q, spec)


def dequantize(planes: dict[str, torch.Tensor], spec: IntSpec) -> torch.Tensor:
    """The weights [N, K] in float32, K in input order (a perm undone): (code - zero) * scale in
    float32, exact for float16 / bfloat16 scales and integer zeros."""
    k = spec.in_features
    q = codes_of(planes, spec).float()
    group = torch.arange(k, device=q.device) // spec.group_size
    scales = planes["scales"].float().t()[:, group]
    zeros = planes["zeros"].float().t()[:, group] if spec.has_zeros else float(spec.symmetric_zero)
    w = (q - zeros) * scales
    if spec.has_perm:
        out = torch.empty_like(w)
        out[:, planes["perm"].long()] = w
        return out
    return w


def reference_matmul(x: torch.Tensor, planes: dict[str, torch.Tensor], spec: IntSpec) -> torch.Tensor:
    """The kernels' reference: x [M, K] -> float32 [M, N] = x.float() @ dequantize(...).T."""
    return x.float() @ dequantize(planes, spec).t()


def planes_nbytes(planes: dict[str, torch.Tensor]) -> int:
    """Bytes the planes take on their device."""
    return sum(t.numel() * t.element_size() for t in planes.values())


if triton is not None:

    @triton.jit
    def tile_row(rows, row_len, TT: tl.constexpr, BLOCK: tl.constexpr):
        """The part of `plane_offset` that depends on the row alone (hoisted out of K loops)."""
        if TT == 1:
            return rows * row_len
        return (rows // TT) * (TT * row_len) + (rows % TT) * BLOCK

    @triton.jit
    def tile_col(at, TT: tl.constexpr, BLOCK: tl.constexpr):
        """The part of `plane_offset` that depends on the element alone."""
        if TT == 1:
            return at
        return (at // BLOCK) * (TT * BLOCK) + at % BLOCK

    @triton.jit
    def plane_offset(rows, at, row_len, TT: tl.constexpr, BLOCK: tl.constexpr):
        """Where element `at` of row `rows` (int64; broadcast together) lies in a plane of `row_len`
        elements a row (words, or bytes) stored in tiles of TT rows x BLOCK elements a row (the
        spec's `row_tile`, and BLOCK_VALUES values here): row-major where TT is 1 (module
        docstring). The GGUF planes (paphos/quant/gguf/planes.py) are tiled the same way, BLOCK
        the elements of a type's `tile_values`."""
        return tile_row(rows, row_len, TT, BLOCK) + tile_col(at, TT, BLOCK)
