"""The compiled CPU decode step (paphos/worker/compiled_decode.py) against the eager step.

A user turning --enforce-eager on or off must get the same completions: the same greedy tokens and
logprobs within fp32 rounding, for a single stream (the batch-1 graph) and a batch of streams of
different lengths (the symbolic-batch graph), including contexts shorter than one KV block (the
padded block table) and contexts that grow across block boundaries while decoding.
"""

from __future__ import annotations

import pytest

from paphos import LLM, SamplingParams

PROMPT_LENGTHS = (3, 10, 17, 40)  # block size 16: one, two and three blocks at the start


@pytest.fixture
def compile_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAPHOS_CPU_COMPILE", "1")


def _completions(llm: LLM, prompts: list[list[int]], batched: bool) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params) if batched else [llm.generate([p], params)[0] for p in prompts]
    result = []
    for out in outs:
        completion = out.outputs[0]
        assert completion.logprobs is not None
        result.append((list(completion.token_ids), [step.logprob for step in completion.logprobs]))
    return result


def test_compiled_decode_gives_the_eager_tokens_and_logprobs(tiny_model, compile_on) -> None:
    path, _ = tiny_model()
    common = dict(dtype="float32", max_model_len=128, block_size=16, enable_prefix_caching=False)
    compiled = LLM(str(path), **common)
    runner = compiled.engine.runner
    assert runner.compiled_decode is not None, "the CPU engine did not set up the compiled decode step"
    graph_calls = 0
    graphs = runner.compiled_decode._compiled

    def counting(*args):
        nonlocal graph_calls
        graph_calls += 1
        return graphs(*args)

    runner.compiled_decode._compiled = counting
    eager = LLM(str(path), enforce_eager=True, **common)
    assert eager.engine.runner.compiled_decode is None

    prompts = [[(7 * i + 3 * n) % 80 + 5 for i in range(n)] for n in PROMPT_LENGTHS]
    for batched in (False, True):
        got, want = _completions(compiled, prompts, batched), _completions(eager, prompts, batched)
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
            assert tokens == want_tokens
            assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) <= 1e-4
    # 23 decode steps per request alone, then 23 for the batch: every one ran on a graph.
    assert graph_calls == 23 * (len(prompts) + 1)
    assert not runner.compiled_decode._failed_once
