"""AttentionMetadata: how one flat token batch maps onto sequences and the paged KV cache.

Built by the model runner each step and passed unchanged through the model to every attention
layer. Tokens of all scheduled sequences are concatenated (decode rows and prefill chunks alike);
sequence i owns query rows query_start_loc[i]:query_start_loc[i+1] and, after this step's K/V are
written, holds seq_lens[i] tokens in the cache, laid out in the blocks block_tables[i].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_tokens: int
    # int32 [B + 1] on the model's device.
    query_start_loc: torch.Tensor
    # int32 [B]: context length of each sequence including this step's tokens.
    seq_lens: torch.Tensor
    # int32 [B, max_blocks_per_seq]; unused entries are 0 (the reserved null block).
    block_tables: torch.Tensor
    # int64 [T]: cache slot of each new token, block_id * block_size + offset in block.
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # Host copies, so backends that loop over sequences need no device sync.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Every sequence has exactly one query row. Set by the CUDA-graph decode path, whose captured
    # kernels must not read the host copies above (they are stale at replay) nor size launches
    # from max_seq_len; a backend takes its device-only decode path when this is set.
    decode_only: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)
