"""Quantized checkpoints made by the real tools (GPTQModel, AutoAWQ, llm-compressor) against the
tools' own references (scripts/make_quant_fixtures.py wrote both; tests/quant/data/checkpoints/
holds the checkpoints as the tools saved them, tests/quant/data/references/ their references):

- every layout dequantizes bit-exactly as the tool's own dequantizer does (layer 0's linears);
- fp32 logits on 8 prompts equal the reference model's (HF `transformers` with the tool's
  dequantized weights; for checkpoints that quantize activations, the tool's own fp32 forward)
  within 1e-4, through our chunked, paged forward;
- the engine's greedy continuations (8 prompts x 32 tokens) are the reference's;
- our logits are as close to the tool's own quantized forward (fp16 / bf16 kernels) as the
  tool's fp32 reference is, so the distance that remains is the tool's arithmetic, not ours;
- a mixed batch (different samplers, a shared prefix, preemption) gives each request what it
  gets alone.

A checkpoint with FP8 KV-cache scales (`ct-fp8-dynamic-kv`) runs these at the model level with
an fp8 cache: the tool's forward rounds K and V through the scales, and the engine's CPU caches
are float (fp8 caches need the Triton backend); its greedy continuation is checked step by step
through the model instead (tests/quant/test_kv_cache_scales.py has the rest).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import tests.models.paged as paged
from paphos import LLM
from paphos.attention.torch_ref import TorchReferenceBackend
from paphos.loader import load_model_source
from paphos.models.registry import resolve_model_class
from paphos.quant.registry import select_quant_config
from paphos.sampling_params import SamplingParams
from tests.models.paged import run_schedule

DATA = Path(__file__).parent / "data"
# Every fixture scripts/make_quant_fixtures.py makes; a missing one fails (never a silent skip).
FIXTURES = (
    "gptq-4b-g128-sym", "gptq-4b-g32-asym-actorder", "gptq-4b-g64-asym-v2", "gptq-8b-perchannel-sym",
    "gptq-4b-g128-sym-lmhead", "gptq-3b-g32-asym", "gptq-2b-g64-sym", "awq-gemm-4b-g64", "awq-gemm-4b-g64-autoawq",
    "ct-w4a16-sym-g64",
    "ct-w4a16-asym-g64", "ct-w8a16-channel", "ct-w4a16-gptq-actorder-group", "ct-awq-asym-g64",
    "ct-fp8-dynamic", "ct-fp8-static", "ct-fp8-block", "ct-naive-w8a8", "exl2-4.0bpw-h6", "exl2-6.0bpw-h8",
    "ct-fp8-dynamic-kv",
)  # fmt: skip
# The KV cache each fixture's reference implies: float32, except where the tool's forward rounds
# K and V through the checkpoint's KV-cache scales.
KV_CACHE_DTYPE = {"ct-fp8-dynamic-kv": torch.float8_e4m3fn}
# The engine runs float caches on the CPU: the fixtures whose reference it can reach.
ENGINE_FIXTURES = tuple(name for name in FIXTURES if name not in KV_CACHE_DTYPE)
LOGIT_TOL = 1e-4
# Fixtures whose forward rounds activations (or K and V) to 8 bits as it runs: a last-bit difference
# in a float32 sum (each CPU's GEMM cuts K its own way) can move one value across a rounding step
# there, and that token's logits then differ by the step's effect (up to 0.11 on a Sapphire Rapids
# CPU, none on the fixtures' machine or an AVX2 EPYC). So a few positions may exceed LOGIT_TOL by
# up to FLIP_TOL, below the tools' own kernels' distance from their references (0.27-0.98).
ROUNDED_ACTIVATIONS = ("ct-fp8-dynamic", "ct-fp8-static", "ct-naive-w8a8", "ct-fp8-dynamic-kv")
FLIP_POSITIONS = 8  # of a reference's 8 prompts x 16 tokens
FLIP_TOL = 0.25
LINEARS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2), "self_attn.o_proj": ("self_attn.o_proj", 0),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0), "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.down_proj": ("mlp.down_proj", 0),
}  # fmt: skip


def checkpoint(name: str) -> Path:
    path = DATA / "checkpoints" / name
    assert (path / "config.json").is_file(), f"fixture {name} is missing: run scripts/make_quant_fixtures.py"
    return path


def reference(name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    file = DATA / "references" / f"{name}.safetensors"
    with safe_open(str(file), framework="pt") as f:
        metadata = f.metadata()
    return load_file(str(file)), metadata


def build(path: Path) -> torch.nn.Module:
    """Our model in float32 on the CPU, its format chosen by the registry as at start-up."""
    source = load_model_source(str(path))
    config = source.hf_config
    model = resolve_model_class(config)(config, torch.float32, TorchReferenceBackend(), select_quant_config(source, None))
    source.load_into(model, show_progress=False)
    return model.eval()


def dense_weight(layer: torch.nn.Module) -> torch.Tensor:
    """The float weight a layer multiplies by on the CPU (dequantized at load)."""
    weight = getattr(layer, "dense_weight", None)
    return weight if weight is not None else layer.weight


def logits(
    model: torch.nn.Module, ids: torch.Tensor, chunks: list[int], cache_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[prompts, tokens, vocab] computed in the given chunks of every prompt per step."""
    blocks = len(ids) * (-(-ids.shape[1] // paged.BLOCK)) + 1
    caches = [
        torch.zeros(model.kv_cache_shape_per_layer(blocks, paged.BLOCK), dtype=cache_dtype)
        for _ in range(model.num_layers)
    ]
    old = paged.NUM_BLOCKS
    paged.NUM_BLOCKS = blocks
    try:
        return torch.stack(run_schedule(model, caches, list(ids), [[c] * len(ids) for c in chunks]))
    finally:
        paged.NUM_BLOCKS = old


@pytest.fixture(scope="module", params=FIXTURES)
def case(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module, dict[str, torch.Tensor], dict[str, str]]:
    name = request.param
    ref, metadata = reference(name)
    return name, build(checkpoint(name)), ref, metadata


def assert_logits_match(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """got within LOGIT_TOL of want at every (prompt, token), but for the rounding flips a fixture in
    ROUNDED_ACTIVATIONS may show at a few positions."""
    per_position = (got - want).abs().amax(-1)
    worst = per_position.max().item()
    if name not in ROUNDED_ACTIVATIONS:
        assert worst <= LOGIT_TOL, f"{name}: max |dlogit| {worst:.2e} vs the tool's fp32 reference"
        return
    off = int((per_position > LOGIT_TOL).sum())
    assert off <= FLIP_POSITIONS and worst <= FLIP_TOL, (
        f"{name}: {off} of {per_position.numel()} positions beyond {LOGIT_TOL} of the tool's fp32 reference, "
        f"worst {worst:.2e}"
    )


def test_every_layout_dequantizes_as_the_tool_does(case) -> None:  # noqa: ANN001
    name, model, ref, _ = case
    layer = model.model.layers[0]
    for theirs, (ours, shard) in LINEARS.items():
        module = layer.get_submodule(ours)
        start = sum(module.output_sizes[:shard])
        got = dense_weight(module)[start : start + module.output_sizes[shard]].float()
        torch.testing.assert_close(got, ref[f"dequant.model.layers.0.{theirs}.weight"], rtol=0, atol=0, msg=f"{name} {theirs}")


def test_logits_match_the_tools_reference(case) -> None:  # noqa: ANN001
    name, model, ref, _ = case
    ids = ref["input_ids"]
    got = logits(model, ids, [5, 11], KV_CACHE_DTYPE.get(name, torch.float32))  # chunked prefill: 5, then 11
    assert_logits_match(name, got, ref["dequant_logits"])


def test_as_close_to_the_tools_own_kernels_as_its_reference_is(case) -> None:  # noqa: ANN001
    name, model, ref, metadata = case
    got = logits(model, ref["input_ids"], [16], KV_CACHE_DTYPE.get(name, torch.float32))
    theirs = (ref["dequant_logits"] - ref["tool_logits"]).abs().max().item()
    ours = (got - ref["tool_logits"]).abs().max().item()
    assert ours <= theirs + LOGIT_TOL, f"{name}: {ours:.3g} from {metadata.get('tool_logits')}, reference {theirs:.3g}"


@pytest.mark.parametrize("name", list(KV_CACHE_DTYPE))
def test_greedy_continuations_through_an_fp8_cache_match_the_reference(name: str) -> None:
    """The reference's 32 greedy tokens fed back one decode step at a time (the prompts
    prefilled in chunks of 5 and 11): every step whose reference margin exceeds 0.25 picks the
    reference's next token. Not every step: the checkpoint rounds activations to FP8 per token,
    so the last-bit differences between a decode step's attention and a whole prompt's may move
    one rounding by a step, and with it the logits (measured: up to 0.2 in one sequence from
    its first decode step on, through 25 K/V values of layer 1 rounded differently; the same
    tokens in one chunk give the tool's logits exactly)."""
    ref, _ = reference(name)
    model = build(checkpoint(name))
    seqs = torch.cat([ref["input_ids"], ref["greedy"]], dim=1)
    got = logits(model, seqs[:, :-1], [5, 11] + [1] * (seqs.shape[1] - 17), KV_CACHE_DTYPE[name])
    clear = ref["greedy_margin"] > 0.25
    assert clear.sum() >= 200  # of 256 steps
    assert torch.equal(got[:, 15:].argmax(-1)[clear], ref["greedy"][clear])


@pytest.mark.parametrize("name", ENGINE_FIXTURES)
def test_engine_greedy_continuations_match_the_reference(name: str) -> None:
    ref, _ = reference(name)
    llm = LLM(str(checkpoint(name)), dtype="float32", max_model_len=128, block_size=4)
    prompts = [row.tolist() for row in ref["input_ids"]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    got = torch.tensor([o.outputs[0].token_ids for o in outputs])
    assert torch.equal(got, ref["greedy"]), f"{name}: first difference at {(got != ref['greedy']).nonzero()[:1].tolist()}"


def _float_gemm_sums_by_row_count() -> bool:
    """Whether this CPU's float32 GEMM sums a row differently by how many rows it multiplies at once
    (on an AVX2-only AMD EPYC, rows went in blocks of four and a remainder row took another order)."""
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 64, generator=gen), torch.randn(5, 64, generator=gen)
    return not torch.equal(torch.nn.functional.linear(x, w)[4:], torch.nn.functional.linear(x[4:], w))


# W8A8 rounds every activation to int8 per token after a float GEMM: where the GEMM's last bit
# follows the batch, one rounding can flip and the request continues differently. Paphos keeps the
# tool's float GEMM (its fp32 logits within 1e-4 above); an exact integer GEMM is batch-invariant
# but lands 0.10 from the tool's reference, by such flips. Expected to fail only where the CPU's
# GEMM is batch-dependent; it passes (XPASS) elsewhere.
W8A8_MIXED = pytest.param("ct-naive-w8a8", marks=pytest.mark.xfail(
    _float_gemm_sums_by_row_count(), reason="this CPU's float GEMM is batch-dependent in the last bit, "
    "which W8A8's per-token int8 rounding can turn into another token", strict=False))  # fmt: skip


@pytest.mark.parametrize("name", ["gptq-4b-g32-asym-actorder", "ct-fp8-dynamic", W8A8_MIXED, "exl2-4.0bpw-h6"])
def test_a_mixed_batch_gives_each_request_what_it_gets_alone(name: str) -> None:
    ref, _ = reference(name)
    prefix = ref["input_ids"][0].tolist()
    requests = [
        (prefix + [7, 8], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)),
        (prefix + [9], SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=24, ignore_eos=True)),
        (ref["input_ids"][1].tolist(), SamplingParams(temperature=1.0, min_p=0.1, seed=2, max_tokens=24,
                                                      repetition_penalty=1.2, ignore_eos=True)),
        (prefix, SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=24, logprobs=2, ignore_eos=True)),
    ]  # fmt: skip
    # 12 blocks of 4 tokens: four requests of up to 42 tokens cannot all stay resident (preemption).
    batched = LLM(str(checkpoint(name)), dtype="float32", max_model_len=64, block_size=4, num_gpu_blocks_override=12)
    together = batched.generate([p for p, _ in requests], [s for _, s in requests])
    assert batched.engine.scheduler.num_preemptions_total > 0, "the batch must preempt for the test to mean anything"
    assert batched.engine.scheduler.prefix_cache_hits > 0
    alone = LLM(str(checkpoint(name)), dtype="float32", max_model_len=64, block_size=4)
    for (prompt, params), out in zip(requests, together, strict=True):
        single = alone.generate([prompt], params)[0].outputs[0]
        assert out.outputs[0].token_ids == single.token_ids
        if params.logprobs:
            for a, b in zip(out.outputs[0].logprobs, single.logprobs, strict=True):
                assert a.top_token_ids == b.top_token_ids
                assert max(abs(x - y) for x, y in zip(a.top_logprobs, b.top_logprobs, strict=True)) <= 1e-4


def test_int_quantized_is_the_naive_layout_under_its_default_name(tmp_path: Path) -> None:
    """llm-compressor writes W8A8 INT8 as format 'int-quantized' unless told otherwise (the fixture
    forced 'naive-quantized'; both are one compressor): the same tensors under that name load and
    give the tool's logits."""
    ref, _ = reference("ct-naive-w8a8")
    source = checkpoint("ct-naive-w8a8")
    for file in source.iterdir():
        if file.is_file():
            shutil.copy(file, tmp_path / file.name)
    config = json.loads((source / "config.json").read_text())
    qc = config["quantization_config"]
    qc["format"] = "int-quantized"
    for group in qc["config_groups"].values():
        group["format"] = "int-quantized"
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert_logits_match("ct-naive-w8a8", logits(build(tmp_path), ref["input_ids"], [16]), ref["dequant_logits"])


def test_fixtures_record_their_tool() -> None:
    for name in FIXTURES:
        config = json.loads((checkpoint(name) / "config.json").read_text())
        _, metadata = reference(name)
        assert "quantization_config" in config and metadata["tool"], name


@pytest.mark.parametrize("name", ["gptq-4b-g32-asym-actorder", "gptq-4b-g64-asym-v2", "awq-gemm-4b-g64", "ct-w4a16-sym-g64"])
def test_bf16_on_the_cpu_keeps_4_bit_layers_packed(name: str) -> None:
    """bf16 models on the CPU run 4-bit layers on torch's int4 matmul (act-order through a
    permutation of x), within bf16 rounding of the fp32 reference."""
    ref, _ = reference(name)
    source = load_model_source(str(checkpoint(name)))
    config = select_quant_config(source, None)
    model = resolve_model_class(source.hf_config)(source.hf_config, torch.bfloat16, TorchReferenceBackend(), config)
    source.load_into(model, show_progress=False)
    packed = [m for m in model.modules() if getattr(getattr(m, "quant_method", None), "int4pack_group", None)]
    assert len(packed) == 8, config.summary()  # every decoder linear of the two layers
    blocks = len(ref["input_ids"]) * 4 + 1
    caches = [torch.zeros(model.kv_cache_shape_per_layer(blocks, paged.BLOCK), dtype=torch.bfloat16) for _ in range(2)]
    old, paged.NUM_BLOCKS = paged.NUM_BLOCKS, blocks
    try:
        got = torch.stack(run_schedule(model, caches, list(ref["input_ids"]), [[16] * 8]))
    finally:
        paged.NUM_BLOCKS = old
    worst = (got - ref["dequant_logits"]).abs().max().item()
    assert worst <= 0.25, f"{name}: max |dlogit| {worst:.3f} in bf16"
