"""The compiled weight dequantizers of the CPU's prefill GEMMs (quant/kernels/compiled_dequant.py):
the same weights as the eager dequantizers, bit for bit; shapes compiled during the warm-up only,
a shape met later dequantized eagerly (never a compile in the middle of serving)."""

from __future__ import annotations

import logging

import pytest
import torch

from paphos.native import cpu as native_cpu
from paphos.quant.kernels import compiled_dequant, int4pack_cpu, int8_group_cpu


@pytest.fixture
def enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(compiled_dequant._state, "enabled", True)
    monkeypatch.setitem(compiled_dequant._state, "failed", False)
    monkeypatch.setattr(compiled_dequant, "_compiled", {})


def _packed(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scales, zeros = torch.rand(n, k // 32, generator=gen), torch.randn(n, k // 32, generator=gen)
    return int4pack_cpu.pack(codes, scales, zeros)


def test_compiled_dequantizers_equal_the_eager_ones(enabled, caplog: pytest.LogCaptureFixture) -> None:
    packed, scale_zero = _packed(128, 64, 0)
    q = torch.randint(-128, 128, (96, 64), dtype=torch.int8)
    scales = torch.rand(96, 2)
    with compiled_dequant.warming_up():
        w4 = compiled_dequant.dequantize(int4pack_cpu.unpack, packed, scale_zero, 32)
        w8 = compiled_dequant.dequantize(int8_group_cpu.dequantize_rows, q, scales, torch.bfloat16)
    assert torch.equal(w4, int4pack_cpu.unpack(packed, scale_zero, 32))
    assert torch.equal(w8, int8_group_cpu.dequantize_rows(q, scales, torch.bfloat16))
    assert set(compiled_dequant._compiled) == {int4pack_cpu.unpack, int8_group_cpu.dequantize_rows}
    # After the warm-up a new weight shape is not compiled: the eager dequantizer answers, once logged.
    other, other_sz = _packed(64, 96, 1)
    with caplog.at_level(logging.WARNING):
        got = compiled_dequant.dequantize(int4pack_cpu.unpack, other, other_sz, 32)
    assert torch.equal(got, int4pack_cpu.unpack(other, other_sz, 32))
    assert "dequantizing eagerly" in caplog.text


def test_long_chunks_take_the_dense_path_from_fewer_rows_when_compiled(enabled) -> None:
    packed, scale_zero = _packed(128, 64, 2)
    x = torch.randn(int4pack_cpu.DENSE_MIN_TOKENS_COMPILED, 64, dtype=torch.bfloat16)
    with compiled_dequant.warming_up(), native_cpu.disabled():  # the native kernel would take 128 rows
        dense = int4pack_cpu.matmul(x, packed, scale_zero, 32)
    packed_path = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scale_zero)
    if not int4pack_cpu._layout_known():
        # torch packs int4 for this CPU's instruction set (AVX2 only) in a layout `unpack` does not
        # read: the packed kernel answers, and nothing is compiled
        assert not compiled_dequant._compiled
        torch.testing.assert_close(dense, packed_path, rtol=0, atol=0)
        return
    assert int4pack_cpu.unpack in compiled_dequant._compiled  # the dense path ran, compiled
    reference = torch.nn.functional.linear(x, int4pack_cpu.unpack(packed, scale_zero, 32))
    torch.testing.assert_close(dense, reference, rtol=0, atol=0)
    # The packed kernel sums in another order: equal within bf16 rounding of the outputs' size.
    assert (dense.float() - packed_path.float()).abs().max() <= 2**-7 * packed_path.float().abs().max()
