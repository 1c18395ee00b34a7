"""Per-sequence sampler state survives preemption by recompute: seeded draws (counter-based RNG),
mirostat mu and the XTC coin give the same tokens whether or not the KV pool forced preemptions."""

from __future__ import annotations

from paphos.llm import LLM
from paphos.sampling_params import SamplingParams


def test_stateful_samplers_are_unchanged_by_preemption(tiny_model) -> None:
    path, _ = tiny_model("llama")
    prompts = [f"w{3 + i} w{20 + i} w{40 + i} w{60 + i} w{9 + i}" for i in range(8)]
    params = [
        SamplingParams(max_tokens=16, ignore_eos=True, seed=i, **kw)
        for i, kw in enumerate([dict(mirostat_mode=2, mirostat_tau=3.0), dict(mirostat_mode=1),
                                dict(xtc_probability=0.7, xtc_threshold=0.02), dict(dry_multiplier=1.0),
                                dict(repetition_penalty=1.3, repetition_penalty_range=8, rep_pen_slope=0.5),
                                dict(no_repeat_ngram_size=2), dict(temperature=1.3, top_p=0.8), dict(typical_p=0.7)])
    ]
    roomy = LLM(str(path), dtype="float32", max_model_len=256, block_size=4)
    tight = LLM(str(path), dtype="float32", max_model_len=256, block_size=4, num_gpu_blocks_override=30,
                enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.engine.scheduler.num_preemptions_total > 0
    assert got == expected
