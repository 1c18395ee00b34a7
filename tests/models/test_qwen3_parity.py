"""Our Qwen3 against HF `transformers` on tiny random models (fp32, CPU): chunked prompts and
decode steps of two sequences in flat batches over the paged cache, against HF's forward over
each whole sequence.

head_dim (32) is not hidden / heads (16), so q_proj is wider than the hidden size; the q/k norms
get non-trivial weights, so a norm applied after RoPE, over the wrong axis, or with Gemma's
(1 + w) would show. Variants: q/k/v/o biases (`attention_bias`), sliding-window layers (as
Qwen2's config describes them), tied embeddings.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config
from transformers import Qwen3ForCausalLM as HFQwen3

from paphos.attention.torch_ref import TorchReferenceBackend
from paphos.models.qwen3 import Qwen3ForCausalLM
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
WINDOW = 5
VARIANTS = {
    "plain": {},
    "attention_bias": {"attention_bias": True},
    "window": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "tied": {"tie_word_embeddings": True},
}


def make_hf(seed: int = 0, **overrides) -> tuple[Qwen3Config, HFQwen3]:
    kwargs = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        architectures=["Qwen3ForCausalLM"],
    )  # fmt: skip
    kwargs.update(overrides)
    cfg = Qwen3Config(**kwargs)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = HFQwen3(cfg).eval()
    scramble_weights(hf, norm_center=1.0)
    return cfg, hf


def _ours(cfg: Qwen3Config, hf: HFQwen3, dtype: torch.dtype = torch.float32):
    model = resolve_model_class(cfg)(cfg, dtype, TorchReferenceBackend()).eval()
    model.load_weights(hf.state_dict().items())
    shape = model.kv_cache_shape_per_layer(NUM_BLOCKS, BLOCK)
    caches = [torch.zeros(shape, dtype=dtype) for _ in range(model.num_layers)]
    return model, caches


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_prompts_and_decode_rows_match_hf(variant: str) -> None:
    cfg, hf = make_hf(**VARIANTS[variant])
    model, caches = _ours(cfg, hf)
    assert isinstance(model, Qwen3ForCausalLM)
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.weight.shape == ((4 + 2 * 2) * 32, 64) and attn.q_norm.weight.shape == (32,)
    assert model.sliding_windows == ([None, WINDOW] if variant == "window" else [None, None])
    # a (23 tokens): chunks of 9 + 7 + 4, then decode rows; b (16): 5 + 9, a decode row beside a's
    # last chunk, then one beside a's decode row in the same flat batch.
    steps = [[9, 5], [7, 9], [4, 1], [1, 1], [1, 0], [1, 0]]
    assert_schedule_matches_hf(model, caches, hf, cfg.vocab_size, [23, 16], steps, seed=2, tol=TOL)


def test_bfloat16_close_to_hf() -> None:
    cfg, hf = make_hf()
    ids = torch.randint(0, cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(4))
    ref = hf_logits(hf, ids)
    model, caches = _ours(cfg, hf.to(torch.bfloat16), torch.bfloat16)
    ours = run_schedule(model, caches, [ids], [[12], [1], [1], [1], [1]])[0]
    # bf16 rounding differs in attention internals; logits are O(10), so compare relatively.
    assert (ours - ref).abs().max() <= 0.05 * ref.abs().max()
