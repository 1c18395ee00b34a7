"""Qwen3 from GGUF (llama.cpp architecture `qwen3`): a tiny random HF Qwen3 written as llama.cpp's
converter writes it (per-head `attn_q_norm` / `attn_k_norm`, Q/K rows not permuted, linear
weights and the untied head in Q8_0 / Q4_0 blocks), read by our GGUF path: the config and tensors
equal transformers' own GGUF conversion of the file, and our quantized path's logits match HF
holding the same (dequantized) weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paphos.loader import GGUFCheckpoint
from tests.models.gguf_files import load_ours, run_chunks, write_like_llamacpp
from tests.models.paged import hf_logits
from tests.models.test_qwen3_parity import make_hf

_TYPES = {"attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q4_0",
          "ffn_gate": "Q8_0", "ffn_up": "Q4_0", "ffn_down": "Q8_0", "output": "Q8_0"}  # fmt: skip


def test_synthetic_qwen3_gguf_matches_hf(tmp_path: Path) -> None:
    from transformers import Qwen3ForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg, hf = make_hf()
    path = tmp_path / "qwen3.gguf"
    write_like_llamacpp(hf, cfg, path, "qwen3", _TYPES, rope_freq_base=cfg.rope_parameters["rope_theta"])
    ckpt = GGUFCheckpoint(path)
    config = ckpt.hf_config
    assert config.architectures == ["Qwen3ForCausalLM"] and config.model_type == "qwen3"
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        64, 4, 2, 32,
    )  # fmt: skip
    assert config.rope_parameters["rope_theta"] == 1e6
    assert config.rms_norm_eps == pytest.approx(1e-6)  # stored as float32
    assert not config.tie_word_embeddings and not config.attention_bias and config.sliding_window is None

    with torch.device("meta"):
        meta = Qwen3ForCausalLM(config)
    reference = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta)
    # (transformers reads no head_dim from the file: its Qwen3Config would take the default 128.)
    for key in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "max_position_embeddings", "rms_norm_eps", "vocab_size", "tie_word_embeddings",
    ):  # fmt: skip
        assert getattr(config, key) == reference["config"][key], key
    ours = dict(ckpt.iter_weights(show_progress=False))
    assert sorted(ours) == sorted(reference["tensors"]) == sorted(hf.state_dict())
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference["tensors"][name].float()), name
        assert torch.equal(tensor, hf.state_dict()[name]), name  # as written: no permutation, no offset

    ids = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(6))
    got = run_chunks(load_ours(ckpt, torch.float32), ids, [9, 8, 1, 1, 1], block=4)
    torch.testing.assert_close(got, hf_logits(hf, ids), rtol=0, atol=1e-4)
