"""TorchReferenceBackend against a per-token loop over the plain (unpaged) K/V history."""

from __future__ import annotations

import math

import pytest
import torch

from paphos.attention.backend import AttentionBackend, write_kv_cache
from paphos.attention.testing import allocate_block_tables, build_metadata
from paphos.attention.torch_ref import TorchReferenceBackend

BLOCK = 4


def naive_attention(q, keys, values, scale, window=None, cap=None):
    """q [Lq, Hq, D] for the last Lq positions of a context keys/values [L, Hkv, D]; float64."""
    q_len, num_heads, _ = q.shape
    ctx, num_kv, _ = keys.shape
    group = num_heads // num_kv
    out = torch.zeros(q.shape, dtype=torch.float64)
    for j in range(q_len):
        p = ctx - q_len + j
        for h in range(num_heads):
            scores = []
            for t in range(p + 1):
                if window is not None and t <= p - window:
                    scores.append(float("-inf"))
                    continue
                s = float(q[j, h].double() @ keys[t, h // group].double()) * scale
                if cap is not None:
                    s = cap * math.tanh(s / cap)
                scores.append(s)
            probs = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
            out[j, h] = probs @ values[: p + 1, h // group].double()
    return out


def run_case(
    seqs: list[tuple[int, int]],
    num_kv: int,
    ratio: int,
    head_dim: int = 8,
    window: int | None = None,
    cap: float | None = None,
    dtype: torch.dtype = torch.float32,
    gather_budget: int = 32768,
    q_gain: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(sum(q * 31 + s for q, s in seqs) + num_kv * 7 + ratio)
    num_heads = num_kv * ratio
    num_blocks = 64
    tables = allocate_block_tables([s for _, s in seqs], BLOCK, num_blocks, gen)
    cache = torch.randn(num_blocks, 2, BLOCK, num_kv, head_dim, generator=gen).to(dtype)  # garbage
    hist_k = [torch.randn(s, num_kv, head_dim, generator=gen).to(dtype) for _, s in seqs]
    hist_v = [torch.randn(s, num_kv, head_dim, generator=gen).to(dtype) for _, s in seqs]

    # Tokens before this step's chunk are already cached (earlier chunks / decode steps).
    for (q_len, s_len), table, hk, hv in zip(seqs, tables, hist_k, hist_v, strict=True):
        if s_len > q_len:
            pre = build_metadata([s_len - q_len], [s_len - q_len], [table], BLOCK)
            write_kv_cache(hk[: s_len - q_len], hv[: s_len - q_len], cache, pre.slot_mapping)

    md = build_metadata([q for q, _ in seqs], [s for _, s in seqs], tables, BLOCK)
    qs = [q_gain * torch.randn(q_len, num_heads, head_dim, generator=gen) for q_len, _ in seqs]
    q = torch.cat(qs).to(dtype)
    k = torch.cat([hk[s - ql :] for (ql, s), hk in zip(seqs, hist_k, strict=True)])
    v = torch.cat([hv[s - ql :] for (ql, s), hv in zip(seqs, hist_v, strict=True)])
    scale = head_dim**-0.5
    backend = TorchReferenceBackend(max_decode_gather_tokens=gather_budget)
    assert isinstance(backend, AttentionBackend)
    out = backend.forward(q, k, v, cache, md, scale, sliding_window=window, logits_soft_cap=cap)
    assert out.shape == q.shape and out.dtype == dtype
    # Calling again with the same metadata reuses the plan and rewrites the same slots.
    out2 = backend.forward(q, k, v, cache, md, scale, sliding_window=window, logits_soft_cap=cap)
    torch.testing.assert_close(out, out2, rtol=0, atol=0)

    expected = torch.cat(
        [naive_attention(qs[i].to(dtype), hist_k[i], hist_v[i], scale, window, cap) for i in range(len(seqs))]
    )
    return out, expected


MIXED = [(1, 17), (7, 7), (1, 1), (5, 23), (1, 40), (3, 3), (1, 9)]


@pytest.mark.parametrize("ratio", [1, 3, 4])
@pytest.mark.parametrize("num_kv", [1, 2])
def test_mixed_batch_gqa(num_kv: int, ratio: int) -> None:
    out, expected = run_case(MIXED, num_kv, ratio)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_decode_only_many_groups() -> None:
    # A tiny gather budget forces one decode group per sequence (and sorting by length).
    seqs = [(1, 5), (1, 33), (1, 12), (1, 2), (1, 29)]
    out, expected = run_case(seqs, 2, 2, gather_budget=16)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_chunked_prefill_only() -> None:
    out, expected = run_case([(6, 30), (10, 10), (2, 13)], 2, 3)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [1, 4, 6])
def test_sliding_window(window: int) -> None:
    out, expected = run_case(MIXED, 2, 2, window=window)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_soft_cap() -> None:
    # Large queries so scores reach the region where tanh capping changes the result.
    out, expected = run_case(MIXED, 1, 4, cap=5.0, q_gain=6.0)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    uncapped, _ = run_case(MIXED, 1, 4, cap=None, q_gain=6.0)
    assert (uncapped - out).abs().max() > 1e-2


def test_soft_cap_with_window() -> None:
    out, expected = run_case(MIXED, 2, 3, window=5, cap=3.0, q_gain=4.0)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("window", "cap"), [(None, None), (5, None), (None, 3.0), (4, 3.0)])
def test_compiled_cpu_decode_form_matches(monkeypatch: pytest.MonkeyPatch, window: int | None,
                                          cap: float | None) -> None:  # fmt: skip
    # Inside the compiled CPU decode step, decode rows attend through reductions instead of SDPA.
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    out, expected = run_case([(1, 17), (1, 1), (1, 40), (1, 9)], 2, 3, window=window, cap=cap, q_gain=4.0)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_bfloat16_cache() -> None:
    out, expected = run_case(MIXED, 2, 2, dtype=torch.bfloat16)
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)


def test_write_kv_cache_slots() -> None:
    cache = torch.zeros(5, 2, BLOCK, 1, 2)
    k = torch.arange(6, dtype=torch.float32).view(3, 1, 2)
    slots = torch.tensor([3 * BLOCK + 1, 1 * BLOCK + 0, 4 * BLOCK + 3])
    write_kv_cache(k, -k, cache, slots)
    assert torch.equal(cache[3, 0, 1], k[0]) and torch.equal(cache[3, 1, 1], -k[0])
    assert torch.equal(cache[1, 0, 0], k[1]) and torch.equal(cache[4, 1, 3], -k[2])
    assert cache.abs().sum() == 2 * k.abs().sum()


def test_metadata_refilled_in_place_rebuilds_plan() -> None:
    """A runner that reuses one metadata object must not get the previous step's plan."""
    gen = torch.Generator().manual_seed(5)
    cache = torch.zeros(8, 2, BLOCK, 1, 4)
    tables = allocate_block_tables([6, 6], BLOCK, 8, gen)
    backend = TorchReferenceBackend()
    md = build_metadata([6], [6], tables[:1], BLOCK)
    q, k = torch.randn(6, 2, 4, generator=gen), torch.randn(6, 1, 4, generator=gen)
    backend.forward(q, k, k, cache, md, 0.5)
    step2 = build_metadata([1, 6], [7, 6], tables, BLOCK)
    for field in ("num_tokens", "query_start_loc", "seq_lens", "slot_mapping", "query_start_loc_cpu"):
        setattr(md, field, getattr(step2, field))
    md.seq_lens_cpu[:] = step2.seq_lens_cpu  # same list object, new contents
    md.block_tables = step2.block_tables
    q2, k2 = torch.randn(7, 2, 4, generator=gen), torch.randn(7, 1, 4, generator=gen)
    out = backend.forward(q2, k2, k2, cache, md, 0.5)
    fresh = TorchReferenceBackend().forward(q2, k2, k2, cache, step2, 0.5)
    torch.testing.assert_close(out, fresh, rtol=0, atol=0)
