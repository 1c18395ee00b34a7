"""Safetensors loader on tiny random HF models saved with `save_pretrained` (single and sharded),
and its error messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from paphos.loader import LoaderError, iter_safetensors, safetensors_files


@pytest.fixture
def save_tiny(tiny_llama_config):
    def save(path: Path, **save_kwargs) -> dict[str, torch.Tensor]:
        return _save_tiny(tiny_llama_config(), path, **save_kwargs)

    return save


def _save_tiny(config, path: Path, **save_kwargs) -> dict[str, torch.Tensor]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, **save_kwargs)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_single_file(tmp_path: Path, save_tiny) -> None:
    expected = save_tiny(tmp_path)
    assert [f.name for f in safetensors_files(tmp_path)] == ["model.safetensors"]
    loaded = dict(iter_safetensors(tmp_path, show_progress=False))
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_sharded_with_index(tmp_path: Path, save_tiny) -> None:
    expected = save_tiny(tmp_path, max_shard_size="20KB")
    files = safetensors_files(tmp_path)
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    loaded = dict(iter_safetensors(tmp_path, show_progress=True))  # the bar goes to stderr
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_missing_shard_is_named(tmp_path: Path, save_tiny) -> None:
    save_tiny(tmp_path, max_shard_size="20KB")
    victim = safetensors_files(tmp_path)[1]
    victim.unlink()
    with pytest.raises(LoaderError, match=victim.name):
        safetensors_files(tmp_path)


def test_corrupt_shard_is_named(tmp_path: Path, save_tiny) -> None:
    save_tiny(tmp_path, max_shard_size="20KB")
    victim = safetensors_files(tmp_path)[1]
    victim.write_bytes(b"\x00garbage" * 100)
    with pytest.raises(LoaderError, match=f"{victim.name}: cannot read safetensors file"):
        list(iter_safetensors(tmp_path, show_progress=False))


def test_truncated_file_is_named(tmp_path: Path, save_tiny) -> None:
    save_tiny(tmp_path)
    victim = tmp_path / "model.safetensors"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(LoaderError, match="model.safetensors"):
        list(iter_safetensors(tmp_path, show_progress=False))


def test_bad_index_and_empty_dirs(tmp_path: Path) -> None:
    with pytest.raises(LoaderError, match="no \\*.safetensors files"):
        safetensors_files(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"nope": 1}))
    with pytest.raises(LoaderError, match="not a valid safetensors index"):
        safetensors_files(tmp_path)
    with pytest.raises(LoaderError, match="not a directory"):
        safetensors_files(tmp_path / "missing")
