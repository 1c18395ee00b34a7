"""The whole engine against Hugging Face `transformers` on tiny random models (fp32, CPU).

Every token the engine schedules (prefill chunks, decode rows, prefix-cache hits, recomputation
after preemption) has its logits compared with HF's forward over the same full sequence.
"""

from __future__ import annotations

import pytest
import torch

import paphos.worker.model_runner as model_runner_module
from paphos.engine.llm_engine import LLMEngine
from paphos.llm import build_engine_config
from paphos.sampling_params import SamplingParams

TOLERANCE = 1e-4


class LogitRecorder:
    """Records, for every scheduled token of every step, (request, position, logits)."""

    def __init__(self, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: list[tuple[str, int, torch.Tensor]] = []
        self.steps_with_mixed_rows = 0
        self.hit_tokens = 0
        runner = engine.runner
        model = runner.model
        original_build = model_runner_module.build_step_inputs
        original_forward = model.forward
        pending: list = []

        def build(*args, **kwargs):
            inputs = original_build(*args, **kwargs)
            pending.append(inputs)
            return inputs

        def forward(input_ids, positions, kv_caches, attn_metadata):
            hidden = original_forward(input_ids, positions, kv_caches, attn_metadata)
            inputs = pending.pop()
            logits = model.compute_logits(hidden)
            qsl = attn_metadata.query_start_loc_cpu
            lengths = [b - a for a, b in zip(qsl, qsl[1:], strict=False)]
            if 1 in lengths and any(n > 1 for n in lengths):
                self.steps_with_mixed_rows += 1
            for i, req_id in enumerate(inputs.req_ids):
                for row in range(qsl[i], qsl[i + 1]):
                    self.rows.append((req_id, int(positions[row]), logits[row].clone()))
            return hidden

        monkeypatch.setattr(model_runner_module, "build_step_inputs", build)
        monkeypatch.setattr(model, "forward", forward)


def run_engine(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}{i}", prompt, params)
    outputs: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].extend(out.outputs[0].token_ids if out.outputs else [])
    return outputs


def hf_logits(hf_model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0]


def hf_greedy(hf_model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def make_prompts(count: int, seed: int, shared_prefix: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 9, 17, 24, 33, 40, 51, 70][:count]
    return [shared_prefix + torch.randint(3, 96, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama3-rope"])
def test_every_scheduled_token_matches_hf_with_chunking_prefix_hits_and_preemption(
    tiny_model, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides = {}
    if arch == "llama3-rope":
        overrides = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}
    path, hf_model = tiny_model("llama" if arch == "llama3-rope" else arch, **overrides)
    # A budget of 24 tokens chunks every longer prompt and mixes chunks with decode rows; 24 blocks
    # of 4 tokens cannot hold the 8 sequences at once, so the scheduler must preempt.
    engine = LLMEngine(build_engine_config(
        str(path), dtype="float32", max_model_len=256, max_num_batched_tokens=24, block_size=4, num_gpu_blocks_override=40,
    ))
    recorder = LogitRecorder(engine, monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    shared = torch.randint(3, 96, (12,), generator=torch.Generator().manual_seed(7)).tolist()
    first = make_prompts(8, seed=1, shared_prefix=[])
    generated = run_engine(engine, first, params, "a")
    # A second wave sharing a 12-token prefix with each other and repeating the first prompts' text:
    # its blocks come from the prefix cache.
    queries_before = engine.scheduler.prefix_cache_hits
    second = [shared + p for p in make_prompts(4, seed=2, shared_prefix=[])] + first[:2]
    generated |= run_engine(engine, second, params, "b")

    assert engine.scheduler.num_preemptions_total > 0, "the pool was meant to force a preemption"
    assert engine.scheduler.prefix_cache_hits > queries_before, "the second wave was meant to hit the cache"
    assert recorder.steps_with_mixed_rows > 0, "decode rows and prefill chunks never shared a step"

    sequences = {f"a{i}": p + generated[f"a{i}"] for i, p in enumerate(first)}
    sequences |= {f"b{i}": p + generated[f"b{i}"] for i, p in enumerate(second)}
    reference = {rid: hf_logits(hf_model, tokens) for rid, tokens in sequences.items()}
    worst = 0.0
    for req_id, position, logits in recorder.rows:
        rid = req_id.split("#")[0]
        worst = max(worst, (logits - reference[rid][position]).abs().max().item())
    assert worst <= TOLERANCE, f"max |logit difference| {worst:.2e} > {TOLERANCE}"
    assert len(recorder.rows) >= sum(len(s) - 1 for s in sequences.values())

    # Greedy continuations of the 8 batched prompts equal HF generate, token for token.
    for i, prompt in enumerate(first):
        assert generated[f"a{i}"] == hf_greedy(hf_model, prompt, 12), f"prompt {i} diverged from HF"


def test_preemption_and_resume_give_the_same_greedy_outputs(tiny_model) -> None:
    path, _ = tiny_model("llama")
    prompts = make_prompts(8, seed=3, shared_prefix=[])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    roomy = LLMEngine(build_engine_config(str(path), dtype="float32", max_model_len=256, block_size=4))
    tight = LLMEngine(build_engine_config(
        str(path), dtype="float32", max_model_len=256, block_size=4, num_gpu_blocks_override=30, enable_prefix_caching=False,
    ))
    assert run_engine(roomy, prompts, params, "r") == {
        k.replace("t", "r"): v for k, v in run_engine(tight, prompts, params, "t").items()
    }
    assert tight.scheduler.num_preemptions_total > 0
