"""Tensor parallelism on the CPU (gloo, two processes): `-tp 2` against `-tp 1`, the start-up
refusals, and a follower that dies (paphos/worker/tensor_parallel.py, paphos/layers/parallel.py).

The parity runs are the engine's whole path (scheduler, broadcast step messages, sharded layers,
all-reduces, gathered logits, rank 0's sampler) in fp32 over chunked prefill mixed with decode
rows, a KV pool small enough to force preemption, and a second wave that hits the prefix cache:
every greedy token equal, every logprob (sampled, top, prompt) within 1e-4.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from paphos import LLM, SamplingParams
from paphos.config import ConfigError
from paphos.outputs import RequestOutput
from paphos.worker.tensor_parallel import TensorParallelError
from tests.engine.conftest import _write_tokenizer
from tests.quant.gguf_blocks import MIXED_TYPE_LAYERS, write_tiny_llama
from tests.quant.test_checkpoint_parity import checkpoint
from tests.server.spawn import spawn_server_process
from tests.server.test_spawned_lifecycle import alive, core_pid

TOLERANCE = 1e-4
NEW_TOKENS = 10
# Chunked prefill (24-token steps mixing chunks with decode rows) and a pool of 40 blocks of 4
# tokens that cannot hold the 8 sequences at once: the scheduler preempts.
ENGINE = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=24, block_size=4, num_gpu_blocks_override=40)


def _prompts(vocab: int, seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def _workload(llm: LLM, vocab: int) -> list[RequestOutput]:
    """Two waves of greedy requests; the second shares a prefix among itself and repeats two of
    the first's prompts (prefix-cache hits). One request per wave asks for prompt logprobs."""
    scheduler = llm.engine.scheduler
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    scored = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    first = _prompts(vocab, 1, (3, 9, 17, 24, 33, 40, 51, 70))
    outputs = llm.generate(first, [scored] + [greedy] * (len(first) - 1))
    hits_before = scheduler.prefix_cache_hits
    shared = _prompts(vocab, 7, (12,))[0]
    second = [shared + p for p in _prompts(vocab, 2, (5, 11, 19, 26))] + first[:2]
    outputs += llm.generate(second, [greedy] * (len(second) - 1) + [scored])
    assert scheduler.num_preemptions_total > 0, "the pool was meant to force a preemption"
    assert scheduler.prefix_cache_hits > hits_before, "the second wave was meant to hit the prefix cache"
    return outputs


def _assert_same(reference: list[RequestOutput], sharded: list[RequestOutput]) -> None:
    worst = 0.0
    for ref, out in zip(reference, sharded, strict=True):
        a, b = ref.outputs[0], out.outputs[0]
        assert a.token_ids == b.token_ids, f"request {ref.request_id}: {a.token_ids} != {b.token_ids}"
        assert a.logprobs is not None and b.logprobs is not None
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.top_token_ids == y.top_token_ids
            worst = max(worst, abs(x.logprob - y.logprob), *(abs(p - q) for p, q in zip(x.top_logprobs,
                                                                                          y.top_logprobs, strict=True)))
        assert (ref.prompt_logprobs is None) == (out.prompt_logprobs is None)
        for x, y in zip(ref.prompt_logprobs or [], out.prompt_logprobs or [], strict=True):
            if x is not None and y is not None:
                assert (x.token_id, x.rank, x.top_token_ids) == (y.token_id, y.rank, y.top_token_ids)
                worst = max(worst, abs(x.logprob - y.logprob))
    assert worst <= TOLERANCE, f"max |logprob difference| {worst:.2e} > {TOLERANCE}"


@pytest.mark.parametrize("variant", ["llama", "qwen2-mqa-tied-odd-vocab", "qwen3"])
def test_tp2_matches_tp1_on_a_tiny_safetensors_model(tiny_model, engines: list[LLM], variant: str) -> None:
    """llama: 2 KV heads sharded, untied head. qwen2: q/k/v biases, one KV head replicated on both
    ranks, a head tied to the embedding, a vocabulary of 97 (the last rank's rows padded). qwen3:
    heads wider than hidden / heads, the per-head q/k norms whole on each rank."""
    if variant == "qwen2-mqa-tied-odd-vocab":
        path, _ = tiny_model("qwen2", num_key_value_heads=1, tie_word_embeddings=True, vocab_size=97)
    else:
        path, _ = tiny_model(variant)
    engines.append(LLM(str(path), **ENGINE))
    engines.append(LLM(str(path), **ENGINE, tensor_parallel_size=2))
    _assert_same(_workload(engines[0], 96), _workload(engines[1], 96))


def test_tp2_matches_tp1_on_a_tiny_gguf(tmp_path: Path, engines: list[LLM]) -> None:
    """Raw GGUF blocks sharded: q/k/v and gate/up by whole rows (after llama.cpp's Q/K row
    permutation is undone), o/down by whole blocks of every row, the tied Q8_0 embedding by rows."""
    path = write_tiny_llama(tmp_path / "tiny.gguf", MIXED_TYPE_LAYERS, hidden=512, inter=1024, seed=5)
    _write_tokenizer(tmp_path / "tokenizer")
    settings = dict(ENGINE, tokenizer=str(tmp_path / "tokenizer"))
    engines.append(LLM(str(path), **settings))
    engines.append(LLM(str(path), **settings, tensor_parallel_size=2))
    _assert_same(_workload(engines[0], 32), _workload(engines[1], 32))


def _refusal(tmp_path: Path, tiny_model, case: str) -> tuple[str, dict[str, object]]:
    if case == "heads":
        return str(tiny_model("llama")[0]), {"tensor_parallel_size": 3}
    if case == "kv_heads":
        return str(tiny_model("llama", hidden_size=60, num_attention_heads=6, num_key_value_heads=3)[0]), {}
    if case == "intermediate":
        return str(tiny_model("llama", intermediate_size=129)[0]), {}
    if case == "gptq-4b-g128-sym":  # the tool's checkpoint
        return str(checkpoint(case)), {}
    # gguf_blocks: 256 inputs of a Q4_K o_proj split in two: 128 per rank, half a block.
    path = write_tiny_llama(tmp_path / "t.gguf", [{"attn_output": "Q4_K"}], hidden=256, inter=512)
    _write_tokenizer(tmp_path / "tokenizer")
    return str(path), {"tokenizer": str(tmp_path / "tokenizer")}


@pytest.mark.parametrize(("case", "message"), [
    ("heads", "--tensor-parallel-size 3 must divide the model's num_attention_heads (4)"),
    ("kv_heads", "num_key_value_heads (3) must be a multiple or a divisor of 2"),
    ("intermediate", "must divide the model's intermediate_size (129)"),
    ("gguf_blocks", "GGUF tensor model.layers.0.self_attn.o_proj.weight (Q4_K, 256 inputs)"),
    # o_proj's 128 inputs split in two cut its groups of 128
    ("gptq-4b-g128-sym", "model.layers.0.self_attn.o_proj: quantization_config group_size 128: a rank's 64 input rows"),
])  # fmt: skip
def test_models_and_formats_that_cannot_be_split_are_refused_at_start_up(
    tmp_path: Path, tiny_model, case: str, message: str
) -> None:
    model, settings = _refusal(tmp_path, tiny_model, case)
    settings = {"tensor_parallel_size": 2, "dtype": "float32", "max_model_len": 128, **settings}
    before = set(multiprocessing.active_children())
    with pytest.raises(ConfigError) as exc:
        LLM(model, **settings)
    assert message in str(exc.value)
    assert set(multiprocessing.active_children()) <= before, "a refused model must not start any rank"


def test_a_follower_killed_mid_generation_ends_the_engine_with_an_error(tiny_model, engines: list[LLM]) -> None:
    path, _ = tiny_model("llama")
    llm = LLM(str(path), dtype="float32", max_model_len=512, num_gpu_blocks_override=200, tensor_parallel_size=2)
    engines.append(llm)
    driver = llm.engine.core._tp
    assert driver is not None
    follower = driver.processes[0]
    killer = threading.Timer(0.5, os.kill, (follower.pid, signal.SIGKILL))
    killer.start()
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        for _ in range(50):  # the kill lands in one of these steps (or between two)
            llm.generate([[5, 6, 7]] * 4, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    killer.join()
    assert time.monotonic() - started < 30
    assert not any(p.is_alive() for p in driver.processes)
    with pytest.raises(TensorParallelError):  # the engine stays down
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))


def test_a_dead_follower_takes_the_server_down(tmp_path: Path, tiny_model) -> None:
    """The operator's view: an idle server whose rank 1 dies answers 503 on /health within a few
    seconds and exits non-zero (a supervisor restarts it)."""
    path, _ = tiny_model("llama")
    args = (str(path), "--max-model-len", "256", "--num-gpu-blocks-override", "64", "--device", "cpu", "-tp", "2")
    with spawn_server_process(tmp_path, *args) as (server, base):
        core = core_pid(server)
        followers = Path(f"/proc/{core}/task/{core}/children").read_text().split()
        rank1 = next(int(p) for p in followers if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes())
        reply = httpx.post(f"{base}/v1/completions", json={"model": "smol", "prompt": [5, 6, 7], "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        status = 200
        while status != 503 and time.monotonic() - killed < 10:
            try:
                status = httpx.get(f"{base}/health", timeout=1).status_code
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert status == 503, "/health did not turn 503 within 10 s of rank 1's death"
        assert server.wait(30) != 0
        assert not alive(core)
