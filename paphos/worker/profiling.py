"""GPU memory budget for the KV cache, measured with a profiling forward pass.

Data flow: worker setup (model loaded, no KV cache yet) -> here -> bytes the KV cache may take ->
kv_cache.num_blocks_for_budget. The budget is what `--gpu-memory-utilization` grants of the GPU's
total memory, minus everything else this process needs at its peak: the weights, the activations
of the largest step the scheduler can build (`--max-num-batched-tokens` tokens, measured by
running it), the logits and sampler temporaries of `--max-num-seqs` rows, memory outside torch's
allocator (CUDA context, cuBLAS workspaces), and a reserve for CUDA graphs.
"""

from __future__ import annotations

import logging
import math

import torch

from paphos.attention.testing import build_metadata
from paphos.config import EngineConfig
from paphos.worker.kv_cache import KVCacheSpec, allocate_kv_caches

logger = logging.getLogger(__name__)

# Captured decode graphs share one pool sized by the largest batch's activations (small next to
# a prefill step); this covers the pool and the graphs' own bookkeeping.
_CUDA_GRAPH_RESERVE = 512 << 20
# The sampler holds a few [rows, vocab] fp32 tensors at once (logits, logprobs, probabilities,
# their cumulative sum, a masked copy); counted as this many logits-sized tensors.
_SAMPLER_LOGITS_COPIES = 6


@torch.inference_mode()
def profile_kv_budget(model: torch.nn.Module, config: EngineConfig, spec: KVCacheSpec, device: torch.device) -> int:
    block_size = config.cache.block_size
    tokens = config.scheduler.max_num_batched_tokens
    seq_len = min(tokens, config.scheduler.max_model_len)
    # The largest step: max_num_batched_tokens prompt tokens, in sequences of at most max_model_len.
    query_lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    blocks_per_seq = math.ceil(seq_len / block_size)
    num_blocks = 1 + blocks_per_seq * len(query_lens)
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(len(query_lens))]

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    scratch_cache = allocate_kv_caches(spec, num_blocks, block_size, device)
    scratch_bytes = sum(c.numel() * c.element_size() for c in scratch_cache)
    metadata = build_metadata(query_lens, query_lens, tables, block_size, device)
    input_ids = torch.zeros(tokens, dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in query_lens])
    hidden = model(input_ids, positions, scratch_cache, metadata)
    rows = min(config.scheduler.max_num_seqs, tokens)
    logits = model.compute_logits(hidden[:rows])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - scratch_bytes
    sampler_bytes = _SAMPLER_LOGITS_COPIES * logits.numel() * logits.element_size()
    del hidden, logits, scratch_cache
    torch.cuda.empty_cache()

    free, total = torch.cuda.mem_get_info(device)
    outside_torch = (total - free) - torch.cuda.memory_reserved(device)
    granted = int(total * config.cache.gpu_memory_utilization)
    budget = granted - peak - sampler_bytes - outside_torch - _CUDA_GRAPH_RESERVE
    logger.info(
        "GPU memory: %.1f GiB granted (%.2f of %.1f GiB); peak of a %d-token step %.2f GiB (weights "
        "included), sampler %.2f GiB, outside torch %.2f GiB, CUDA graphs %.2f GiB -> KV cache %.2f GiB",
        granted / 2**30, config.cache.gpu_memory_utilization, total / 2**30, tokens, peak / 2**30,
        sampler_bytes / 2**30, outside_torch / 2**30, _CUDA_GRAPH_RESERVE / 2**30, budget / 2**30,
    )
    return max(0, budget)
