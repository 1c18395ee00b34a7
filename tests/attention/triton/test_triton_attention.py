"""Triton paged-attention kernels (under the interpreter, see conftest.py) against the torch
reference backend, on small shapes: GQA ratios, head sizes, windows, soft-cap, paged tables with
gaps, chunked prefill after a cached prefix, mixed batches, fp16/bf16/fp8 caches."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from triton.runtime.interpreter import InterpretedFunction

from paphos.attention import triton_attention as ta
from paphos.attention import triton_kv_write as tw
from paphos.attention import triton_prefill as tp
from paphos.attention.backend import AttentionBackend, write_kv_cache
from paphos.attention.metadata import AttentionMetadata
from paphos.attention.testing import allocate_block_tables, build_metadata
from paphos.attention.torch_ref import TorchReferenceBackend
from paphos.attention.triton_backend import TritonAttentionBackend
from paphos.layers import x_int8, x_int8_blocks
from paphos.layers.x_int8_outputs import Int8Outputs

# (query_len, seq_len): decode rows, a full prefill, chunks after a cached prefix, a 1-token seq.
MIXED = [(1, 17), (7, 7), (1, 1), (5, 23), (1, 40), (3, 3), (9, 30)]
FP8 = torch.float8_e4m3fn
ATOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cache: torch.Tensor  # before this step's write; each backend gets its own clone
    md: AttentionMetadata
    scale: float


def make_case(
    seqs: list[tuple[int, int]],
    num_kv: int,
    ratio: int,
    head_dim: int = 64,
    block_size: int = 4,
    cache_dtype: torch.dtype = torch.bfloat16,
    act_dtype: torch.dtype = torch.bfloat16,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    q_gain: float = 1.0,
    seed: int = 0,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    capacities = [s for _, s in seqs]
    num_blocks = sum(-(-c // block_size) for c in capacities) + 6  # a few blocks never used
    tables = allocate_block_tables(capacities, block_size, num_blocks, gen)  # shuffled ids
    # Garbage everywhere, so a kernel reading an unwritten slot or the null block shows up.
    cache = (torch.randn(num_blocks, 2, block_size, num_kv, head_dim, generator=gen) * 4).to(cache_dtype)
    for (q_len, s_len), table in zip(seqs, tables, strict=True):
        if s_len > q_len:  # the cached prefix, written as earlier steps would have
            pre = build_metadata([s_len - q_len], [s_len - q_len], [table], block_size)
            hist = torch.randn(2, s_len - q_len, num_kv, head_dim, generator=gen).to(act_dtype)
            write_kv_cache(hist[0], hist[1], cache, pre.slot_mapping, k_scale, v_scale)
    md = build_metadata([q for q, _ in seqs], capacities, tables, block_size)
    # Unused trailing table entries are 0 (the null block), as the model runner pads them.
    md.block_tables = F.pad(md.block_tables, (0, 3))
    num_tokens = md.num_tokens
    q = (q_gain * torch.randn(num_tokens, num_kv * ratio, head_dim, generator=gen)).to(act_dtype)
    k = torch.randn(num_tokens, num_kv, head_dim, generator=gen).to(act_dtype)
    v = torch.randn(num_tokens, num_kv, head_dim, generator=gen).to(act_dtype)
    return Case(q, k, v, cache, md, head_dim**-0.5)


def compare(
    case: Case,
    window: int | None = None,
    cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    decode_only: bool = False,
) -> float:
    """Run both backends; caches must match bit for bit, outputs within the dtype's tolerance."""
    ref_cache, tri_cache = case.cache.clone(), case.cache.clone()
    ref = TorchReferenceBackend(k_scale=k_scale, v_scale=v_scale)
    tri = TritonAttentionBackend(k_scale=k_scale, v_scale=v_scale)
    assert isinstance(tri, AttentionBackend)
    expected = ref.forward(case.q, case.k, case.v, ref_cache, case.md, case.scale, window, cap)
    fn = tri.forward_decode if decode_only else tri.forward
    out = fn(case.q, case.k, case.v, tri_cache, case.md, case.scale, window, cap)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert torch.equal(tri_cache.view(torch.uint8), ref_cache.view(torch.uint8))
    err = (out.float() - expected.float()).abs().max().item()
    assert err <= ATOL[case.q.dtype], err
    return err


# ------------------------------------------------------------------------------------------ setup


def test_kernels_run_in_the_interpreter_on_cpu_tensors() -> None:
    for kernel in (
        tw._write_kv_kernel,
        ta._decode_split_kernel,
        ta._decode_reduce_kernel,
        tp._prefill_kernel,
    ):
        assert isinstance(kernel, InterpretedFunction)
    case = make_case([(1, 5), (3, 3)], 1, 2)
    assert case.q.device.type == "cpu"
    compare(case)


# ------------------------------------------------------------------------------------------ attention


@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_mixed_batch_gqa(ratio: int) -> None:
    compare(make_case(MIXED, 2, ratio, seed=ratio))


def test_head_dim_128_fp16_window_block8() -> None:
    case = make_case(
        MIXED, 2, 2, head_dim=128, block_size=8, cache_dtype=torch.float16, act_dtype=torch.float16
    )
    compare(case, window=6)


def test_head_dim_256_softcap() -> None:
    case = make_case([(1, 21), (6, 14)], 1, 2, head_dim=256, block_size=16, q_gain=4.0)
    compare(case, cap=5.0)


@pytest.mark.parametrize("window", [1, 4, 9])
def test_sliding_window(window: int) -> None:
    compare(make_case(MIXED, 1, 4, seed=window), window=window)


def test_soft_cap_changes_the_result() -> None:
    case = make_case(MIXED, 2, 2, q_gain=6.0, seed=3)
    capped = compare(case, cap=5.0)
    assert capped <= 2e-2
    tri = TritonAttentionBackend()
    a = tri.forward(case.q, case.k, case.v, case.cache.clone(), case.md, case.scale, None, 5.0)
    b = tri.forward(case.q, case.k, case.v, case.cache.clone(), case.md, case.scale, None, None)
    assert (a.float() - b.float()).abs().max() > 0.1


def test_chunked_prefill_only_block32() -> None:
    # Pages larger than a key tile, chunks starting mid-page after long cached prefixes.
    compare(make_case([(6, 45), (17, 17), (2, 70)], 2, 4, block_size=32, seed=5), window=20, cap=8.0)


@pytest.mark.parametrize("window", [None, 7])
def test_fp8_cache(window: int | None) -> None:
    k_scale, v_scale = 0.05, 0.5  # k's stored values reach the saturation limit (|x|/0.05 > 448)
    case = make_case(MIXED, 2, 4, cache_dtype=FP8, k_scale=k_scale, v_scale=v_scale, seed=11)
    case.k[0, 0, :4] = 40.0  # saturates: 40 / 0.05 = 800 > 448
    compare(case, window=window, k_scale=k_scale, v_scale=v_scale)


def test_fp8_cache_under_bf16_queries_beyond_fp16_range() -> None:
    """Under bf16 queries an fp8 cache is attended in fp16 (one conversion per pair of cache values
    instead of two per value through bf16): queries past fp16's 65504 still attend as the
    reference does, since q is multiplied by the softmax scale before it is rounded to fp16."""
    case = make_case(MIXED, 2, 4, cache_dtype=FP8, k_scale=0.05, v_scale=0.5, q_gain=3e4, seed=12)
    assert case.q.abs().max() > 65504
    compare(case, k_scale=0.05, v_scale=0.5)


def test_fp8_cache_reference_roundtrip() -> None:
    """The oracle itself: an fp8 cache reads back within e4m3's precision of the written value."""
    cache = torch.zeros(3, 2, 4, 1, 8, dtype=FP8)
    k = torch.randn(2, 1, 8)
    write_kv_cache(k, -k, cache, torch.tensor([5, 9]), k_scale=0.1, v_scale=0.2)
    back = cache[1, 0, 1].float() * 0.1
    torch.testing.assert_close(back, k[0], rtol=0.07, atol=0.1 * 2**-9)
    torch.testing.assert_close(cache[2, 1, 1].float() * 0.2, -k[1], rtol=0.07, atol=0.2 * 2**-9)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_batches(seed: int) -> None:
    rng = random.Random(seed)
    seqs = []
    for _ in range(rng.randint(2, 6)):
        q_len = rng.choice([1, 1, rng.randint(2, 20)])
        seqs.append((q_len, q_len + rng.choice([0, rng.randint(1, 40)])))
    ratio, head_dim = rng.choice([1, 4, 8]), rng.choice([64, 128])
    block_size = rng.choice([4, 8, 16])
    cache_dtype = rng.choice([torch.bfloat16, FP8])
    scales = (rng.uniform(0.02, 0.5), rng.uniform(0.02, 0.5)) if cache_dtype == FP8 else (1.0, 1.0)
    case = make_case(
        seqs, rng.choice([1, 2]), ratio, head_dim, block_size, cache_dtype, torch.bfloat16, *scales, 3.0, seed
    )
    window = rng.choice([None, rng.randint(1, 30)])
    cap = rng.choice([None, 10.0])
    compare(case, window, cap, *scales)


# ------------------------------------------------------------------------------------------ decode path


@pytest.mark.parametrize(("splits", "window"), [(1, None), (4, None), (16, 5)])
def test_forward_decode_splits(splits: int, window: int | None) -> None:
    seqs = [(1, 3), (1, 50), (1, 17), (1, 1)]
    case = make_case(seqs, 2, 4, seed=splits)
    ref_cache, tri_cache = case.cache.clone(), case.cache.clone()
    expected = TorchReferenceBackend().forward(case.q, case.k, case.v, ref_cache, case.md, case.scale, window)
    tw.write_kv_cache_triton(case.k, case.v, tri_cache, case.md.slot_mapping)
    out = torch.empty_like(case.q)
    ta.paged_attention_decode(
        case.q, tri_cache, case.md.block_tables, case.md.seq_lens, out,
        scale=case.scale, num_splits=splits, sliding_window=window,
    )  # fmt: skip
    assert (out.float() - expected.float()).abs().max() <= 2e-2


def test_forward_decode_reads_no_host_metadata_and_zeroes_padding_rows() -> None:
    """The CUDA-graph path: host lists gone, a padding row (seq_len 0, slot -1) at the end."""
    case = make_case([(1, 9), (1, 33), (1, 2)], 2, 4, seed=7)
    expected = TorchReferenceBackend().forward(
        case.q, case.k, case.v, case.cache.clone(), case.md, case.scale
    )
    md = case.md
    pad = lambda t, value: torch.cat([t, torch.full_like(t[:1], value)])  # noqa: E731
    graph_md = AttentionMetadata(
        num_tokens=4,
        query_start_loc=torch.zeros(0, dtype=torch.int32),  # must not be read
        seq_lens=pad(md.seq_lens, 0),
        block_tables=pad(md.block_tables, 0),
        slot_mapping=pad(md.slot_mapping, -1),
        max_query_len=1,
        max_seq_len=0,
        query_start_loc_cpu=None,  # type: ignore[arg-type]
        seq_lens_cpu=None,  # type: ignore[arg-type]
    )
    graph_md.decode_only = True
    q, k, v = (pad(t, 1.0) for t in (case.q, case.k, case.v))
    cache = case.cache.clone()
    backend = TritonAttentionBackend()
    assert backend.num_splits(4, 2, q.device) > 1  # the merge kernel runs too
    out = backend.forward(q, k, v, cache, graph_md, case.scale)  # routed to forward_decode
    assert (out[:3].float() - expected.float()).abs().max() <= 2e-2
    assert torch.equal(out[3], torch.zeros_like(out[3]))


def _o_proj_layouts() -> list[tuple[str, Int8Outputs]]:
    from paphos.quant.gguf.triton_gguf_i8 import x_layout as gguf_layout
    from paphos.quant.kernels.triton_int_i8 import x_layout as int_layout

    return [
        ("gemv 4-bit", Int8Outputs(gemv=x_int8.Int8Layout(4, 4))),
        ("int4 blocks of 128", Int8Outputs(blocks=int_layout(4, 3, 32))),
        ("q4_k blocks of 256", Int8Outputs(blocks=gguf_layout("Q4_K", 64))),  # two 128-wide heads a program
        ("q8_0 blocks of 128", Int8Outputs(blocks=gguf_layout("Q8_0", 32))),  # the 8-bit order, one head
    ]


@pytest.mark.parametrize("name", [name for name, _ in _o_proj_layouts()])
def test_decode_merge_writes_the_o_projections_int8_parts(name: str) -> None:
    """In a decode-only batch the merge kernel also writes the int8 parts of its output that the
    o projection reads (GEMV parts at one row, GEMM blocks where the GEMM runs), attached to the
    output and carried to the o projection's [T, K] view: bit for bit what quantizing the
    output apart gives, and the attention output itself unchanged. A mixed batch, or one the
    merge does not run for, writes none (the projection quantizes it itself)."""
    wanted = dict(_o_proj_layouts())[name]
    layout = wanted.gemv or wanted.blocks
    rows = 1 if wanted.gemv else 4
    case = make_case([(1, 9 + 7 * i) for i in range(rows)], 2, 4, head_dim=128, seed=11)
    backend = TritonAttentionBackend()
    assert backend.num_splits(rows, 2, case.q.device) > 1
    plain = backend.forward(case.q, case.k, case.v, case.cache.clone(), case.md, case.scale)
    out = backend.forward(case.q, case.k, case.v, case.cache.clone(), case.md, case.scale, int8_outputs=wanted)
    assert torch.equal(out, plain)
    flat = x_int8.reshape(out, rows, -1)
    fed = x_int8.attached(flat, layout)
    assert fed is not None
    if wanted.gemv:
        want = x_int8.quantize(flat[0].clone(), layout)
        assert torch.equal(fed.words, want.words) and torch.equal(fed.scales, want.scales)
    else:
        want = x_int8_blocks.quantize(flat.clone(), layout)  # a copy carries none: the standalone launch
        for got, ref in zip(fed, want, strict=True):
            assert torch.equal(got, ref)
        ref = x_int8_blocks.reference_quantize(flat.float(), layout.make_order(), layout.xb, layout.sum_every)
        assert torch.equal(fed[0], ref[0]) and torch.equal(fed[2], ref[2])
    mixed = make_case([(1, 9), (3, 12), (1, 20), (1, 5)], 2, 4, head_dim=128, seed=12)
    out = backend.forward(mixed.q, mixed.k, mixed.v, mixed.cache.clone(), mixed.md, mixed.scale, int8_outputs=wanted)
    assert x_int8.attached(x_int8.reshape(out, out.shape[0], -1), layout) is None
    one_split = TritonAttentionBackend(max_splits=1)
    out = one_split.forward(case.q, case.k, case.v, case.cache.clone(), case.md, case.scale, int8_outputs=wanted)
    assert x_int8.attached(x_int8.reshape(out, rows, -1), layout) is None


def test_merge_programs_cover_the_units_read_at_that_row_count() -> None:
    """Heads per merge program follow the layouts read at the step's row count: at one row a GEMV's
    32-value groups need one 128-wide head, even where the GEMM at more rows reads 256-value
    blocks (two heads)."""
    from paphos.quant.gguf.triton_gguf_i8 import x_layout as q4_k_layout

    wanted = Int8Outputs(gemv=x_int8.Int8Layout(4, 4), blocks=q4_k_layout("Q4_K", 64))
    one_row = torch.empty(1, 32, 128, dtype=torch.bfloat16)
    heads, parts = ta._reduce_outputs(one_row, wanted, False, 128)
    assert heads == 1 and parts.constexprs["QLO"] == 4 and parts.constexprs["BXB"] == 0
    rows = torch.empty(16, 32, 128, dtype=torch.bfloat16)
    heads, parts = ta._reduce_outputs(rows, wanted, False, 128)
    assert heads == 2 and parts.constexprs["BXB"] == 256 and parts.constexprs["QLO"] == 0
    assert ta._reduce_outputs(rows, wanted, True, 128)[1].writes is False  # mixed batch


def test_num_splits_depends_only_on_rows() -> None:
    backend = TritonAttentionBackend(num_sms=132)
    assert backend.num_splits(1, 8, torch.device("cpu")) == 32
    assert backend.num_splits(64, 8, torch.device("cpu")) == 1
    assert backend.num_splits(8, 8, torch.device("cpu")) == 8
    assert TritonAttentionBackend(max_splits=4, num_sms=132).num_splits(1, 8, torch.device("cpu")) == 4


# ------------------------------------------------------------------------------------------ kernels alone


def test_prefill_kernel_alone_covers_decode_rows() -> None:
    """With skip_decode_rows=False the tiled kernel serves every row, whatever the query length."""
    case = make_case(MIXED, 2, 2, seed=9)
    ref_cache, tri_cache = case.cache.clone(), case.cache.clone()
    expected = TorchReferenceBackend().forward(case.q, case.k, case.v, ref_cache, case.md, case.scale, 6)
    tw.write_kv_cache_triton(case.k, case.v, tri_cache, case.md.slot_mapping)
    out = torch.empty_like(case.q)
    md = case.md
    tp.paged_attention_prefill(
        case.q, tri_cache, md.block_tables, md.seq_lens, md.query_start_loc, out,
        scale=case.scale, sliding_window=6, skip_decode_rows=False,
    )  # fmt: skip
    assert (out.float() - expected.float()).abs().max() <= 2e-2


def test_gpu_tile_configs() -> None:
    """The H200 tile sizes (not the interpreter's small default) on a batch that spans tiles."""
    case = make_case([(1, 90), (70, 70), (40, 100)], 1, 4, block_size=16, seed=13)
    ref_cache, tri_cache = case.cache.clone(), case.cache.clone()
    expected = TorchReferenceBackend().forward(case.q, case.k, case.v, ref_cache, case.md, case.scale)
    tw.write_kv_cache_triton(case.k, case.v, tri_cache, case.md.slot_mapping)
    out = torch.empty_like(case.q)
    md = case.md
    tp.paged_attention_prefill(
        case.q, tri_cache, md.block_tables, md.seq_lens, md.query_start_loc, out,
        scale=case.scale, config=tp.PrefillConfig(128, 32, 4, 2),
    )  # fmt: skip
    ta.paged_attention_decode(
        case.q, tri_cache, md.block_tables, md.seq_lens, out, scale=case.scale, num_splits=2,
        query_start_loc=md.query_start_loc, config=ta.DecodeConfig(64, 4, 2),
    )  # fmt: skip
    assert (out.float() - expected.float()).abs().max() <= 2e-2


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, FP8])
def test_write_kernel_matches_reference_bytes(cache_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    act = torch.float16 if cache_dtype == torch.float16 else torch.bfloat16
    ref_cache = torch.zeros(6, 2, 8, 3, 40, dtype=cache_dtype)  # odd head count, D not a power of 2
    k = (torch.randn(5, 3, 40, generator=gen) * 30).to(act)
    v = torch.randn(5, 3, 40, generator=gen).to(act)
    k[0, 0, 0], v[1, 1, 1] = 7.99 * 0.5, 1e-4  # a rounding carry and an fp8 subnormal
    slots = torch.tensor([9, 47, 8, 21, 40])
    write_kv_cache(k, v, ref_cache, slots, 0.5, 0.25)
    tri_cache = torch.zeros_like(ref_cache)
    tw.write_kv_cache_triton(k, v, tri_cache, slots, 0.5, 0.25)
    assert torch.equal(tri_cache.view(torch.uint8), ref_cache.view(torch.uint8))
    # A negative slot is a padding row: nothing is stored.
    tw.write_kv_cache_triton(k, v, tri_cache, torch.tensor([-1, -1, -1, -1, 3]), 0.5, 0.25)
    assert torch.equal(tri_cache[:, :, :3].view(torch.uint8), ref_cache[:, :, :3].view(torch.uint8))


@pytest.mark.parametrize(("cache_dtype", "rotary_dim"), [(torch.float16, 64), (torch.float16, 32), (FP8, 64)])
def test_rope_and_write_kernel_matches_rotary_then_write(cache_dtype: torch.dtype, rotary_dim: int) -> None:
    """One launch rotates q and k in place and stores the rotated k with v: the same bytes as the
    torch rotary embedding followed by the reference write (fp16: the interpreter rounds it
    exactly), padding rows (slot -1) rotated but not stored."""
    from paphos.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(3)
    rotary = RotaryEmbedding(64, 128, 10000.0, rotary_dim=rotary_dim)
    qkv = (torch.randn(5, (4 + 2 + 2) * 64, generator=gen) * 3).to(torch.float16)
    q, k, v = (t.view(5, -1, 64) for t in qkv.split([4 * 64, 2 * 64, 2 * 64], dim=1))
    positions = torch.tensor([0, 5, 17, 100, 127])
    slots = torch.tensor([9, 47, -1, 21, 40])
    ref_q, ref_k = rotary(positions, q.clone(), k.clone())
    ref_cache = torch.zeros(6, 2, 8, 2, 64, dtype=cache_dtype)
    write_kv_cache(ref_k[[0, 1, 3, 4]], v[[0, 1, 3, 4]], ref_cache, slots[[0, 1, 3, 4]], 0.5, 0.25)
    tri_cache = torch.zeros_like(ref_cache)
    tw.rope_and_write_kv_cache_triton(
        positions, q, k, v, tri_cache, slots, rotary.cos_sin_cache, rotary_dim, 0.5, 0.25
    )
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(tri_cache.view(torch.uint8), ref_cache.view(torch.uint8))


def test_backend_applies_the_rotary_it_is_handed() -> None:
    """forward(rotary=...) equals rotating first and calling forward without it, on both backends."""
    from paphos.layers.rotary import RotaryEmbedding

    case = make_case(MIXED, 2, 2, act_dtype=torch.float16, cache_dtype=torch.float16, seed=21)
    rotary = RotaryEmbedding(64, 256, 10000.0)
    positions = torch.cat([
        torch.arange(s - q_len, s) for q_len, s in MIXED
    ])
    for backend in (TorchReferenceBackend(), TritonAttentionBackend()):
        rq, rk = rotary(positions, case.q.clone(), case.k.clone())
        cache_a, cache_b = case.cache.clone(), case.cache.clone()
        expected = backend.forward(rq, rk, case.v, cache_a, case.md, case.scale)
        out = backend.forward(case.q.clone(), case.k.clone(), case.v, cache_b, case.md, case.scale,
                              rotary=rotary, positions=positions)
        assert torch.equal(out, expected), backend.name
        assert torch.equal(cache_a, cache_b), backend.name
