"""GPTQ's 2- and 3-bit checkpoints: their packing read back (3-bit values run over int32
boundaries) against a plain bit-stream packer, and the widening to the 4-bit kernels' codes.
The real tool's checkpoints of both widths are in test_checkpoint_parity.py."""

from __future__ import annotations

import pytest
import torch

from paphos.quant.gptq import GPTQConfig, GPTQLayout
from paphos.quant.int_linear import packed_run, unpack_along_cols, unpack_along_rows


def _pack_stream(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[V, C] codes -> int32 [V * bits / 32, C]: each column's values as one little-endian bit
    stream, value v at bits v * bits (AutoGPTQ's and GPTQModel's packing of every width)."""
    v, c = values.shape
    words = torch.zeros(v * bits // 32, c, dtype=torch.int64)
    for col in range(c):
        stream = sum(int(x) << (i * bits) for i, x in enumerate(values[:, col].tolist()))
        for w in range(words.shape[0]):
            words[w, col] = (stream >> (32 * w)) & 0xFFFFFFFF
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_codes_read_back_from_the_bit_stream(bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    values = torch.randint(0, 1 << bits, (96, 5), generator=gen)
    packed = _pack_stream(values, bits)
    assert torch.equal(unpack_along_rows(packed, bits), values)
    along_cols = _pack_stream(values, bits).t().contiguous()  # [5, 96 * bits / 32]: each row's stream
    assert torch.equal(unpack_along_cols(along_cols, bits), values.t())


def test_a_run_of_3_bit_values_fills_3_words() -> None:
    assert packed_run(3) == (32, 3)
    assert packed_run(4) == (8, 1) and packed_run(2) == (16, 1) and packed_run(8) == (4, 1)


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("version", [1, 2])
def test_low_bit_codes_widen_to_the_same_weights(bits: int, version: int) -> None:
    """Codes and zeros shifted by 8 - 2**(bits-1) into 4-bit codes give every weight unchanged;
    a symmetric checkpoint's zero (2**(bits-1)) becomes the 4-bit kernels' implicit 8."""
    gen = torch.Generator().manual_seed(bits * 10 + version)
    k, n, group = 64, 32, 32
    codes = torch.randint(0, 1 << bits, (k, n), generator=gen)
    for symmetric in (True, False):
        zeros = torch.full((k // group, n), 1 << (bits - 1)) if symmetric else torch.randint(0, 1 << bits, (k // group, n), generator=gen)
        stored = zeros if version == 2 else (zeros - 1) % (1 << bits)
        layer = torch.nn.Module()
        layer.qweight = torch.nn.Parameter(_pack_stream(codes, bits), requires_grad=False)
        layer.qzeros = torch.nn.Parameter(_pack_stream(stored.t().contiguous(), bits).t().contiguous(), requires_grad=False)
        layer.scales = torch.nn.Parameter(torch.rand(k // group, n, generator=gen), requires_grad=False)
        layer.g_idx = torch.nn.Parameter((torch.arange(k) // group).int(), requires_grad=False)
        u = GPTQLayout(bits, group, version).unpack(layer)
        assert u.bits == 4 and int(u.codes.min()) >= 0 and int(u.codes.max()) < 16
        z = u.zeros if u.zeros is not None else torch.full_like(u.scales, 8.0)
        assert (u.zeros is None) == symmetric
        widened = (u.codes.float() - z.repeat_interleave(group, dim=1)) * u.scales.repeat_interleave(group, dim=1)
        want = (codes.float() - zeros.float().repeat_interleave(group, dim=0)) * layer.scales.repeat_interleave(group, dim=0)
        assert torch.equal(widened, want.t())


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_the_log_names_widened_codes_only(bits: int, caplog: pytest.LogCaptureFixture) -> None:
    """A 2- or 3-bit checkpoint is told that its planes grow; a 4- or 8-bit one is not (they run as
    stored)."""
    with caplog.at_level("INFO", logger="paphos.quant.gptq"):
        GPTQConfig.from_quant_config({"quant_method": "gptq", "bits": bits, "group_size": 128, "desc_act": False,
                                      "sym": True})  # fmt: skip
    widened = [r.getMessage() for r in caplog.records if "widened" in r.getMessage()]
    assert widened == ([f"GPTQ {bits}-bit codes are widened to 4 bits at load: the 4-bit kernels run them, and their "
                        f"planes take {'2x' if bits == 2 else '4/3'} of the checkpoint's bytes"] if bits < 4 else [])  # fmt: skip
