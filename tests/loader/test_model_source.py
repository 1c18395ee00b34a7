"""`detect_format` and `load_model_source`: what the engine gets for each kind of model path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from paphos.loader import (
    LoaderError,
    ModelSource,
    derive_max_model_len,
    detect_format,
    find_gguf_file,
    load_model_source,
)


def _fake_gguf(path: Path) -> Path:
    path.write_bytes(b"GGUF" + b"\0" * 60)  # enough for detection, which reads only the magic
    return path


class _RecordingModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def load_weights(self, weights) -> None:
        self.names.extend(name for name, _ in weights)


def test_detect_format(tmp_path: Path, smol_path: Path) -> None:
    assert detect_format(smol_path) == "gguf"
    assert detect_format(smol_path, "gguf") == "gguf"
    assert detect_format(smol_path, "dummy") == "dummy"
    one = tmp_path / "one"
    one.mkdir()
    gguf_file = _fake_gguf(one / "m.gguf")
    assert detect_format(one) == "gguf" and find_gguf_file(one) == gguf_file
    (tmp_path / "st").mkdir()
    (tmp_path / "st" / "model.safetensors").write_bytes(b"")
    assert detect_format(tmp_path / "st") == "safetensors"
    with pytest.raises(LoaderError, match="looks like safetensors"):
        detect_format(tmp_path / "st", "gguf")
    with pytest.raises(LoaderError, match="no such file"):
        detect_format(tmp_path / "missing")
    with pytest.raises(LoaderError, match="load-format"):
        detect_format(one, "pt")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(LoaderError, match="must be a .gguf file"):
        detect_format(tmp_path / "notes.txt")
    _fake_gguf(one / "other.gguf")
    with pytest.raises(LoaderError, match="several .gguf files"):
        find_gguf_file(one)


def test_gguf_source(smol_path: Path) -> None:
    source = load_model_source(smol_path)
    assert isinstance(source, ModelSource)
    assert source.load_format == "gguf" and source.path == smol_path
    assert source.hf_config.architectures == ["LlamaForCausalLM"]
    assert source.eos_token_ids == (2, 0)  # <|im_end|>, <|endoftext|>
    assert source.max_model_len == 8192
    assert source.tokenizer is not None and not source.tokenizer.add_bos
    assert "Q4_1" in source.description
    name, tensor = next(source.iter_weights(show_progress=False))
    assert name == "model.embed_tokens.weight" and tensor.shape == (49152, 576)


def test_safetensors_source(tmp_path: Path, tiny_llama_config, smol_tokenizer) -> None:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config())
    model.save_pretrained(tmp_path)
    with pytest.raises(LoaderError, match="--tokenizer"):
        load_model_source(tmp_path)
    smol_tokenizer.hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 5], "temperature": 0.6, "do_sample": True})
    )
    source = load_model_source(tmp_path, chat_template="{{ 'x' }}")
    assert source.load_format == "safetensors"
    assert source.eos_token_ids == (2, 5)
    assert source.generation_defaults == {"temperature": 0.6}
    assert source.max_model_len == 256
    assert source.checkpoint_dtype == torch.float32  # save_pretrained of a float32 model
    assert source.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "x"
    recorder = _RecordingModel()
    source.load_into(recorder, show_progress=False)
    assert sorted(recorder.names) == sorted(model.state_dict())


def test_dummy_source_from_config_file(tmp_path: Path, tiny_llama_config) -> None:
    from transformers import LlamaForCausalLM

    tiny_llama_config().save_pretrained(tmp_path)
    source = load_model_source(tmp_path / "config.json", load_format="dummy")
    assert source.load_format == "dummy" and source.tokenizer is None
    assert source.hf_config.num_hidden_layers == 2 and source.max_model_len == 256
    with pytest.raises(LoaderError, match="dummy"):
        source.iter_weights()
    model = LlamaForCausalLM(source.hf_config)
    source.load_into(model, seed=3)
    assert torch.all(model.model.norm.weight == 1.0)


def test_derive_max_model_len_fallback() -> None:
    class Bare:
        pass

    config = Bare()
    assert derive_max_model_len(config) == 2048
    config.n_positions = 1024
    assert derive_max_model_len(config) == 1024


def test_dummy_source_from_gguf(smol_path: Path) -> None:
    source = load_model_source(smol_path, load_format="dummy")
    assert source.load_format == "dummy" and source.hf_config.num_hidden_layers == 30
    assert source.tokenizer is not None and source.eos_token_ids == (2, 0)
    with pytest.raises(LoaderError, match="dummy"):
        source.iter_weights()
    with pytest.raises(ValueError, match="--chat-template"):
        load_model_source(smol_path, load_format="dummy", chat_template="/nonexistent/t.jinja")
