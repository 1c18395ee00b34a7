"""The Triton GGUF kernels (paphos/quant/gguf/triton_gguf.py) under the Triton interpreter, against
the torch reference (dequant.py, bit-exact vs gguf, then a float32 matmul): the repacked planes
dequantize exactly, and the fused / dequantize+GEMM paths are within 1e-2 relative for M = 1,
a few tokens, and more than FUSED_MAX_TOKENS, odd N, split-K, and merged shards of mixed types.

TRITON_INTERPRET is read when a kernel is decorated, so the module is (re)imported interpreted
here, also on a GPU machine, and re-imported compiled afterwards (as tests/attention/triton does).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch import nn

from paphos.layers import x_int8, x_int8_outputs
from paphos.quant.gguf import launch, planes
from paphos.quant.gguf.dequant import dequantize
from paphos.quant.gguf.kernels import GGUFShard
from tests.quant import ptx_sim
from tests.quant.gguf_blocks import random_blocks, weight_scale
from tests.triton_interpreted import interpreted

_MODULE = "paphos.quant.gguf.triton_gguf"
_Q6_K = "paphos.quant.gguf.q6_k_tile"
_GEMV = "paphos.quant.gguf.triton_gemv"
_KERNEL_MODULES = ("paphos.layers.pdl", "paphos.layers.x_int8", _GEMV, "paphos.quant.kernels.split_k",
                   "paphos.layers.x_int8_blocks", "paphos.quant.kernels.x_blocks", "paphos.quant.kernels.triton_int_i8", "paphos.quant.gguf.triton_gguf_i8", _Q6_K)  # fmt: skip


GGUF_KERNEL_MODULES = (*_KERNEL_MODULES, _MODULE)


@pytest.fixture(scope="module")
def tg() -> Iterator[object]:
    with interpreted(GGUF_KERNEL_MODULES, "_fused_kernel") as module:
        yield module


PRIORITY = ("Q4_K", "Q6_K", "Q8_0")
OTHERS = ("Q5_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS")
K = 512
N = 37  # odd: masked rows


def _raw(type_name: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(random_blocks(type_name, rows, cols, rng, weight_scale(type_name)))


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("type_name", PRIORITY + OTHERS)
def test_repacked_planes_dequantize_exactly(tg, type_name: str) -> None:  # noqa: ANN001
    raw = _raw(type_name, N, K, 1)
    repacked = planes.repack(raw, type_name)
    seg = tg.Segment(type_name, 0, N, K, repacked)
    size = sum(t.numel() * t.element_size() for t in repacked.values())
    assert size <= raw.numel() * 1.05  # repacking keeps memory within 5% of the file's bytes
    out = torch.full((N, K), float("nan"))
    tg.dequant_into(seg, 0, N, out)
    assert torch.equal(out, dequantize(raw, type_name))
    # A row range (the chunked prefill path) lands at the top of its destination.
    part = torch.full((9, K), float("nan"))
    tg.dequant_into(seg, 20, 29, part)
    assert torch.equal(part, dequantize(raw[20:29], type_name))


def test_planes_tile_rows_where_k_and_rows_allow() -> None:
    """Every plane in tiles of ROW_TILE rows x 256 values where K % 256 == 0 and rows % 4 == 0
    (planes.py), row-major otherwise; the tiles hold the row-major planes' elements."""
    raw = _raw("Q4_K", 8, K, 1)
    tiled, flat = planes.repack(raw, "Q4_K"), planes.repack(raw, "Q4_K", tile=False)
    for name, t in flat.items():
        per = t.shape[1] * 256 // K  # a row's elements in one tile (256 values: a super-block)
        tiles = tiled[name].reshape(2, K // 256, planes.ROW_TILE, per)
        assert torch.equal(tiles.transpose(1, 2).reshape(t.shape), t), name
    assert planes.row_tile("Q4_K", 37, K) == 1 and planes.row_tile("Q4_K", 40, K) == 4
    assert planes.row_tile("Q4_K", 40, K + 128) == 1 and planes.row_tile("Q8_0", 40, K + 128) == 4
    odd = planes.repack(_raw("Q8_0", 8, K + 32, 1), "Q8_0")
    assert torch.equal(odd["lo"], planes.repack(_raw("Q8_0", 8, K + 32, 1), "Q8_0", tile=False)["lo"])


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "Q5_K", "Q4_0", "Q3_K"])
def test_every_kernel_reads_tiled_planes(tg, type_name: str) -> None:  # noqa: ANN001
    """40 rows, K = 512: the planes are tiled (the other tests' 37 rows are not): dequantize and
    row gathers exact, the GEMV, the fused kernel and (Q4_K, Q5_K, Q8_0) the int8 kernel against
    the reference."""
    n = 40
    raw = _raw(type_name, n, K, 7)
    seg = tg.Segment(type_name, 0, n, K, planes.repack(raw, type_name))
    assert seg.row_tile == planes.ROW_TILE
    table = dequantize(raw, type_name)
    out = torch.full((n, K), float("nan"))
    tg.dequant_into(seg, 0, n, out)
    assert torch.equal(out, table)
    ids = torch.tensor([39, 0, 5, 22, 5])
    rows = torch.full((5, K), float("nan"))
    tg.gather_rows(seg, ids, rows)
    assert torch.equal(rows, table[ids])
    gen = torch.Generator().manual_seed(3)
    x1 = torch.randn(1, K, generator=gen).to(torch.bfloat16)
    assert _rel(tg.gemv_matmul(x1, [seg], n), planes.reference_matmul(raw, type_name, x1)) < 1e-2
    x = torch.randn(17, K, generator=gen).to(torch.bfloat16)
    ref = planes.reference_matmul(raw, type_name, x)
    assert _rel(tg.fused_matmul(x, [seg], n, [tg.KernelConfig(16, 128, 2, 4, 2, 32)]), ref) < 1e-2
    ti8 = sys.modules["paphos.quant.gguf.triton_gguf_i8"]
    if ti8.supports(type_name, K):
        got = torch.full((17, n), float("nan"))
        ti8.matmul_into(got, ti8.quantize_x(x, type_name), seg, ti8.I8Config(16, 16, 2))
        assert _rel(got, ref) < 1e-4


@pytest.mark.parametrize("type_name", PRIORITY + OTHERS)
def test_fused_kernel_matches_reference(tg, type_name: str) -> None:  # noqa: ANN001
    raw = _raw(type_name, N, K, 2)
    seg = tg.Segment(type_name, 0, N, K, planes.repack(raw, type_name))
    gen = torch.Generator().manual_seed(0)
    tokens = (1, 3, 17) if type_name in PRIORITY else (1, 17)
    for m in tokens:
        x = torch.randn(m, K, generator=gen).to(torch.bfloat16)
        ref = planes.reference_matmul(raw, type_name, x)
        bm = 1 if m == 1 else 16
        configs = [tg.KernelConfig(16, 256, 1, 4, 2, bm), tg.KernelConfig(32, 128, 2, 4, 2, bm)]
        if m > 1 and type_name in PRIORITY:
            configs.append(tg.KernelConfig(16, 64, 4, 4, 2, 32))
        for cfg in configs:
            got = tg.fused_matmul(x, [seg], N, [cfg])
            assert got.dtype == torch.bfloat16 and got.shape == (m, N)
            assert _rel(got, ref) < 1e-2, (type_name, m, cfg)
            # a mixed linear's segment lands in its columns of the linear's output, the others untouched
            wide = torch.full((m, N + 24), float("nan"), dtype=torch.bfloat16)
            assert tg.fused_matmul(x, [seg], N, [cfg], into=wide[:, 8 : 8 + N]).data_ptr() == wide[:, 8:].data_ptr()
            assert torch.equal(wide[:, 8 : 8 + N], got) and wide[:, :8].isnan().all() and wide[:, 8 + N :].isnan().all()


@pytest.mark.parametrize("type_name", PRIORITY + OTHERS)
def test_batch1_gemv_matches_reference(tg, type_name: str) -> None:  # noqa: ANN001
    """The M == 1 path (triton_gemv for linear formats, the fused kernel for the others): odd
    rows, several row blocks and warps, K chunks that do and do not divide K (K = 1280)."""
    k = 1280
    raw = _raw(type_name, N, k, 4)
    seg = tg.Segment(type_name, 0, N, k, planes.repack(raw, type_name))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ref = planes.reference_matmul(raw, type_name, x)
    got = tg.gemv_matmul(x, [seg], N)
    assert got.dtype == torch.bfloat16 and got.shape == (1, N)
    assert _rel(got, ref) < 1e-2
    gemv = sys.modules[_GEMV]
    if not gemv.supports(seg.fmt):
        assert type_name in ("Q3_K", "IQ4_NL", "IQ4_XS")
        return
    exact = x.float() @ dequantize(raw, type_name).t()
    for block_n, warps, chunk in ((1, 1, None), (8, 2, 512), (2, 4, 1024)):
        out = torch.empty(N, dtype=torch.float32)
        gemv.gemv(x[0].float(), seg, out, block_n, warps, chunk, int8_x=False)
        # exact dequantized weights, float32 products and sums: only the summation order differs
        assert _rel(out, exact) < 1e-5, (block_n, warps, chunk)
    if not gemv.integer_dots(seg.fmt):
        assert type_name not in ("Q4_K", "Q6_K", "Q4_0", "Q4_1", "Q8_0")
        return
    # Integer dots: the exact product of the dequantized weights with x in two int8 parts per tile
    # group, x = dx * (q1 + q2 / 254), dx = max|x| / 127, as a numpy reference computes it (float32
    # steps as the kernel takes them: bf16 x lands on exact halves often, so roundings decide ties).
    xt = x.float().reshape(-1, seg.fmt.tile_values).numpy()
    amax = np.abs(xt).max(axis=1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    v = (xt * inv).astype(np.float32)
    q1 = np.round(v)
    q2 = np.round(((v - q1) * np.float32(254)).astype(np.float32))
    xq = (amax * np.float32(1 / 127)) * (q1 + q2 / np.float32(254))
    quantized_x = torch.from_numpy(xq.reshape(1, -1).astype(np.float32)) @ dequantize(raw, type_name).t()
    x_quantized = x_int8.quantize(x[0].float(), gemv.int8_layout(seg.fmt))  # once, as gemv_matmul shares it
    for block_n, warps, rows_per_program in ((1, 1, 3), (4, 2, None), (2, 4, 16)):
        out = torch.empty(N, dtype=torch.float32)
        gemv.gemv(x[0].float(), seg, out, block_n, warps, None, True, rows_per_program)
        assert _rel(out, quantized_x) < 1e-5, (block_n, warps, rows_per_program)
        assert _rel(out, exact) < 1e-4  # 15 bits of x
        shared = torch.empty(N, dtype=torch.float32)
        gemv.gemv(x[0].float(), seg, shared, block_n, warps, None, True, rows_per_program, x_quantized)
        assert torch.equal(shared, out)


def _merged_layer(tg, types: tuple[str, ...], rows: tuple[int, ...]) -> tuple[nn.Module, tuple, torch.Tensor]:  # noqa: ANN001
    raws = [_raw(t, r, K, 10 + i) for i, (t, r) in enumerate(zip(types, rows, strict=True))]
    shards, row, offset = [], 0, 0
    for i, (t, raw) in enumerate(zip(types, raws, strict=True)):
        shards.append(GGUFShard(f"s{i}", t, raw.shape[0], raw.shape[1], row, offset))
        row, offset = row + raw.shape[0], offset + raw.numel()
    layer = nn.Module()
    layer.weight = nn.Parameter(torch.cat([r.reshape(-1) for r in raws]), requires_grad=False)
    w = torch.cat([dequantize(r, t) for r, t in zip(raws, types, strict=True)])
    return layer, tuple(shards), w


def test_merged_shards_of_mixed_types(tg, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    # q|k Q4_K and v Q6_K (a Q4_K_M attention layer), odd-sized tail shard of Q8_0.
    layer, shards, w = _merged_layer(tg, ("Q4_K", "Q4_K", "Q6_K", "Q8_0"), (32, 16, 16, 7))
    kernel = tg.TritonGGUFKernel()
    kernel.prepare(layer, shards, torch.bfloat16)
    assert kernel.fallback is None and [s.type_name for s in kernel.segments] == ["Q4_K", "Q6_K", "Q8_0"]
    assert layer.weight.numel() == 0  # the raw blocks are freed; the planes are buffers
    assert sum(b.numel() * b.element_size() for b in layer.buffers()) <= 1.05 * sum(s.n_bytes for s in shards)
    gen = torch.Generator().manual_seed(3)
    # 1 token: the GEMV; 5: the int8 tensor-core kernel (every type here has it); FUSED_MAX_TOKENS
    # + 3: dequantize + GEMM, then in row chunks.
    for m in (1, 5, tg.FUSED_MAX_TOKENS + 3):
        x = torch.randn(m, K, generator=gen).to(torch.bfloat16)
        ref = x.float() @ w.t()
        assert _rel(kernel.apply(layer, x), ref) < 1e-2, m
    monkeypatch.setattr(tg, "SCRATCH_ELEMS", 20 * K)  # 20-row chunks straddle the segments
    tg._SCRATCH.clear()
    x = torch.randn(tg.FUSED_MAX_TOKENS + 1, K, generator=gen).to(torch.bfloat16)
    assert _rel(kernel.apply(layer, x), x.float() @ w.t()) < 1e-2
    tg._SCRATCH.clear()


def test_batch1_gemv_takes_the_int8_parts_its_producer_attached(tg, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A Q4_K_M attention layer (q|k Q4_K, v Q6_K): its producer is asked for the Q4_K layout (most
    of the bytes), the GEMV uses the parts attached to x for those segments and quantizes only
    the Q6_K layout itself; the result equals quantizing both itself."""
    from types import SimpleNamespace

    from paphos.layers.linear import UnquantizedLinearMethod
    from paphos.layers.norm import RMSNorm
    from paphos.quant.gguf.linear import GGUFLinearMethod

    layer, shards, _ = _merged_layer(tg, ("Q4_K", "Q4_K", "Q6_K"), (32, 16, 16))
    kernel = tg.TritonGGUFKernel()
    kernel.prepare(layer, shards, torch.bfloat16)
    layout = kernel.int8_input_layout()
    assert layout == x_int8.Int8Layout(4, 4)
    method = GGUFLinearMethod([])
    method.kernel = kernel
    norm = RMSNorm(K)
    x_int8_outputs.feed(norm, SimpleNamespace(quant_method=method))
    assert norm.int8_outputs.gemv == layout
    x_int8_outputs.feed(norm, SimpleNamespace(quant_method=UnquantizedLinearMethod()))
    assert norm.int8_outputs == x_int8_outputs.Int8Outputs(None, None)

    x = torch.randn(1, K, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    plain = kernel.apply(layer, x)
    fed = x_int8.attach(x.clone(), layout, x_int8.quantize(x[0], layout))
    quantize, layouts = x_int8.quantize, []
    monkeypatch.setattr(x_int8, "quantize", lambda v, lay: layouts.append(lay) or quantize(v, lay))
    assert torch.equal(method.apply(layer, fed), plain)
    assert layouts == [x_int8.Int8Layout(4, 2)]


def test_self_check_failure_falls_back_to_dequantize_at_load(tg, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    layer, shards, w = _merged_layer(tg, ("Q3_K",), (16,))  # a type on the fused kernel at every batch

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("does not compile")

    monkeypatch.setattr(tg, "fused_matmul", broken)
    monkeypatch.setattr(tg, "_VERIFIED", {})
    kernel = tg.TritonGGUFKernel()
    kernel.prepare(layer, shards, torch.float32)
    assert kernel.fallback is not None
    x = torch.randn(2, K)
    assert torch.allclose(kernel.apply(layer, x), x @ w.t(), rtol=1e-5, atol=1e-5)


def test_int8_path_failing_its_self_check_leaves_the_fused_kernel(tg, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A wrong int8 tensor-core kernel costs batched decode its speed, not the layer its planes:
    the layer stays on the Triton kernels and 2-32 tokens take the fused kernel."""
    from paphos.quant.gguf import triton_gguf_i8 as ti8

    layer, shards, w = _merged_layer(tg, ("Q4_K",), (16,))
    wrong = []

    def off_by_one(out: torch.Tensor, *args: object, **kwargs: object) -> None:
        wrong.append(out.shape[0])
        out.fill_(1.0)

    monkeypatch.setattr(ti8, "matmul_into", off_by_one)
    monkeypatch.setattr(tg, "_VERIFIED", {})
    monkeypatch.setattr(tg, "_INT8_FAILED", set())
    kernel = tg.TritonGGUFKernel(matmul=False)
    kernel.prepare(layer, shards, torch.float32)
    assert kernel.fallback is None and wrong == [5, 16, 29, 61]  # checked at 5, 16, 29, 61 tokens, then left out
    assert tg._INT8_FAILED == {("Q4_K", "cpu")}
    x = torch.randn(16, K)
    assert _rel(kernel.apply(layer, x), x @ w.t()) < 1e-2 and wrong == [5, 16, 29, 61]


def test_kernel_choice(tg) -> None:  # noqa: ANN001
    from paphos.quant.gguf.kernels import KERNELS

    _, shards, _ = _merged_layer(tg, ("Q4_K", "Q6_K"), (16, 16))
    cls = next(c for c in KERNELS if c.name == "triton-gguf")
    assert KERNELS[0] is cls  # GPU kernels go first
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert cls.can_implement(shards, cuda, torch.bfloat16) and cls.can_implement(shards, cuda, torch.float16)
    assert not cls.can_implement(shards, cpu, torch.bfloat16)
    assert not cls.can_implement(shards, cuda, torch.float32)  # the exact reference path instead
    f16 = (GGUFShard("f", "F16", 16, 2 * K, 0, 0),)
    assert not cls.can_implement(f16, cuda, torch.bfloat16)  # dequantized at load


def _bits16(v: float, dtype: torch.dtype) -> int:
    return torch.tensor([v], dtype=torch.float32).to(dtype).view(torch.int16).item() & 0xFFFF


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_q6_k_asm_decodes_as_the_interpreter_path(tg, dtype: torch.dtype) -> None:  # noqa: ANN001
    """The fused kernel's Q6_K decode on the GPU (`_q6_k_asm`, run here by tests/quant/ptx_sim.py on
    random groups) gives the interpreter path's weights bit for bit: code x (hi + lo) rounded
    once, which is the correctly rounded code x scale for all but a few weights."""
    q6_k = sys.modules[_Q6_K]
    asm = (q6_k._ASM_Q6_K_F16 if dtype == torch.float16 else q6_k._ASM_Q6_K_BF16).value
    rng = np.random.default_rng(5)
    rounded_once = total = 0
    for _ in range(300):
        w0, w1, hw = (int(v) for v in rng.integers(0, 1 << 32, 3))
        scale = np.float32(rng.integers(-128, 128)) * np.float32(np.float16(rng.uniform(1e-4, 0.05)))
        hi = float(torch.tensor([float(scale)]).to(dtype))
        lo = float(torch.tensor([float(scale) - hi]).to(dtype))
        out = ptx_sim.run(asm, [w0, w1, hw, _bits16(hi, dtype), _bits16(lo, dtype)], 16)
        for j in range(16):
            word = w1 if j % 2 else w0
            code = ((word >> (4 * (j // 2))) & 15 | ((hw >> (16 * (j % 2) + 2 * (j // 2))) & 3) << 4) - 32
            part = float(torch.tensor([code * lo]).to(dtype))
            assert out[j] == _bits16(code * hi + part, dtype), (j, code, hi, lo)
            rounded_once += out[j] == _bits16(code * float(scale), dtype)
            total += 1
    assert rounded_once >= 0.99 * total


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_q6_k_tile_rounds_each_weight_once(tg, dtype: torch.dtype, transposed: bool,  # noqa: ANN001
                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The weights the fused kernel multiplies for Q6_K (one-hot tokens read them back) are the
    exact dequantized weights rounded to the model dtype, but where a weight lies within 2^-16
    of a rounding boundary (one unit in the last place there); in both tile orientations, at the
    engine's 16-token tile (64 rows, 64 values a step) and at 32 x 128."""
    monkeypatch.setattr(sys.modules[_Q6_K], "TRANSPOSED", transposed)
    raw = _raw("Q6_K", N, K, 3)
    seg = tg.Segment("Q6_K", 0, N, K, planes.repack(raw, "Q6_K"))
    exact = dequantize(raw, "Q6_K").t()
    ulp = exact.abs() * (2.0**-7 if dtype == torch.bfloat16 else 2.0**-10)
    engine = launch.default_config("Q6_K", N, K, 16)
    for cfg in (tg.KernelConfig(engine.block_n, engine.block_k, 1, 4, 3, 16), tg.KernelConfig(32, 128, 1, 4, 2, 16)):
        got = tg.fused_matmul(torch.eye(K, dtype=dtype), [seg], N, [cfg]).float()
        assert (got == exact.to(dtype).float()).float().mean() >= 0.99, cfg
        assert ((got - exact).abs() <= ulp).all(), cfg
