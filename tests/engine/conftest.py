"""Tiny random HF models (config, safetensors weights, tokenizer) written to disk in the test,
so the whole engine (loader, scheduler, runner, sampler) runs against `transformers` on CPU."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

VOCAB = 96


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(path)


def _build(tmp_path: Path, arch: str, seed: int = 0, **overrides) -> tuple[Path, torch.nn.Module]:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "qwen2":
        config = Qwen2Config(architectures=["Qwen2ForCausalLM"], **common)
    elif arch == "qwen3":  # head_dim 32, not hidden / heads: q_proj is wider than the hidden size
        config = Qwen3Config(architectures=["Qwen3ForCausalLM"], **({"head_dim": 32} | common))
    else:
        config = LlamaConfig(architectures=["LlamaForCausalLM"], **common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # Random init leaves the logits nearly flat; sharpen them so greedy choices are not near-ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    path = tmp_path / arch
    model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path)
    return path, model


@pytest.fixture
def tiny_model(tmp_path: Path) -> Callable[..., tuple[Path, torch.nn.Module]]:
    """Factory: (directory of a tiny random model, the HF model itself)."""
    return lambda arch="llama", **overrides: _build(tmp_path, arch, **overrides)
