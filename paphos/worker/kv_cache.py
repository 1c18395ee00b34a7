"""Paged KV cache tensors: one [num_blocks, 2, block_size, num_kv_heads, head_dim] tensor per layer.

The number of blocks comes from a memory budget (CPU: `--cpu-kv-cache-gb`), or a forced count.
Block 0 is the reserved null block (padding in block tables points there).

The cache starts zeroed (the gathering attention paths multiply masked slots by zero weights, and
0 * NaN would leak). On the CPU it lives in one anonymous memory map, which the kernel zero-fills
page by page on first write: the default 4 GiB budget took ~5 s of `torch.zeros` at every start
on two cores and was resident from the start; now a page costs memory once a block uses it.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch

from paphos.config import CacheConfig


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_block(self, block_size: int) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * block_size * self.num_kv_heads * self.head_dim * element


def num_blocks_for_budget(spec: KVCacheSpec, cache_config: CacheConfig, budget_bytes: int) -> int:
    if cache_config.num_gpu_blocks_override is not None:
        return cache_config.num_gpu_blocks_override
    return max(2, budget_bytes // spec.bytes_per_block(cache_config.block_size))


def allocate_kv_caches(
    spec: KVCacheSpec, num_blocks: int, block_size: int, device: torch.device
) -> list[torch.Tensor]:
    shape = (num_blocks, 2, block_size, spec.num_kv_heads, spec.head_dim)
    if device.type != "cpu":
        return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
    # the tensor keeps the map alive (torch.frombuffer holds a reference to it)
    pages = torch.frombuffer(mmap.mmap(-1, num_blocks * spec.bytes_per_block(block_size)), dtype=torch.uint8)
    return list(pages.view(spec.dtype).view(spec.num_layers, *shape).unbind(0))
