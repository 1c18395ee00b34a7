"""Build `AttentionMetadata` by hand from per-sequence host lists.

Not on the serving path (the model runner builds metadata from its input batch). Used by tests
and benchmarks that drive a model or backend directly: request -> [this helper stands in for
scheduler + model runner] -> model -> attention.
"""

from __future__ import annotations

import math

import torch

from paphos.attention.metadata import AttentionMetadata


def allocate_block_tables(
    capacities: list[int], block_size: int, num_blocks: int, generator: torch.Generator | None = None
) -> list[list[int]]:
    """Give each sequence enough blocks for `capacities[i]` tokens, drawn in random order from
    1..num_blocks-1 (block 0 is the reserved null block), so tables are non-contiguous."""
    needed = [math.ceil(c / block_size) for c in capacities]
    if sum(needed) > num_blocks - 1:
        raise ValueError(f"need {sum(needed)} blocks, cache has {num_blocks - 1} usable")
    free = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    tables, at = [], 0
    for n in needed:
        tables.append(free[at : at + n])
        at += n
    return tables


def build_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata for one flat batch: sequence i contributes its last `query_lens[i]` tokens of a
    context of `seq_lens[i]` tokens (all earlier tokens must already be in the cache)."""
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
    qsl = [0]
    slots: list[int] = []
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        if not 0 < q_len <= s_len or math.ceil(s_len / block_size) > len(table):
            raise ValueError(f"bad sequence: query_len={q_len} seq_len={s_len} blocks={len(table)}")
        qsl.append(qsl[-1] + q_len)
        for pos in range(s_len - q_len, s_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    width = max(len(t) for t in block_tables)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    return AttentionMetadata(
        num_tokens=qsl[-1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens),
    )
