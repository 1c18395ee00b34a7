"""Device and dtype choices made at start-up."""

import pytest
import torch

from paphos.worker.setup import resolve_device, resolve_dtype

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
