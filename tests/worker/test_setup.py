"""Device and dtype choices made at start-up."""

import pytest
import torch

from paphos.attention.torch_ref import TorchReferenceBackend
from paphos.config import CacheConfig, ConfigError, EngineConfig, ModelConfig
from paphos.worker.setup import _attention_backend, _kv_cache_dtype, resolve_device, resolve_dtype

CPU = torch.device("cpu")


def test_explicit_dtype_is_kept() -> None:
    assert resolve_dtype("float32", object(), CPU) == torch.float32
    assert resolve_dtype("float16", object(), CPU) == torch.float16


@pytest.mark.parametrize(("bf16", "amx", "expected"), [
    (True, False, torch.bfloat16), (False, True, torch.bfloat16), (False, False, torch.float32),
])
def test_auto_on_cpu_uses_bf16_only_with_native_support(monkeypatch, bf16, amx, expected) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert resolve_dtype("auto", object(), CPU) == expected


def test_auto_on_gpu_follows_a_float16_checkpoint() -> None:
    class Config:
        dtype = torch.float16

    assert resolve_dtype("auto", Config(), torch.device("cuda")) == torch.float16
    assert resolve_dtype("auto", object(), torch.device("cuda")) == torch.bfloat16


def test_auto_device_is_cpu_without_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == CPU


def _engine_config(**cache: object) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model="unused"), cache=CacheConfig(**cache))


def test_fp8_kv_cache_on_cpu_is_a_startup_error_naming_the_flag() -> None:
    backend = _attention_backend(_engine_config(), CPU)
    assert backend.name == "torch_ref"
    with pytest.raises(ConfigError, match="--kv-cache-dtype fp8 needs the Triton attention backend"):
        _kv_cache_dtype(_engine_config(kv_cache_dtype="fp8"), backend, torch.bfloat16)


def test_fp8_e5m2_is_refused_with_the_supported_choice() -> None:
    with pytest.raises(ConfigError, match="use fp8 \\(e4m3\\)"):
        _kv_cache_dtype(_engine_config(kv_cache_dtype="fp8_e5m2"), TorchReferenceBackend(), torch.bfloat16)


def test_triton_attention_backend_needs_a_gpu() -> None:
    config = EngineConfig(model=ModelConfig(model="unused", attention_backend="triton"))
    with pytest.raises(ConfigError, match="--attention-backend triton needs a CUDA GPU"):
        _attention_backend(config, CPU)
