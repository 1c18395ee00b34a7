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

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize as np_dequantize
from gguf.quants import quantize as np_quantize

from paphos.attention.torch_ref import TorchReferenceBackend
from paphos.loader import GGUFCheckpoint
from paphos.loader.source import raw_tensor_names
from paphos.models.registry import resolve_model_class
from paphos.quant.gguf import GGUFQuantConfig
from tests.models.paged import hf_logits, run_schedule
from tests.models.test_gemma3_parity import make_hf

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip
# Linear weights' types in the synthetic file (the head is tied to the embedding).
_TYPES = {"attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q4_K",
          "ffn_gate": "Q4_K", "ffn_up": "Q8_0", "ffn_down": "Q8_0"}  # fmt: skip


def _write_like_llamacpp(hf: torch.nn.Module, cfg, path: Path) -> None:
    """`hf` as llama.cpp's converter writes Gemma 3; `hf`'s linear weights are replaced by their
    quantized-then-dequantized values, so both sides hold the same numbers."""
    w = GGUFWriter(str(path), "gemma3")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_sliding_window(cfg.sliding_window)
    w.add_uint32("gemma3.vocab_size", cfg.vocab_size)
    with torch.no_grad():
        for name, p in hf.state_dict().items():
            if name == "lm_head.weight":
                continue
            array = p.numpy().astype(np.float32)
            if name == "model.embed_tokens.weight":
                gguf_name = "token_embd.weight"
            elif name == "model.norm.weight":
                gguf_name = "output_norm.weight"
            else:
                layer, module = name.removeprefix("model.layers.").removesuffix(".weight").split(".", 1)
                gguf_name = f"blk.{layer}.{_HF_TO_GGUF[module]}.weight"
            kind = gguf_name.split(".")[-2]
            if "norm" in kind or kind == "output_norm":
                w.add_tensor(gguf_name, array + 1.0)  # the converter stores 1 + w
            elif kind in _TYPES:
                qtype = GGMLQuantizationType[_TYPES[kind]]
                if qtype == GGMLQuantizationType.Q4_K:  # no numpy quantizer: take Q8_0 values' blocks
                    qtype = GGMLQuantizationType.Q8_0
                raw = np_quantize(array, qtype)
                p.copy_(torch.from_numpy(np_dequantize(raw, qtype)))
                w.add_tensor(gguf_name, raw, raw_dtype=qtype)
            else:
                w.add_tensor(gguf_name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _ours(ckpt: GGUFCheckpoint, dtype: torch.dtype) -> torch.nn.Module:
    config = ckpt.hf_config
    model = resolve_model_class(config)(
        config, dtype, TorchReferenceBackend(), GGUFQuantConfig.from_checkpoint(ckpt)
    )
    model.load_weights(ckpt.iter_weights(show_progress=False, raw_names=raw_tensor_names(model)))
    return model.eval()


def _run(model: torch.nn.Module, ids: torch.Tensor, chunks: list[int], block: int = 16) -> torch.Tensor:
    blocks = -(-len(ids) // block) + 1
    caches = [
        torch.zeros(model.kv_cache_shape_per_layer(blocks + 1, block), dtype=model.dtype)
        for _ in range(model.num_layers)
    ]
    import tests.models.paged as paged

    old = paged.BLOCK, paged.NUM_BLOCKS
    paged.BLOCK, paged.NUM_BLOCKS = block, blocks + 1
    try:
        return run_schedule(model, caches, [ids], [[n] for n in chunks])[0]
    finally:
        paged.BLOCK, paged.NUM_BLOCKS = old


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
    got = _run(_ours(ckpt, torch.float32), ids, [9, 8, 1, 1, 1], block=4)
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
    got = _run(_ours(ckpt, torch.float32), ids, [len(ids) - 3, 1, 1, 1])
    assert (got - ref).abs().max() <= 1e-3, (got - ref).abs().max()


def test_real_bfloat16_quantized_close_to_hf(real) -> None:
    ckpt, _, ids, ref = real
    model = _ours(ckpt, torch.bfloat16)
    got = _run(model, ids, [len(ids) - 3, 1, 1, 1])
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    delta = (
        (got.log_softmax(-1) - ref.log_softmax(-1))
        .gather(-1, ref.argmax(-1, keepdim=True))
        .abs()
        .mean()
        .item()
    )
    assert top1 >= 0.9 and delta <= 0.1, (top1, delta)
