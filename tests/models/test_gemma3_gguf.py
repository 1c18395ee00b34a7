"""Gemma 3 from GGUF: metadata -> HF config, tensor names, llama.cpp's stored (1 + w) norms, and the
logits of the quantized path against HF `transformers`.

- Synthetic: a tiny random HF Gemma 3 written as a GGUF file the way llama.cpp's converter writes
  it (names, norms + 1, linear weights in Q8_0 / Q4_0 / Q4_K), loaded by our GGUF path, against HF
  holding the same (dequantized) weights.
- Real: Gemma-3-270M Q4_K_M (design.md §12) through our quantized path, float32 and bf16, against
  HF with the weights as `gguf` dequantizes them (tests/loader checks those equal transformers'
  own GGUF conversion for SmolLM2; for this file `test_real_weights_match_transformers` below).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paphos.loader import GGUFCheckpoint
from tests.models.gguf_files import LAYER_NAMES, load_ours, run_chunks, write_like_llamacpp
from tests.models.paged import hf_logits
from tests.models.test_gemma3_parity import make_hf

# Gemma's four norms around attention and MLP.
_HF_TO_GGUF = LAYER_NAMES | {
    "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}  # fmt: skip
# Linear weights' types in the synthetic file (the head is tied to the embedding).
_TYPES = {"attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q4_K",
          "ffn_gate": "Q4_K", "ffn_up": "Q8_0", "ffn_down": "Q8_0"}  # fmt: skip


def _write_like_llamacpp(hf: torch.nn.Module, cfg, path: Path) -> None:
    """`hf` as llama.cpp's converter writes Gemma 3 (norms stored as 1 + w); `hf`'s linear weights
    are replaced by their quantized-then-dequantized values, so both sides hold the same numbers."""
    write_like_llamacpp(
        hf, cfg, path, "gemma3", _TYPES, layer_names=_HF_TO_GGUF, norm_offset=1.0,
        rope_freq_base=cfg.rope_parameters["full_attention"]["rope_theta"], sliding_window=cfg.sliding_window,
    )  # fmt: skip


def test_synthetic_gemma3_gguf_matches_hf(tmp_path: Path) -> None:
    cfg, hf = make_hf(
        query_pre_attn_scalar=16, final_logit_softcapping=None,  # llama.cpp: 1/sqrt(head_dim), no cap
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        hidden_size=256, intermediate_size=512,
    )  # fmt: skip
    path = tmp_path / "gemma3.gguf"
    _write_like_llamacpp(hf, cfg, path)
    ckpt = GGUFCheckpoint(path)
    ours_cfg = ckpt.hf_config
    assert ours_cfg.architectures == ["Gemma3ForCausalLM"] and ours_cfg.model_type == "gemma3_text"
    assert ours_cfg.layer_types == cfg.layer_types and ours_cfg.sliding_window == cfg.sliding_window
    assert ours_cfg.rope_parameters == cfg.rope_parameters and ours_cfg.tie_word_embeddings
    assert ours_cfg.query_pre_attn_scalar == 16 and ours_cfg.hidden_activation == "gelu_pytorch_tanh"
    ids = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(6))
    got = run_chunks(load_ours(ckpt, torch.float32), ids, [9, 8, 1, 1, 1], block=4)
    torch.testing.assert_close(got, hf_logits(hf, ids), rtol=0, atol=1e-4)


# ---- the real Gemma-3-270M Q4_K_M -------------------------------------------------------------


@pytest.fixture(scope="module")
def real(gemma3_270m_path: Path) -> tuple[GGUFCheckpoint, torch.nn.Module, torch.Tensor, torch.Tensor]:
    """(checkpoint, HF model on `gguf`-dequantized weights, prompt ids, HF logits)."""
    from transformers import Gemma3ForCausalLM

    ckpt = GGUFCheckpoint(gemma3_270m_path)
    config = ckpt.hf_config
    config._attn_implementation = "eager"
    with torch.device("meta"):
        hf = Gemma3ForCausalLM(config)
    state = dict(ckpt.iter_weights(show_progress=False))
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf.load_state_dict(state, assign=True)
    # Derived buffers were made on the meta device too (building on the CPU costs a random init).
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config)
    hf.model.embed_tokens.embed_scale = torch.tensor(config.hidden_size**0.5)
    assert not any(t.is_meta for t in [*hf.parameters(), *hf.buffers()])
    hf.eval()
    text = "<start_of_turn>user\nName three rivers in Europe.<end_of_turn>\n<start_of_turn>model\n"
    ids = torch.tensor(ckpt.tokenizer().encode(text))
    return ckpt, hf, ids, hf_logits(hf, ids)


def test_real_config(real) -> None:
    config = real[0].hf_config
    assert (config.num_hidden_layers, config.hidden_size, config.head_dim) == (18, 640, 256)
    assert (config.num_attention_heads, config.num_key_value_heads, config.sliding_window) == (4, 1, 512)
    assert [i for i, t in enumerate(config.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1000000.0
    assert config.query_pre_attn_scalar == 256 and config.vocab_size == 262144


def test_real_float32_matches_hf(real) -> None:
    ckpt, _, ids, ref = real
    got = run_chunks(load_ours(ckpt, torch.float32), ids, [len(ids) - 3, 1, 1, 1])
    assert (got - ref).abs().max() <= 1e-3, (got - ref).abs().max()


def test_real_bfloat16_quantized_close_to_hf(real) -> None:
    ckpt, _, ids, ref = real
    model = load_ours(ckpt, torch.bfloat16)
    got = run_chunks(model, ids, [len(ids) - 3, 1, 1, 1])
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    delta = (
        (got.log_softmax(-1) - ref.log_softmax(-1))
        .gather(-1, ref.argmax(-1, keepdim=True))
        .abs()
        .mean()
        .item()
    )
    assert top1 >= 0.9 and delta <= 0.1, (top1, delta)
