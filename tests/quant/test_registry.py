"""Format selection (paphos/quant/registry.py): the checkpoint's own quantization_config decides,
`--quantization` may only agree with it (Aphrodite's *_marlin names included) or ask for FP8 at load,
and whatever cannot run is a start-up error that names the file, field and value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paphos.config import QUANTIZATIONS, ConfigError
from paphos.loader import load_model_source
from paphos.quant import registry
from paphos.quant.awq import AWQConfig
from paphos.quant.compressed_tensors import CompressedTensorsIntConfig
from paphos.quant.gptq import GPTQConfig
from tests.engine.conftest import _build


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path, _ = _build(tmp_path_factory.mktemp("registry"), "llama")
    return path


def source_with(model_dir: Path, quantization_config: dict | None):
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (model_dir / "config.json").write_text(json.dumps(config))
    return load_model_source(str(model_dir))


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


def test_every_flag_value_has_a_format() -> None:
    assert set(QUANTIZATIONS) == set(registry._BUILDERS) | set(registry.ALIASES)


def test_the_checkpoint_decides_and_the_flag_may_agree(model_dir: Path) -> None:
    source = source_with(model_dir, GPTQ)
    assert isinstance(registry.select_quant_config(source, None), GPTQConfig)
    for flag in ("gptq", "gptq_marlin", "marlin"):
        assert isinstance(registry.select_quant_config(source, flag), GPTQConfig)
    with pytest.raises(ConfigError, match=r"--quantization awq given, but .*config.json has quantization_config.quant_method = 'gptq'"):
        registry.select_quant_config(source, "awq")
    assert registry.select_quant_config(source_with(model_dir, None), None) is None
    with pytest.raises(ConfigError, match="--quantization gptq given, but .* has no quantization_config"):
        registry.select_quant_config(source_with(model_dir, None), "gptq")
    awq = {"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm", "zero_point": True}
    assert isinstance(registry.select_quant_config(source_with(model_dir, awq), "awq_marlin"), AWQConfig)


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        ({"quant_method": "bitsandbytes"}, r"config.json: quantization_config.quant_method = 'bitsandbytes' is not supported"),
        (GPTQ | {"bits": 5}, r"config.json: quantization_config.bits = 5 is not supported: 2, 3, 4 or 8"),
        (GPTQ | {"checkpoint_format": "marlin"}, r"quantization_config.checkpoint_format = 'marlin'"),
        (GPTQ | {"group_size": 100}, r"quantization_config.group_size = 100"),
        ({"quant_method": "awq", "version": "gemv_fast"}, r"quantization_config.version = 'gemv_fast'"),
        (
            {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
                "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
                "input_activations": {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}}}},
            r"quantization_config.config_groups.group_0.input_activations = .* dynamic per-token int8",
        ),
        (
            {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
                "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64}}},
             "sparsity_config": {"format": "sparse-24"}},
            r"quantization_config.sparsity_config = .* not supported",
        ),
        ({"quant_method": "compressed-tensors", "format": "marlin-24", "config_groups": {"g": {"targets": ["Linear"]}}},
         r"quantization_config.format = 'marlin-24'"),
    ],
)
def test_unsupported_configs_name_the_file_field_and_value(model_dir: Path, quantization_config: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        registry.select_quant_config(source_with(model_dir, quantization_config), None)


def test_older_repos_side_files_are_read(model_dir: Path) -> None:
    source = source_with(model_dir, None)
    side = model_dir / "quantize_config.json"
    side.write_text(json.dumps({"bits": 4, "group_size": 64, "desc_act": True, "sym": False}))
    try:
        config = registry.select_quant_config(source, None)
        assert isinstance(config, GPTQConfig) and config.layout.group_size == 64
    finally:
        side.unlink()


def test_compressed_tensors_int_schemes_follow_targets_and_ignore(model_dir: Path) -> None:
    scheme = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64, "symmetric": True}}
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": scheme},
          "ignore": ["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj$"]}
    config = registry.select_quant_config(source_with(model_dir, qc), None)
    assert isinstance(config, CompressedTensorsIntConfig)
    assert config.get_linear_method("lm_head") is None
    assert config.get_linear_method("model.layers.1.mlp.down_proj") is None
    assert config.get_linear_method("model.layers.0.mlp.down_proj") is not None
    assert config.get_linear_method("model.layers.1.self_attn.qkv_proj") is not None
    qc["ignore"] = ["model.layers.0.self_attn.k_proj"]
    config = registry.select_quant_config(source_with(model_dir, qc), None)
    with pytest.raises(ConfigError, match="q_proj, .*k_proj, .*v_proj different schemes"):
        config.get_linear_method("model.layers.0.self_attn.qkv_proj")


def test_the_kernel_log_says_marlin_class_in_the_line_users_look_for() -> None:
    """One line per outcome: the fast path's own words, the others with a count, reason and example."""
    from paphos.quant.int_linear import MARLIN_CLASS, IntKernelLog

    log = IntKernelLog("GPTQ")
    for layer in ("model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"):
        log.record(MARLIN_CLASS, layer)
    log.record("dequantized at load (8-bit on the CPU)", "lm_head")
    assert log.summary() == [
        "Using Marlin-class kernels for 2 layers (GPTQ)",
        "GPTQ: 1 layers dequantized at load (8-bit on the CPU) (e.g. lm_head)",
    ]
