"""Layers against HF's own functions (RoPE, RMSNorm) and the shard-loading rules of linears."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from paphos.layers.activation import SiluAndMul
from paphos.layers.linear import MergedColumnLinear, QKVLinear
from paphos.layers.norm import RMSNorm
from paphos.layers.rotary import RotaryEmbedding, compute_inv_freq
from paphos.layers.weights import ShapeMismatchError
from paphos.models.hf_config import rope_parameters

ROPES = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
]


def _cfg(rope: dict | None) -> LlamaConfig:
    params = {"rope_theta": 50000.0, **(rope or {"rope_type": "default"})}
    return LlamaConfig(
        hidden_size=128, num_attention_heads=4, max_position_embeddings=512, rope_parameters=params
    )


@pytest.mark.parametrize("rope", ROPES)
def test_inv_freq_matches_hf(rope: dict | None) -> None:
    cfg = _cfg(rope)
    theta, scaling, _ = rope_parameters(cfg)
    ours = compute_inv_freq(32, theta, scaling)
    rope_type = cfg.rope_parameters["rope_type"]
    if rope_type == "default":
        hf, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        hf, _ = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    torch.testing.assert_close(ours, hf, rtol=0, atol=0)


@pytest.mark.parametrize("rope", ROPES)
def test_rotation_matches_hf(rope: dict | None) -> None:
    cfg = _cfg(rope)
    theta, scaling, _ = rope_parameters(cfg)
    emb = RotaryEmbedding(32, 512, theta, scaling)
    pos = torch.tensor([0, 5, 300, 7, 511])
    q, k = torch.randn(5, 4, 32), torch.randn(5, 2, 32)
    oq, ok = emb(pos, q, k)
    inv = compute_inv_freq(32, theta, scaling)
    freqs = torch.cat([pos[:, None].float() * inv] * 2, -1)
    # HF layout: [batch, heads, seq, dim]; cos/sin [batch, seq, dim].
    hq, hk = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], freqs.cos()[None], freqs.sin()[None]
    )
    torch.testing.assert_close(oq, hq[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(ok, hk[0].transpose(0, 1), rtol=0, atol=1e-6)


def test_partial_rotary_leaves_tail() -> None:
    emb = RotaryEmbedding(16, 32, 10000.0, rotary_dim=8)
    q = torch.randn(3, 2, 16)
    oq, _ = emb(torch.tensor([1, 2, 3]), q, q[:, :1])
    assert torch.equal(oq[..., 8:], q[..., 8:]) and not torch.allclose(oq[..., :8], q[..., :8])


def test_unsupported_rope_type() -> None:
    with pytest.raises(ValueError, match="dynamic.*default, linear, llama3"):
        compute_inv_freq(8, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_hf_and_fuses_residual(dtype: torch.dtype) -> None:
    hf = LlamaRMSNorm(16, eps=1e-5)
    ours = RMSNorm(16, 1e-5, dtype)
    w = 1 + 0.3 * torch.randn(16)
    with torch.no_grad():
        hf.weight.copy_(w)
        ours.weight.copy_(w)
    hf = hf.to(dtype)
    x, r = torch.randn(4, 16, dtype=dtype), torch.randn(4, 16, dtype=dtype)
    assert torch.equal(ours(x), hf(x))
    y, s = ours(x, r)
    assert torch.equal(s, r + x) and torch.equal(y, hf(r + x))


def test_silu_and_mul() -> None:
    x = torch.randn(3, 10)
    torch.testing.assert_close(SiluAndMul()(x), torch.nn.functional.silu(x[:, :5]) * x[:, 5:])


def test_qkv_and_merged_loaders() -> None:
    qkv = QKVLinear(8, head_dim=2, num_heads=4, num_kv_heads=1, bias=True)
    parts = {s: torch.randn(n, 8) for s, n in (("q", 8), ("k", 2), ("v", 2))}
    for s, t in parts.items():
        qkv.weight_loader(qkv.weight, t, s)
        qkv.weight_loader(qkv.bias, t[:, 0], s)
    x = torch.randn(5, 8)
    q, k, v = qkv.split(qkv(x))
    torch.testing.assert_close(k, x @ parts["k"].T + parts["k"][:, 0])
    with pytest.raises(ShapeMismatchError, match=r"expected shape \[2, 8\], got \[3, 8\]"):
        qkv.weight_loader(qkv.weight, torch.randn(3, 8), "v")
    with pytest.raises(ValueError, match="shard id"):
        qkv.weight_loader(qkv.weight, parts["q"], "x")

    # A packed parameter (4 outputs per stored column) is sliced in proportion to shard sizes.
    merged = MergedColumnLinear(4, [8, 16])
    packed = torch.nn.Parameter(torch.zeros(4, 6), requires_grad=False)
    packed.output_dim = 1
    merged.weight_loader(packed, torch.ones(4, 4), 1)
    assert packed[:, :2].sum() == 0 and packed[:, 2:].sum() == 16
