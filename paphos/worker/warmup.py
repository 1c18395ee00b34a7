"""Kernel warm-up: the Triton variants that mixed steps launch, compiled before the first request.

Data flow: worker setup (model loaded, KV cache allocated, decode graphs captured) -> here ->
ready. Triton compiles a kernel variant the first time it is launched with new compile-time
values. Decode-only steps have theirs compiled by the graph capture and the largest prefill by
the KV profiling pass, but steps that mix decode rows with a prefill chunk (every step of a
server whose requests arrive at different times) launch the split-KV decode kernel in its mixed
form with a split count that follows the number of decode rows, short prefill chunks with other
tiles, and the sampler at new batch sizes. A server met them under its first bursts of arrivals,
where each compile (~1 s) stalled every stream: on the H200, 64 streams of 128 / 128 tokens had
a median time to first token of 881 ms in the first run and 283 ms in the second, with a fifth of
the core's samples still in Triton's compiler.

The warm-up runs, through the model runner itself, steps of N decode rows plus one prefill chunk
for N = 1, 2, 4, ... up to --max-num-seqs, half the rows greedy and half sampled (temperature,
top-p, min-p), on blocks of the empty KV cache; then forgets them.
"""

from __future__ import annotations

import logging
import time

from paphos.core.protocol import SamplingInputs
from paphos.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from paphos.quant.kernels import compiled_dequant
from paphos.sampling_params import SamplingParams
from paphos.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_PROMPT_TOKENS = 16
_CHUNK_TOKENS = 48
_GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
_SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, min_p=0.05, max_tokens=4)


def warm_up_mixed_steps(runner: ModelRunner, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int) -> None:
    started = time.perf_counter()
    block_size = runner.block_size
    blocks_per_request = -(-max(_PROMPT_TOKENS + 1, _CHUNK_TOKENS) // block_size)
    # Each step holds rows + 1 sequences, rows prompts in one step, and blocks_per_request blocks per sequence.
    limit = min(max_num_seqs - 1, (num_blocks - 1) // blocks_per_request - 1,
                (max_num_batched_tokens - _CHUNK_TOKENS) // _PROMPT_TOKENS)
    for rows in sorted({min(1 << i, limit) for i in range(limit.bit_length() + 1)} if limit >= 1 else ()):
        _mixed_step(runner, rows, blocks_per_request)
    logger.info("kernels warmed up for mixed steps in %.1f s", time.perf_counter() - started)


def warm_up_prefill(runner: ModelRunner, num_tokens: int, num_blocks: int) -> None:
    """One prefill chunk of `num_tokens` rows (CPU): compiles the weight dequantizers that chunks of
    that many rows or more use (quant/kernels/compiled_dequant.py), for every weight shape."""
    started = time.perf_counter()
    num_tokens = min(num_tokens, (num_blocks - 1) * runner.block_size)
    request = _request(runner, "warmup-prefill", 0, num_tokens, _GREEDY, -(-num_tokens // runner.block_size))
    with compiled_dequant.warming_up():
        runner.execute(SchedulerOutput(
            scheduled_new_reqs=[request], num_scheduled_tokens={request.req_id: num_tokens},
            total_num_scheduled_tokens=num_tokens,
        ))
    runner.execute(SchedulerOutput(finished_req_ids={request.req_id}))
    logger.info("weight dequantizers compiled for prefill chunks in %.1f s", time.perf_counter() - started)


def _request(
    runner: ModelRunner, req_id: str, index: int, num_tokens: int, params: SamplingParams, blocks_per_request: int
) -> NewRequestData:
    first = 1 + index * blocks_per_request
    ids = min(100, runner.vocab_size - 1)
    return NewRequestData(
        req_id=req_id, prompt_token_ids=[1 + (index + i) % ids for i in range(num_tokens)], output_token_ids=[],
        sampling_params=params, sampling_inputs=SamplingInputs(),
        block_ids=list(range(first, first + blocks_per_request)), num_computed_tokens=0,
    )


def _mixed_step(runner: ModelRunner, rows: int, blocks_per_request: int) -> None:
    ids = [f"warmup-{rows}-{i}" for i in range(rows)]
    params = [_GREEDY if i % 2 == 0 else _SAMPLED for i in range(rows)]
    prefill = [_request(runner, req_id, i, _PROMPT_TOKENS, p, blocks_per_request)
               for i, (req_id, p) in enumerate(zip(ids, params, strict=True))]
    runner.execute(SchedulerOutput(
        scheduled_new_reqs=prefill, num_scheduled_tokens=dict.fromkeys(ids, _PROMPT_TOKENS),
        total_num_scheduled_tokens=rows * _PROMPT_TOKENS,
    ))
    chunk = _request(runner, f"warmup-{rows}-chunk", rows, _CHUNK_TOKENS, _SAMPLED, blocks_per_request)
    decode = [CachedRequestData(req_id, [], _PROMPT_TOKENS) for req_id in ids]
    runner.execute(SchedulerOutput(
        scheduled_new_reqs=[chunk], scheduled_cached_reqs=decode,
        num_scheduled_tokens={**dict.fromkeys(ids, 1), chunk.req_id: _CHUNK_TOKENS},
        total_num_scheduled_tokens=rows + _CHUNK_TOKENS,
    ))
    runner.execute(SchedulerOutput(finished_req_ids={*ids, chunk.req_id}))
