"""EXL2's layout on the GPU (paphos/quant/kernels/exl2_layout.py) against exl2.dequantize, the
oracle that equals exllamav2's own reconstruction bit for bit: `pack` keeps the checkpoint's
bytes and `reference_weight` (the torch reading of the planes) equals `dequantize` exactly, for
every bit width 2..8 the kernels take, mixed 32/64/128-row groups, K not a multiple of 32 (a
short last run), padded output columns, merged shards with their own groups and permutations;
`unsupported` names what the kernels cannot take. The kernels: test_exl2_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from paphos.quant.exl2 import dequantize, parse_groups
from paphos.quant.kernels import exl2_layout
from tests.quant.test_exl2 import Encoded, quantize, random_encoded


def _shard(enc: Encoded, columns: int) -> exl2_layout.Shard:
    t = enc.tensors
    groups = parse_groups(t["q_groups"], t["q_weight"].shape[0], t["q_invperm"].numel())
    return exl2_layout.Shard(t["q_weight"], t["q_scale"], t["q_scale_max"], t["q_invperm"],
                    [(g.bits, g.words.start, g.rows.start) for g in groups], columns)  # fmt: skip


def _layer(k: int, seed: int) -> tuple[list[tuple[Encoded, int]], torch.Tensor]:
    """A merged layer of three shards over K inputs: 8/6/5/4/3/2-bit groups, 3-bit only, and a
    40-column shard padded to 64 columns (as the converter writes it) in 5/4/2 bits."""
    gen = torch.Generator().manual_seed(seed)
    shards = [
        (random_encoded(64, k, gen, (8, 6, 5, 4, 3, 2)), 64),
        (random_encoded(32, k, gen, (3,)), 32),
        (quantize(torch.randn(40, k, generator=gen), gen, (5, 4, 2)), 40),
    ]
    weight = torch.cat([dequantize(**enc.tensors)[:cols] for enc, cols in shards])
    return shards, weight


@pytest.mark.parametrize("k", [200, 256])
def test_pack_keeps_the_bytes_and_the_values(k: int) -> None:
    shards, weight = _layer(k, k)
    planes = exl2_layout.pack([_shard(enc, cols) for enc, cols in shards], block_n=32)
    assert planes.n == 136 and planes.k == k
    assert torch.equal(exl2_layout.reference_weight(planes), weight)
    checkpoint = sum(t.numel() * t.element_size() for enc, _ in shards for t in enc.tensors.values())
    runs = -(-k // 32)
    # the run table (8 bytes per 32 inputs) replaces q_groups; a short last run is padded to
    # `bits` words; everything else keeps its bytes
    q_groups = sum(enc.tensors["q_groups"].numel() * 2 for enc, _ in shards)
    padding = 0
    for (enc, _), shard_runs in zip(shards, planes.runs.tolist(), strict=True):
        bits = shard_runs[-1][1] & 15
        padding += (bits - -(-(k % 32 or 32) * bits // 32)) * enc.tensors["q_weight"].shape[1] * 4
    assert (padding > 0) == (k % 32 != 0)
    expected = checkpoint - q_groups + padding + 3 * runs * 8 + 3 * 8 * 4 + planes.tiles.numel() * 4
    assert planes.nbytes() == expected


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_every_bit_width_reads_back(bits: int) -> None:
    enc = random_encoded(32, 96, torch.Generator().manual_seed(bits), (bits,))
    planes = exl2_layout.pack([_shard(enc, 32)])
    assert torch.equal(exl2_layout.reference_weight(planes), dequantize(**enc.tensors))


def test_unsupported_layouts_are_named() -> None:
    assert exl2_layout.unsupported([[(4, 0, 0), (3, 16, 128)]], 160) is None
    assert "7-bit groups" in exl2_layout.unsupported([[(7, 0, 0)]], 64)
    assert "a group of 16 rows at row 0" in exl2_layout.unsupported([[(8, 0, 0), (4, 4, 16)]], 48)
