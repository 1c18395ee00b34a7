"""The batched multi-LoRA kernels (paphos/lora/kernels): the token -> slot mapping, the torch
reference and the Triton shrink / expand.

- `build_mapping` groups token rows by slot in batch order, pads to the capacity, cuts each
  slot's tokens into the kernels' tiles (16 rows for decode capacities, 64 above) and refuses
  tokens in empty slots or outside the slots; `LoRAMapping.write` reuses its buffers.
- The reference equals a naive per-token formula in float64 (tolerance 1e-5 of the largest
  value: float32 sums against float64 ones).
- The Triton kernels under the interpreter (TRITON_INTERPRET=1, tiny shapes) equal the
  reference: T up to 70 (decode tiles of 16 tokens, prefill tiles of 64), K 32-96, O 40-96,
  1-4 slots, R 8 / 16 / 32 with 1, 2 and 3 slices, tokens without adapter, an empty slot, a
  loaded slot without tokens, ranks below R (shrink tiles of only padded rows, expand rank chunks
  skipped), fp32 and bf16, x with a row stride, split-K with 2 and 3 slices, expand tiles across
  slice boundaries, a slot with more tokens than one tile. The
  interpreter multiplies in float32 (the kernels' `F32` / ieee branches), so only the
  summation order differs: h and fp32 y within 1e-5 of the largest value, bf16 y within one
  bf16 unit in the last place (2^-7 relative) plus 1e-5 of the largest value. Rows of tokens without an adapter stay bit-exact
  (h: untouched NaN), the split-K counters end at zero, and a mapping rewritten into the same
  buffers (as before a CUDA-graph replay) is honoured by the same launch.
- The kernels compile for sm_90 with the installed triton and the H200 image's (3.6): no
  register spills, tensor-core MMAs, programmatic dependent launch, split-K atomics.
What the GPU computes and how fast: benchmarks/lora_kernels.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from paphos.lora.kernels import LoRAMapping, build_mapping, expand_ref, shrink_ref
from paphos.lora.kernels.mapping import tile_rows
from paphos.quant.kernels import split_k
from tests.device_triton import TRITON_IDS, TRITONS, check_compiles_in_child, compile_sm90, run_compiles
from tests.triton_interpreted import interpreted

_MODULES = ("paphos.layers.pdl", "paphos.quant.kernels.split_k", "paphos.lora.kernels.triton_sgmv")


@pytest.fixture(scope="module")
def ts() -> Iterator[object]:
    with interpreted(_MODULES, "_shrink_kernel") as module:
        yield module


# ---------------------------------------------------------------------------- mapping


def test_build_mapping_groups_tokens_by_slot() -> None:
    host = build_mapping(np.array([2, -1, 0, 2, 0, -1, 3]), [16, 8, 4, 5], 4, 10)
    assert host.sorted_token_ids.dtype == np.int32 and host.slot_starts.dtype == np.int32
    assert host.sorted_token_ids.tolist() == [2, 4, 0, 3, 6, 0, 0, 0, 0, 0]  # batch order within a slot
    assert host.slot_starts.tolist() == [0, 2, 2, 4, 5]
    assert host.slot_ranks.tolist() == [16, 8, 4, 5]
    # tiles of 16 rows: one per slot with tokens, in slot order; slot 1 (no tokens) has none
    assert host.tile_meta.tolist() == [[0, 16], [2, 4], [3, 5], [0, 0], [0, 0]]
    assert host.tile_ids.shape == (5, 16)
    assert host.tile_ids[:3, :3].tolist() == [[2, 4, -1], [0, 3, -1], [6, -1, -1]]
    assert (host.tile_ids[3:] == -1).all()
    empty = build_mapping(np.full(3, -1), [4], 1, 3)
    assert empty.slot_starts.tolist() == [0, 0] and empty.sorted_token_ids.tolist() == [0, 0, 0]
    assert not empty.tile_meta[:, 1].any() and (empty.tile_ids == -1).all()


def test_build_mapping_tiles_of_prefill_chunks() -> None:
    """Above 64 tokens of capacity tiles hold 64 rows: slot 1's 100 tokens take two, the second
    partial; a slot of rank 0 gets no tile."""
    slots = np.array([1] * 100 + [0] * 30 + [-1] * 10)
    host = build_mapping(slots, [8, 16, 0], 3, 160)
    assert host.tile_ids.shape == (-(-160 // 64) + 3, 64)
    assert host.tile_meta[:3].tolist() == [[0, 8], [1, 16], [1, 16]] and not host.tile_meta[3:, 1].any()
    assert host.tile_ids[0, :30].tolist() == list(range(100, 130)) and (host.tile_ids[0, 30:] == -1).all()
    assert host.tile_ids[1].tolist() == list(range(64))
    assert host.tile_ids[2, :36].tolist() == list(range(64, 100)) and (host.tile_ids[2, 36:] == -1).all()


@pytest.mark.parametrize(
    ("slots", "ranks", "capacity", "why"),
    [([0, 1], [4, 0], 4, "empty slots"), ([0, 2], [4, 4], 4, "outside"), ([0, -2], [4, 4], 4, "outside"),
     ([0, 0, 0], [4, 4], 2, "capacity"), ([0], [4], 4, "2 slots")],
)  # fmt: skip
def test_build_mapping_refuses(slots: list[int], ranks: list[int], capacity: int, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        build_mapping(np.array(slots), ranks, 2, capacity)


def test_mapping_write_reuses_buffers() -> None:
    mapping = LoRAMapping.empty(2, 6, "cpu")
    buffers = ("sorted_token_ids", "slot_starts", "slot_ranks", "tile_meta", "tile_ids")
    pointers = [getattr(mapping, name).data_ptr() for name in buffers]
    mapping.write(build_mapping(np.array([1, 0, 1]), [4, 8], 2, 6))
    assert [getattr(mapping, name).data_ptr() for name in buffers] == pointers
    assert mapping.tile_meta[:2].tolist() == [[0, 4], [1, 8]] and mapping.tile_ids[1, :3].tolist() == [0, 2, -1]
    assert mapping.sorted_token_ids.tolist() == [1, 0, 2, 0, 0, 0] and mapping.slot_starts_host == [0, 1, 3]
    assert mapping.slot_ranks.tolist() == [4, 8]
    with pytest.raises(ValueError, match="buffers for 2 x 6"):
        mapping.write(build_mapping(np.array([1, 0, 1]), [4, 8], 2, 7))


# ---------------------------------------------------------------------------- layers


@dataclass(frozen=True)
class Case:
    tokens: tuple[int, ...]  # slot per token row, -1: none
    capacity: int
    k: int
    slices: tuple[int, ...]  # output column offsets
    r: int  # padded rank
    ranks: tuple[int, ...]  # per slot, 0: empty
    dtype: torch.dtype
    strided_x: bool
    shrink_cfg: tuple[int, ...] | None = None  # ShrinkConfig fields, else shrink_config's
    expand_cfg: tuple[int, ...] | None = None


def _cycle(pattern: tuple[int, ...], t: int) -> tuple[int, ...]:
    return tuple(pattern[i % len(pattern)] for i in range(t))


CASES = {
    # decode tiles, q|k|v-like slices, an empty slot, ranks below R, K not a multiple of BK
    "3-slices-fp32-strided": Case(_cycle((0, 2, 3, -1, 2), 37), 40, 96, (0, 32, 48, 80), 16, (16, 0, 8, 13),
                                  torch.float32, True),
    # K split in 3 (two K steps each); expand blocks of 32 columns straddling slice ends 48, two
    # per program (the second program's second block wholly past O)
    "3-slices-split-k": Case(_cycle((3, -1, 0, 2), 21), 24, 96, (0, 32, 48, 80), 16, (16, 0, 8, 13),
                             torch.float32, False, (16, 16, 3), (32, 16, 4, 2, 2)),
    # one slot of rank R = 8 (< the 16-wide tiles: masked along the rank), bf16
    "1-slice-bf16-r8": Case((0, 0, -1, 0, 0), 8, 64, (0, 64), 8, (8,), torch.bfloat16, True),
    # gate|up-like, slot 0 with 20 tokens (two tiles), a slot with a rank and no tokens, split 2;
    # rank 5 of R = 32: shrink tiles of only padded rows (zeros written, A not read), expand's
    # second rank chunk skipped; 64-column expand tiles across the slice end at 48
    "2-slices-bf16": Case((0,) * 12 + _cycle((1, 0, -1), 18), 32, 32, (0, 48, 96), 32, (32, 5, 7),
                          torch.bfloat16, False, (16, 16, 2), (64, 16)),
    # prefill tiles (capacity > 64: 64 tokens per tile), rank 8 of R = 16
    "prefill-fp32": Case(_cycle((0, 1, -1, 1), 70), 80, 48, (0, 40), 16, (16, 8), torch.float32, True),
}


def _layer(case: Case, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, K] (a view with row stride K + 8 if strided_x), a [S, N, K], b [S, O, R] zero past
    each slot's rank, y [T, O]."""
    gen = torch.Generator().manual_seed(seed)
    ns, s, t = len(case.slices) - 1, len(case.ranks), len(case.tokens)
    o = case.slices[-1]
    a = torch.zeros(s, ns * case.r, case.k)
    b = torch.zeros(s, o, case.r)
    for slot, rank in enumerate(case.ranks):
        for j in range(ns):
            a[slot, j * case.r : j * case.r + rank] = torch.randn(rank, case.k, generator=gen) / case.k**0.5
        b[slot, :, :rank] = torch.randn(o, rank, generator=gen)
    x = torch.randn(t, case.k + (8 if case.strided_x else 0), generator=gen)[:, : case.k]
    y = torch.randn(t, o, generator=gen)
    return x.to(case.dtype), a.to(case.dtype), b.to(case.dtype), y.to(case.dtype)


def _mapping(case: Case) -> LoRAMapping:
    return LoRAMapping.from_host(
        build_mapping(np.array(case.tokens), list(case.ranks), len(case.ranks), case.capacity), "cpu"
    )


def _naive(case: Case, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
           y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Token by token in float64: h[t] = a[s] x[t], y[t, c] += sum_{k < rank} h[t, j(c) R + k] b[s, c, k]."""
    h = torch.zeros(len(case.tokens), a.shape[1], dtype=torch.float64)
    out = y.double().clone()
    j = torch.bucketize(torch.arange(out.shape[1]), torch.tensor(case.slices[1:-1]), right=True)
    for t, s in enumerate(case.tokens):
        if s < 0:
            continue
        h[t] = a[s].double() @ x[t].double()
        k = torch.arange(case.ranks[s])
        out[t] += (h[t, j[:, None] * case.r + k[None, :]] * b[s, :, : case.ranks[s]].double()).sum(1)
    return h, out


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_naive_formula(name: str) -> None:
    case = CASES[name]
    x, a, b, y = _layer(case, 1)
    mapping = _mapping(case)
    h = torch.full((case.capacity, a.shape[1]), float("nan"))
    shrink_ref(x, a, mapping, h)
    out = y.clone()
    expand_ref(h, b, case.slices, mapping, out)
    h_naive, y_naive = _naive(case, x, a, b, y)
    used = torch.tensor(case.tokens) >= 0
    assert _rel(h[: len(case.tokens)][used], h_naive[used]) < 1e-5
    assert h[: len(case.tokens)][~used].isnan().all()
    if case.dtype == torch.float32:
        assert _rel(out, y_naive) < 1e-5
    else:  # one rounding to bf16 of a float32 sum
        assert ((out.double() - y_naive).abs() <= y_naive.abs() * 2**-8 + 1e-5 * y_naive.abs().max()).all()


@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_reference(ts, name: str) -> None:  # noqa: ANN001
    case = CASES[name]
    x, a, b, y = _layer(case, 2)
    mapping = _mapping(case)
    ns, used = len(case.slices) - 1, torch.tensor(case.tokens) >= 0
    shrink_cfg = ts.ShrinkConfig(*case.shrink_cfg) if case.shrink_cfg else None
    expand_cfg = ts.ExpandConfig(*case.expand_cfg) if case.expand_cfg else None
    counters = split_k.counters(torch.device("cpu"), "lora")
    for seed in (3, 4):  # the second mapping is written into the first one's buffers
        h_ref = torch.full((case.capacity, a.shape[1]), float("nan"))
        shrink_ref(x, a, mapping, h_ref)
        h = torch.full_like(h_ref, float("nan"))
        ts.lora_shrink(x, a, mapping, h, n_slices=ns, cfg=shrink_cfg)
        assert torch.equal(h.isnan(), h_ref.isnan())  # rows of tokens without an adapter untouched
        assert _rel(h.nan_to_num(), h_ref.nan_to_num()) < 1e-5
        assert not counters.any()  # every split tile's counter is back to zero
        y_ref, got = y.clone(), y.clone()
        expand_ref(h_ref, b, case.slices, mapping, y_ref)
        ts.lora_expand(h_ref, b, case.slices, mapping, got, cfg=expand_cfg)
        assert torch.equal(got[~used], y[~used])
        if case.dtype == torch.float32:
            assert _rel(got, y_ref) < 1e-5
        else:
            tol = y_ref.double().abs() * 2**-7 + 1e-5 * y_ref.double().abs().max()
            assert ((got.double() - y_ref.double()).abs() <= tol).all()
        gen = np.random.default_rng(seed)
        tokens = np.where(gen.random(len(case.tokens)) < 0.2, -1, np.array(case.tokens))
        mapping.write(build_mapping(tokens, list(case.ranks), len(case.ranks), case.capacity))
        used = torch.from_numpy(tokens >= 0)


def test_launch_checks(ts) -> None:  # noqa: ANN001
    case = CASES["1-slice-bf16-r8"]
    x, a, b, y = _layer(case, 5)
    mapping = _mapping(case)
    with pytest.raises(ValueError, match="rows for a mapping of capacity 8"):
        ts.lora_shrink(x, a, mapping, torch.zeros(4, 8), n_slices=1)
    with pytest.raises(ValueError, match="slices"):
        ts.lora_expand(torch.zeros(8, 8), b, (0, 32), mapping, y)
    assert not ts.supports(torch.device("cpu"))


def test_configs_follow_the_shape() -> None:
    from paphos.lora.kernels import triton_sgmv

    decode = triton_sgmv.shrink_config(1, 16, 48, 4096)  # one token: K split as far as it goes
    assert (decode.block_n, decode.split_k) == (16, triton_sgmv.MAX_SPLIT_K)
    many = triton_sgmv.shrink_config(64, 16, 192, 4096)  # decode splits finely even with 16 slots
    assert many.split_k == triton_sgmv.MAX_SPLIT_K
    prefill = triton_sgmv.shrink_config(512, 1, 192, 4096)
    assert (prefill.block_n, prefill.block_k) == (64, 64) and prefill.split_k > 1
    busy = triton_sgmv.shrink_config(8192, 16, 192, 4096)  # prefill tiles fill the SMs: no split
    assert busy.split_k == 1
    assert triton_sgmv.expand_config(16, 4096, 64) == triton_sgmv.ExpandConfig(128, 32, num_warps=8)
    assert triton_sgmv.expand_config(16, 28672, 64) == triton_sgmv.ExpandConfig(128, 32, num_warps=8, col_blocks=2)
    assert triton_sgmv.expand_config(512, 4096, 16) == triton_sgmv.ExpandConfig(64, 16)


# ---------------------------------------------------------------------------- sm_90 compiles


@pytest.mark.parametrize("triton_path", TRITONS, ids=TRITON_IDS)
def test_lora_kernels_compile_for_sm90(triton_path: Path | None) -> None:
    check_compiles_in_child("tests.lora.kernels.test_sgmv", COMPILES, triton_path)


_MAPPING_ARGS = {"meta_ptr": "*i32", "ids_ptr": "*i32"}


def _shrink(t_cap: int, slots: int, n: int, k: int) -> None:
    """The launch `shrink_config` picks, bf16 x and A of a Llama-3-8B projection."""
    from paphos.lora.kernels import triton_sgmv as ts

    cfg = ts.shrink_config(t_cap, slots, n, k)
    ints = dict(N=n, K=k, R=64, stride_x=k, stride_h=n, iters_per_split=k // cfg.block_k // cfg.split_k,
                plane=t_cap * n)  # fmt: skip
    args = {"x_ptr": "*bf16", "a_ptr": "*bf16", "h_ptr": "*fp32", "part_ptr": "*fp32", "count_ptr": "*i32",
            **_MAPPING_ARGS, **{name: "i32" for name in ints}}  # fmt: skip
    constexprs = dict(BM=tile_rows(t_cap), BN=cfg.block_n, BK=cfg.block_k, SPLIT=cfg.split_k,
                      EVEN_K=True, F32=False, ASM=True, PDL=True)  # fmt: skip
    ptx = compile_sm90(ts._shrink_kernel, args, constexprs, cfg.num_warps, ints, cfg.num_stages)
    assert "mma" in ptx and "bf16" in ptx and "griddepcontrol.wait" in ptx and "STACK:0 " in ptx, ptx[-300:]
    if cfg.split_k > 1:
        assert "fence.acq_rel.gpu" in ptx and "atom.global" in ptx


def _expand(t_cap: int, slices: tuple[int, ...], r: int) -> None:
    """The launch `expand_config` picks, bf16 B and y of a Llama-3-8B projection."""
    from paphos.lora.kernels import triton_sgmv as ts

    cfg = ts.expand_config(t_cap, slices[-1], r)
    ints = dict(N_OUT=slices[-1], R=r, stride_h=r * (len(slices) - 1), stride_y=slices[-1])
    args = {"h_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16", **_MAPPING_ARGS, **{name: "i32" for name in ints}}
    constexprs = dict(SLICES=slices, BM=tile_rows(t_cap), BN=cfg.block_n, BK=cfg.block_k, COL_BLOCKS=cfg.col_blocks,
                      EVEN_R=r % cfg.block_k == 0,
                      PRECISION="tf32", PDL=True)  # fmt: skip
    ptx = compile_sm90(ts._expand_kernel, args, constexprs, cfg.num_warps, ints, cfg.num_stages)
    assert "mma" in ptx and "tf32" in ptx and "griddepcontrol.wait" in ptx and "STACK:0 " in ptx, ptx[-300:]


COMPILES = {
    "shrink-qkv-1-token": (_shrink, 1, 4, 192, 4096),
    "shrink-down-64-tokens": (_shrink, 64, 16, 64, 14336),
    "shrink-qkv-prefill": (_shrink, 512, 4, 192, 4096),
    "expand-qkv-1-token": (_expand, 1, (0, 4096, 5120, 6144), 16),
    "expand-gate-up-64-tokens": (_expand, 64, (0, 14336, 28672), 64),
    "expand-o-prefill": (_expand, 512, (0, 4096), 64),
}


if __name__ == "__main__":
    run_compiles(COMPILES)
