"""`--quantization` / `-q` (Aphrodite's flag): gguf is chosen from a .gguf path; an explicit value
that the model does not match is a startup error naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from paphos.cli import build_configs, parse_args
from paphos.config import ConfigError, ModelConfig

DUMMY = str(Path(__file__).parents[2] / "benchmarks" / "configs" / "llama-3-8b.json")


def test_quantization_flag(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    engine, _ = build_configs(parse_args(["run", str(gguf), "-q", "gguf"]))
    assert engine.model.quantization == "gguf"
    assert ModelConfig(model=str(gguf)).quantization is None  # auto: gguf for a .gguf path
    with pytest.raises(ConfigError, match="--quantization must be one of gguf, gptq"):
        ModelConfig(model=str(gguf), quantization="bitsandbytes")
    with pytest.raises(ConfigError, match="--quantization awq given, but .* is a gguf model"):
        ModelConfig(model=str(gguf), quantization="awq")
    with pytest.raises(ConfigError, match="--quantization gguf given, but .* is dummy weights"):
        ModelConfig(model=DUMMY, load_format="dummy", quantization="gguf")
