"""EXL2's layout on the GPU: `pack` re-lays a layer's checkpoint shards (ExLlamaV2's per-group
mixed bit widths) into the planes the Triton kernels read (triton_exl2.py), `unsupported` says
which layers they cannot take, `reference_weight` is the torch reference every kernel is tested
against. Pure torch: the checkpoint's codes re-laid, nothing expanded.

Data flow: paphos/quant/exl2.py validates each shard's checkpoint tensors into a `Shard`, calls
`pack` once per layer (all shards of a merged q|k|v or gate|up layer in one set of planes; with
`-tp N` a rank's part) and frees the checkpoint tensors; every step then calls
`triton_exl2.matmul(x, planes)`.

Planes:
  words   int32 [sum of R_s * N_s]   per shard, run of 32 stored rows and output column, the run's
                                     `bits` words ([R, N] row-major: a word row is contiguous over
                                     the columns, so a program's columns load coalesced). A
                                     b-bit code is a low plane of LO bits and a high plane of HI
                                     (PLANES: 2 = 2, 3 = 2 + 1, 4 = 4, 5 = 4 + 1, 6 = 4 + 2,
                                     8 = 8), each of w bits in w words: the field of stored row
                                     4j + l sits at bit w * (j % (8 / w)) + 8 l of the plane's
                                     word j // (8 / w). One shift and mask of a word thus gives
                                     the fields of four consecutive rows in the four bytes, the
                                     high plane shifted up by LO and OR-ed in: the codes as bytes
                                     for `dp4a`, whatever the width (the checkpoint's streams put
                                     3/5/6-bit codes across words and in no byte order: per code
                                     ~8.5 instructions of shifts, float conversion and FMA)
  scales  int32 [sum of G_s * N_s/8] every shard's q_scale as stored (4-bit codes, 8 per word)
  smax    fp16  [sum of G_s]         fp16(q_scale_max / 256): the rounded maximum every scale
                                     multiplies (exl2.py's rule), computed once
  runs    int32 [S, ceil(K / 32), 2] per shard and run of 32 stored rows: its first word row and
                                     (bits | group << 4). A run never crosses a group (groups
                                     are whole runs but the last, `unsupported` checks), so a run
                                     has one bit width and one scale row, known by one load
  perm    int32 [S * K]              per shard argsort(q_invperm): stored row j multiplies
                                     x[perm[j]]; the GEMV's x is gathered in stored order first
                                     (by the quantizing launch); the dequantization writes stored
                                     row j as input row perm[j] (so one cuBLAS call serves shards
                                     with different perms)
  meta    int32 [S, 8]               per shard: offsets and strides into the planes above, its
                                     first output column and its columns
  tiles   int32 [T, 2]               (shard, first column) of each BLOCK_N-column program tile
                                     (tiles never cross shards): one launch per merged layer
About K / 4 + 8 bytes per shard beyond the checkpoint's tensors (runs against q_groups), and a
short last run (K not a multiple of 32) padded to whole words. The scales stay 4-bit codes (a
scale per group and column in fp16 would be 4x q_scale's bytes, +3-5 % of the weights at 4 bpw,
to save a load and ~8 integer ops per 32 codes). x is permuted rather than the weights and the
merged shards keep their own permutations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# The bit widths the kernels unpack (exllamav2's converter writes these).
KERNEL_BITS = (2, 3, 4, 5, 6, 8)
# A width's codes as a low and a high plane of 8, 4, 2 or 1 bits (module docstring).
PLANES = {2: (2, 0), 3: (2, 1), 4: (4, 0), 5: (4, 1), 6: (4, 2), 8: (8, 0)}
PACK_ROWS = 4096  # input rows re-laid at a time (a multiple of 32)
META = 8  # int32 entries per shard in `meta`


@dataclass(frozen=True)
class Shard:
    """One checkpoint shard's tensors, validated (exl2.check_tensors), as `pack` takes them."""

    q_weight: torch.Tensor  # int32 [R, Npad]
    q_scale: torch.Tensor  # int32 [G, ceil(Npad / 8)]
    q_scale_max: torch.Tensor  # fp16 [G]
    invperm: torch.Tensor  # [K]
    groups: list[tuple[int, int, int]]  # per group (bits, first q_weight row, first stored row)
    columns: int  # output columns the layer keeps (<= Npad)


@dataclass
class EXL2Planes:
    """A layer's weights as the kernels read them (module docstring)."""

    words: torch.Tensor
    scales: torch.Tensor
    smax: torch.Tensor
    runs: torch.Tensor
    perm: torch.Tensor
    meta: torch.Tensor
    tiles: torch.Tensor
    k: int
    n: int  # output columns of all shards
    block_n: int
    max_bits: int  # the widest run's bits (the GEMV keeps registers for that many word rows)
    aligned: bool  # every shard's word-row stride and columns a multiple of 4 (16-byte loads)
    launches: dict[int, tuple[int, bool]] = field(default_factory=dict)  # GEMV (K slices, ahead) by MP

    @property
    def n_runs(self) -> int:
        return self.runs.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in ("words", "scales", "smax", "runs", "perm", "meta", "tiles")}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def unsupported(shard_groups: list[list[tuple[int, int, int]]], k: int) -> str | None:
    """Why the kernels cannot take a layer whose shards have these groups, or None: bit widths
    they do not unpack, or a group other than the last whose rows are not whole runs of 32."""
    for groups in shard_groups:
        for g, (bits, _, row) in enumerate(groups):
            end = groups[g + 1][2] if g + 1 < len(groups) else k
            if bits not in KERNEL_BITS:
                return f"{bits}-bit groups (the kernels unpack {', '.join(map(str, KERNEL_BITS))} bits)"
            if row % 32 or (g + 1 < len(groups) and (end - row) % 32):
                return f"a group of {end - row} rows at row {row} (the kernels take groups of whole 32-row runs)"
    return None


def default_block_n(columns: tuple[int, ...]) -> int:
    """256 columns per program tile (4 per thread on 2 warps: 16-byte loads of each word row),
    fewer for layers whose every shard is narrower."""
    return max(16, min(256, 1 << (max(columns) - 1).bit_length()))


def _stream_codes(stream: torch.Tensor, rows: int, bits: int) -> torch.Tensor:
    """int64 [rows, N]: the codes of a bit stream as the checkpoint stores it (int32 [W, N]; code
    v at stream bit v * bits, a code across two words joined from both)."""
    words = stream.to(torch.int64) & 0xFFFFFFFF
    start = torch.arange(rows, device=stream.device) * bits
    lo, shift = start // 32, (start % 32)[:, None]
    hi = torch.clamp(lo + 1, max=words.shape[0] - 1)
    return ((words[lo] >> shift) | torch.where(shift + bits > 32, words[hi] << (32 - shift), 0)) & ((1 << bits) - 1)


def _plane_words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 codes [32 * runs, N] of one width -> the runs' words, int32 [bits * runs, N]: per
    run the low plane's words, then the high plane's (PLANES; module docstring)."""
    runs, n = codes.shape[0] // 32, codes.shape[1]
    lo_bits, hi_bits = PLANES[bits]
    planes = []
    for width, part in ((lo_bits, codes & ((1 << lo_bits) - 1)), (hi_bits, codes >> lo_bits)):
        if width:
            per = 8 // width  # fields per byte lane; row 4 * (word * per + field) + lane
            shift = width * torch.arange(per, device=codes.device)[:, None] + 8 * torch.arange(4, device=codes.device)
            planes.append((part.view(runs, width, per, 4, n) << shift[:, :, None]).sum(dim=(2, 3)))
    words = torch.cat(planes, dim=1).reshape(runs * bits, n)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _plane_codes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `_plane_words`: int64 codes [32 * runs, N]."""
    runs, n = words.shape[0] // bits, words.shape[1]
    w = (words.to(torch.int64) & 0xFFFFFFFF).view(runs, bits, n)
    lo_bits, hi_bits = PLANES[bits]
    codes = torch.zeros(runs, 32, n, dtype=torch.int64, device=words.device)
    for first, width, up in ((0, lo_bits, 0), (lo_bits, hi_bits, lo_bits)):
        if width:
            per = 8 // width
            shift = width * torch.arange(per, device=words.device)[:, None] + 8 * torch.arange(4, device=words.device)
            fields = (w[:, first : first + width, None, None] >> shift[:, :, None]) & ((1 << width) - 1)
            codes |= fields.reshape(runs, 32, n) << up
    return codes.reshape(runs * 32, n)


def pack(shards: list[Shard], block_n: int | None = None) -> EXL2Planes:
    """The kernels' planes of a layer's shards (same K; on their device). Call `unsupported` first."""
    k = shards[0].invperm.numel()
    device = shards[0].q_weight.device
    n_runs = -(-k // 32)
    block_n = block_n or default_block_n(tuple(s.columns for s in shards))
    runs: list[list[int]] = []  # per shard and run: first word row, bits | group << 4
    words, meta, tiles = [], [], []
    s_off = m_off = col0 = 0
    w_off = 0
    for i, s in enumerate(shards):
        npad = s.q_weight.shape[1]
        word_row = 0
        for g, (bits, word0, row0) in enumerate(s.groups):
            end = s.groups[g + 1][2] if g + 1 < len(s.groups) else k
            for a in range(row0, end, PACK_ROWS):  # in slices: int64 codes of a whole group can be GBs
                rows = min(PACK_ROWS, end - a)
                first = word0 + (a - row0) * bits // 32
                codes = _stream_codes(s.q_weight[first : first + -(-rows * bits // 32)], rows, bits)
                codes = torch.nn.functional.pad(codes, (0, 0, 0, -rows % 32))  # whole runs
                words.append(_plane_words(codes, bits))
            for _ in range(row0 // 32, -(-end // 32)):
                runs.append([word_row, bits | g << 4])
                word_row += bits
        meta.append([w_off, npad, word_row, s_off, s.q_scale.shape[1], m_off, col0, s.columns])
        tiles += [[i, c] for c in range(0, s.columns, block_n)]
        w_off += word_row * npad
        s_off += s.q_scale.numel()
        m_off += s.q_scale_max.numel()
        col0 += s.columns
    if w_off >= 1 << 31 or s_off >= 1 << 31:
        raise ValueError("EXL2 layer too large for 32-bit offsets")
    return EXL2Planes(
        words=torch.cat([w.reshape(-1) for w in words]),
        scales=torch.cat([s.q_scale.reshape(-1) for s in shards]),
        # exllamav2's rounding of the maximum (exl2.py): fp16(fp16 max / 256), exact in float32 first
        smax=torch.cat([(s.q_scale_max.float() / 256).half() for s in shards]),
        runs=torch.tensor(runs, dtype=torch.int32, device=device).view(len(shards), n_runs, 2),
        perm=torch.cat([torch.argsort(s.invperm.long()) for s in shards]).to(torch.int32),
        meta=torch.tensor(meta, dtype=torch.int32, device=device),
        tiles=torch.tensor(tiles, dtype=torch.int32, device=device),
        k=k,
        n=col0,
        block_n=block_n,
        max_bits=max(bits for s in shards for bits, _, _ in s.groups),
        aligned=all(s.q_weight.shape[1] % 4 == 0 and s.columns % 4 == 0 for s in shards),
    )


# ---------------------------------------------------------------------------- torch reference


def reference_weight(planes: EXL2Planes) -> torch.Tensor:
    """float32 [N, K] (input order) from the planes, in torch: what every kernel computes."""
    k = planes.k
    runs, meta = planes.runs.cpu(), planes.meta.cpu().tolist()
    words_all = planes.words.cpu()
    out = []
    for i, (w_off, npad, rows, s_off, s_words, m_off, _, cols) in enumerate(meta):
        words = words_all[w_off : w_off + rows * npad].view(rows, npad)
        qs_words = planes.scales.cpu()[s_off:].to(torch.int64)
        stored = torch.empty(planes.n_runs * 32, npad, dtype=torch.float32)
        for run in range(planes.n_runs):
            word0, info = runs[i, run].tolist()
            bits, g = info & 15, info >> 4
            codes = _plane_codes(words[word0 : word0 + bits], bits)
            qs = (qs_words[g * s_words + torch.arange(npad) // 8] >> (torch.arange(npad) % 8 * 4)) & 15
            scale = ((qs + 1).square().float() * planes.smax.cpu()[m_off + g].float()).half().float()
            stored[run * 32 : run * 32 + 32] = ((codes - (1 << (bits - 1))).float() * scale).half().float()
        perm = planes.perm.cpu()[i * k : (i + 1) * k].long()
        w = torch.empty(npad, k)
        w[:, perm] = stored[:k].t()
        out.append(w[:cols])
    return torch.cat(out)


def bits_per_weight(planes: EXL2Planes) -> float:
    """Bytes on the GPU per weight of the layer, in bits (its padding columns included)."""
    return planes.nbytes() * 8 / (planes.n * planes.k) if planes.n else math.nan
