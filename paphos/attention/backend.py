"""The attention backend protocol: the one seam between model code and attention kernels.

Data flow: request -> scheduler -> model runner (builds `AttentionMetadata`) -> model -> each
attention layer calls `backend.forward(...)` with this step's projected q/k/v. The backend stores
the new K/V in the layer's paged cache and attends every query row over its sequence's context,
reading the context through the block table. Models never touch the cache layout themselves, so
a Triton backend can replace the torch reference without a model change.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from paphos.attention.metadata import AttentionMetadata
from paphos.layers.x_int8_outputs import Int8Outputs


class Rotary(Protocol):
    """The rotary embedding a layer hands its backend (paphos.layers.rotary.RotaryEmbedding)."""

    cos_sin_cache: torch.Tensor  # [max_position, rotary_dim]: cos of each half-frequency, then sin
    rotary_dim: int
    fusable: bool  # whether the fused GPU kernels handle it (power-of-two rotary_dim / 2)

    def __call__(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class AttentionBackend(Protocol):
    """Paged causal attention over one flat batch of decode rows and prefill chunks.

    Shapes: q [T, Hq, D]; k, v [T, Hkv, D] with Hq % Hkv == 0 (kv head j serves query heads
    j*G .. j*G+G-1, G = Hq // Hkv, as HF `repeat_kv` does); kv_cache
    [num_blocks, 2, block_size, Hkv, D] (index 0 on dim 1 holds K, index 1 holds V).

    Semantics every backend must match:
      * when `rotary` is given, first rotate q and k by it at `positions` (`rotary(positions, q, k)`;
        a GPU backend fuses this with the K/V store, which is why the layer hands it over);
      * write k/v into kv_cache at `metadata.slot_mapping` (slot = block * block_size + offset);
      * query row j of sequence i sits at position p = seq_lens[i] - query_len_i + j and attends
        the keys at positions t of that sequence with t <= p and, when `sliding_window` is set,
        t > p - sliding_window (the HF convention: the last `sliding_window` tokens, itself
        included);
      * scores are `scale * q.k`, then `cap * tanh(score / cap)` when `logits_soft_cap` is set,
        softmax in fp32; the output has q's dtype, shape [T, Hq, D].

    `int8_outputs` (the o projection's int8 layouts, paphos/layers/x_int8_outputs.py) lets a
    backend write the int8 parts of its output that projection reads, attached to the output;
    where it writes none the projection quantizes the output itself, so ignoring it is correct.

    `kv_scales` (k_scale, v_scale): this layer's per-tensor scales of an fp8 cache (a checkpoint's,
    paphos/quant/kv_cache.py), as Python floats, constant per layer (no tensor read in a step, so
    a captured graph keeps them); None takes the backend's own (its constructor's, 1.0 by
    default). An fp8 cache stores x / scale and reads stored * scale; other cache dtypes ignore them.
    """

    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        rotary: Rotary | None = None,
        positions: torch.Tensor | None = None,
        int8_outputs: Int8Outputs | None = None,
        kv_scales: tuple[float, float] | None = None,
    ) -> torch.Tensor: ...


FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store this step's K/V rows ([T, Hkv, D]) into the paged cache at their slots, in place.

    Padding rows (e.g. of a captured graph) should point at a slot of the reserved null block 0;
    that block is never read as context, so no masking is needed here.

    An fp8 cache stores x / scale (computed in fp32, saturated to the format's finite range,
    round-to-nearest-even) and is read back as stored * scale; the scales are per tensor and
    ignored for other cache dtypes.
    """
    block_size = kv_cache.shape[2]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    if kv_cache.dtype in FP8_KV_DTYPES:
        k, v = quantize_fp8(k, k_scale, kv_cache.dtype), quantize_fp8(v, v_scale, kv_cache.dtype)
    # One index_put on the cache tensor itself (not on a view of it): a compiled step then writes
    # the rows in place instead of copying the whole cache back (worker/cpu_compiled.py).
    kv_cache[blocks, :, offsets] = torch.stack((k, v), dim=1).to(kv_cache.dtype)


def quantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale as `dtype` (an fp8 format), saturated: a plain cast would turn overflow into NaN."""
    fp8_max = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-fp8_max, fp8_max).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """K or V read from the cache, as fp32 values when the cache is fp8 (stored * scale);
    other dtypes are returned unchanged."""
    return x.float() * scale if x.dtype in FP8_KV_DTYPES else x
