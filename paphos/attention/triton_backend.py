"""TritonAttentionBackend: the GPU implementation of the `AttentionBackend` protocol.

Data flow: model runner (builds AttentionMetadata) -> model -> attention layer -> `forward` here
-> Triton kernels in triton_attention.py (decode) and triton_prefill.py. Per call (one layer, one step):
  1. the rotary embedding (when the layer hands it over) and the K/V store at `slot_mapping`
     (fp8 caches: x / k_scale) in one kernel (triton_kv_write.py);
  2. decode rows (query_len 1) go through the split-KV decode kernel (+ its merge kernel, which
     in a decode-only batch also writes the int8 parts of the output the o projection reads:
     `int8_outputs`, paphos/layers/x_int8_outputs.py);
  3. prefill chunks (query_len > 1, possibly after a cached prefix) go through the tiled
     flash-attention kernel.
Semantics are the torch reference's (torch_ref.py), which is the oracle the tests compare against.

CUDA graphs: `forward_decode` is the entry for a decode-only batch (every sequence has one query
row, row i = sequence i). It reads only device tensors of the metadata (slot_mapping, seq_lens,
block_tables), sizes its launches from q.shape[0] and fixed config, and never synchronizes, so
the model runner can capture it once per padded batch size and replay it. `forward` takes this
path by itself when `metadata.decode_only` is set or `max_query_len == 1`.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import triton

from paphos.attention.backend import FP8_KV_DTYPES, Rotary
from paphos.attention.metadata import AttentionMetadata
from paphos.attention.triton_attention import DecodeConfig, paged_attention_decode
from paphos.attention.triton_kv_write import rope_and_write_kv_cache_triton, write_kv_cache_triton
from paphos.attention.triton_prefill import PrefillConfig, paged_attention_prefill
from paphos.layers.x_int8_outputs import Int8Outputs

_SUPPORTED_CACHE_DTYPES = (torch.float16, torch.bfloat16, *FP8_KV_DTYPES)


class TritonAttentionBackend:
    """Paged attention with Triton kernels (CUDA; also runs on CPU under TRITON_INTERPRET=1).

    k_scale / v_scale: per-tensor scales of an fp8 KV cache (stored = x / scale, read back as
    stored * scale) for calls that pass no `kv_scales` of their own (a checkpoint's per-layer
    scales); ignored for fp16/bf16 caches. max_splits caps the split-KV factor of decode.
    num_sms: the processor count used to size the split-KV factor (default: the current device's).
    decode_config / prefill_config: tile sizes (default: per head size, tuned on an H200).
    """

    name = "triton"

    def __init__(
        self,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        max_splits: int = 32,
        num_sms: int | None = None,
        decode_config: DecodeConfig | None = None,
        prefill_config: PrefillConfig | None = None,
    ) -> None:
        if k_scale <= 0 or v_scale <= 0:
            raise ValueError("k_scale and v_scale must be positive")
        if max_splits < 1 or max_splits & (max_splits - 1):
            raise ValueError("max_splits must be a power of two")
        self.k_scale = float(k_scale)
        self.v_scale = float(v_scale)
        self.max_splits = max_splits
        self._num_sms = num_sms
        self.decode_config = decode_config
        self.prefill_config = prefill_config
        # (host query_start_loc seen last, its number of decode rows): every layer of a step
        # gets the same metadata, so the O(batch) count runs once a step, not once a layer.
        self._decode_rows_key: list[int] | None = None
        self._decode_rows = 0

    # ---------------------------------------------------------------- protocol entry

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
    ) -> torch.Tensor:
        """Any flat batch of decode rows and prefill chunks; q [T, Hq, D] -> out [T, Hq, D].

        Reads the device tensors of `metadata` plus the host ints max_query_len and decode_only;
        no host lists, no synchronization. `int8_outputs` serves decode-only batches alone.
        `kv_scales`: the layer's fp8 cache scales (Python floats), else this backend's."""
        if getattr(metadata, "decode_only", False) or metadata.max_query_len == 1:
            return self.forward_decode(
                q, k, v, kv_cache, metadata, scale, sliding_window, logits_soft_cap, rotary, positions, int8_outputs,
                kv_scales,
            )  # fmt: skip
        self._check(q, k, v, kv_cache)
        k_scale, v_scale = kv_scales or (self.k_scale, self.v_scale)
        q = self._store_kv(q, k, v, kv_cache, metadata.slot_mapping, rotary, positions, k_scale, v_scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        common = dict(
            scale=scale,
            k_scale=k_scale,
            v_scale=v_scale,
            sliding_window=sliding_window,
            soft_cap=logits_soft_cap,
        )
        num_decode = self._count_decode_rows(metadata)
        if num_decode:
            # Decode rows of a mixed batch: the kernel skips every sequence whose query_len != 1.
            paged_attention_decode(
                q,
                kv_cache,
                metadata.block_tables,
                metadata.seq_lens,
                out,
                num_splits=self.num_splits(num_decode, kv_cache.shape[3], q.device),
                query_start_loc=metadata.query_start_loc,
                config=self.decode_config,
                **common,
            )
        paged_attention_prefill(
            q,
            kv_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            out,
            skip_decode_rows=True,
            config=self.prefill_config,
            **common,
        )
        return out

    def _count_decode_rows(self, md: AttentionMetadata) -> int:
        """Sequences with query_len 1, from the host copy of query_start_loc (this path may read
        host metadata). Without it (None), assume every sequence might be one."""
        qsl = md.query_start_loc_cpu
        if qsl is None:
            return md.seq_lens.shape[0]
        if qsl != self._decode_rows_key:
            self._decode_rows = sum(1 for a, b in pairwise(qsl) if b - a == 1)
            self._decode_rows_key = list(qsl)
        return self._decode_rows

    # ---------------------------------------------------------------- decode-only (CUDA-graph safe)

    def forward_decode(
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
    ) -> torch.Tensor:
        """A batch where every sequence has exactly one query row: row i of q is sequence i.

        Reads only metadata.slot_mapping [T], metadata.seq_lens [T] and metadata.block_tables
        [T, max_blocks] (device tensors); grid sizes depend only on T = q.shape[0], the head
        counts and this backend's fixed config. Padding rows for a captured graph: slot in the
        null block 0 (or -1: not stored) and seq_len 0 (their output is zeros) or 1. `kv_scales`
        are kernel arguments: a captured graph replays each layer's own.
        """
        self._check(q, k, v, kv_cache)
        if metadata.seq_lens.shape[0] != q.shape[0]:
            raise ValueError(
                f"forward_decode needs one query row per sequence: {q.shape[0]} rows, "
                f"{metadata.seq_lens.shape[0]} sequences"
            )
        k_scale, v_scale = kv_scales or (self.k_scale, self.v_scale)
        q = self._store_kv(q, k, v, kv_cache, metadata.slot_mapping, rotary, positions, k_scale, v_scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        paged_attention_decode(
            q,
            kv_cache,
            metadata.block_tables,
            metadata.seq_lens,
            out,
            scale=scale,
            num_splits=self.num_splits(q.shape[0], kv_cache.shape[3], q.device),
            k_scale=k_scale,
            v_scale=v_scale,
            sliding_window=sliding_window,
            soft_cap=logits_soft_cap,
            config=self.decode_config,
            int8_outputs=int8_outputs,
        )
        return out

    def _store_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        rotary: Rotary | None,
        positions: torch.Tensor | None,
        k_scale: float,
        v_scale: float,
    ) -> torch.Tensor:
        """Rotates q and k (when given a rotary) and stores k, v in the cache (an fp8 cache as
        x / scale); returns the q to attend with."""
        if rotary is None:
            write_kv_cache_triton(k, v, kv_cache, slot_mapping, k_scale, v_scale)
            return q
        assert positions is not None, "rotary needs the token positions"
        if rotary.fusable and all(x.stride(-1) == 1 for x in (q, k, v)):
            rope_and_write_kv_cache_triton(
                positions, q, k, v, kv_cache, slot_mapping, rotary.cos_sin_cache, rotary.rotary_dim, k_scale, v_scale,
            )  # fmt: skip
            return q
        q, k = rotary(positions, q, k)
        write_kv_cache_triton(k, v, kv_cache, slot_mapping, k_scale, v_scale)
        return q

    # ---------------------------------------------------------------- launch config

    def num_splits(self, num_rows: int, num_kv_heads: int, device: torch.device) -> int:
        """Split-KV factor of the decode kernel: enough (row, kv head, split) programs for about
        two waves over the processors, a power of two in [1, max_splits]. A function of the row
        count and fixed config only, never of context lengths (CUDA-graph replay)."""
        ctas = max(1, num_rows * num_kv_heads)
        want = triton.cdiv(2 * self._sms(device), ctas)
        return min(self.max_splits, triton.next_power_of_2(want)) if want > 1 else 1

    def _sms(self, device: torch.device) -> int:
        if self._num_sms is None:
            if device.type == "cuda":
                self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
            else:
                self._num_sms = 8  # interpreter runs: a few splits, so tests exercise the merge
        return self._num_sms

    @staticmethod
    def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> None:
        if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or kv_cache.stride(-1) != 1:
            raise ValueError(
                f"kv_cache must be [num_blocks, 2, block_size, Hkv, D], got {tuple(kv_cache.shape)}"
            )
        if kv_cache.dtype not in _SUPPORTED_CACHE_DTYPES:
            raise ValueError(f"unsupported KV cache dtype {kv_cache.dtype}")
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"q must be fp16 or bf16, got {q.dtype}")
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = kv_cache.shape[3]
        if k.shape[1:] != (num_kv_heads, head_dim) or v.shape != k.shape or kv_cache.shape[4] != head_dim:
            raise ValueError(f"k/v {tuple(k.shape)} do not match the cache {tuple(kv_cache.shape)}")
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
