"""The native CPU matmuls (paphos/native/cpu.py) against exact products of the
weights they read, and the routes that choose them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paphos.native import cpu as native_cpu
from paphos.quant.kernels import int4pack_cpu, int8_group_cpu

pytestmark = pytest.mark.skipif(not native_cpu.load(), reason="needs an x86 CPU with AVX512-BF16 and a C compiler")


def _x(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("rows", [2, 5, 16, 17, 40])
def test_int8_groups_multiply_the_bf16_weight_in_fp32(group: int, rows: int) -> None:
    n, k = 1040, 96  # 1040 = 65 blocks of 16 rows; the last is partial in the second test below
    gen = torch.Generator().manual_seed(group + rows)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=gen) * 0.01
    x = _x(rows, k)
    # The dense path's weight: each value dequantized in fp32 and rounded to bf16.
    w = int8_group_cpu.dequantize_rows(q, scales, torch.bfloat16).double()
    reference = x.double() @ w.t()
    y = native_cpu.int8_group_mm(x, q, scales, torch.float32)
    assert y.shape == (rows, n)
    assert (y.double() - reference).abs().max() <= 1e-5 * reference.abs().max()
    assert torch.equal(native_cpu.int8_group_mm(x, q, scales, torch.bfloat16), y.to(torch.bfloat16))


def test_int8_groups_take_a_partial_last_block() -> None:
    q = torch.randint(-127, 128, (37, 64), dtype=torch.int8)
    scales = torch.rand(37, 2)
    x = _x(3, 64)
    reference = x.double() @ int8_group_cpu.dequantize_rows(q, scales, torch.bfloat16).double().t()
    y = native_cpu.int8_group_mm(x, q, scales, torch.float32)
    assert (y.double() - reference).abs().max() <= 1e-5 * reference.abs().max()


def _int4(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02).to(torch.bfloat16).float()
    zeros = (torch.randn(n, k // group, generator=gen) * 0.01).to(torch.bfloat16).float()
    packed, scale_zero = int4pack_cpu.pack(codes, scales, zeros)
    w = (codes.double() - 8).view(n, k // group, group) * scales.double().unsqueeze(-1) + zeros.double().unsqueeze(-1)
    return packed, scale_zero, w.view(n, k)


@pytest.mark.parametrize(("n", "k", "group"), [(64, 64, 32), (128, 256, 64), (192, 256, 128)])
@pytest.mark.parametrize("rows", [8, 9, 16, 33])
def test_int4pack_layout_sums_exact_products(n: int, k: int, group: int, rows: int) -> None:
    packed, scale_zero, w = _int4(n, k, group, seed=n + rows)
    x = _x(rows, k, seed=rows)
    reference = x.double() @ w.t()
    y = native_cpu.int4pack_mm(x, packed, scale_zero, group)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    # Products exact, fp32 sums, one rounding to the bf16 output.
    assert (y.double() - reference).abs().max() <= 2**-8 * reference.abs().max()


def test_int4pack_below_the_native_rows_is_torchs_kernel() -> None:
    packed, scale_zero, _ = _int4(64, 64, 32, seed=1)
    x = _x(native_cpu.INT4_MIN_ROWS - 1, 64)
    torch_kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scale_zero)
    assert torch.equal(native_cpu.int4pack_mm(x, packed, scale_zero, 32), torch_kernel)


def test_matmuls_route_several_rows_to_the_native_kernels() -> None:
    packed, scale_zero, _ = _int4(128, 64, 32, seed=2)
    x = _x(16, 64)
    native = int4pack_cpu.matmul(x, packed, scale_zero, 32)
    assert torch.equal(native, native_cpu.int4pack_mm(x, packed, scale_zero, 32))
    with native_cpu.disabled():
        assert torch.equal(int4pack_cpu.matmul(x, packed, scale_zero, 32),
                           torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scale_zero))  # fmt: skip

    q = torch.randint(-127, 128, (64, 64), dtype=torch.int8)
    scales = torch.rand(64, 2)
    assert torch.equal(int8_group_cpu.matmul(x, q, scales), native_cpu.int8_group_mm(x, q, scales, torch.bfloat16))
    with native_cpu.disabled():
        dense = F.linear(x, int8_group_cpu.dequantize_rows(q, scales, torch.bfloat16))
        assert torch.equal(int8_group_cpu.matmul(x, q, scales), dense)


def test_the_switch_turns_the_kernels_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native_cpu.ENV_SWITCH, "0")
    assert native_cpu._open() is None


def _whole_prompts(lens: list[int], heads: int, kv_heads: int, head_dim: int):
    """q, k, v as views of one qkv projection (rows strided, as the models produce them), with a
    row before, between and after the prompts that no prompt may read."""
    total = sum(lens) + len(lens) + 1
    gen = torch.Generator().manual_seed(sum(lens) + heads)
    qkv = (torch.randn(total, (heads + 2 * kv_heads) * head_dim, generator=gen) * 2).to(torch.bfloat16)
    q = qkv[:, : heads * head_dim].view(total, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(total, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(total, kv_heads, head_dim)
    starts, row = [], 1
    for n in lens:
        starts.append(row)
        row += n + 1
    return q, k, v, starts


@pytest.mark.parametrize(
    ("lens", "heads", "kv_heads", "head_dim"),
    [([70], 9, 3, 64), ([5, 17, 33, 1, 16], 4, 2, 32), ([40, 21], 8, 8, 128), ([3], 2, 1, 6)],
)
def test_prefill_attention_is_sdpa_per_prompt(lens: list[int], heads: int, kv_heads: int, head_dim: int) -> None:
    q, k, v, starts = _whole_prompts(lens, heads, kv_heads, head_dim)
    scale = head_dim**-0.5
    out = torch.zeros(q.shape, dtype=torch.bfloat16)
    native_cpu.prefill_attention(q, k, v, out, starts, lens, scale)
    for start, n in zip(starts, lens, strict=True):
        rows = slice(start, start + n)
        reference = F.scaled_dot_product_attention(
            *(t[rows].transpose(0, 1)[None].float() for t in (q, k, v)), is_causal=True, scale=scale, enable_gqa=True
        )[0].transpose(0, 1)
        # fp32 throughout, then the bf16 output's rounding.
        assert (out[rows].float() - reference).abs().max() <= 2**-8 * reference.abs().max()
    untouched = torch.ones(q.shape[0], dtype=torch.bool)
    for start, n in zip(starts, lens, strict=True):
        untouched[start : start + n] = False
    assert not out[untouched].any()  # rows outside the prompts are not written


def test_the_reference_backend_attends_whole_prompts_natively() -> None:
    from paphos.attention.metadata import AttentionMetadata
    from paphos.attention.torch_ref import TorchReferenceBackend

    lens, heads, kv_heads, head_dim, block = [20, 9], 4, 2, 32, 16
    q, k, v, _ = _whole_prompts(lens, heads, kv_heads, head_dim)
    q, k, v = q[1:30].contiguous(), k[1:30].contiguous(), v[1:30].contiguous()
    cache = torch.zeros(8, 2, block, kv_heads, head_dim, dtype=torch.bfloat16)
    md = AttentionMetadata(
        num_tokens=29, query_start_loc=torch.tensor([0, 20, 29]), seq_lens=torch.tensor(lens),
        block_tables=torch.tensor([[1, 2], [3, 0]], dtype=torch.int32), slot_mapping=torch.cat(
            [torch.arange(16, 36), torch.arange(48, 57)]), max_query_len=20, max_seq_len=20,
        query_start_loc_cpu=[0, 20, 29], seq_lens_cpu=lens,
    )  # fmt: skip
    native = TorchReferenceBackend().forward(q, k, v, cache.clone(), md, head_dim**-0.5)
    with native_cpu.disabled():
        sdpa = TorchReferenceBackend().forward(q, k, v, cache.clone(), md, head_dim**-0.5)
    assert (native.float() - sdpa.float()).abs().max() <= 2**-7 * sdpa.float().abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [49152, 1000, 7])
def test_row_stats_are_torchs_in_float32(vocab: int, dtype: torch.dtype) -> None:
    logits = (torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab)) * 4).to(dtype)
    logits[1, vocab // 2] = logits[1].max() + 1  # a unique max in the middle
    logits[2, : min(3, vocab)] = 30.0  # ties: the first index wins
    logits[3, -1] = float("nan")
    logits[4] = float("-inf")
    top, first, lse = native_cpu.row_stats(logits)
    raw = logits.float()
    torch.testing.assert_close(top, raw.amax(-1), equal_nan=True, rtol=0, atol=0)
    assert torch.equal(first, raw.argmax(-1))
    torch.testing.assert_close(lse, raw.logsumexp(-1), equal_nan=True, rtol=1e-6, atol=1e-6)


def _paged_context(lens: list[int], heads: int, kv_heads: int, head_dim: int, block: int, seed: int = 0):
    """q [B, Hq, D] and a cache of shuffled blocks holding each sequence's keys and values, every
    slot no sequence owns (past seq_len in its last block, spare blocks, the tables' padding
    entries) NaN; per sequence its keys and values [n, Hkv, D]."""
    gen = torch.Generator().manual_seed(seed + sum(lens) + heads + head_dim + block)
    owned = [-(-n // block) for n in lens]
    num_blocks = sum(owned) + 3
    cache = torch.full((num_blocks, 2, block, kv_heads, head_dim), float("nan"), dtype=torch.bfloat16)
    order = torch.randperm(num_blocks, generator=gen)
    # Tables one entry wider than the longest needs, padded with a spare (NaN) block.
    tables = torch.full((len(lens), max(owned) + 1), int(order[-1]), dtype=torch.int32)
    contexts, at = [], 0
    for b, (n, m) in enumerate(zip(lens, owned, strict=True)):
        blocks = order[at : at + m]
        at += m
        tables[b, :m] = blocks.to(torch.int32)
        kv = (torch.randn(2, n, kv_heads, head_dim, generator=gen) * 2).to(torch.bfloat16)
        padded = torch.full((2, m * block, kv_heads, head_dim), float("nan"), dtype=torch.bfloat16)
        padded[:, :n] = kv
        cache[blocks] = padded.view(2, m, block, kv_heads, head_dim).transpose(0, 1)
        contexts.append(kv)
    q = (torch.randn(len(lens), heads, head_dim, generator=gen) * 2).to(torch.bfloat16)
    return q, cache, tables, torch.tensor(lens, dtype=torch.int32), contexts


def _decode_reference(q: torch.Tensor, contexts: list[torch.Tensor], scale: float) -> torch.Tensor:
    """float64 SDPA of each row of q over its sequence's (exact bf16) keys and values -> [B, Hq, D]."""
    return torch.stack([
        F.scaled_dot_product_attention(
            q[b, :, None].double()[None], *(t.transpose(0, 1).double()[None] for t in kv), scale=scale,
            enable_gqa=True,
        )[0, :, 0]
        for b, kv in enumerate(contexts)
    ])  # fmt: skip


DECODE_LENS = [17, 1, 300, 16, 100, 15, 33]


@pytest.mark.parametrize("block", [8, 16, 32])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(9, 3, 64), (32, 8, 128), (8, 8, 256), (16, 1, 32), (12, 4, 96), (10, 2, 160)],
)
def test_decode_attention_is_sdpa_over_the_paged_context(heads: int, kv_heads: int, head_dim: int, block: int) -> None:
    q, cache, tables, seq_lens, contexts = _paged_context(DECODE_LENS, heads, kv_heads, head_dim, block)
    assert native_cpu.decode_attention_supported(q, cache)
    scale = head_dim**-0.5
    out = native_cpu.decode_attention(q, cache, tables, seq_lens, scale)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    # Every slot past seq_len is NaN: a finite output is one that never read past it.
    assert out.isfinite().all()
    reference = _decode_reference(q, contexts, scale)
    # Exact bf16 inputs and products, fp32 softmax and sums, then one rounding of each output
    # value to bf16 (at most 2**-8 of it); 1e-5 for the fp32 arithmetic (seen: under 1e-6).
    excess = (out.double() - reference).abs() - 2**-8 * reference.abs()
    for b, n in enumerate(DECODE_LENS):
        assert excess[b].max() <= 1e-5, (b, n, float(excess[b].max()))


def test_decode_attention_takes_int64_tables_and_strided_queries() -> None:
    heads, kv_heads, head_dim = 8, 2, 64
    _, cache, tables, seq_lens, _ = _paged_context([5, 40, 16], heads, kv_heads, head_dim, 16, seed=1)
    wide = (torch.randn(3, 2 * heads, head_dim, generator=torch.Generator().manual_seed(1)) * 2).to(torch.bfloat16)
    scale = head_dim**-0.5
    for q in (
        wide[:, heads:],  # rows 2 * Hq * D apart, heads contiguous: read in place
        wide[:, ::2],  # every other head
        wide[:, :heads].transpose(0, 1).contiguous().transpose(0, 1),  # rows D apart, heads B * D
    ):
        assert not q.is_contiguous()
        expected = native_cpu.decode_attention(q.contiguous(), cache, tables, seq_lens, scale)
        assert expected.isfinite().all()
        assert torch.equal(native_cpu.decode_attention(q, cache, tables.long(), seq_lens.long(), scale), expected)


def test_decode_attention_compiles_into_a_graph() -> None:
    q, cache, tables, seq_lens, _ = _paged_context([3, 20], 4, 2, 32, 8, seed=2)

    def step(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        return native_cpu.decode_attention(q * 1, cache, tables, seq_lens + 0, 32**-0.5).float() * 2

    compiled = torch.compile(step, fullgraph=True)
    assert torch.equal(compiled(q, cache, tables, seq_lens), step(q, cache, tables, seq_lens))


def _counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    kernel = native_cpu.decode_attention

    def counting(*args, **kwargs):
        calls[0] += 1
        return kernel(*args, **kwargs)

    monkeypatch.setattr(native_cpu, "decode_attention", counting)
    return calls


def test_the_reference_backend_decodes_natively(monkeypatch: pytest.MonkeyPatch) -> None:
    from paphos.attention.torch_ref import TorchReferenceBackend

    heads, kv_heads, head_dim = 8, 2, 64
    q, cache, tables, seq_lens, _ = _paged_context([1, 17, 70, 32], heads, kv_heads, head_dim, 16, seed=3)
    # The torch path masks the slots past seq_len but multiplies their values by 0: no NaN there.
    cache = cache.nan_to_num(0.0)
    scale = head_dim**-0.5
    calls = _counted(monkeypatch)
    backend = TorchReferenceBackend()
    native = backend._attend_decode(q, cache, seq_lens.long(), tables.long(), scale, None, None)
    assert calls[0] == 1
    with native_cpu.disabled():
        torch_path = backend._attend_decode(q, cache, seq_lens.long(), tables.long(), scale, None, None)
    assert calls[0] == 1
    assert native.dtype == torch_path.dtype == torch.bfloat16
    # Two outputs in fp32 each rounded once to bf16.
    assert (native.float() - torch_path.float()).abs().max() <= 2**-7 * torch_path.float().abs().max()

    for window, cap in ((8, None), (None, 30.0)):
        out = backend._attend_decode(q, cache, seq_lens.long(), tables.long(), scale, window, cap)
        assert out.isfinite().all()
    assert calls[0] == 1  # a sliding window or a soft cap keeps the torch path
