"""EXL2's Triton kernels (paphos/quant/kernels/triton_exl2.py) against exl2.dequantize, the oracle
that equals exllamav2's own reconstruction bit for bit.

The planes they read are tested in test_exl2_layout.py.
- The kernels under the interpreter (TRITON_INTERPRET=1, tiny shapes): the dequantize kernel
  bit-exact (float32 out; a column window as the scratch buffer's chunks use); the GEMV within
  1e-5 of max|ref| (float32 products of the same fp16 weights, only the summation order differs)
  at 1 and 3 tokens, one and several K slices; `matmul` in bf16 (GEMV and dequantize + matmul in
  small scratch chunks) within 1e-2; the linear method on the kernels' path ("Using EXL2 kernels
  for 1 layers").
- The kernels compile for sm_90 with the installed triton and the H200 image's (tests/device_triton.py):
  no spills, the GEMV waits for its predecessor (PDL) and sums split-K partials with a fence.
  What the GPU computes on Llama-3-8B shapes and the tool-made fixtures is checked by
  benchmarks/bench_quant_gpu.py (`exl2_kernels`, `fixtures`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import paphos.quant.kernels.triton_exl2  # noqa: F401 - imported compiled first, so `interpreted` reloads it
from paphos.layers.linear import Linear, QKVLinear
from paphos.quant.exl2 import EXL2Config, EXL2LinearMethod
from paphos.quant.kernels import exl2_layout
from tests.device_triton import TRITON_IDS, TRITONS, check_compiles_in_child, compile_sm90, run_compiles
from tests.quant.test_exl2 import QC, random_encoded
from tests.quant.test_exl2_layout import _layer, _shard
from tests.triton_interpreted import interpreted

_MODULES = ("paphos.layers.pdl", "paphos.quant.kernels.split_k", "paphos.quant.kernels.triton_exl2")


@pytest.fixture(scope="module")
def te() -> Iterator[object]:
    with interpreted(_MODULES, "_gemv_kernel") as module:
        yield module


@pytest.mark.parametrize("k", [200, 256])
def test_dequantize_kernel_is_exact(te, k: int) -> None:  # noqa: ANN001
    """W^T in input order, every shard's own permutation undone; a column window lands at
    column 0 of its buffer."""
    shards, weight = _layer(k, 10 + k)
    planes = exl2_layout.pack([_shard(enc, cols) for enc, cols in shards], block_n=32)
    out = torch.full((k, planes.n), float("nan"))
    te.dequantize_into(planes, 0, planes.n, out)
    assert torch.equal(out, weight.t())
    part = torch.full((k, 50), float("nan"))  # columns 70..119: across the second and third shards
    te.dequantize_into(planes, 70, 120, part)
    assert torch.equal(part, weight.t()[:, 70:120])


@pytest.mark.parametrize("k", [200, 256])
def test_gemv_matches_reference(te, k: int) -> None:  # noqa: ANN001
    """1 and 3 tokens, one K slice and several (added into the zeroed plane, which the last program
    of a tile reads and leaves at zero for the next launch)."""
    from paphos.quant.kernels import split_k

    shards, weight = _layer(k, 20 + k)
    planes = exl2_layout.pack([_shard(enc, cols) for enc, cols in shards], block_n=32)
    gen = torch.Generator().manual_seed(k)
    counters = split_k.counters(torch.device("cpu"))
    for m, split in ((1, 1), (1, 3), (3, 2)):
        x = torch.randn(m, k, generator=gen)
        ref = x.double() @ weight.double().t()
        got = te.gemv(x, planes, split=split)
        assert got.shape == (m, 136) and got.dtype == torch.float32
        # x to ~15 bits and the weights unrounded (within 2**-12 of their fp16 values): 1.5-3e-4
        assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-3, (m, split)
        assert not counters.any()
        assert not split_k.zeros(torch.device("cpu"), m * 136).any()


def test_matmul_in_bf16(te, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """The GEMV up to GEMV_MAX_TOKENS, dequantize + matmul above, in scratch chunks of 48 columns."""
    from paphos.quant.gguf import triton_gguf

    shards, weight = _layer(96, 30)
    planes = exl2_layout.pack([_shard(enc, cols) for enc, cols in shards], block_n=32)
    monkeypatch.setattr(te, "GEMV_MAX_TOKENS", 2)
    monkeypatch.setattr(triton_gguf, "_SCRATCH", {})
    monkeypatch.setattr(triton_gguf, "SCRATCH_ELEMS", 48 * 96)
    gen = torch.Generator().manual_seed(31)
    for m in (1, 5):
        x = torch.randn(m, 96, generator=gen).to(torch.bfloat16)
        got = te.matmul(x, planes)
        assert got.dtype == torch.bfloat16 and got.shape == (m, 136)
        ref = x.double() @ weight.double().t()
        assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < 1e-2, m


def test_linear_method_runs_the_kernels(te, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A q|k|v layer whose shards differ in widths, groups and permutations: one set of planes,
    the checkpoint tensors freed, the output of the dense weights, the log line users look for."""
    monkeypatch.setattr(EXL2LinearMethod, "_kernel_problem", lambda self, shards, device: None)
    gen = torch.Generator().manual_seed(40)
    config = EXL2Config.from_quant_config(QC)
    layer = QKVLinear(64, 16, 4, 2, params_dtype=torch.float32,
                      quant_method=config.get_linear_method("model.layers.0.self_attn.qkv_proj"))  # fmt: skip
    shards = {"q": random_encoded(64, 64, gen, (8, 5)), "k": random_encoded(32, 64, gen, (3,)),
              "v": random_encoded(32, 64, gen, (6, 4, 2))}  # fmt: skip
    for shard, enc in shards.items():
        for name, tensor in enc.tensors.items():
            getattr(layer, name).weight_loader(getattr(layer, name), tensor, shard)
    layer.quant_method.process_weights_after_loading(layer)
    assert not hasattr(layer, "q_weight") and not hasattr(layer, "dense_weight")
    assert layer.exl2_words.numel() == sum(enc.tensors["q_weight"].numel() for enc in shards.values())
    weight = torch.cat([shards[s].weight for s in "qkv"])
    x = torch.randn(2, 3, 64, generator=gen)
    got = layer(x)
    assert got.shape == (2, 3, 128)
    ref = x @ weight.t()
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-3  # the GEMV's numerics (test above)
    assert config.summary() == ["Using EXL2 kernels for 1 layers"]


def test_kernels_failing_their_self_check_leave_the_layer_dense(te, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Kernels that disagree with the decoded weight at start-up (a GPU they misbehave on) cost
    speed, not tokens: the layer keeps its dense weight and the log says why."""
    from paphos.quant import exl2

    monkeypatch.setattr(EXL2LinearMethod, "_kernel_problem", lambda self, shards, device: None)
    monkeypatch.setattr(exl2, "_VERIFIED", {})
    monkeypatch.setattr(te, "matmul", lambda x, planes: torch.zeros(x.shape[0], planes.n, dtype=x.dtype))
    gen = torch.Generator().manual_seed(41)
    config = EXL2Config.from_quant_config(QC)
    layer = Linear(64, 32, params_dtype=torch.float32, quant_method=config.get_linear_method("model.layers.0.mlp.down_proj"))
    enc = random_encoded(32, 64, gen, (4,))
    for name, tensor in enc.tensors.items():
        getattr(layer, name).weight_loader(getattr(layer, name), tensor)
    layer.quant_method.process_weights_after_loading(layer)
    assert torch.equal(layer.dense_weight, enc.weight) and not hasattr(layer, "exl2_words")
    x = torch.randn(3, 64, generator=gen)
    torch.testing.assert_close(layer(x), x @ enc.weight.t(), rtol=0, atol=1e-5)
    assert "self-check" in config.summary()[0]


# ---------------------------------------------------------------------------- sm_90 compiles


@pytest.mark.parametrize("triton_path", TRITONS, ids=TRITON_IDS)
def test_exl2_kernels_compile_for_sm90(triton_path: Path | None) -> None:
    check_compiles_in_child("tests.quant.test_exl2_kernels", CASES, triton_path)


_TABLES = {"w_ptr": "*i32", "s_ptr": "*i32", "m_ptr": "*fp16", "run_ptr": "*i32"}


def _gemv(mp: int, split: bool) -> None:
    """A Llama-3-8B o_proj's launch (4096 x 4096)."""
    from paphos.quant.kernels import triton_exl2 as te

    args = {"xq_ptr": "*i32", "xf_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32", **_TABLES,
            "meta_ptr": "*i32", "tile_ptr": "*i32"}  # fmt: skip
    ints = dict(M=mp, N=4096, n_runs=128, runs_per_split=4)
    args |= {name: "i32" for name in ints}
    # a 4.0 bpw layer: runs of 3, 4 and 5 bits
    constexprs = dict(BN=256, MP=mp, MAXBITS=5, SPLIT=split, ATOMIC=split, AHEAD=mp <= te.AHEAD_MAX_TOKENS,
                      ALIGNED=True, ASM=True, PDL=True)  # fmt: skip
    ptx = compile_sm90(te._gemv_kernel, args, constexprs, te.gemv_warps(256, mp), ints)
    assert "griddepcontrol.wait" in ptx and "STACK:0 " in ptx, ptx[-300:]
    assert "dp4a.s32.s32" in ptx  # the integer dots
    assert "ld.global.v4.b32" in ptx or "ld.global.v2.b32" in ptx  # a thread's columns in one access
    if split:
        assert "fence.acq_rel.gpu" in ptx and "atom.global" in ptx
        assert re.search(r"(red|atom)\.global\.\S*add(\.v[24])?\.f32", ptx)  # the partials added, not stored


def _dequant(dtype: str) -> None:
    from paphos.quant.kernels import triton_exl2 as te

    args = {"out_ptr": dtype, **_TABLES, "perm_ptr": "*i32", "meta_ptr": "*i32", "tile_ptr": "*i32"}
    ints = dict(K=4096, n_runs=128, col_a=0, col_b=4096, stride_o=4096)
    args |= {name: "i32" for name in ints}
    assert "STACK:0 " in compile_sm90(te._dequant_kernel, args, dict(BN=256, EVEN_K=True, ALIGNED=True), 4, ints)


def _quantize() -> None:
    from paphos.quant.kernels import triton_exl2 as te

    ints = dict(M=1, K=4096, n_runs=128, total_runs=3 * 128, stride_xm=4096)
    args = {"x_ptr": "*bf16", "perm_ptr": "*i32", "xq_ptr": "*i32", "xf_ptr": "*fp32", **{name: "i32" for name in ints}}
    ptx = compile_sm90(te._quantize_kernel, args, dict(MP=1, RB=te.QUANTIZE_RUNS, PDL=True), 1, ints)
    assert "griddepcontrol.wait" in ptx and "STACK:0 " in ptx


CASES = {
    "gemv-1-token-split": (_gemv, 1, True),
    "gemv-2-tokens": (_gemv, 2, False),
    "gemv-4-tokens-split": (_gemv, 4, True),
    "gemv-16-tokens-split": (_gemv, 16, True),
    "dequant-bf16": (_dequant, "*bf16"),
    "quantize": (_quantize,),
}


if __name__ == "__main__":
    run_compiles(CASES)
