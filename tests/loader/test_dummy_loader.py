"""Dummy weights: deterministic per seed, small, norms at identity; configs from a dir or a file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paphos.loader import LoaderError, fill_dummy_weights, load_dummy_config


def _model(config):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(config)


def test_fill_is_seeded_and_shaped(tiny_llama_config) -> None:
    config = tiny_llama_config()
    a, b, c = _model(config), _model(config), _model(config)
    fill_dummy_weights(a, seed=1)
    fill_dummy_weights(b, seed=1)
    fill_dummy_weights(c, seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    for name, tensor in sa.items():
        assert torch.equal(tensor, sb[name]), name
        if "norm" in name:
            assert torch.all(tensor == 1.0), name
        else:
            assert not torch.equal(tensor, sc[name]), name
            assert 0.01 < tensor.std().item() < 0.03, name
    # a forward pass stays finite
    logits = a(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()


def test_norm_value_override(tiny_llama_config) -> None:
    model = _model(tiny_llama_config())
    fill_dummy_weights(model, seed=0, norm_value=0.0)
    assert torch.all(model.model.norm.weight == 0.0)


def test_config_from_dir_or_file(tmp_path: Path, tiny_llama_config) -> None:
    tiny_llama_config(num_hidden_layers=3).save_pretrained(tmp_path)
    assert load_dummy_config(tmp_path).num_hidden_layers == 3
    assert load_dummy_config(tmp_path / "config.json").num_hidden_layers == 3
    with pytest.raises(LoaderError, match="no config.json"):
        load_dummy_config(_empty_dir(tmp_path))
    with pytest.raises(LoaderError, match="no such file"):
        load_dummy_config(tmp_path / "missing.json")


def _empty_dir(tmp_path: Path) -> Path:
    empty = tmp_path / "empty"
    empty.mkdir()
    return empty
