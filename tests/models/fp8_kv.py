"""A plain torch emulation of an fp8 KV cache with per-layer scales, for the tests of a
checkpoint's KV-cache scales (tests/quant/test_kv_cache_scales.py, and the Triton backend's in
tests/attention/triton/): K (after RoPE) and V rounded to e4m3 through their layer's scale, then
attended from a float32 cache by the torch reference backend. The layer is told by the order of
the calls (every step calls layers 0..L-1 in turn), not by anything the model hands the backend,
so the emulation does not trust the code it checks. Also: our model built from an HF one with
per-layer scales loaded as checkpoint tensors, and scales set as a calibration would."""

from __future__ import annotations

from typing import Any

import torch

import tests.models.paged as paged
from paphos.attention.torch_ref import TorchReferenceBackend
from paphos.models.registry import resolve_model_class
from paphos.quant.compressed_tensors import KVCacheOnlyConfig

FP8 = torch.float8_e4m3fn


def round_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x rounded onto scale * e4m3 (saturated at 448, nearest even), as float32."""
    return ((x.float() / scale).clamp(-448.0, 448.0).to(FP8).float()) * scale


class EmulatedFP8KV:
    """An attention backend: rotates q and k, rounds k and v through `scales[layer]` (None:
    only records each layer's largest |k| and |v| in `amax`), then the torch reference on a
    float32 cache. One instance per run (it counts the calls)."""

    name = "emulated_fp8_kv"

    def __init__(self, num_layers: int, scales: list[tuple[float, float]] | None) -> None:
        self.num_layers = num_layers
        self.scales = scales
        self.amax = [(0.0, 0.0)] * num_layers
        self.calls = 0
        self.inner = TorchReferenceBackend()

    def forward(self, q, k, v, kv_cache, metadata, scale, sliding_window=None, logits_soft_cap=None,  # noqa: ANN001
                rotary=None, positions=None, int8_outputs=None, kv_scales=None) -> torch.Tensor:  # noqa: ANN001
        assert kv_cache.dtype == torch.float32, "the emulation keeps K/V in a float32 cache"
        layer = self.calls % self.num_layers
        self.calls += 1
        if rotary is not None:
            q, k = rotary(positions, q, k)
        a, b = self.amax[layer]
        self.amax[layer] = (max(a, k.abs().max().item()), max(b, v.abs().max().item()))
        if self.scales is not None:
            k_scale, v_scale = self.scales[layer]
            k, v = round_e4m3(k, k_scale), round_e4m3(v, v_scale)
        return self.inner.forward(q, k.float(), v.float(), kv_cache, metadata, scale, sliding_window, logits_soft_cap)


def caches(model: torch.nn.Module, dtype: torch.dtype, num_blocks: int, block: int) -> list[torch.Tensor]:
    return [torch.zeros(model.kv_cache_shape_per_layer(num_blocks, block), dtype=dtype) for _ in range(model.num_layers)]


def scale_tensors(scales: list[tuple[float, float]]) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint tensors of per-layer scales, bf16 [1] as llm-compressor writes them."""
    out = []
    for i, (k, v) in enumerate(scales):
        out += [(f"model.layers.{i}.self_attn.k_scale", torch.tensor([k], dtype=torch.bfloat16)),
                (f"model.layers.{i}.self_attn.v_scale", torch.tensor([v], dtype=torch.bfloat16))]  # fmt: skip
    return out


def ours(config: Any, hf: torch.nn.Module, dtype: torch.dtype, scales: list[tuple[float, float]] | None,
         backend: Any = None) -> torch.nn.Module:  # fmt: skip
    """Our model of `hf`'s weights; with `scales`, a KV-only compressed-tensors checkpoint's."""
    quant = KVCacheOnlyConfig("fp8 e4m3, static, per tensor") if scales is not None else None
    model = resolve_model_class(config)(config, dtype, backend or TorchReferenceBackend(), quant).eval()
    model.load_weights([*hf.state_dict().items(), *(scale_tensors(scales) if scales else [])])
    return model


def run(model: torch.nn.Module, cache_dtype: torch.dtype, seqs: list[torch.Tensor], steps: list[list[int]]) -> torch.Tensor:
    """The logits of every position of `seqs` scheduled as `steps` (paged.run_schedule), concatenated."""
    return torch.cat(paged.run_schedule(model, caches(model, cache_dtype, paged.NUM_BLOCKS, paged.BLOCK), seqs, steps))


def layer_scales(config: Any, hf: torch.nn.Module, seqs: list[torch.Tensor], steps: list[list[int]]) -> list[tuple[float, float]]:
    """Per-layer scales as a calibration would set them (largest |k|, |v| over this run / 448),
    each times its own factor from 0.6 to 1.5, so no two layers share scales; rounded to bf16 as
    a checkpoint stores them, so the emulation uses exactly what the model loads."""
    n = config.num_hidden_layers
    recorder = EmulatedFP8KV(n, None)
    run(ours(config, hf, torch.float32, None, recorder), torch.float32, seqs, steps)
    factors = torch.linspace(0.6, 1.5, 2 * n).tolist()
    scales = [(k / 448 * factors[2 * i], v / 448 * factors[2 * i + 1]) for i, (k, v) in enumerate(recorder.amax)]
    return [(float(torch.tensor(k).bfloat16()), float(torch.tensor(v).bfloat16())) for k, v in scales]


def emulated(config: Any, hf: torch.nn.Module, scales: list[tuple[float, float]], seqs: list[torch.Tensor],
             steps: list[list[int]], dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    """The logits with K/V rounded through `scales` (layer i's at i) by the emulation."""
    return run(ours(config, hf, dtype, None, EmulatedFP8KV(config.num_hidden_layers, scales)), torch.float32, seqs, steps)
