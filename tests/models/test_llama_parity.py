"""Our Llama-family models against HF `transformers` on the same random weights (fp32, CPU).

The whole sequence goes through HF in one forward; ours runs it as a paged prompt (optionally
chunked) and then one token at a time through the KV cache, sequences batched in one flat batch.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config
from transformers import LlamaForCausalLM as HFLlama
from transformers import MistralForCausalLM as HFMistral
from transformers import Qwen2ForCausalLM as HFQwen2

from paphos.attention.torch_ref import TorchReferenceBackend
from paphos.models.registry import resolve_model_class
from tests.models.paged import (
    BLOCK,
    NUM_BLOCKS,
    assert_schedule_matches_hf,
    hf_logits,
    run_schedule,
    scramble_weights,
)

TOL = 1e-4
SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def make_hf(name: str):
    torch.manual_seed(0)
    if name == "llama":
        cfg, cls = LlamaConfig(**SMALL, architectures=["LlamaForCausalLM"]), HFLlama
    elif name == "llama3_rope":
        cfg, cls = (
            LlamaConfig(**SMALL, rope_parameters=LLAMA3_ROPE, architectures=["LlamaForCausalLM"]),
            HFLlama,
        )
    elif name == "smollm_tied":
        cfg = LlamaConfig(**SMALL, tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
        cls = HFLlama
    elif name == "qwen2":
        cfg, cls = Qwen2Config(**SMALL, architectures=["Qwen2ForCausalLM"]), HFQwen2
    elif name == "qwen2_window":
        cfg = Qwen2Config(
            **SMALL,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,
            architectures=["Qwen2ForCausalLM"],
        )
        cls = HFQwen2
    elif name == "mistral_window":
        cfg, cls = MistralConfig(**SMALL, sliding_window=6, architectures=["MistralForCausalLM"]), HFMistral
    else:
        raise AssertionError(name)
    cfg._attn_implementation = "eager"
    hf = cls(cfg).eval()
    scramble_weights(hf, norm_center=1.0, norm_spread=0.2)
    return cfg, hf


def make_ours(cfg, hf):
    cls = resolve_model_class(cfg)
    model = cls(cfg, torch.float32, TorchReferenceBackend()).eval()
    model.load_weights(hf.state_dict().items())
    caches = [torch.zeros(model.kv_cache_shape_per_layer(NUM_BLOCKS, BLOCK)) for _ in range(model.num_layers)]
    return model, caches


@pytest.mark.parametrize(
    "name", ["llama", "llama3_rope", "smollm_tied", "qwen2", "qwen2_window", "mistral_window"]
)
def test_prompt_then_decode_matches_hf(name: str) -> None:
    cfg, hf = make_hf(name)
    model, caches = make_ours(cfg, hf)
    ids = torch.randint(0, cfg.vocab_size, (15,), generator=torch.Generator().manual_seed(2))
    ours = run_schedule(model, caches, [ids], [[11], [1], [1], [1], [1]])[0]
    torch.testing.assert_close(ours, hf_logits(hf, ids), rtol=0, atol=TOL)


@pytest.mark.parametrize("name", ["llama", "qwen2_window"])
def test_two_sequences_chunked_and_mixed_batches(name: str) -> None:
    cfg, hf = make_hf(name)
    model, caches = make_ours(cfg, hf)
    # step 0: both prompts start (b, 17 tokens, chunked); step 1: a (12) decodes while b's chunk
    # continues; then both decode in the same flat batch; a finishes first.
    steps = [[9, 6], [1, 7], [1, 1], [1, 1], [0, 1], [0, 1]]
    assert_schedule_matches_hf(model, caches, hf, cfg.vocab_size, [12, 17], steps, seed=3, tol=TOL)


def test_bfloat16_close_to_hf() -> None:
    cfg, hf = make_hf("qwen2")
    hf = hf.to(torch.bfloat16)
    model = resolve_model_class(cfg)(cfg, torch.bfloat16, TorchReferenceBackend()).eval()
    model.load_weights(hf.state_dict().items())
    caches = [
        torch.zeros(model.kv_cache_shape_per_layer(NUM_BLOCKS, BLOCK), dtype=torch.bfloat16)
        for _ in range(model.num_layers)
    ]
    ids = torch.randint(0, cfg.vocab_size, (10,), generator=torch.Generator().manual_seed(4))
    ours = run_schedule(model, caches, [ids], [[8], [1], [1]])[0]
    ref = hf_logits(hf, ids)
    # bf16 rounding differs in attention internals; logits are O(10), so compare relatively.
    assert (ours - ref).abs().max() <= 0.05 * ref.abs().max()
