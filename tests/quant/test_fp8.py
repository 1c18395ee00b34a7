"""FP8 weights: the activation quantization (torch, and the Triton kernel: interpreted on CPU,
compiled where a GPU is present) bit for bit against plain torch; the small-M Triton GEMM that
fp8_linear runs at decode sizes against `reference_fp8_linear` (float32 output within 1e-5 of
the largest output on CPU); `reference_fp8_linear` on hand-computed numbers; and tiny Llamas
loaded through `Fp8Config` (compressed-tensors FP8_DYNAMIC, the `fp8` format with static
activations or with block-wise scales, `-q fp8`) against HF `transformers` running the emulation
the producing tools use: linear weights replaced by their dequantized fp8 values, linear inputs
rounded through fp8 (quant-toolchain.md §3). Logits agree within 1e-3 in float32. Block-wise
scales also through the kernels the GPU runs (`fp8_block_linear`, interpreted on CPU).

On CPU every FP8 layer is dequantized at load (there is no FP8 GEMM); the compiled kernels and
`torch._scaled_mm` are checked against `reference_fp8_linear` on the H200 by
benchmarks/bench_fp8_gpu.py.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, Qwen3Config
from transformers import LlamaForCausalLM as HFLlama
from transformers import Qwen3ForCausalLM as HFQwen3

from paphos.attention.torch_ref import TorchReferenceBackend
from paphos.layers.linear import LinearBase, QKVLinear
from paphos.loader import iter_safetensors
from paphos.models.errors import WeightLoadError
from paphos.models.registry import resolve_model_class
from paphos.quant.errors import QuantConfigError
from paphos.quant.fp8 import DEQUANTIZED, Fp8Config, Fp8LinearMethod
from paphos.quant.kernels import fp8_blocks, split_k
from paphos.quant.kernels.fp8 import quantize_per_tensor, quantize_per_token, reference_fp8_linear
from tests.device_triton import TRITON_IDS, TRITONS, compile_env
from tests.models.paged import BLOCK, NUM_BLOCKS, hf_logits, run_schedule

FP8 = torch.float8_e4m3fn
TOL = 1e-3


def _plain_quantize(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The references' activation math, row by row: s = max|x| / 448 (float32 eps for zero rows),
    correctly rounded (a tensor divisor: on CUDA torch multiplies by the reciprocal of a scalar)."""
    x = x.float()
    if scale is None:
        amax = torch.stack([row.abs().max() for row in x])
        scale = torch.clamp(amax / torch.full_like(amax, 448.0), min=torch.finfo(torch.float32).eps)
    scale = scale.to(x.device).reshape(-1, 1).expand(x.shape[0], 1)
    return torch.clamp(x / scale, min=-448.0, max=448.0).to(FP8), scale


def _fake_quantize(x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    q, s = _plain_quantize(flat, scale)
    return (q.float() * s).reshape(x.shape)


def _fake_quantize_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """Per token and run of `group` values along the last dim (the last run may be short)."""
    flat = x.reshape(-1, x.shape[-1])
    runs = [_fake_quantize(flat[:, a : a + group]) for a in range(0, flat.shape[1], group)]
    return torch.cat(runs, dim=1).reshape(x.shape)


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


# ---------------------------------------------------------------- activation quantization


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_per_token_matches_plain_torch(dtype: torch.dtype) -> None:
    x = (torch.randn(6, 96, generator=torch.Generator().manual_seed(0)) * 5).to(dtype)
    x[2] = 0  # an all-zero row: scale eps, codes 0
    x[4] *= 1e-3
    q, s = quantize_per_token(x)
    want_q, want_s = _plain_quantize(x)
    assert q.dtype == FP8 and q.shape == x.shape and s.dtype == torch.float32 and s.shape == (6, 1)
    assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(s, want_s)
    # every row uses its full range: its largest |x| lands on 448
    assert torch.equal(q.float().abs().amax(dim=1)[[0, 1, 3, 4, 5]], torch.full((5,), 448.0))


def test_quantize_per_tensor_saturates() -> None:
    x = torch.tensor([[5.0, -0.123, 0.0, -9.0]])
    q, s = quantize_per_tensor(x, torch.tensor([0.01]))
    assert q.float().tolist() == [[448.0, -12.0, 0.0, -448.0]] and torch.equal(s, torch.tensor([[0.01]]))


@pytest.fixture(scope="module")
def kernel() -> tuple[object, str]:
    """(the kernel module, the device its inputs go to): compiled on CUDA where there is a GPU,
    else run by the Triton interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET
    before any kernel is decorated)."""
    pytest.importorskip("triton")
    import paphos.quant.kernels.fp8 as module

    return module, "cuda" if torch.cuda.is_available() else "cpu"


# one block, a masked block, a row in slices (the last masked), the two-pass loop
@pytest.mark.parametrize("k", [64, 100, 3000, 20000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_quantize_is_bit_exact(kernel, k: int, dtype: torch.dtype) -> None:  # noqa: ANN001
    module, device = kernel
    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(4, k + 8, generator=gen) * 3).to(dtype)[:, 3 : 3 + k].to(device)  # row stride != K
    x[1] = 0
    x[2, :6] = torch.tensor([-0.0, 1e-30, -1e-6, 3e-3, 2.0**-15, -1.0]).to(dtype)
    # Dynamic, static with saturation, then given per row (a row-parallel rank's whole-row scales).
    per_row = torch.tensor([[0.004], [1.0], [0.5], [0.02]], device=device)
    for scale in (None, torch.tensor([0.004], device=device), per_row):
        q, s = module.triton_quantize(x, scale)
        want_q, want_s = _plain_quantize(x, scale)
        assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(s, want_s)


def test_triton_rounding_of_every_bfloat16_value(kernel) -> None:  # noqa: ANN001
    """Every finite bf16 value in [-448, 448] rounds to torch's e4m3 (ties to even, subnormals,
    signed zero): the kernel's rounding covers the whole input space of bf16 models."""
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = values[values.float().abs() <= 448.0]
    module, device = kernel
    q, _ = module.triton_quantize(values.view(1, -1).to(device), torch.tensor([1.0], device=device))
    assert torch.equal(_bits(q).cpu(), _bits(values.float().to(FP8)).view(1, -1))


# ---------------------------------------------------------------- the small-M kernel (decode)

# fp32 output: on CPU (interpreted, fp32 operands) the kernel differs from the reference only in
# fp32 summation order (~1e-7 of the largest output here), where one fp8 code off by a step moves
# an output by ~1e-3 of it. On a GPU the fp8 MMA adds with fewer bits than fp32 (see
# `_small_m_kernel`; 4.5e-5 measured at K = 4096): looser there.
SMALL_TOL = {"cpu": 1e-5, "cuda": 2e-4}


def _small_problem(
    m: int, n: int, k: int, seed: int, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [m, k] bf16 (row 0 all zeros when m > 2: scale eps, every code 0), an fp8 weight quantized
    per row as the checkpoints are, its scales, a bf16 bias."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * 2).to(torch.bfloat16)
    if m > 2:
        x[0] = 0
    w = torch.randn(n, k, generator=gen) * 0.05
    ws = w.abs().amax(dim=1) / 448.0
    wq = (w / ws[:, None]).clamp(-448, 448).to(FP8)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    return x.to(device), wq.to(device), ws.to(device), bias.to(device)


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 37, 100),  # odd N: rows past N masked; K inside one block, masked
        (1, 64, 512),  # whole K blocks (two)
        (3, 37, 300),  # K tail: 300 = 256 + 44
        (20, 70, 600),  # 20 tokens padded to 32; 70 rows: a second, mostly masked, row block
        (70, 40, 256),  # 70 tokens: two token blocks of 64
    ],
)
@pytest.mark.parametrize("static", [False, True])
def test_small_m_linear_matches_reference(kernel, m: int, n: int, k: int, static: bool) -> None:  # noqa: ANN001
    module, device = kernel
    x, w, ws, bias = _small_problem(m, n, k, m * n + k, device)
    # static: half the dynamic scale of the largest row, so its larger values saturate at 448
    scale = (x.float().abs().max() / 896.0).reshape(1) if static else None
    for b in (None, bias):
        y = module.small_m_linear(x, w, ws, scale, torch.float32, b)
        ref = reference_fp8_linear(x, w, ws, scale, torch.float32, b)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        err = (y - ref).abs().max().item()
        assert err <= SMALL_TOL[device] * ref.abs().max().item(), err
        if m > 2:  # the all-zero row: exactly the bias (or zero)
            assert torch.equal(y[0], torch.zeros(n, device=device) if b is None else b.float())


@pytest.mark.parametrize("split", [2, 3])
def test_small_m_kernel_split_k(kernel, split: int) -> None:  # noqa: ANN001
    """K split over programs (the last one of a tile sums the float32 partials, applies the
    scales and resets its counter): the same numbers as the reference at one token and several,
    dynamic and static activations, K with a tail."""
    module, device = kernel
    cfg = module.SmallMConfig(64, 64, split_k=split)
    for m, static in ((1, False), (3, True), (20, False)):
        x, w, ws, bias = _small_problem(m, 70, 300, m + split, device)
        scale = (x.float().abs().max() / 896.0).reshape(1) if static else None
        y = module.small_m_linear(x, w, ws, scale, torch.float32, bias, cfg)
        ref = reference_fp8_linear(x, w, ws, scale, torch.float32, bias)
        assert (y - ref).abs().max().item() <= SMALL_TOL[device] * ref.abs().max().item(), (m, static)
        assert module.split_for(m, 70, 300, cfg) == split
        if device == "cpu":
            assert not split_k.counters(torch.device(device)).any()  # every counter back to zero


def test_small_m_split_rule(kernel) -> None:  # noqa: ANN001
    """`split_for`: the narrow Llama-3-8B layers get K slices until about two programs per SM;
    gate|up (448 row tiles) gets none."""
    module, _ = kernel
    cfg = module.SmallMConfig()
    assert module.split_for(1, 4096, 4096, cfg) == 4  # o: 64 tiles
    assert module.split_for(1, 4096, 14336, cfg) == 4  # down
    assert module.split_for(1, 6144, 4096, cfg) == 2  # q|k|v: 96 tiles
    assert module.split_for(1, 28672, 4096, cfg) == 1
    assert module.split_for(1, 4096, 512, cfg) == 1  # two K steps: no slice of one


@pytest.mark.parametrize(("n", "k"), [(37, 100), (64, 512), (5, 14336)])  # odd N, K tails, down's K
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_gemv_linear_matches_reference(kernel, n: int, k: int, static: bool, rows: int) -> None:  # noqa: ANN001
    """The one-token GEMV: exact products summed in fp32, so within fp32 summation order of the
    reference on CPU and GPU alike, rows past N (N not a multiple of the rows a program takes)
    neither computed wrong nor stored."""
    module, device = kernel
    x, w, ws, bias = _small_problem(1, n, k, n + k + rows, device)
    scale = (x.float().abs().max() / 896.0).reshape(1) if static else None
    for b in (None, bias):
        out = module.gemv_linear(x, w, ws, scale, torch.float32, b, module.GemvConfig(rows, 4))
        ref = reference_fp8_linear(x, w, ws, scale, torch.float32, b)
        assert out.shape == (1, n)
        assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_fp8_linear_picks_the_kernel_by_tokens(kernel, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """fp8_linear at decode sizes (3-D input, bf16 output): one token through the GEMV, a few
    through the small-M kernel, a token whose row is longer than GEMV_MAX_K through the small-M
    kernel too; within one bf16 step (2^-7 relative) of the reference: the Triton interpreter's
    fp32 -> bf16 cast truncates (triton 3.9, `fp_downcast_rounding` too), where the GPU's rounds
    to nearest."""
    module, device = kernel
    taken: list[str] = []
    for name in ("gemv_linear", "small_m_linear"):

        def spy(*args, _real=getattr(module, name), _name=name, **kwargs):
            taken.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    monkeypatch.setattr(module, "GEMV_MAX_K", 256)
    for m, k in ((1, 256), (6, 256), (1, 300)):
        x, w, ws, bias = _small_problem(m, 37, k, m, device)
        y = module.fp8_linear(x.view(1, m, k), w, ws, None, torch.bfloat16, bias)
        ref = reference_fp8_linear(x, w, ws, None, torch.float32, bias)
        assert y.shape == (1, m, 37) and y.dtype == torch.bfloat16
        torch.testing.assert_close(y.view(m, 37).float(), ref, rtol=2**-7, atol=1e-6)
    assert taken == ["gemv_linear", "small_m_linear", "small_m_linear"]


# ---------------------------------------------------------------- block-wise scales


@pytest.mark.parametrize(("k", "group"), [(64, 64), (100, 32), (300, 128), (4096, 128)])
def test_triton_quantize_groups_is_bit_exact(kernel, k: int, group: int) -> None:  # noqa: ANN001
    """Per token and run of `group` values (the last run short where K is not a multiple): the
    kernel's codes and scales are the torch reference's, whose numbers are plain per-run torch."""
    module, device = kernel
    gen = torch.Generator().manual_seed(k + group)
    x = (torch.randn(3, k + 5, generator=gen) * 3).to(torch.bfloat16)[:, 2 : 2 + k].to(device)
    x[1, :group] = 0  # an all-zero run: scale eps, codes 0
    q, s = fp8_blocks.triton_quantize_groups(x, group)
    want_q, want_s = module.reference_quantize_groups(x, group)
    assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(s, want_s)
    plain = torch.cat([_fake_quantize(x[:, a : a + group].float()) for a in range(0, k, group)], dim=1)
    torch.testing.assert_close((q.float() * s.repeat_interleave(group, 1)[:, :k]).cpu(), plain.cpu(), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("m", "n", "k", "rows", "cols"),
    [
        (1, 70, 300, 32, 64),  # the GEMV: short last row block and K block
        (1, 64, 512, 128, 128),  # one row block, whole K blocks
        (3, 70, 300, 32, 64),  # the small-M kernel
        (20, 64, 512, 64, 128),  # K steps of 128 inside blocks of 128
        (70, 40, 256, 16, 32),  # two token tiles, blocks of 32 (K steps of 32)
        (1, 6, 8320, 128, 128),  # a row longer than GEMV_LONG_K: one row a program
    ],
)  # fmt: skip
def test_fp8_block_linear_matches_reference(kernel, m: int, n: int, k: int, rows: int, cols: int) -> None:  # noqa: ANN001
    """Block-wise weight scales, activations per token and run of `cols` values: the GEMV at one
    token, the small-M kernel (K split too) above, against the dequantized float32 emulation."""
    module, device = kernel
    gen = torch.Generator().manual_seed(m * n + k)
    x = (torch.randn(m, k, generator=gen) * 2).to(torch.bfloat16).to(device)
    w = torch.randn(n, k, generator=gen) * 0.05
    scales = torch.rand(-(-n // rows), -(-k // cols), generator=gen) * 1e-3 + 1e-4
    spread = scales.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
    wq = (w / spread).clamp(-448, 448).to(FP8)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).to(device)
    ref = torch.nn.functional.linear(module.fake_quantize(x.float().cpu(), group=cols), wq.float() * spread)
    blocks = fp8_blocks.BlockScales(scales.to(device), rows, cols)
    configs = [module.DEFAULT_SMALL_M] + ([module.SmallMConfig(32, 64, split_k=3)] if m > 1 else [])
    for cfg in configs:
        for b in (None, bias):
            y = fp8_blocks.fp8_block_linear(x, wq.to(device), blocks, torch.float32, b, cfg)
            want = ref + (0 if b is None else b.float().cpu())
            assert y.shape == (m, n)
            assert (y.cpu() - want).abs().max().item() <= SMALL_TOL[device] * want.abs().max().item()


def test_quantize_groups_scales_by_column(kernel) -> None:  # noqa: ANN001
    """The layout cuBLAS reads (strides (1, M)): the same codes and scales as row by row."""
    _, device = kernel
    x = (torch.randn(5, 300, generator=torch.Generator().manual_seed(3)) * 2).to(torch.bfloat16).to(device)
    q, s = fp8_blocks.triton_quantize_groups(x, 128)
    q_col, s_col = fp8_blocks.triton_quantize_groups(x, 128, scales_by_column=True)
    ref_q, ref_s = fp8_blocks.quantize_per_group(x.cpu(), 128, scales_by_column=True)
    assert s_col.shape == (5, 3) and s_col.stride() == (1, 5) and ref_s.stride() == (1, 5)
    assert torch.equal(_bits(q_col), _bits(q)) and torch.equal(s_col, s) and torch.equal(ref_s, s.cpu())


def test_fp8_block_linear_hands_more_tokens_to_cublas(kernel, monkeypatch) -> None:  # noqa: ANN001
    """With `BlockScales.cublas`, above SMALL_M_MAX tokens the product is cuBLAS's block-scaled
    `torch._scaled_mm`, called with the operands and scale layouts torch documents for it (x's
    scales [M, K / 128] by column, W^T and its scales [K / 128, N / 128] column-major, no copies);
    up to SMALL_M_MAX the Triton kernels run. The stand-in multiplies as cuBLAS does."""
    module, device = kernel
    m_big, n, k = module.SMALL_M_MAX + 8, 256, 512
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(n, k, generator=gen) * 0.05
    scales = torch.rand(n // 128, k // 128, generator=gen) * 1e-3 + 1e-4
    spread = scales.repeat_interleave(128, 0).repeat_interleave(128, 1)
    wq = (w / spread).clamp(-448, 448).to(FP8).to(device)
    blocks = fp8_blocks.BlockScales(scales.to(device), 128, 128, cublas=True)
    calls = []

    def scaled_mm(a, b, scale_a, scale_b, out_dtype):  # noqa: ANN001, ANN202
        calls.append(a.shape[0])
        assert a.dtype == FP8 and b.data_ptr() == wq.data_ptr() and b.stride() == (1, k)
        assert scale_a.shape == (a.shape[0], k // 128) and scale_a.stride() == (1, a.shape[0])
        assert scale_b.shape == (k // 128, n // 128) and scale_b.stride() == (1, k // 128)
        x32 = a.float() * scale_a.repeat_interleave(128, 1)
        return (x32 @ (b.float() * scale_b.repeat_interleave(128, 0).repeat_interleave(128, 1))).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    bias = torch.randn(n, generator=gen).to(device)
    for m in (m_big, module.SMALL_M_MAX):
        x = (torch.randn(m, k, generator=gen) * 2).to(torch.bfloat16).to(device)
        want = torch.nn.functional.linear(module.fake_quantize(x.float().cpu(), group=128), wq.float().cpu() * spread)
        y = fp8_blocks.fp8_block_linear(x, wq, blocks, torch.float32, bias)
        assert (y.cpu() - want - bias.cpu()).abs().max().item() <= SMALL_TOL[device] * want.abs().max().item()
    assert calls == [m_big]


def test_cublas_blocks_unsupported_says_why() -> None:
    """Only 128 x 128 blocks on Hopper go to cuBLAS; elsewhere the reason, and the Triton kernels."""
    cpu = torch.device("cpu")
    assert "128 x 128" in fp8_blocks.cublas_blocks_unsupported(cpu, torch.bfloat16, 64, 64, 256, 512)
    assert "cpu" in fp8_blocks.cublas_blocks_unsupported(cpu, torch.bfloat16, 128, 128, 256, 512)


# ---------------------------------------------------------------- reference_fp8_linear by hand


def test_reference_fp8_linear_by_hand() -> None:
    weight = torch.tensor([[1.0, -2.0], [0.5, 4.0]]).to(FP8)
    weight_scale = torch.tensor([2.0, 0.25])
    x = torch.tensor([[1.0, -3.0]])
    # dynamic: s = 3 / 448; 1 / s = 149.33 rounds to 144 (e4m3 steps of 16 in [128, 256)), -3 -> -448
    xq = torch.tensor([144.0 * 3 / 448, -3.0])
    w = torch.tensor([[2.0, -4.0], [0.125, 1.0]])
    y = reference_fp8_linear(x, weight, weight_scale, None, torch.float32, bias=torch.tensor([0.5, -1.0]))
    torch.testing.assert_close(y, (xq @ w.T + torch.tensor([0.5, -1.0]))[None], rtol=0, atol=1e-6)
    # static 0.01: 5 saturates at 4.48, -0.123 -> -12 * 0.01
    y = reference_fp8_linear(
        torch.tensor([[5.0, -0.123]]), weight, weight_scale, torch.tensor(0.01), torch.float32
    )
    torch.testing.assert_close(y, (torch.tensor([4.48, -0.12]) @ w.T)[None], rtol=0, atol=1e-6)


# ---------------------------------------------------------------- a merged layer, shard by shard


def test_merged_layer_takes_each_shards_scales() -> None:
    """q|k|v with per-tensor weight scales of different shapes (0-d, [1]) and dtypes, and static
    input scales: each shard's rows get its own weight scale; the input scale is the max."""
    gen = torch.Generator().manual_seed(0)
    layer = QKVLinear(32, 16, 2, 1, quant_method=Fp8LinearMethod("static"))
    shards = {"q": 32, "k": 16, "v": 16}
    scales = {
        "q": torch.tensor(0.02),
        "k": torch.tensor([0.5], dtype=torch.bfloat16),
        "v": torch.tensor([0.125]),
    }
    input_scales = {"q": torch.tensor(0.03), "k": torch.tensor([0.05]), "v": torch.tensor([0.04])}
    weights = {
        s: torch.randn(n, 32, generator=gen).mul(100).clamp(-448, 448).to(FP8) for s, n in shards.items()
    }
    for s in shards:
        layer.weight.weight_loader(layer.weight, weights[s], s)
        layer.weight_scale.weight_loader(layer.weight_scale, scales[s], s)
        layer.input_scale.weight_loader(layer.input_scale, input_scales[s], s)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.quant_method.kernel == DEQUANTIZED
    assert torch.equal(layer.input_scale, torch.tensor([0.05]))
    want_w = torch.cat([weights[s].float() * scales[s].float() for s in shards])
    torch.testing.assert_close(layer.weight, want_w, rtol=0, atol=0)
    x = torch.randn(5, 32, generator=gen)
    torch.testing.assert_close(layer(x), _fake_quantize(x, torch.tensor(0.05)) @ want_w.T, rtol=0, atol=1e-5)


def test_checkpoint_weight_must_be_fp8() -> None:
    layer = QKVLinear(32, 16, 2, 1, quant_method=Fp8LinearMethod("dynamic"))
    with pytest.raises(ValueError, match="F8_E4M3"):
        layer.weight.weight_loader(layer.weight, torch.zeros(32, 32, dtype=torch.bfloat16), "q")


# ---------------------------------------------------------------- tiny Llamas against HF

SMALL = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # fmt: skip
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _hf_model(arch: str = "llama") -> tuple[LlamaConfig | Qwen3Config, HFLlama | HFQwen3]:
    torch.manual_seed(0)
    if arch == "qwen3":  # heads of 32: q_proj has 128 rows for a hidden size of 64
        cfg, cls = Qwen3Config(**SMALL, head_dim=32, architectures=["Qwen3ForCausalLM"]), HFQwen3
    else:
        cfg, cls = LlamaConfig(**SMALL, architectures=["LlamaForCausalLM"]), HFLlama
    cfg._attn_implementation = "eager"
    hf = cls(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
    return cfg, hf


def _linears(hf: HFLlama) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in hf.named_modules() if n.rsplit(".", 1)[-1] in PROJECTIONS}


def _input_amax(hf: HFLlama, ids: torch.Tensor) -> dict[str, float]:
    """Static calibration as llm-compressor's min-max observer does it: max |input| per linear."""
    amax: dict[str, float] = {}
    hooks = [
        m.register_forward_pre_hook(lambda _, a, n=n: amax.__setitem__(n, a[0].abs().max().item()))
        for n, m in _linears(hf).items()
    ]
    hf_logits(hf, ids)
    for h in hooks:
        h.remove()
    return amax


def _emulation(
    hf: HFLlama,
    weights: dict[str, torch.Tensor],
    input_scales: dict[str, torch.Tensor | int | None],
    ours_inputs: dict[str, torch.Tensor],
) -> HFLlama:
    """HF with those linears' weights replaced by `weights` (dequantized fp8) and their inputs
    rounded through fp8 (per token, with the static scale, or per token and group of an int's
    values).

    The rounding is applied to our model's input of the same layer (`ours_inputs`, checked to be
    within 1e-4 of HF's own): two float32 computations that differ by 1e-7 can put a value on
    either side of an fp8 rounding boundary, a jump of 1/16 of it that moves the logits far more
    than the tolerance, and which value lands near a boundary depends on the CPU's summation
    order. Sharing the rounding decisions keeps the comparison exact on every machine."""
    emu = copy.deepcopy(hf)
    linears = _linears(emu)

    def hook(name: str) -> Callable:
        def fake_quantize_ours(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
            x = args[0]
            ours = ours_inputs[name].view(x.shape)
            torch.testing.assert_close(x, ours, rtol=0, atol=1e-4)
            scale = input_scales[name]
            return (_fake_quantize_groups(ours, scale) if isinstance(scale, int) else _fake_quantize(ours, scale),)

        return fake_quantize_ours

    with torch.no_grad():
        for name, w in weights.items():
            linears[name].weight.copy_(w)
            linears[name].register_forward_pre_hook(hook(name))
    return emu


def _write(path: Path, cfg: LlamaConfig, tensors: dict[str, torch.Tensor], qc: dict | None) -> Path:
    path.mkdir()
    config = cfg.to_dict() | ({"quantization_config": qc} if qc else {})
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def _load(
    path: Path, cfg: LlamaConfig, quant_config: Fp8Config
) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    model = resolve_model_class(cfg)(
        cfg, torch.float32, TorchReferenceBackend(), quant_config=quant_config
    ).eval()
    model.load_weights(iter_safetensors(path, show_progress=False))
    caches = [torch.zeros(model.kv_cache_shape_per_layer(NUM_BLOCKS, BLOCK)) for _ in range(model.num_layers)]
    return model, caches


def _compare(
    model: torch.nn.Module,
    caches: list[torch.Tensor],
    hf: HFLlama,
    weights: dict[str, torch.Tensor],
    input_scales: dict[str, torch.Tensor | int | None],
) -> None:
    """Our logits (a prompt chunk, then decode steps) against HF's emulation of the same fp8 model."""
    inputs: dict[str, list[torch.Tensor]] = {}
    hooks = [
        m.register_forward_pre_hook(lambda _, a, n=n: inputs.setdefault(n, []).append(a[0].clone()))
        for n, m in model.named_modules()
        if isinstance(m, LinearBase)
    ]
    ids = torch.randint(0, SMALL["vocab_size"], (8,), generator=torch.Generator().manual_seed(2))
    ours = run_schedule(model, caches, [ids], [[6], [1], [1]])[0]
    for h in hooks:
        h.remove()
    merged = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
              "up_proj": "gate_up_proj"}  # fmt: skip
    ours_inputs = {}
    for name in weights:
        parent, _, leaf = name.rpartition(".")
        ours_inputs[name] = torch.cat(inputs[f"{parent}.{merged.get(leaf, leaf)}"])
    emu = _emulation(hf, weights, input_scales, ours_inputs)
    torch.testing.assert_close(ours, hf_logits(emu, ids), rtol=0, atol=TOL)


CT_DYNAMIC = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj$"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True},
    }},
}  # fmt: skip


def test_compressed_tensors_fp8_dynamic_matches_emulation(tmp_path: Path) -> None:
    """FP8_DYNAMIC as llm-compressor writes it: F8_E4M3 weights, BF16 [N, 1] per-channel scales,
    per-token activations; one ignored layer stays float (matched by a 're:' entry)."""
    cfg, hf = _hf_model()
    tensors = dict(hf.state_dict())
    dequantized = {}
    for name, m in _linears(hf).items():
        if name == "model.layers.1.mlp.down_proj":
            continue
        scale = (m.weight.abs().amax(dim=1, keepdim=True) / 448.0).to(torch.bfloat16)
        q = (m.weight / scale.float()).clamp(-448.0, 448.0).to(FP8)
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"] = q, scale
        dequantized[name] = q.float() * scale.float()
    path = _write(tmp_path / "ct", cfg, tensors, CT_DYNAMIC)
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    config = Fp8Config.from_compressed_tensors(qc)
    model, caches = _load(path, cfg, config)
    assert model.model.layers[1].mlp.down_proj.quant_method.__class__.__name__ == "UnquantizedLinearMethod"
    assert model.lm_head.quant_method is None
    assert config.summary()[0].startswith("FP8 (compressed-tensors float-quantized, dynamic activations): "
                                       "dequantized at load for 7 layers (no FP8 GEMM on cpu)")  # fmt: skip
    _compare(model, caches, hf, dequantized, dict.fromkeys(dequantized))


def test_fp8_format_static_per_tensor_matches_emulation(tmp_path: Path) -> None:
    """The `fp8` format with static activations: per-tensor F32 weight scales (0-d as ModelOpt
    writes them, [1] as llm-compressor does) differing between q/k/v and gate/up, calibrated
    per-tensor input scales."""
    cfg, hf = _hf_model()
    calib = torch.randint(0, SMALL["vocab_size"], (24,), generator=torch.Generator().manual_seed(5))
    amax = _input_amax(hf, calib)
    tensors = dict(hf.state_dict())
    dequantized, input_scales = {}, {}
    for i, (name, m) in enumerate(_linears(hf).items()):
        scale = m.weight.abs().max() / 448.0
        q = (m.weight / scale).clamp(-448.0, 448.0).to(FP8)
        input_scales[name] = torch.tensor(amax[name] / 448.0)
        shape = () if i % 2 else (1,)
        tensors[f"{name}.weight"] = q
        tensors[f"{name}.weight_scale"] = scale.reshape(shape)
        tensors[f"{name}.input_scale"] = input_scales[name].reshape(shape)
        dequantized[name] = q.float() * scale
    qc = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": []}
    config = Fp8Config.from_hf_quant_config(qc)
    model, caches = _load(_write(tmp_path / "fp8", cfg, tensors, qc), cfg, config)
    # 4 layers per decoder layer (qkv, o, gate_up, down), all dequantized at load on CPU
    assert sum(m.kernel == DEQUANTIZED for m in config.methods.values()) == 8
    _compare(model, caches, hf, dequantized, input_scales)


def _block_quantize(w: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 codes, float32 amax / 448 per block [ceil(N / rows), ceil(K / cols)]), as
    transformers' FineGrainedFP8 quantizer writes them (short blocks at the edges)."""
    (n, k), (rows, cols) = w.shape, block
    padded = torch.nn.functional.pad(w, (0, -k % cols, 0, -n % rows))
    scale = padded.view(-(-n // rows), rows, -(-k // cols), cols).abs().amax(dim=(1, 3)) / 448.0
    spread = scale.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
    return (w / spread).clamp(-448.0, 448.0).to(FP8), scale


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp8_format_block_scales_match_emulation(tmp_path: Path, arch: str) -> None:
    """The `fp8` format with `weight_block_size` (DeepSeek-V3, Qwen3-FP8): a float32 scale per
    block as `weight_scale_inv`, activations per token and run of the block's columns. 24 x 48
    blocks leave short blocks at every edge (Llama: q 64 rows, k / v 32, K = 64 and 128; Qwen3,
    whose q/k norms stay float: q 128 rows, k / v 64); the weights equal transformers' own
    dequantizer's bit for bit, and the logits its emulation."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    cfg, hf = _hf_model(arch)
    block = [24, 48]
    tensors = dict(hf.state_dict())
    dequantized = {}
    for name, m in _linears(hf).items():
        q, scale = _block_quantize(m.weight.detach(), block)
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"] = q, scale
        dequantized[name] = _dequantize_fp8_weight(q, scale, block, torch.float32)
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": block}
    config = Fp8Config.from_hf_quant_config(qc)
    model, caches = _load(_write(tmp_path / "block", cfg, tensors, qc), cfg, config)
    assert config.summary()[0].startswith("FP8 (fp8 checkpoint, 24x48 weight blocks, dynamic activations per 48 "
                                          "values): dequantized at load for 8 layers")  # fmt: skip
    attn = model.model.layers[0].self_attn.qkv_proj
    want = torch.cat([dequantized[f"model.layers.0.self_attn.{p}"] for p in ("q_proj", "k_proj", "v_proj")])
    torch.testing.assert_close(attn.weight, want, rtol=0, atol=0)
    assert not hasattr(attn, "weight_scale_inv")  # the scales go once applied
    _compare(model, caches, hf, dequantized, dict.fromkeys(dequantized, block[1]))


@pytest.mark.parametrize(("block", "kernel_taken"), [([32, 32], True), ([24, 32], False)])
def test_block_scales_through_the_fp8_kernels(
    kernel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: list[int], kernel_taken: bool  # noqa: ANN001
) -> None:  # fmt: skip
    """The GPU's path, run by the Triton interpreter (the FP8 GEMM made available on CPU): 32 x 32
    blocks, on which every shard starts, keep the fp8 weight and one scale per block and run
    `fp8_block_linear` (the GEMV at the decode steps, the small-M kernel for the prompt); 24-row
    blocks, which k_proj's rows start inside of in the merged q|k|v, fall back to the
    dequantized weight there and say why. Both match the emulation."""
    import paphos.quant.fp8 as fp8_method

    module, _ = kernel
    monkeypatch.setattr(fp8_method, "scaled_mm_unsupported", lambda *args: None)
    calls: list[int] = []
    real = fp8_method.fp8_block_linear
    monkeypatch.setattr(fp8_method, "fp8_block_linear", lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k))
    cfg, hf = _hf_model()
    tensors = dict(hf.state_dict())
    dequantized = {}
    for name, m in _linears(hf).items():
        q, scale = _block_quantize(m.weight.detach(), block)
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"] = q, scale
        dequantized[name] = q.float() * scale.repeat_interleave(block[0], 0)[: q.shape[0]].repeat_interleave(block[1], 1)
    qc = {"quant_method": "fp8", "weight_block_size": block}
    config = Fp8Config.from_hf_quant_config(qc)
    model, caches = _load(_write(tmp_path / "block", cfg, tensors, qc), cfg, config)
    attn = model.model.layers[0].self_attn.qkv_proj
    if kernel_taken:
        assert attn.weight.dtype == FP8 and attn.weight_scale_inv.shape == (4, 2)  # (64 + 32 + 32) / 32 x 64 / 32
        assert config.summary()[0].endswith("block-scaled FP8 GEMM (Triton) for 8 layers")
    else:
        assert attn.weight.dtype == torch.float32 and config.methods["model.layers.0.self_attn.qkv_proj"].reason == (
            "a shard or rank starting inside a 24x32 weight block")  # fmt: skip
    _compare(model, caches, hf, dequantized, dict.fromkeys(dequantized, block[1]))
    assert {1, 6} <= set(calls)  # o_proj and down_proj (one shard, starting at 0) take the kernel either way


def test_block_scales_of_the_wrong_shape_name_the_tensor(tmp_path: Path) -> None:
    cfg, hf = _hf_model()
    tensors = dict(hf.state_dict())
    for name, m in _linears(hf).items():
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"] = _block_quantize(m.weight.detach(), [32, 32])
    qc = {"quant_method": "fp8", "weight_block_size": [64, 32]}  # the file's scales are for 32 x 32
    with pytest.raises(WeightLoadError, match=r"weight_scale_inv' has shape \[2, \d\], expected \[1, \d\]"):
        _load(_write(tmp_path / "block", cfg, tensors, qc), cfg, Fp8Config.from_hf_quant_config(qc))


def test_runtime_fp8_matches_emulation(tmp_path: Path) -> None:
    """`-q fp8` on a float checkpoint: per-channel amax / 448 scales (float32), per-token activations;
    the head stays float."""
    cfg, hf = _hf_model()
    hf.save_pretrained(tmp_path / "dense", safe_serialization=True)
    dequantized = {}
    for name, m in _linears(hf).items():
        scale = m.weight.abs().amax(dim=1, keepdim=True) / 448.0
        dequantized[name] = (m.weight / scale).clamp(-448.0, 448.0).to(FP8).float() * scale
    config = Fp8Config.runtime()
    model, caches = _load(tmp_path / "dense", cfg, config)
    assert model.lm_head.quant_method is None and len(config.methods) == 8
    _compare(model, caches, hf, dequantized, dict.fromkeys(dequantized))


# ---------------------------------------------------------------- configs


def _ct(**changes: object) -> dict:
    qc = copy.deepcopy(CT_DYNAMIC)
    group = qc["config_groups"]["group_0"]
    for key, value in changes.items():
        part, _, field = key.partition("__")
        if field:
            group[part][field] = value
        else:
            group[part] = value
    return qc


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Fp8Config.from_hf_quant_config({"quant_method": "fp8", "weight_block_size": [128]}),
         r"weight_block_size: \[128\] is not a \[rows, cols\] pair"),
        (lambda: Fp8Config.from_hf_quant_config({"quant_method": "fp8", "weight_block_size": [128, 128],
                                                 "activation_scheme": "static"}),
         "activation_scheme: 'static' with weight_block_size"),
        (lambda: Fp8Config.from_hf_quant_config({"quant_method": "fp8", "weight_block_size": [128, 128],
                                                 "scale_fmt": "ue8m0"}), "scale_fmt: 'ue8m0'"),
        (lambda: Fp8Config.from_hf_quant_config({"quant_method": "fp8", "fmt": "e5m2"}), "fmt: 'e5m2'"),
        (lambda: Fp8Config.from_compressed_tensors(_ct(weights__strategy="block")),
         r"group_0.weights.block_structure: None"),
        (lambda: Fp8Config.from_compressed_tensors(_ct(input_activations__strategy="group")),
         "group_0.input_activations.group_size: None"),
        (lambda: Fp8Config.from_hf_quant_config({"quant_method": "fp8", "activation_scheme": "per_token"}),
         "activation_scheme: 'per_token'"),
        (lambda: Fp8Config.from_compressed_tensors(CT_DYNAMIC | {"format": "pack-quantized"}),
         "format: 'pack-quantized'"),
        (lambda: Fp8Config.from_compressed_tensors(_ct(weights__strategy="group")),
         "group_0.weights.strategy: 'group'"),
        (lambda: Fp8Config.from_compressed_tensors(_ct(weights__type="int")), "group_0.weights.type: 'int'"),
        (lambda: Fp8Config.from_compressed_tensors(_ct(weights__num_bits=4)), "group_0.weights.num_bits: 4"),
        (lambda: Fp8Config.from_compressed_tensors(_ct(input_activations__strategy="tensor")),
         "group_0.input_activations: strategy 'tensor' with dynamic True"),
        (lambda: Fp8Config.from_compressed_tensors(CT_DYNAMIC | {"kv_cache_scheme": {"num_bits": 8}}),
         r"kv_cache_scheme\.type = 'int'"),  # QuantizationArgs' default type
    ],
)  # fmt: skip
def test_unsupported_configs_name_the_field(make: Callable[[], Fp8Config], message: str) -> None:
    with pytest.raises(QuantConfigError, match=message):
        make()


def test_ignore_lists_and_merged_layers() -> None:
    ct = Fp8Config.from_compressed_tensors(
        CT_DYNAMIC | {"ignore": ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                                 "model.layers.0.self_attn.v_proj", "model.layers.1.mlp.gate_proj"]}
    )  # fmt: skip
    assert ct.get_linear_method("model.layers.0.self_attn.qkv_proj") is None  # every part ignored
    assert ct.get_linear_method("model.layers.1.self_attn.qkv_proj").activation == "dynamic"
    assert ct.get_linear_method("lm_head") is not None  # Linear targets it and it is not ignored here
    with pytest.raises(
        QuantConfigError, match="gate_proj: not quantized, model.layers.1.mlp.up_proj: dynamic"
    ):
        ct.get_linear_method("model.layers.1.mlp.gate_up_proj")
    tied = Fp8Config.from_compressed_tensors(CT_DYNAMIC | {"ignore": []}, tied_embeddings=True)
    assert tied.get_linear_method("lm_head") is None
    weight_only = Fp8Config.from_compressed_tensors(_ct(input_activations=None))
    assert weight_only.get_linear_method("model.layers.0.mlp.down_proj").activation == "none"
    fp8 = Fp8Config.from_hf_quant_config(
        {"quant_method": "fp8", "ignored_layers": ["model.layers.0.mlp.down_proj"]}
    )
    assert fp8.get_linear_method("model.layers.0.mlp.down_proj") is None
    # transformers' FineGrainedFP8Config names the list modules_to_not_convert
    blocks = Fp8Config.from_hf_quant_config({"quant_method": "fp8", "weight_block_size": [128, 128],
                                             "modules_to_not_convert": ["model.layers.0.mlp.down_proj"]})  # fmt: skip
    assert blocks.get_linear_method("model.layers.0.mlp.down_proj") is None
    assert blocks.get_linear_method("model.layers.1.mlp.down_proj").act_group == 128
    assert (
        fp8.get_linear_method("lm_head") is None and Fp8Config.runtime().get_linear_method("lm_head") is None
    )
    assert fp8.get_linear_method("model.layers.0.mlp.gate_up_proj").activation == "dynamic"


# ---------------------------------------------------------------- sm_90 compiles


@pytest.mark.parametrize("triton_path", TRITONS, ids=TRITON_IDS)
def test_fp8_kernels_compile_for_sm90(triton_path: Path | None) -> None:
    """The small-M kernel as `small_m_linear` launches it on the H200 (split-K and not): Hopper's
    fp8 wgmma, the split's fence and atomic counter, PDL, no spills; and the one-token GEMV at the
    longest row it takes, without spills; with the installed triton and the H200 image's."""
    pytest.importorskip("triton")
    done = subprocess.run(
        [sys.executable, "-c", "from tests.quant.test_fp8 import compile_kernels; compile_kernels()"],
        env=compile_env(triton_path), cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.split() == ["split:ok", "whole:ok", "blocks:ok", "gemv:ok", "gemv_blocks:ok", "groups:ok", "rows:ok"], (
        done.stdout
    )


def compile_kernels() -> None:
    """In a child process without the interpreter: compile `_small_m_kernel` (per-channel and
    block-wise scales), `_gemv_kernel`, `_gemv_blocks_kernel`, `_quantize_groups_kernel` and
    `_quantize_rows_kernel` for sm_90."""
    from paphos.quant.kernels import fp8 as k8
    from tests.device_triton import compile_sm90

    cfg = k8.DEFAULT_SMALL_M
    for label, split, blocks in (("split", True, 0), ("whole", False, 0), ("blocks", True, 128)):
        args = {"q_ptr": "*fp8e4nv", "sx_ptr": "*fp32", "w_ptr": "*fp8e4nv", "sw_ptr": "*fp32", "b_ptr": "*fp32",
                "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"}  # fmt: skip
        ints = dict(M=1, N=4096, K=4096, stride_qm=4096, stride_wn=4096, stride_om=4096, k_per_split=1024)
        args |= {name: "i32" for name in ints}
        constexprs = dict(F8_MMA=True, HAS_BIAS=False, BN=cfg.block_n, BM=16, BK=min(cfg.block_k, blocks or 1 << 30),
                          EVEN_K=True, SPLIT=split, PDL=True, BR=blocks, BC=blocks)  # fmt: skip
        ptx = compile_sm90(k8._small_m_kernel, args, constexprs, cfg.num_warps, ints, cfg.num_stages)
        assert "wgmma.mma_async" in ptx and "e4m3" in ptx and "griddepcontrol.wait" in ptx, ptx[-300:]
        assert "STACK:0 " in ptx, ptx[-300:]
        if split:
            assert "fence.acq_rel.gpu" in ptx and "atom.global" in ptx
        print(f"{label}:ok", flush=True)
    # the one-token GEMV at the longest row it takes (down's 14336 -> 16384): no spills either
    args = {"q_ptr": "*fp8e4nv", "sx_ptr": "*fp32", "w_ptr": "*fp8e4nv", "sw_ptr": "*fp32", "b_ptr": "*fp32",
            "out_ptr": "*bf16", "N": "i32", "K": "i32", "stride_wn": "i32"}  # fmt: skip
    ints = dict(N=4096, K=14336, stride_wn=14336)
    gemv = k8.DEFAULT_GEMV
    constexprs = dict(HAS_BIAS=False, KB=k8.GEMV_MAX_K, RPP=gemv.rows_per_program, PDL=True)
    ptx = compile_sm90(k8._gemv_kernel, args, constexprs, gemv.num_warps, ints)
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "griddepcontrol.wait" in ptx, ptx[-300:]
    assert "STACK:0 " in ptx, ptx[-300:]
    print("gemv:ok", flush=True)
    gemv = fp8_blocks.GEMV_LONG_ROWS  # as fp8_block_linear launches rows this long
    constexprs = dict(HAS_BIAS=False, NB=128, BR=128, BC=128, RPP=gemv.rows_per_program, PDL=True)
    ptx = compile_sm90(fp8_blocks._gemv_blocks_kernel, args, constexprs, gemv.num_warps, ints)
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "griddepcontrol.wait" in ptx, ptx[-300:]
    assert "STACK:0 " in ptx, ptx[-300:]
    print("gemv_blocks:ok", flush=True)
    args = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "K": "i32", "n_groups": "i32", "stride_xm": "i32",
            "stride_sm": "i32", "stride_sg": "i32"}  # fmt: skip
    constexprs = dict(G=128, GB=16, QMAX=k8.FP8_MAX, SMIN=k8.MIN_SCALE, PDL=True)
    ints = dict(K=4096, n_groups=32, stride_xm=4096, stride_sm=1, stride_sg=512)  # scales by column, 512 tokens
    ptx = compile_sm90(fp8_blocks._quantize_groups_kernel, args, constexprs, 4, ints)
    assert "STACK:0 " in ptx, ptx[-300:]
    print("groups:ok", flush=True)
    # per-token rows as prefill launches them: one program a whole row of 4096 values, rounded by
    # the store's conversion (to nearest even, saturating: the references' cast)
    args = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "static_scale_ptr": "*fp32", "K": "i32",
            "stride_xm": "i32"}  # fmt: skip
    constexprs = dict(BLOCK=4096, SLICE=4096, STATIC=False, SINGLE=True, QMAX=k8.FP8_MAX, SMIN=k8.MIN_SCALE,
                      PDL=True, STATIC_STRIDE=0, HW_ROUND=True)  # fmt: skip
    ptx = compile_sm90(k8._quantize_rows_kernel, args, constexprs, 8, dict(K=4096, stride_xm=4096))
    assert "STACK:0 " in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx, ptx[-300:]
    print("rows:ok", flush=True)
