"""The fused Triton layer kernels against the torch layers they replace on a GPU.

On CPU the kernels run in the Triton interpreter (tests/conftest.py), so CI checks them on small
shapes. The kernels round like the torch reference, so bf16 results must agree to one ulp.
"""

import pytest
import torch

from paphos.layers import fused, x_int8, x_int8_blocks
from paphos.layers.activation import SiluAndMul
from paphos.layers.norm import RMSNorm
from paphos.layers.rotary import RotaryEmbedding
from paphos.layers.x_int8_outputs import Int8Outputs

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# The Triton interpreter truncates fp32 -> bf16 where a GPU rounds to nearest, so on CPU a result
# may sit a few bf16 ulps away (the truncations compound); on a GPU the only freedom is the fp32 summation order.
ULPS = 1 if DEVICE == "cuda" else 4


def _assert_close_bf16(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-3) -> None:
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=ULPS / 128, atol=atol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm_matches_rmsnorm(dtype: torch.dtype, with_residual: bool) -> None:
    torch.manual_seed(0)
    hidden = 96  # not a power of two: the kernel masks the tail of its block
    norm = RMSNorm(hidden, eps=1e-5, params_dtype=dtype)
    norm.weight.data = torch.randn(hidden, dtype=dtype)
    x = torch.randn(5, hidden, dtype=dtype) * 3
    residual = torch.randn(5, hidden, dtype=dtype) if with_residual else None
    want = norm(x, residual)
    out, summed = fused.add_rmsnorm(x.to(DEVICE), None if residual is None else residual.to(DEVICE),
                                    norm.weight.to(DEVICE), norm.eps)
    if with_residual:
        _assert_close_bf16(summed.cpu(), want[1])
        _assert_close_bf16(out.cpu(), want[0])
    else:
        assert summed is None
        _assert_close_bf16(out.cpu(), want)


@pytest.mark.parametrize("chunk", [32, 64])
def test_add_rmsnorm_in_column_chunks_matches_whole_rows(chunk: int) -> None:
    """A row normalised by several programs (each sums the whole row's squares, then writes its
    columns: how the norm runs where it writes int8 parts) gives the whole-row kernel's output and
    residual bit for bit; 96 columns in chunks of 64 mask half the second program."""
    torch.manual_seed(1)
    x, residual = (torch.randn(5, 96, dtype=torch.bfloat16).to(DEVICE) * 3 for _ in range(2))
    weight = torch.randn(96, dtype=torch.bfloat16).to(DEVICE)
    whole = fused.add_rmsnorm(x, residual, weight, 1e-5)
    chunked = fused.add_rmsnorm(x, residual, weight, 1e-5, chunk=chunk)
    assert torch.equal(chunked[0], whole[0]) and torch.equal(chunked[1], whole[1])


def test_add_rmsnorm_per_head_matches_rmsnorm() -> None:
    """Qwen3's q norm: q [T, heads, head_dim], a strided view of the fused qkv projection, is
    normalised head by head with one head_dim weight, and keeps its shape."""
    torch.manual_seed(3)
    tokens, heads, head_dim = 5, 3, 32
    qkv = torch.randn(tokens, (heads + 2) * head_dim, dtype=torch.bfloat16) * 3
    norm = RMSNorm(head_dim, eps=1e-6, params_dtype=torch.bfloat16)
    norm.weight.data = torch.randn(head_dim, dtype=torch.bfloat16)
    want = norm(qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim))
    q = qkv.to(DEVICE)[:, : heads * head_dim].reshape(tokens, heads, head_dim)
    out, summed = fused.add_rmsnorm(q, None, norm.weight.to(DEVICE), norm.eps)
    assert summed is None and out.shape == (tokens, heads, head_dim)
    _assert_close_bf16(out.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_and_mul_matches_reference(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x = torch.randn(7, 2 * 80, dtype=dtype) * 4
    want = SiluAndMul()(x)
    got = fused.silu_and_mul(x.to(DEVICE)).cpu()
    _assert_close_bf16(got, want)


@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
def test_rope_in_place_matches_reference(rotary_fraction: float) -> None:
    torch.manual_seed(2)
    head_dim, hq, hkv, tokens = 32, 6, 2, 9
    rope = RotaryEmbedding(head_dim, 256, 10000.0, rotary_dim=int(head_dim * rotary_fraction))
    # q and k as strided views of one fused projection, as the attention layer hands them over.
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head_dim, dtype=torch.bfloat16)
    positions = torch.randint(0, 256, (tokens,))
    q = qkv[:, : hq * head_dim].reshape(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hkv) * head_dim].reshape(tokens, hkv, head_dim)
    want_q, want_k = rope(positions, q.clone(), k.clone())
    dev_qkv = qkv.to(DEVICE)
    dq = dev_qkv[:, : hq * head_dim].reshape(tokens, hq, head_dim)
    dk = dev_qkv[:, hq * head_dim : (hq + hkv) * head_dim].reshape(tokens, hkv, head_dim)
    got_q, got_k = fused.rope_(positions.to(DEVICE), dq, dk, rope.cos_sin_cache.to(DEVICE), rope.rotary_dim)
    # x1*cos - x2*sin cancels: near zero an ulp of the products (|x| ~ 3) is the error scale.
    _assert_close_bf16(got_q.cpu(), want_q, atol=ULPS * 2**-6)
    _assert_close_bf16(got_k.cpu(), want_k, atol=ULPS * 2**-6)
    # In place: the fused buffer holds the rotated heads; the v part is untouched.
    torch.testing.assert_close(dev_qkv[:, (hq + hkv) * head_dim :].cpu(), qkv[:, (hq + hkv) * head_dim :])


@pytest.mark.parametrize("producer", ["add_rmsnorm", "silu_and_mul"])
@pytest.mark.parametrize("layout", [x_int8.Int8Layout(4, 4), x_int8.Int8Layout(4, 2), x_int8.Int8Layout(8, 4)])
def test_producers_write_the_int8_parts_of_their_output(producer: str, layout: x_int8.Int8Layout) -> None:
    """At one row, the norm and SiLU x mul write their output's int8 parts for the next GEMV (in its
    code layout) in the same kernel: the same words and scales as quantizing the output apart, and
    attached to the output; at several rows, none."""
    torch.manual_seed(3)
    # 1312 = 1024 + 288 columns: a second program (SiLU's column block, the norm's NORM_CHUNK)
    # whose last tile groups are masked
    width = 1312
    if producer == "add_rmsnorm":
        weight = torch.randn(width, dtype=torch.bfloat16).to(DEVICE)

        def run(rows: int) -> torch.Tensor:
            x = torch.randn(rows, width, dtype=torch.bfloat16).to(DEVICE)
            res = torch.randn(rows, width, dtype=torch.bfloat16).to(DEVICE)
            out, _ = fused.add_rmsnorm(x, res, weight, 1e-5, Int8Outputs(gemv=layout))
            return out
    else:

        def run(rows: int) -> torch.Tensor:
            return fused.silu_and_mul(torch.randn(rows, 2 * width, dtype=torch.bfloat16).to(DEVICE) * 3,
                                     Int8Outputs(gemv=layout))

    out = run(1)
    parts = x_int8.attached(out, layout)
    assert parts is not None
    want = x_int8.quantize(out[0], layout)
    used = [0, 2] if layout.lo == 8 else [0, 1, 2, 3]  # 8-bit codes have no b words
    assert torch.equal(parts.words[used], want.words[used]) and torch.equal(parts.scales, want.scales)
    assert x_int8.attached(out, x_int8.Int8Layout(8 if layout.lo == 4 else 4, 4)) is None  # another layout
    assert x_int8.attached(run(3), layout) is None


def _int4_blocks() -> "x_int8_blocks.BlockLayout":
    from paphos.quant.kernels.triton_int_i8 import x_layout

    return x_layout(4, 3, 32)


def _q4_k_blocks() -> "x_int8_blocks.BlockLayout":
    from paphos.quant.gguf.triton_gguf_i8 import x_layout

    return x_layout("Q4_K", 64)


def _q8_0_blocks() -> "x_int8_blocks.BlockLayout":
    """GGUF Q8_0's: the integer family's 8-bit blocks of 128 (W8 layers read them too)."""
    from paphos.quant.gguf.triton_gguf_i8 import I8_MAX_TOKENS, x_layout

    return x_layout("Q8_0", I8_MAX_TOKENS["Q8_0"])


@pytest.mark.parametrize("producer", ["add_rmsnorm", "silu_and_mul"])
@pytest.mark.parametrize("make_layout", [_int4_blocks, _q4_k_blocks, _q8_0_blocks], ids=["int4", "q4_k", "q8_0"])
def test_producers_write_the_int8_block_parts_of_their_output(producer: str, make_layout) -> None:  # noqa: ANN001
    """At the token counts where the next linear runs an int8 tensor-core GEMM, the norm and SiLU x
    mul write their output's parts in that GEMM's block layout in the same kernel: bit for bit what
    quantizing the output apart gives; at other token counts (and one row) none."""
    layout = make_layout()
    torch.manual_seed(4)
    # 1536 = 1024 + 512 columns: a second program (SiLU's column block, the norm's NORM_CHUNK)
    # with half its columns masked
    width = 1536
    weight = torch.randn(width, dtype=torch.bfloat16).to(DEVICE)

    def run(rows: int) -> torch.Tensor:
        if producer == "add_rmsnorm":
            x = torch.randn(rows, width, dtype=torch.bfloat16).to(DEVICE)
            res = torch.randn(rows, width, dtype=torch.bfloat16).to(DEVICE)
            return fused.add_rmsnorm(x, res, weight, 1e-5, Int8Outputs(blocks=layout))[0]
        return fused.silu_and_mul(torch.randn(rows, 2 * width, dtype=torch.bfloat16).to(DEVICE) * 3,
                                 Int8Outputs(blocks=layout))

    for rows in (layout.min_tokens, 5):
        out = run(rows)
        fed = x_int8.attached(out, layout)
        assert fed is not None
        want = x_int8_blocks.quantize(out.clone(), layout)  # a copy carries none: the standalone launch
        for got, ref in zip(fed, want, strict=True):
            assert torch.equal(got, ref)
        ref = x_int8_blocks.reference_quantize(out.cpu(), layout.make_order(), layout.xb, layout.sum_every)
        assert torch.equal(fed[0].cpu(), ref[0]) and torch.equal(fed[2].cpu(), ref[2])
    assert x_int8.attached(run(1), layout) is None
    assert x_int8.attached(run(layout.max_tokens + 1), layout) is None
