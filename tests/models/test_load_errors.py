"""Checkpoint loading errors name the tensor and shapes; the registry names what it supports."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from paphos.attention.torch_ref import TorchReferenceBackend
from paphos.models.errors import UnsupportedModelError, WeightLoadError
from paphos.models.llama import LlamaForCausalLM
from paphos.models.qwen2 import Qwen2ForCausalLM
from paphos.models.registry import resolve_model_class

CFG = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
    max_position_embeddings=64,
)


def hf_like_weights(tied: bool = False) -> dict[str, torch.Tensor]:
    """HF tensor names and shapes of a 1-layer Llama with CFG (head_dim 8)."""
    w = {
        "model.embed_tokens.weight": torch.randn(64, 32),
        "model.norm.weight": torch.ones(32),
        "model.layers.0.input_layernorm.weight": torch.ones(32),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(32),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(16, 32),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(16, 32),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(32, 32),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(48, 32),
        "model.layers.0.mlp.up_proj.weight": torch.randn(48, 32),
        "model.layers.0.mlp.down_proj.weight": torch.randn(32, 48),
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.randn(4),  # old checkpoints
    }
    if not tied:
        w["lm_head.weight"] = torch.randn(64, 32)
    return w


def build(tied: bool = False) -> LlamaForCausalLM:
    return LlamaForCausalLM(
        LlamaConfig(**CFG, tie_word_embeddings=tied), torch.float32, TorchReferenceBackend()
    )


def test_loads_and_merges_shards() -> None:
    w = hf_like_weights()
    model = build()
    model.load_weights(w.items())
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(qkv[32:48], w["model.layers.0.self_attn.k_proj.weight"])
    gate_up = model.model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(gate_up[48:], w["model.layers.0.mlp.up_proj.weight"])
    assert model.kv_cache_shape_per_layer(10, 16) == (10, 2, 16, 2, 8)


def test_tied_head_shares_embedding() -> None:
    model = build(tied=True)
    w = hf_like_weights(tied=True)
    model.load_weights(w.items())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # A tied checkpoint that still ships lm_head.weight loads too.
    build(tied=True).load_weights(hf_like_weights().items())


def test_wrong_shape_names_tensor_and_shapes() -> None:
    w = hf_like_weights()
    w["model.layers.0.self_attn.k_proj.weight"] = torch.randn(24, 32)
    with pytest.raises(WeightLoadError) as e:
        build().load_weights(w.items())
    msg = str(e.value)
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "[16, 32]" in msg and "[24, 32]" in msg
    assert e.value.expected == (16, 32) and e.value.got == (24, 32)


def test_unknown_tensor_is_named() -> None:
    w = hf_like_weights()
    w["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.self_attn\.q_norm\.weight"):
        build().load_weights(w.items())


def test_missing_tensors_are_listed() -> None:
    w = hf_like_weights()
    del w["model.norm.weight"], w["model.layers.0.mlp.up_proj.weight"], w["lm_head.weight"]
    with pytest.raises(WeightLoadError) as e:
        build().load_weights(w.items())
    for name in ("model.norm.weight", "model.layers.0.mlp.up_proj.weight", "lm_head.weight"):
        assert name in str(e.value)


def test_registry() -> None:
    cfg = LlamaConfig(**CFG, architectures=["Qwen2ForCausalLM"])
    assert resolve_model_class(cfg) is Qwen2ForCausalLM
    cfg.architectures = ["MistralForCausalLM"]
    assert resolve_model_class(cfg) is LlamaForCausalLM
    cfg.architectures = ["GPTNeoXForCausalLM"]
    with pytest.raises(UnsupportedModelError, match="GPTNeoXForCausalLM.*LlamaForCausalLM"):
        resolve_model_class(cfg)
