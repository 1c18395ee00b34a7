"""TorchReferenceBackend: paged attention in plain PyTorch, on any device.

Data flow: model runner -> model -> attention layer -> here. Two jobs:
  * the oracle that Triton kernels are tested against, so every step is a readable tensor op;
  * the CPU serving path, so nothing loops per token in Python. Per step (the plan is built once
    from the host copies in `AttentionMetadata` and reused by every layer):
      - decode rows (query_len 1) are attended together: with the native CPU kernels (bf16, no
        window or soft cap) in one call that reads the paged cache directly; otherwise their
        contexts are gathered from the block tables into a padded [B, L, Hkv, D] tensor with a
        length mask, then SDPA with GQA (no K/V duplication); inside the compiled CPU decode step,
        two reductions that inductor fuses with the gather instead (`_attend_decode_reduced`);
      - prefill chunks are attended one sequence at a time with
        `torch.nn.functional.scaled_dot_product_attention` (or the matmul path when soft-capping).
All score/softmax/value math runs in fp32 whatever the cache dtype; the result is cast back.
An fp8 cache is dequantized (stored * scale, per-tensor k_scale / v_scale: the layer's `kv_scales`,
else the backend's own) right after the gather.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from paphos.attention.backend import Rotary, dequantize_kv, write_kv_cache
from paphos.attention.metadata import AttentionMetadata
from paphos.layers.x_int8_outputs import Int8Outputs
from paphos.native import cpu as native_cpu


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # long [b]: query rows in the flat batch
    seq_lens: torch.Tensor  # long [b]
    block_tables: torch.Tensor  # long [b, num_blocks] (trimmed to the longest context)


@dataclass
class _Prefill:
    start: int  # first query row
    end: int
    seq_len: int
    blocks: torch.Tensor  # long [ceil(seq_len / block_size)]


@dataclass
class _Plan:
    decode_groups: list[_DecodeGroup]
    prefills: list[_Prefill]


class TorchReferenceBackend:
    name = "torch_ref"

    def __init__(
        self, max_decode_gather_tokens: int = 32768, k_scale: float = 1.0, v_scale: float = 1.0
    ) -> None:
        # Per-tensor scales of an fp8 cache (stored = x / scale); unused for other cache dtypes.
        self.k_scale = k_scale
        self.v_scale = v_scale
        # Bounds the padded decode gather (B * max context tokens) so a large batch of long
        # chats does not materialise its whole KV history at once; groups are formed over
        # sequences sorted by length, so padding inside a group stays small.
        self.max_decode_gather_tokens = max_decode_gather_tokens
        self._plan_key: tuple[weakref.ref[AttentionMetadata], torch.Tensor, list[int], list[int]] | None = (
            None
        )
        self._plan: _Plan | None = None

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
        int8_outputs: Int8Outputs | None = None,  # written by GPU backends only
        kv_scales: tuple[float, float] | None = None,
    ) -> torch.Tensor:
        if rotary is not None:
            assert positions is not None, "rotary needs the token positions"
            q, k = rotary(positions, q, k)
        kv_scales = kv_scales or (self.k_scale, self.v_scale)
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping, *kv_scales)
        if metadata.decode_only:
            # Device tensors only (a compiled decode step, worker/cpu_compiled.py): every row is
            # one sequence's query; block_tables are as wide as the longest context needs.
            return self._attend_decode(
                q, kv_cache, metadata.seq_lens, metadata.block_tables, scale, sliding_window, logits_soft_cap,
                kv_scales,
            )  # fmt: skip
        plan = self._get_plan(metadata, kv_cache.shape[2])
        out = torch.empty_like(q)
        for group in plan.decode_groups:
            out[group.rows] = self._attend_decode(
                q[group.rows], kv_cache, group.seq_lens, group.block_tables, scale, sliding_window, logits_soft_cap,
                kv_scales,
            )  # fmt: skip
        prefills = plan.prefills
        if (
            sliding_window is None
            and logits_soft_cap is None
            and kv_cache.dtype == k.dtype
            and native_cpu.prefill_attention_supported(q, k, v)
        ):
            # Whole prompts (the chunk is the context) in one native call: SmolLM2's 512-token
            # prompt 0.85 ms a layer against 3.3 ms for SDPA's CPU kernel; 15 of 64 tokens 0.41 ms
            # against 1.65 ms in SDPA calls of one sequence each.
            whole = [p for p in prefills if p.end - p.start == p.seq_len]
            if whole:
                native_cpu.prefill_attention(q, k, v, out, [p.start for p in whole], [p.seq_len for p in whole], scale)
                prefills = [p for p in prefills if p.end - p.start != p.seq_len]
        for p in prefills:
            out[p.start : p.end] = self._prefill(q, k, v, kv_cache, p, scale, sliding_window, logits_soft_cap, kv_scales)
        return out

    # ---------------------------------------------------------------- planning (host side, once a step)

    def _get_plan(self, md: AttentionMetadata, block_size: int) -> _Plan:
        # Every layer receives the same metadata object; building the plan once per step keeps
        # the per-layer Python cost independent of the number of sequences. The list compares
        # guard against a runner that refills one metadata object in place between steps.
        key = self._plan_key
        if (
            key is not None
            and self._plan is not None
            and key[0]() is md
            and key[1] is md.block_tables
            and key[2] == md.query_start_loc_cpu
            and key[3] == md.seq_lens_cpu
            and key[4] == block_size
        ):
            return self._plan
        plan = self._build_plan(md, block_size)
        self._plan_key = (
            weakref.ref(md),
            md.block_tables,
            list(md.query_start_loc_cpu),
            list(md.seq_lens_cpu),
            block_size,
        )
        self._plan = plan
        return plan

    def _build_plan(self, md: AttentionMetadata, block_size: int) -> _Plan:
        qsl, seq_lens = md.query_start_loc_cpu, md.seq_lens_cpu
        decode: list[int] = []
        prefills: list[_Prefill] = []
        for i, seq_len in enumerate(seq_lens):
            start, end = qsl[i], qsl[i + 1]
            if end - start == 1:
                decode.append(i)
            elif end > start:
                blocks = md.block_tables[i, : math.ceil(seq_len / block_size)].long()
                prefills.append(_Prefill(start, end, seq_len, blocks))

        groups: list[_DecodeGroup] = []
        decode.sort(key=lambda i: seq_lens[i], reverse=True)
        device = md.block_tables.device
        i = 0
        while i < len(decode):
            max_len = seq_lens[decode[i]]
            size = max(1, self.max_decode_gather_tokens // max(max_len, 1))
            members = decode[i : i + size]
            i += size
            idx = torch.tensor(members, dtype=torch.long, device=device)
            num_blocks = math.ceil(max_len / block_size)
            groups.append(
                _DecodeGroup(
                    rows=torch.tensor([qsl[s] for s in members], dtype=torch.long, device=device),
                    seq_lens=torch.tensor([seq_lens[s] for s in members], dtype=torch.long, device=device),
                    # int64 indices gather measurably faster than int32 on CPU.
                    block_tables=md.block_tables[idx, :num_blocks].long(),
                )
            )
        return _Plan(groups, prefills)

    # ---------------------------------------------------------------- decode rows, batched

    def _attend_decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        soft_cap: float | None,
        kv_scales: tuple[float, float] | None = None,
    ) -> torch.Tensor:
        """q [b, Hq, D], one query per sequence at position seq_len - 1; seq_lens [b] and
        block_tables [b, blocks] integer (the native kernel reads int32, the gather long) ->
        [b, Hq, D] in q's dtype. `kv_scales`: an fp8 cache's (k_scale, v_scale), else the backend's."""
        if sliding_window is None and soft_cap is None and native_cpu.decode_attention_supported(q, kv_cache):
            # Straight from the paged cache, no gather: 16 sequences of 128 tokens (SmolLM2, 2
            # cores) 22 us a layer against 82 us for the reductions below inside the compiled step.
            return native_cpu.decode_attention(q, kv_cache, block_tables, seq_lens, scale)
        seq_lens, block_tables = seq_lens.long(), block_tables.long()
        b = q.shape[0]
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        length = block_tables.shape[1] * block_size
        # Gathering K and V separately yields contiguous [b, blocks, block_size, Hkv, D] tensors,
        # so flattening blocks into one token axis is a free view.
        keys = kv_cache[:, 0][block_tables].view(b, length, num_kv_heads, head_dim)
        values = kv_cache[:, 1][block_tables].view(b, length, num_kv_heads, head_dim)
        k_scale, v_scale = kv_scales or (self.k_scale, self.v_scale)
        keys, values = dequantize_kv(keys, k_scale), dequantize_kv(values, v_scale)

        pos = torch.arange(length, device=q.device)
        valid = pos[None, :] < seq_lens[:, None]
        if sliding_window is not None:
            # The query sits at position seq_len - 1 and sees the keys after p - window.
            valid &= pos[None, :] > (seq_lens[:, None] - 1 - sliding_window)

        if torch.compiler.is_compiling():
            return _attend_decode_reduced(q, keys, values, valid, scale, soft_cap).to(q.dtype)
        mask = valid[:, None, None, :]  # [b, 1, Lq=1, L]
        out = _attend(q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), mask, scale, soft_cap)
        return out.squeeze(2).to(q.dtype)

    # ---------------------------------------------------------------- prefill chunks, per sequence

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        p: _Prefill,
        scale: float,
        sliding_window: int | None,
        soft_cap: float | None,
        kv_scales: tuple[float, float] | None = None,
    ) -> torch.Tensor:
        q_len, ctx_len = p.end - p.start, p.seq_len
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        if q_len == ctx_len and kv_cache.dtype == k.dtype:
            # Whole context is this chunk: the cache holds exactly these rows, skip the gather.
            keys, values = k[p.start : p.end], v[p.start : p.end]
        else:
            keys = kv_cache[:, 0][p.blocks].view(-1, num_kv_heads, head_dim)[:ctx_len]
            values = kv_cache[:, 1][p.blocks].view(-1, num_kv_heads, head_dim)[:ctx_len]
            k_scale, v_scale = kv_scales or (self.k_scale, self.v_scale)
            keys, values = dequantize_kv(keys, k_scale), dequantize_kv(values, v_scale)

        qh = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
        kh = keys.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
        vh = values.transpose(0, 1).unsqueeze(0)

        mask = None
        if q_len != ctx_len or sliding_window is not None:
            # Query row j sits at position ctx_len - q_len + j (the chunk ends the context).
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
            k_pos = torch.arange(ctx_len, device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            if sliding_window is not None:
                mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
            mask = mask[None, None]
        out = _attend(qh, kh, vh, mask, scale, soft_cap)
        return out[0].transpose(0, 1).to(q.dtype)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    soft_cap: float | None,
) -> torch.Tensor:
    """q [b, Hq, Lq, D], k/v [b, Hkv, L, D], mask bool [b or 1, 1, Lq, L] (True = attend) or
    None for a square causal mask. Returns fp32 [b, Hq, Lq, D].

    Inputs are upcast to fp32 first: it is the oracle's precision, and on CPUs without bf16
    matrix units the fp32 kernels are also faster than the bf16 ones (measured ~2x on decode).
    """
    q, k, v = q.float(), k.float(), v.float()
    if soft_cap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
    if mask is None:
        q_len, ctx_len = q.shape[2], k.shape[2]
        mask = torch.ones(q_len, ctx_len, dtype=torch.bool, device=q.device).tril()[None, None]
    return _softcapped_attention(q, k, v, mask, scale, soft_cap)


def _attend_decode_reduced(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    soft_cap: float | None,
) -> torch.Tensor:
    """Decode attention inside a compiled CPU step (worker/compiled_decode.py): q [b, Hq, D], keys
    and values [b, L, Hkv, D] as gathered, valid bool [b, L] -> fp32 [b, Hq, D].

    The same fp32 math as `_attend`, written as two reductions that inductor fuses with the
    gather from the block table, the keys read along the context in the innermost loop. SmolLM2's
    decode attention on 2 cores, per layer, 128-token contexts: 89 us against 170 us for the
    gather and SDPA's CPU kernel at 16 sequences, 26 against 43 us at one.
    """
    b, num_heads, head_dim = q.shape
    length, num_kv_heads = keys.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    qg = q.float().view(b, num_kv_heads, group, head_dim, 1)
    keys_t = keys.permute(0, 2, 3, 1).float().unsqueeze(2)  # [b, Hkv, 1, D, L]
    scores = (qg * keys_t).sum(3) * scale  # [b, Hkv, G, L]
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    scores = scores.masked_fill(~valid.view(b, 1, 1, length), float("-inf"))
    probs = torch.softmax(scores, dim=-1).unsqueeze(-1)  # [b, Hkv, G, L, 1]
    out = (probs * values.permute(0, 2, 1, 3).float().unsqueeze(2)).sum(3)  # [b, Hkv, G, D]
    return out.view(b, num_heads, head_dim)


def _softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, soft_cap: float
) -> torch.Tensor:
    """Attention with tanh soft-capped scores (SDPA has no hook for it); fp32 inputs.

    Query heads are grouped as [Hkv, G * Lq] so each KV head is read once, not repeated G times,
    and both products stay plain 4-D batched matmuls.
    """
    b, num_heads, q_len, head_dim = q.shape
    num_kv_heads, ctx_len = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    qg = q.reshape(b, num_kv_heads, group * q_len, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [b, Hkv, G*Lq, L]
    scores = torch.tanh(scores / soft_cap) * soft_cap
    scores = scores.view(b, num_kv_heads, group, q_len, ctx_len).masked_fill(
        ~mask.unsqueeze(1), float("-inf")
    )
    probs = torch.softmax(scores, dim=-1).view(b, num_kv_heads, group * q_len, ctx_len)
    return torch.matmul(probs, v).view(b, num_heads, q_len, head_dim)
