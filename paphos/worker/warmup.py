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
top-p, min-p), on blocks of the empty KV cache; then forgets them. With LoRA's Triton kernels it
runs them again with every row on an adapter slot (still zeros: lora/slots.py `warming_up`), and
prefill chunks of growing sizes, since eager steps with adapters launch the shrink and expand at
new sizes (on the H200 the first 64 requests on adapters otherwise took twice as long as the next
64).
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
    for rows in _sizes(runner, num_blocks, max_num_seqs, max_num_batched_tokens):
        _mixed_step(runner, rows, _blocks_per_request(runner))
    logger.info("kernels warmed up for mixed steps in %.1f s", time.perf_counter() - started)


def warm_up_adapter_kernels(runner: ModelRunner, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int) -> None:
    """The same mixed steps with every row on an adapter slot still holding zeros (lora/slots.py
    `warming_up`), then prefill chunks of 128, 256, ... rows up to --max-num-batched-tokens and
    the context length (the shrink splits K fewer ways as a chunk's tiles grow): the LoRA shrink
    and expand at the sizes eager steps launch them."""
    slots = runner.adapter_slots
    if slots is None:
        return
    started = time.perf_counter()
    with slots.warming_up():
        for rows in _sizes(runner, num_blocks, max_num_seqs, max_num_batched_tokens):
            _mixed_step(runner, rows, _blocks_per_request(runner))
        largest = min(max_num_batched_tokens, runner.max_model_len)
        chunk = 128
        while chunk < 2 * largest:
            _prefill_step(runner, min(chunk, largest), num_blocks)
            chunk *= 2
    logger.info("LoRA kernels warmed up for mixed steps and prefill chunks in %.1f s", time.perf_counter() - started)


def _blocks_per_request(runner: ModelRunner) -> int:
    return -(-max(_PROMPT_TOKENS + 1, _CHUNK_TOKENS) // runner.block_size)


def _sizes(runner: ModelRunner, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """Decode rows of the warm-up's steps: 1, 2, 4, ... up to what the KV cache and the token
    budget hold (each step holds rows + 1 sequences, rows prompts in one step)."""
    limit = min(max_num_seqs - 1, (num_blocks - 1) // _blocks_per_request(runner) - 1,
                (max_num_batched_tokens - _CHUNK_TOKENS) // _PROMPT_TOKENS)  # fmt: skip
    return sorted({min(1 << i, limit) for i in range(limit.bit_length() + 1)} if limit >= 1 else ())


def warm_up_prefill(runner: ModelRunner, num_tokens: int, num_blocks: int) -> None:
    """One prefill chunk of `num_tokens` rows (CPU): compiles the weight dequantizers that chunks of
    that many rows or more use (quant/kernels/compiled_dequant.py), for every weight shape."""
    started = time.perf_counter()
    with compiled_dequant.warming_up():
        _prefill_step(runner, num_tokens, num_blocks)
    logger.info("weight dequantizers compiled for prefill chunks in %.1f s", time.perf_counter() - started)


def _prefill_step(runner: ModelRunner, num_tokens: int, num_blocks: int) -> None:
    """One request's prefill chunk of `num_tokens` rows (at most what the KV cache holds), then forgotten."""
    num_tokens = min(num_tokens, (num_blocks - 1) * runner.block_size)
    request = _request(runner, "warmup-prefill", 0, num_tokens, _GREEDY, -(-num_tokens // runner.block_size))
    runner.execute(SchedulerOutput(
        scheduled_new_reqs=[request], num_scheduled_tokens={request.req_id: num_tokens},
        total_num_scheduled_tokens=num_tokens,
    ))  # fmt: skip
    runner.execute(SchedulerOutput(finished_req_ids={request.req_id}))


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
