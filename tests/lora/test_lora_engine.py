"""LoRA through the whole engine (CPU, fp32) against PEFT: every scheduled token's logits equal
the PEFT-merged HF model's, a batch mixing adapters gives each request what it gets alone, adapters
hot-swap through --max-loras slots under load, and unloading or a vanished adapter never breaks
another request."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from paphos.engine.llm_engine import LLMEngine
from paphos.llm import LLM, build_engine_config
from paphos.lora.errors import LoRANotFoundError
from paphos.sampling_params import SamplingParams
from tests.engine.test_hf_parity import LogitRecorder, hf_greedy, hf_logits, make_prompts
from tests.lora.peft_fixtures import Adapter, TinyLlama, make_adapter

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def adapters(tiny_llama: TinyLlama, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Adapter]:
    """Four adapters unlike each other: ranks, scales, targets and layers differ."""
    folder = tmp_path_factory.mktemp("adapters")
    return {
        "plain": make_adapter(tiny_llama, folder / "plain", rank=8, alpha=16, seed=1),
        "rslora": make_adapter(tiny_llama, folder / "rslora", rank=16, alpha=8, use_rslora=True, seed=2),
        "attn": make_adapter(tiny_llama, folder / "attn", rank=4, target_modules=("q_proj", "v_proj", "o_proj"), seed=3),
        "mlp-layer1": make_adapter(
            tiny_llama, folder / "mlp1", rank=8, target_modules=("gate_proj", "up_proj", "down_proj"),
            layers_to_transform=[1], seed=4,
        ),
    }  # fmt: skip


def _engine(base: TinyLlama, adapters: dict[str, Adapter], **overrides: object) -> LLMEngine:
    settings = dict(
        dtype="float32", max_model_len=256, block_size=4, enable_lora=True, max_loras=2, max_lora_rank=16,
        lora_modules={name: str(a.path) for name, a in adapters.items()},
    )  # fmt: skip
    settings.update(overrides)
    return LLMEngine(build_engine_config(str(base.path), **settings))


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], str | None]], params: SamplingParams) -> dict:
    for req_id, prompt, name in requests:
        engine.add_request(req_id, prompt, params, lora=engine.frontend.loras.get(name) if name else None)
    outputs: dict[str, list] = {req_id: [] for req_id, _, _ in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def _tokens(outs: list) -> list[int]:
    return [t for o in outs for t in (o.outputs[0].token_ids if o.outputs else [])]


def test_every_scheduled_token_matches_the_peft_merged_model(
    tiny_llama: TinyLlama, adapters: dict[str, Adapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four adapters and the base in one batch through two slots, with chunked prefill, prefix hits
    and preemption: every row's logits are the merged model's within 1e-4."""
    engine = _engine(tiny_llama, adapters, max_num_batched_tokens=24, num_gpu_blocks_override=20)
    recorder = LogitRecorder(engine, monkeypatch)
    names = [None, *adapters]
    shared = make_prompts(1, seed=9, shared_prefix=[])[0] * 3  # 9 tokens: two full blocks shared
    prompts = make_prompts(6, seed=1, shared_prefix=shared)
    requests = [(f"r{i}-{names[i % 5]}", p, names[i % 5]) for i, p in enumerate(prompts + prompts[:4])]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = _run(engine, requests, params)

    assert engine.scheduler.num_preemptions_total > 0, "the pool was meant to force a preemption"
    assert engine.scheduler.prefix_cache_hits > 0, "repeated prompts were meant to hit the cache"
    models = {None: tiny_llama.model} | {name: a.merged for name, a in adapters.items()}
    sequences = {req_id: (prompt + _tokens(outputs[req_id]), name) for req_id, prompt, name in requests}
    reference = {req_id: hf_logits(models[name], tokens) for req_id, (tokens, name) in sequences.items()}
    worst = max((logits - reference[req_id.split("#")[0]][position]).abs().max().item()
                for req_id, position, logits in recorder.rows)  # fmt: skip
    assert worst <= TOLERANCE, f"max |logit difference| {worst:.2e}"
    for req_id, prompt, name in requests:
        assert _tokens(outputs[req_id]) == hf_greedy(models[name], prompt, 10), req_id
    # The adapters matter: the same prompt continues differently under each.
    same_prompt = [_tokens(outputs[f"r{i}-{names[i % 5]}"]) for i in (0, 6)] + [_tokens(outputs["r1-plain"])]
    assert len({tuple(t) for t in same_prompt}) > 1


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(tiny_llama: TinyLlama, adapters: dict[str, Adapter]) -> None:
    names = [None, *adapters]
    prompts = make_prompts(5, seed=4, shared_prefix=[3, 4, 5, 6, 7, 8, 9, 10])
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=12, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=1.0, min_p=0.1, seed=2, max_tokens=12, ignore_eos=True, logprobs=3,
                       repetition_penalty=1.3),
        SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=12, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3, dry_multiplier=0.8),
    ]  # fmt: skip
    modules = {name: str(a.path) for name, a in adapters.items()}
    together = LLM(str(tiny_llama.path), dtype="float32", block_size=4, num_gpu_blocks_override=24,
                   enable_lora=True, max_loras=2, max_lora_rank=16, lora_modules=modules)  # fmt: skip
    batched = together.generate(prompts, params, lora=names)
    assert together.engine.scheduler.num_preemptions_total > 0
    alone = LLM(str(tiny_llama.path), dtype="float32", block_size=4, enable_lora=True, max_loras=1,
                max_lora_rank=16, lora_modules=modules)  # fmt: skip
    for prompt, sp, name, out in zip(prompts, params, names, batched, strict=True):
        single = alone.generate([prompt], sp, lora=name)[0].outputs[0]
        assert out.outputs[0].token_ids == single.token_ids, name
        for a, b in zip(out.outputs[0].logprobs, single.logprobs, strict=True):
            assert a.top_token_ids == b.top_token_ids
            assert max(abs(x - y) for x, y in zip(a.top_logprobs, b.top_logprobs, strict=True)) <= TOLERANCE


def test_sixteen_adapters_hot_swap_through_four_slots(tiny_llama: TinyLlama, tmp_path: Path) -> None:
    """16 adapters, --max-loras 4, --max-cpu-loras 6, 64 requests in random order: every request
    gets its own adapter's output, and nothing leaks (KV blocks, host references, slots)."""
    adapters = {f"a{i}": make_adapter(tiny_llama, tmp_path / f"a{i}", rank=8, seed=100 + i) for i in range(16)}
    engine = _engine(tiny_llama, adapters, max_loras=4, max_cpu_loras=6, max_num_seqs=12)
    rng = random.Random(0)
    prompts = make_prompts(4, seed=5, shared_prefix=[])
    requests = [(f"q{i}", rng.choice(prompts), rng.choice([None, *adapters])) for i in range(64)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = _run(engine, requests, params)

    expected: dict[tuple, list[int]] = {}
    for req_id, prompt, name in requests:
        key = (tuple(prompt), name)
        if key not in expected:
            model = tiny_llama.model if name is None else adapters[name].merged
            expected[key] = hf_greedy(model, prompt, 6)
        assert _tokens(outputs[req_id]) == expected[key], f"{req_id} with {name}"
    scheduler = engine.scheduler
    assert not scheduler.has_unfinished_requests() and scheduler.num_used_blocks == 0
    assert scheduler.kv_cache_manager.req_to_blocks == {}
    host = engine.core.adapters
    assert host is not None and host.num_cached <= 6 and not host._users
    slots = engine.runner.adapter_slots
    assert slots is not None and slots.num_resident <= 4


def test_unloading_an_adapter_in_use_lets_its_requests_finish(tiny_llama: TinyLlama, adapters: dict[str, Adapter]) -> None:
    engine = _engine(tiny_llama, adapters)
    prompt = make_prompts(1, seed=6, shared_prefix=[])[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("running", prompt, params, lora=engine.frontend.loras.get("plain"))
    engine.step()
    engine.remove_lora("plain")
    assert engine.frontend.loras.get("plain") is None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
    assert hf_greedy(adapters["plain"].merged, prompt, 8)[1:] == tokens[-7:]
    assert not engine.core.adapters._users and engine.core.adapters.num_cached <= 2


def test_unknown_adapter_names_are_refused_offline(tiny_llama: TinyLlama, adapters: dict[str, Adapter]) -> None:
    llm = LLM(str(tiny_llama.path), dtype="float32", enable_lora=True, max_lora_rank=16,
              lora_modules={"plain": str(adapters["plain"].path)})  # fmt: skip
    with pytest.raises(LoRANotFoundError, match="no adapter named 'other'"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), lora="other")
    llm.remove_lora("plain")
    with pytest.raises(LoRANotFoundError):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), lora="plain")


def test_an_adapter_gone_from_disk_aborts_only_its_requests(
    tiny_llama: TinyLlama, adapters: dict[str, Adapter], tmp_path: Path
) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(adapters["attn"].path, copy)
    engine = _engine(tiny_llama, {"copy": Adapter(copy, adapters["attn"].merged)})
    shutil.rmtree(copy)  # registered (validated), then deleted before its first use
    prompt = make_prompts(1, seed=7, shared_prefix=[])[0]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outputs = _run(engine, [("lost", prompt, "copy"), ("base", prompt, None)], params)
    assert outputs["lost"][-1].finished and outputs["lost"][-1].outputs[0].finish_reason == "abort"
    assert _tokens(outputs["base"]) == hf_greedy(tiny_llama.model, prompt, 5)
    assert not engine.core.adapters._users


def test_lora_requests_need_lora_enabled(tiny_llama: TinyLlama, adapters: dict[str, Adapter]) -> None:
    from paphos.lora.errors import LoRAError

    llm = LLM(str(tiny_llama.path), dtype="float32")
    with pytest.raises(LoRAError, match="--enable-lora"):
        llm.add_lora("plain", str(adapters["plain"].path))


def test_prefix_cache_never_shares_blocks_across_adapters(tiny_llama: TinyLlama, adapters: dict[str, Adapter]) -> None:
    engine = _engine(tiny_llama, adapters)
    prompt = make_prompts(1, seed=8, shared_prefix=[])[0] * 2
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = _run(engine, [("a", prompt, "plain")], params)
    second = _run(engine, [("b", prompt, "rslora"), ("c", prompt, "plain"), ("d", prompt, None)], params)
    cached = {rid: outs[0].num_cached_tokens for rid, outs in second.items()}
    assert cached["b"] == 0 and cached["d"] == 0 and cached["c"] > 0
    assert _tokens(second["c"]) == _tokens(first["a"])
    assert torch.equal(torch.tensor(_tokens(second["b"])), torch.tensor(hf_greedy(adapters["rslora"].merged, prompt, 4)))


def test_kernel_warm_up_runs_the_adapters_and_adds_nothing(tiny_llama: TinyLlama, adapters: dict[str, Adapter]) -> None:
    """The start-up warm-up of the LoRA kernels (worker/warmup.py) runs mixed steps with every row
    on slot 0 at the maximal rank while its weights are zeros: the adapters' path runs, the
    outputs are the base model's, and afterwards requests get their adapters as before. Once an
    adapter is resident it is refused (its slot would no longer be zeros)."""
    from paphos.worker.warmup import warm_up_adapter_kernels

    engine = _engine(tiny_llama, adapters)
    runner = engine.runner
    slots = runner.adapter_slots
    assert slots is not None
    calls: list[bool] = []
    apply = slots.batch.mapping_for
    slots.batch.mapping_for = lambda rows: (calls.append(slots.batch.active), apply(rows))[1]  # type: ignore[method-assign]
    warm_up_adapter_kernels(runner, engine.core.info.num_blocks, max_num_seqs=4, max_num_batched_tokens=256)
    assert calls and all(calls) and slots.num_resident == 0
    slots.batch.mapping_for = apply  # type: ignore[method-assign]
    prompt = make_prompts(1, seed=8, shared_prefix=[])[0]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = _run(engine, [("base", prompt, None), ("plain", prompt, "plain")], params)
    assert _tokens(outputs["base"]) == hf_greedy(tiny_llama.model, prompt, 4)
    assert _tokens(outputs["plain"]) == hf_greedy(adapters["plain"].merged, prompt, 4)
    with pytest.raises(RuntimeError, match="before any adapter is resident"), slots.warming_up():
        pass


def test_prefetch_takes_only_slots_no_unfinished_request_uses(tiny_llama: TinyLlama, adapters: dict[str, Adapter]) -> None:
    """An adapter in host memory is copied into a device slot before its requests reach the
    scheduler (lora/slots.py prefetch: on a GPU beside the steps, here at once), but never into the
    slot of an adapter that unfinished requests use, nor of one prefetched for requests still held:
    then the requests go to the scheduler and the step loads the adapter."""
    engine = _engine(tiny_llama, adapters, max_loras=2)
    core, slots = engine.core, engine.runner.adapter_slots
    assert slots is not None and core.adapters is not None
    ids = {}
    for name in ("plain", "rslora", "attn"):
        lora = engine.frontend.loras.get(name)
        assert lora is not None
        ids[name] = lora.lora_id
        core.adapters.acquire(lora)
    loaded: list[int] = []
    while len(loaded) < 3:
        core.adapters.wait(0.05)
        loaded += core.adapters.poll()[0]
    plain, rslora, attn = ids["plain"], ids["rslora"], ids["attn"]
    assert slots.prefetch(plain, in_use={plain, rslora}) and slots.prefetch(rslora, in_use={plain, rslora})
    assert slots.is_ready(plain) and slots.is_ready(rslora)
    assert not slots.prefetch(attn, in_use={attn})  # both slots reserved for requests still held
    slots.prepare([plain, rslora], [1, 1])  # their requests ran: no longer reserved
    assert not slots.prefetch(attn, in_use={plain, rslora, attn})  # both in use
    assert slots.prefetch(attn, in_use={rslora, attn})  # plain's requests are gone: its slot
    assert slots.is_ready(attn) and not slots.is_resident(plain) and slots.is_ready(rslora)
    slots.prepare([plain], [2])  # a step needs plain again: the least recently used slot goes
    assert slots.is_resident(plain) and slots.num_resident == 2
