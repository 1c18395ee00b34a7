"""llama.cpp-compatible CPU numerics for GGUF weights (`paphos.quant.gguf`).

Three kinds of checks:
- the activation quantizers against straight NumPy transcriptions of ggml's x86 C code
  (`quantize_row_q8_0/q8_1` AVX path, `quantize_row_q8_K_ref`), ties and zero blocks included;
- `LlamaCppLinearMethod` on synthetic GGUF tensors against an integer block-by-block dot product
  (ggml's formula, not ours), for single and mixed-type merged layers and permuted Q/K rows;
- the bundled SmolLM2 Q4_1 model's layer 0 against tensors dumped from llama.cpp itself
  (`data/smollm2_llamacpp_ops.npz`, written by `scripts/make_llamacpp_op_golden.py`): each linear
  layer given llama.cpp's input reproduces llama.cpp's output to float32 summation noise, and the
  `ggml_ops` references reproduce norm, SwiGLU, softmax and RoPE bit for bit.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from paphos.config import ConfigError, ModelConfig
from paphos.layers.linear import Linear, MergedColumnLinear
from paphos.loader.gguf_loader import unpermute_qk
from paphos.loader.gguf_reader import GGUFTensor
from paphos.models import hf_config
from paphos.quant.gguf import (
    GGUFQuantConfig,
    LlamaCppLinearMethod,
    LlamaCppQuantConfig,
    quant_config_for_source,
)
from paphos.quant.gguf.activations import (
    _div,
    activation_format,
    quantize_activations,
    quantize_q8_0,
    quantize_q8_1,
    quantize_q8_K,
)
from tests.quant import ggml_reference_ops as ggml_ops

OPS_PATH = Path(__file__).parent / "data" / "smollm2_llamacpp_ops.npz"
GT = gguf.GGMLQuantizationType


# ---- NumPy transcriptions of ggml's C code -------------------------------------------------------


def ref_q8_1(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_row_q8_1 (x86 AVX2): per 32 -> (q int, d fp16, s fp16), one row."""
    qs, ds, ss = [], [], []
    for blk in x.astype(np.float32).reshape(-1, 32):
        amax = np.float32(np.abs(blk).max())
        d = np.float32(amax / np.float32(127))
        inv = np.float32(np.float32(127) / amax) if amax != 0 else np.float32(0)
        q = np.rint((blk * inv).astype(np.float32))  # _MM_ROUND_NEAREST: half to even
        qs.append(q)
        ds.append(np.float16(d))
        ss.append(np.float16(np.float32(d * np.float32(q.sum()))))
    return np.array(qs), np.array(ds), np.array(ss)


def ref_q8_K(x: np.ndarray) -> np.ndarray:
    """quantize_row_q8_K_ref -> dequantized d * q, one row."""
    out = []
    for blk in x.astype(np.float32).reshape(-1, 256):
        i = int(np.argmax(np.abs(blk)))  # first index of the largest magnitude
        mx = blk[i]
        if mx == 0:
            out.append(np.zeros(256, np.float32))
            continue
        iscale = np.float32(np.float32(-127) / mx)
        q = np.minimum(127, np.rint((iscale * blk).astype(np.float32)))
        out.append((np.float32(np.float32(1) / iscale) * q).astype(np.float32))
    return np.concatenate(out)


def awkward_rows(n_rows: int, width: int, seed: int = 0) -> torch.Tensor:
    """Random rows with exact half-way ties, zero blocks, and wide dynamic range."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_rows, width, generator=g) * torch.exp(torch.randn(n_rows, 1, generator=g) * 3)
    # Ties: amax 127 * 2^-4 makes x * 127/amax = x * 16, so k/2 / 16 lands exactly on k/2.
    tie = torch.arange(-63, 64, dtype=torch.float32)[:31] / 2 / 16
    x[0, :32] = torch.cat([torch.tensor([127 / 16]), tie])
    x[1, 32:64] = 0.0
    return x


# ---- activation quantizers -----------------------------------------------------------------------


def test_scalar_over_tensor_division_is_correctly_rounded() -> None:
    r = torch.rand(100_000) + 0.01
    want = torch.from_numpy(np.float32(127) / r.numpy())
    assert torch.equal(_div(127.0, r), want)
    assert not torch.equal(127.0 / r, want)  # the torch pitfall `_div` exists for


def test_q8_1_matches_ggml() -> None:
    x = awkward_rows(6, 256)
    xq, s_err = quantize_q8_1(x)
    for row in range(x.shape[0]):
        q, d, s = ref_q8_1(x[row].numpy())
        want_xq = (q * d.astype(np.float32)[:, None]).reshape(-1)
        assert np.array_equal(xq[row].numpy(), want_xq)
        want_s = s.astype(np.float32) - d.astype(np.float32) * q.sum(-1)
        assert np.array_equal(s_err[row].numpy(), want_s.astype(np.float32))
    assert xq[0, 1:32].abs().sum() > 0 and torch.all(xq[1, 32:64] == 0)


def test_q8_0_is_q8_1_without_s() -> None:
    x = awkward_rows(4, 128, seed=1)
    assert torch.equal(quantize_q8_0(x), quantize_q8_1(x)[0])


def test_q8_K_matches_ggml() -> None:
    x = awkward_rows(4, 512, seed=2)
    x[2, 256:] = 0.0
    x[3, 5] = -x[3, :256].abs().max()  # negative extreme: ggml's sign convention
    got = quantize_q8_K(x)
    for row in range(x.shape[0]):
        assert np.array_equal(got[row].numpy(), ref_q8_K(x[row].numpy()))


def test_activation_formats_follow_ggml_vec_dot_types() -> None:
    assert activation_format("Q4_1") == activation_format("Q5_1") == "Q8_1"
    assert activation_format("Q4_0") == activation_format("Q8_0") == activation_format("IQ4_NL") == "Q8_0"
    assert activation_format("Q4_K") == activation_format("Q6_K") == activation_format("IQ2_XS") == "Q8_K"
    assert activation_format("F16") == "F16" and activation_format("BF16") == "BF16"
    assert activation_format("F32") == activation_format("SOMETHING_NEW") == "F32"
    x = torch.randn(2, 64)
    assert torch.equal(quantize_activations(x, "F16")[0], x.half().float())
    with pytest.raises(ValueError):
        quantize_activations(x, "Q9_9")


# ---- the linear method on synthetic tensors ------------------------------------------------------


def gguf_tensor(name: str, w: np.ndarray, qtype: GT) -> GGUFTensor:
    data = quantize(w.astype(np.float32), qtype)
    return GGUFTensor(name, qtype, tuple(w.shape), data, data.nbytes)


def dequant(t: GGUFTensor) -> torch.Tensor:
    return torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(t.shape).astype(np.float32))


def ggml_block_dot(x: torch.Tensor, t: GGUFTensor) -> torch.Tensor:
    """ggml's vec_dot for Q4_1/Q5_1 (with Q8_1 activations) or Q8_0/Q4_0/Q5_0 (Q8_0): integer sums
    per block, d_w * d_x per block, plus m_w * s for the types with a minimum; float64."""
    block, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
    rows, nb = t.shape[0], t.shape[1] // block
    raw = np.asarray(t.data).reshape(rows, nb, type_size)
    d_w = torch.from_numpy(raw[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float64))
    w = dequant(t).double().reshape(rows, nb, block)
    with_min = t.tensor_type in (GT.Q4_1, GT.Q5_1)
    m_w = (
        torch.from_numpy(raw[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64))
        if with_min
        else torch.zeros(rows, nb, dtype=torch.float64)
    )
    q_w = torch.round((w - m_w[..., None]) / d_w[..., None])
    out = []
    for row in x:
        q, d, s = (torch.from_numpy(a.astype(np.float64)) for a in ref_q8_1(row.numpy()))
        sumi = torch.einsum("bk,obk->ob", q, q_w)
        out.append((d_w * d * sumi).sum(-1) + (m_w * s).sum(-1) * with_min)
    return torch.stack(out)


def build(layer_cls: Any, tensors: list[GGUFTensor], *args: Any) -> Any:
    method = LlamaCppLinearMethod([t.name for t in tensors], tensors, head_dim=8)
    layer = layer_cls(*args, quant_method=method)
    if isinstance(layer, MergedColumnLinear):
        for i, t in enumerate(tensors):
            layer.weight_loader(layer.weight, dequant(t), i)
    else:
        layer.weight_loader(layer.weight, dequant(tensors[0]))
    method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("qtype", [GT.Q4_1, GT.Q5_1, GT.Q8_0, GT.Q4_0, GT.Q5_0])
def test_linear_matches_ggml_block_dot(qtype: GT) -> None:
    g = np.random.default_rng(0)
    t = gguf_tensor("w", g.standard_normal((24, 128)) * 0.1 + 0.02, qtype)
    layer = build(Linear, [t], 128, 24)
    x = awkward_rows(5, 128, seed=3)
    want = ggml_block_dot(x, t)
    got = layer(x)
    assert torch.allclose(got.double(), want, rtol=0, atol=2e-6 * want.abs().max().item())
    if qtype in (GT.Q4_1, GT.Q5_1):
        # Without the s correction the result is measurably off (fp16 rounding of s).
        plain = torch.nn.functional.linear(quantize_q8_1(x)[0], layer.weight)
        assert (plain.double() - want).abs().max() > 20 * (got.double() - want).abs().max()


def test_merged_layer_with_mixed_types_rounds_each_shard_its_way() -> None:
    g = np.random.default_rng(1)
    a = gguf_tensor("gate", g.standard_normal((16, 256)) * 0.1, GT.Q4_1)
    b = gguf_tensor("up", g.standard_normal((8, 256)) * 0.1, GT.Q8_0)
    layer = build(MergedColumnLinear, [a, b], 256, [16, 8])
    assert [s.fmt for s in layer.quant_method.segments] == ["Q8_1", "Q8_0"]
    x = awkward_rows(3, 256, seed=4)
    want = torch.cat([ggml_block_dot(x, a), ggml_block_dot(x, b)], dim=-1)
    got = layer(x)
    assert torch.allclose(got.double(), want, rtol=0, atol=2e-6 * want.abs().max().item())


def test_block_minima_follow_the_loaders_qk_permutation() -> None:
    g = np.random.default_rng(2)
    t = gguf_tensor("q", g.standard_normal((32, 64)) * 0.1 + 0.05, GT.Q4_1)
    method = LlamaCppLinearMethod(["q"], [t], head_dim=8)
    layer = Linear(64, 32, quant_method=method)
    layer.weight_loader(layer.weight, unpermute_qk(dequant(t), 4))  # as the GGUF loader does
    method.process_weights_after_loading(layer)
    x = awkward_rows(2, 64, seed=5)
    want = unpermute_qk(ggml_block_dot(x, t).T.contiguous(), 4).T
    assert torch.allclose(layer(x).double(), want, rtol=0, atol=2e-6 * want.abs().max().item())

    layer.weight.data[3, 0] += 1.0  # a weight that is not this file's
    with pytest.raises(ValueError, match="does not match"):
        method.process_weights_after_loading(layer)


def test_numerics_modes() -> None:
    from paphos.default_model import default_model_path

    class Source:
        load_format = "safetensors"
        path = default_model_path()
        hf_config = None

    assert quant_config_for_source(Source(), "llamacpp") is None
    Source.load_format = "gguf"
    # The default keeps weights quantized (GGUFLinearMethod); 'llamacpp' rounds activations.
    assert isinstance(quant_config_for_source(Source(), "float"), GGUFQuantConfig)
    assert isinstance(quant_config_for_source(Source(), "llamacpp"), LlamaCppQuantConfig)
    with pytest.raises(ConfigError, match="--gguf-numerics"):
        ModelConfig(model="m.gguf", gguf_numerics="fast")


# ---- the bundled model against llama.cpp's own tensors -------------------------------------------


@pytest.fixture(scope="module")
def ops() -> dict[str, Any]:
    data = np.load(OPS_PATH)
    return {
        k: (data[k] if k in ("tokens", "model_sha256") else torch.from_numpy(data[k])) for k in data.files
    }


@pytest.fixture(scope="module")
def model(ops: dict[str, Any]) -> Any:
    from paphos.attention.torch_ref import TorchReferenceBackend
    from paphos.default_model import default_model_path
    from paphos.loader.gguf_loader import GGUFCheckpoint
    from paphos.models.llama import LlamaForCausalLM

    path = Path(default_model_path())
    if hashlib.sha256(path.read_bytes()).hexdigest() != str(ops["model_sha256"]):
        pytest.fail(f"{OPS_PATH.name} was not made from {path}: run scripts/make_llamacpp_op_golden.py")
    ck = GGUFCheckpoint(path)
    config = LlamaCppQuantConfig.from_gguf(path, ck.hf_config)
    m = LlamaForCausalLM(ck.hf_config, torch.float32, TorchReferenceBackend(), quant_config=config)
    m.load_weights(ck.iter_weights(show_progress=False))
    return m.eval()


def close(got: torch.Tensor, want: torch.Tensor, rel: float = 2e-6) -> tuple[bool, float]:
    err = (got - want).abs().max().item() / want.abs().max().item()
    return err <= rel, err


def test_linears_reproduce_llamacpp(model: Any, ops: dict[str, Any]) -> None:
    layer = model.model.layers[0]
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    with torch.inference_mode():
        q, k, v = layer.self_attn.qkv_proj.split(layer.self_attn.qkv_proj(ops["attn_norm"]))
        gate, up = layer.mlp.gate_up_proj(ops["ffn_norm"]).chunk(2, dim=-1)
        checks = {
            # llama.cpp's Q/K rows are in the GGUF's RoPE-interleaved order; ours in HF's.
            "q": (q, unpermute_qk(ops["q"].T.contiguous(), heads).T),
            "k": (k, unpermute_qk(ops["k"].T.contiguous(), kv_heads).T),
            "v": (v, ops["v"]),
            "o": (layer.self_attn.o_proj(ops["kqv_out"]), ops["attn_out"]),
            "gate": (gate, ops["ffn_gate"]),
            "up": (up, ops["ffn_up"]),
            "down": (layer.mlp.down_proj(ops["ffn_swiglu"]), ops["ffn_down"]),
            "lm_head": (model.compute_logits(ops["result_norm"])[:, :512], ops["logits"]),
        }
        plain = torch.nn.functional.linear(ops["ffn_norm"], layer.mlp.gate_up_proj.weight)[:, :1536]
    for name, (got, want) in checks.items():
        ok, err = close(got, want)
        assert ok, f"{name}: max relative error {err:.2e}"
    # The float32 product of the same weights is ~1000x farther: the rounding is what we emulate.
    assert close(plain, ops["ffn_gate"], rel=1e-3)[1] > 1e-3


def test_ggml_ops_are_bit_exact(model: Any, ops: dict[str, Any]) -> None:
    eps = model.config.rms_norm_eps
    layers = model.model.layers
    with torch.inference_mode():
        embd = model.model.embed_tokens(torch.from_numpy(ops["tokens"]))
        assert torch.equal(ggml_ops.rms_norm(embd, eps, layers[0].input_layernorm.weight), ops["attn_norm"])
        assert torch.equal(
            ggml_ops.rms_norm(ops["l_out"], eps, layers[1].input_layernorm.weight), ops["attn_norm_1"]
        )
        assert torch.equal(ggml_ops.swiglu(ops["ffn_gate"], ops["ffn_up"]), ops["ffn_swiglu"])
        n = len(ops["tokens"])
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        assert torch.equal(ggml_ops.soft_max(ops["kq"], 0.125, causal), ops["kq_soft_max"])
        # RoPE in llama.cpp's layout: rotated pairs are adjacent (2i, 2i+1).
        cos, sin = ggml_ops.rope_cos_sin(torch.arange(n), 64, hf_config.rope_parameters(model.config)[0])
        for heads, roped in ((ops["q_heads"], ops["q_roped"]), (ops["k_heads"], ops["k_roped"])):
            a, b = ggml_ops.rope_rotate(heads[..., 0::2], heads[..., 1::2], cos[:, None], sin[:, None])
            assert torch.equal(torch.stack([a, b], dim=-1).flatten(-2), roped)
        # Attention (f16 operands and probabilities): equal up to the matmuls' summation order.
        q = ops["q_roped"].transpose(0, 1)
        k = ops["k_roped"].transpose(0, 1)
        v = ops["v"].view(n, -1, 64).transpose(0, 1)
        out = ggml_ops.attention_no_fa(q, k, v, 0.125, causal).transpose(0, 1).reshape(n, -1)
    ok, err = close(out, ops["kqv_out"], rel=1e-5)
    assert ok, f"attention: max relative error {err:.2e}"


def test_expf_saturates_like_ggml() -> None:
    x = torch.tensor([-float("inf"), -200.0, -1.0, 0.0, 1.0, 88.0, 200.0])
    got = ggml_ops.expf(x)
    assert got[0] == 0 and got[1] == 0 and got[3] == 1 and torch.isinf(got[-1])
    assert torch.allclose(got[2:6], torch.exp(x[2:6]), rtol=2e-7)
