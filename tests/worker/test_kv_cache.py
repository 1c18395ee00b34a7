"""The paged KV cache's tensors (paphos/worker/kv_cache.py) on the CPU."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from paphos.worker.kv_cache import KVCacheSpec, allocate_kv_caches


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_cpu_cache_is_zeroed_writable_and_per_layer(dtype: torch.dtype) -> None:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype)
    caches = allocate_kv_caches(spec, num_blocks=5, block_size=4, device=torch.device("cpu"))
    assert len(caches) == 3
    for cache in caches:
        assert cache.shape == (5, 2, 4, 2, 8) and cache.dtype == dtype and cache.is_contiguous()
        assert not cache.float().any()
    caches[1][2, 0].fill_(1.0)  # one layer's block: no other layer sees it
    assert caches[1].float().sum().item() == 4 * 2 * 8
    assert not caches[0].float().any() and not caches[2].float().any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB is Linux's")
def test_cpu_cache_takes_memory_only_where_blocks_are_written() -> None:
    """A large budget costs nothing at start-up: pages are committed as blocks get written."""
    spec = KVCacheSpec(num_layers=4, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)
    before = _peak_rss_mib()
    caches = allocate_kv_caches(spec, num_blocks=8192, block_size=16, device=torch.device("cpu"))  # 2 GiB
    assert _peak_rss_mib() - before < 64
    caches[0][:64].fill_(1.0)  # 64 blocks of one layer: 4 MiB
    assert _peak_rss_mib() - before < 64
    assert caches[0][:64].float().mean().item() == 1.0 and not caches[3][:64].float().any()
