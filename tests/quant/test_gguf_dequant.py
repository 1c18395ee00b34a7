"""Our torch GGUF dequantizers against `gguf`'s numpy reference, bit for bit in float32.

Blocks are random bytes (every bit pattern of quants, scales and signs gets exercised) with the
fp16/fp32 scale fields replaced by finite values; types `gguf` can quantize are also checked on
the output of its quantizer (realistic blocks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as np_dequantize
from gguf.quants import quantize as np_quantize

from paphos.quant.gguf.dequant import SUPPORTED_TYPES, dequantize
from tests.quant.gguf_blocks import random_blocks

ROWS, COLS = 8, 2048  # 8 blocks of 256 (64 of 32) per row


def _reference(raw: np.ndarray, name: str) -> np.ndarray:
    if name == "Q8_K":  # `gguf` has no numpy Q8_K; the format is d (fp32) * int8
        blocks = raw.reshape(-1, 292)
        d = blocks[:, :4].copy().view(np.float32)
        return (d * blocks[:, 4:260].copy().view(np.int8).astype(np.float32)).reshape(raw.shape[0], -1)
    return np_dequantize(raw, GGMLQuantizationType[name]).astype(np.float32)


def _assert_bit_exact(raw: np.ndarray, name: str) -> None:
    want = _reference(raw, name)
    got = dequantize(torch.from_numpy(raw), name)
    assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
    mismatch = got.numpy().view(np.uint32) != want.view(np.uint32)
    assert not mismatch.any(), (
        f"{name}: {int(mismatch.sum())} values differ, first at {np.argwhere(mismatch)[0]}"
    )


@pytest.mark.parametrize("name", SUPPORTED_TYPES)
def test_random_blocks_bit_exact(name: str) -> None:
    rng = np.random.default_rng(sum(map(ord, name)))
    _assert_bit_exact(random_blocks(name, ROWS, COLS, rng), name)


@pytest.mark.parametrize("name", ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_quantizer_output_bit_exact(name: str) -> None:
    values = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    _assert_bit_exact(np.asarray(np_quantize(values, GGMLQuantizationType[name])).view(np.uint8), name)


def test_shape_and_type_errors() -> None:
    with pytest.raises(NotImplementedError, match="NVFP4"):
        dequantize(torch.zeros(1, 36, dtype=torch.uint8), "NVFP4")
    with pytest.raises(ValueError, match="whole 18-byte blocks"):
        dequantize(torch.zeros(1, 20, dtype=torch.uint8), "Q4_0")
