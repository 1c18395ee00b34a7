"""The compiled CPU decode step (paphos/worker/compiled_decode.py) against the eager step.

A user turning --enforce-eager on or off must get the same completions: the same greedy tokens and
logprobs within fp32 rounding, for a single stream (the batch-1 graph) and a batch of streams of
different lengths (the symbolic-batch graph), including contexts shorter than one KV block (the
padded block table) and contexts that grow across block boundaries while decoding.
"""

from __future__ import annotations

import pytest
import torch

from paphos import LLM, SamplingParams
from paphos.attention.metadata import AttentionMetadata
from paphos.attention.torch_ref import TorchReferenceBackend
from paphos.loader import GGUFCheckpoint
from paphos.loader.source import raw_tensor_names
from paphos.models.registry import resolve_model_class
from paphos.quant.gguf import GGUFQuantConfig
from paphos.quant.gguf.kernels import Int4PackCPUKernel, Int8GroupCPUKernel
from paphos.worker.compiled_decode import CompiledDecode
from tests.quant.gguf_blocks import write_tiny_llama

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
    head_calls = 0
    head = runner.compiled_decode._head

    def counting_head(hidden):
        nonlocal head_calls
        head_calls += 1
        return head(hidden)

    runner.compiled_decode._head = counting_head
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
    assert head_calls > graph_calls  # prefill steps' sampling rows take the head's graphs too
    assert not runner.compiled_decode._failed_once


def test_int8_group_layers_in_a_compiled_step_match_the_eager_step(tmp_path) -> None:
    """Q8_0 / Q5_0 / Q6_K layers and a tied Q8_0 head of a bf16 GGUF model, kept as int8 codes:
    the compiled step's fused batch-1 reduction and its batch >= 2 graph give the eager step's logits
    within bf16 rounding (eager rounds the dequantized weights to bf16, the reduction does not)."""
    types = {"attn_q": "Q5_0", "attn_k": "Q8_0", "attn_v": "Q6_K", "attn_output": "Q4_K",
             "ffn_gate": "Q5_0", "ffn_up": "Q8_0", "ffn_down": "Q6_K"}  # fmt: skip
    ckpt = GGUFCheckpoint(write_tiny_llama(tmp_path / "tiny.gguf", [types, types]))
    config = ckpt.hf_config
    model = resolve_model_class(config)(
        config, torch.bfloat16, TorchReferenceBackend(), GGUFQuantConfig.from_checkpoint(ckpt)
    ).eval()
    model.load_weights(ckpt.iter_weights(show_progress=False, raw_names=raw_tensor_names(model)))
    layer = model.model.layers[0]
    kernels = [type(m.quant_method.kernel) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                     layer.mlp.gate_up_proj, layer.mlp.down_proj)]  # fmt: skip
    assert kernels == [Int8GroupCPUKernel, Int4PackCPUKernel, Int8GroupCPUKernel, Int8GroupCPUKernel]
    assert isinstance(model.model.embed_tokens.quant_method.kernel, Int8GroupCPUKernel)  # the tied head

    block = 4
    caches = [torch.zeros(model.kv_cache_shape_per_layer(16, block), dtype=torch.bfloat16) for _ in range(2)]
    compiled = CompiledDecode(model, caches, max_num_seqs=4)
    compiled.warm_up()
    gen = torch.Generator().manual_seed(0)
    # Inside inference mode, as the runner builds its step inputs (the graphs guard on it).
    with torch.inference_mode():
        for batch, width in ((1, 3), (3, 2), (1, 1)):
            seq_lens = torch.randint(1, width * block + 1, (batch,), generator=gen, dtype=torch.int32)
            tables = (1 + torch.randperm(15, generator=gen)[: batch * width]).view(batch, width).to(torch.int32)
            positions = seq_lens.long() - 1
            slots = tables.long().gather(1, (positions // block).unsqueeze(1)).squeeze(1) * block + positions % block
            md = AttentionMetadata(
                num_tokens=batch, query_start_loc=torch.arange(batch + 1, dtype=torch.int32), seq_lens=seq_lens,
                block_tables=tables, slot_mapping=slots, max_query_len=1, max_seq_len=int(seq_lens.max()),
                query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=seq_lens.tolist(),
            )  # fmt: skip
            ids = torch.randint(0, config.vocab_size, (batch,), generator=gen)
            got = compiled.run(ids, positions, md)
            want = compiled._forward(*compiled._inputs(ids, positions, slots, tables, seq_lens))
            assert got.shape == (batch, config.vocab_size)
            assert (got - want).abs().max() <= 0.02 * want.abs().max(), (batch, width)
    assert not compiled._failed_once  # every step ran on the graphs
