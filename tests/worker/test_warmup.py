"""The start-up warm-up runs real mixed steps through the runner and leaves no trace: afterwards
the runner holds no request and generates exactly what an engine that never warmed up does."""

from paphos import SamplingParams
from paphos.llm import LLM
from paphos.worker.warmup import warm_up_mixed_steps


def test_warm_up_leaves_the_engine_as_it_found_it(tiny_model) -> None:
    path, _ = tiny_model()
    kwargs = dict(dtype="float32", max_model_len=128, block_size=4, max_num_seqs=8)
    warmed, fresh = LLM(str(path), **kwargs), LLM(str(path), **kwargs)
    runner = warmed.engine.runner
    steps = []
    execute = runner.execute
    runner.execute = lambda out: steps.append(out) or execute(out)
    warm_up_mixed_steps(runner, warmed.engine.core.info.num_blocks, max_num_seqs=8, max_num_batched_tokens=256)
    del runner.execute
    # Decode rows 1, 2, 4 and 7 (max_num_seqs - 1) beside a prefill chunk, each after its prompts.
    mixed = [out for out in steps if out.scheduled_cached_reqs and out.scheduled_new_reqs]
    assert [len(out.scheduled_cached_reqs) for out in mixed] == [1, 2, 4, 7]
    assert runner.states == {} and runner.seeds == {}
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in warmed.generate(prompts, params)]
    assert got == [o.outputs[0].token_ids for o in fresh.generate(prompts, params)]
