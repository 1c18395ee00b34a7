"""Tensor parallelism of the quantized formats and of LoRA (docs/tensor-parallel.md, Weight formats):

- every projection of layer 0 of every GPTQ / AWQ / compressed-tensors / FP8 fixture the real
  tools made (tests/quant/data/checkpoints/), loaded as each rank of `-tp 2` loads it, multiplies
  by exactly its slice of the `-tp 1` weight; where the split cannot be made (packed words or
  groups cut), the start-up check names the tensor or field (test_tensor_parallel.py: the engine
  refuses to start); a quantized head splits by vocabulary rows;
- row-parallel ranks scale dynamic activations (W8A8 int8, FP8) by each token's whole row, so
  their partial outputs sum to the `-tp 1` output;
- the engine (CPU, gloo, two processes, fp32) gives the same greedy tokens and logprobs within
  1e-4 at `-tp 2` as at `-tp 1` on a choice of them: act-order GPTQ and compressed-tensors
  (g_idx, packed zeros), FP8 with static input scales, `-q fp8` at load, and two PEFT adapters
  and the base model in one batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from paphos import LLM, SamplingParams
from paphos.config import ConfigError
from paphos.layers import parallel
from paphos.layers.embedding import LMHead
from paphos.layers.linear import LinearBase, MergedColumnLinear, QKVLinear, RowParallelLinear
from paphos.layers.parallel import Slice, TPGroup
from paphos.loader import load_model_source
from paphos.models import hf_config as hf
from paphos.quant.registry import select_quant_config
from paphos.worker.tensor_parallel import _check_layer_splits
from tests.lora.peft_fixtures import make_adapter, write_tiny_llama
from tests.quant.test_checkpoint_parity import FIXTURES, LINEARS, checkpoint, dense_weight
from tests.worker.test_tensor_parallel import ENGINE, _assert_same, _prompts, _workload

# The integer and FP8 fixtures (EXL2's: test_tensor_parallel_exl2.py).
FORMATS = tuple(name for name in FIXTURES if not name.startswith("exl2"))
# Of them, the ones whose every layer splits in two (act-order or per-channel: any input range;
# the group-64 / group-128 ones cut down_proj's 160 inputs per rank inside a group).
SPLITS = ("gptq-4b-g32-asym-actorder", "gptq-8b-perchannel-sym", "ct-w8a16-channel", "ct-w4a16-gptq-actorder-group",
          "ct-naive-w8a8", "ct-fp8-dynamic", "ct-fp8-static")  # fmt: skip
KINDS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@functools.cache
def _model(path: Path) -> tuple[Any, Any]:
    """(HF config, quant config) of a checkpoint, as start-up reads them."""
    source = load_model_source(str(path))
    return source.hf_config, select_quant_config(source, None)


def _weights_file(path: Path) -> Path:
    """The one safetensors file of a fixture (exllamav2 names it output.safetensors)."""
    (file,) = path.glob("*.safetensors")
    return file


def _layer(path: Path, kind: str, tp: TPGroup) -> LinearBase:
    """Layer 0's `kind` as rank `tp.rank` builds and loads it, quant method processed."""
    config, quant_config = _model(path)
    method = quant_config.get_linear_method(f"model.layers.0.{kind}")
    heads, head_dim = config.num_attention_heads, hf.head_dim(config)
    with parallel.building(tp):
        layer = {
            "self_attn.qkv_proj": lambda: QKVLinear(config.hidden_size, head_dim, heads, hf.num_kv_heads(config),
                                                    quant_method=method),
            "self_attn.o_proj": lambda: RowParallelLinear(heads * head_dim, config.hidden_size, quant_method=method),
            "mlp.gate_up_proj": lambda: MergedColumnLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                           quant_method=method),
            "mlp.down_proj": lambda: RowParallelLinear(config.intermediate_size, config.hidden_size,
                                                       quant_method=method),
        }[kind]()  # fmt: skip
    loaded = 0
    with safe_open(str(_weights_file(path)), framework="pt") as f:
        for name in f.keys():
            module, _, param = name.removeprefix("model.layers.0.").rpartition(".")
            if not name.startswith("model.layers.0.") or LINEARS.get(module, ("",))[0] != kind:
                continue
            index = LINEARS[module][1]
            shard = QKVLinear.SHARDS[index] if kind == "self_attn.qkv_proj" else index
            target = getattr(layer, param)
            if isinstance(layer, MergedColumnLinear | QKVLinear):
                target.weight_loader(target, f.get_tensor(name), shard)
            else:
                target.weight_loader(target, f.get_tensor(name))
            loaded += 1
    assert loaded >= len(layer.output_sizes)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _head(path: Path, tp: TPGroup) -> LMHead:
    """A quantized `lm_head` as rank `tp.rank` builds and loads it."""
    config, quant_config = _model(path)
    with parallel.building(tp):
        head = LMHead(config.vocab_size, config.hidden_size, quant_method=quant_config.get_linear_method("lm_head"))
    with safe_open(str(_weights_file(path)), framework="pt") as f:
        for name in (n for n in f.keys() if n.startswith("lm_head.")):
            param = getattr(head, name.removeprefix("lm_head."))
            param.weight_loader(param, f.get_tensor(name))
    head.process_weights_after_loading()
    return head


def test_a_quantized_head_splits_by_vocabulary_rows() -> None:
    """GPTQModel's 8-bit group-32 lm_head: each rank's rows (qzeros packed 4 per word), the last
    rank's padding rows zero."""
    path = checkpoint("gptq-4b-g128-sym-lmhead")
    whole = dense_weight(_head(path, parallel.SINGLE))
    for rank in range(5):  # 96 rows in 20 per rank, the last rank's 16 padded with 4
        head = _head(path, TPGroup(rank, 5))
        rows, weight = head.rows, dense_weight(head)
        assert torch.equal(weight[: rows.length], whole[rows.start : rows.start + rows.length])
        assert not weight[rows.length :].any()
    # 7 ranks of 14 rows would cut qzeros' words.
    quant_config = _model(path)[1]
    assert quant_config.tp_split_problem("lm_head", [TPGroup(1, 7).split_padded(96)], Slice.whole(128)) == (
        "lm_head.qzeros packs 4 output columns per int32; a rank's columns [14, 28) of 96 are not whole words"
    )


def _rank_slice(whole: LinearBase, part: LinearBase) -> torch.Tensor:
    """The rows and columns of `whole`'s weight that `part`'s rank holds."""
    weight, start, rows = dense_weight(whole), 0, []
    for i, size in enumerate(whole.output_sizes):
        mine = part.tp_rows(i)
        rows.append(weight[start + mine.start : start + mine.start + mine.length])
        start += size
    cols = part.tp_cols()
    return torch.cat(rows)[:, cols.start : cols.start + cols.length]


def _split_problem(path: Path, kind: str, tp: TPGroup) -> str | None:
    """What the start-up check says of this rank's split of layer 0's `kind` (None: it splits)."""
    config, quant_config = _model(path)
    with parallel.building(tp):
        layer = _layer_shape(config, kind)
    rows = [layer.tp_rows(i) for i in range(len(layer.output_sizes))]
    return quant_config.tp_split_problem(f"model.layers.0.{kind}", rows, layer.tp_cols())


def _layer_shape(config: Any, kind: str) -> LinearBase:
    """An unquantized layer of `kind`'s shape, for its slices."""
    heads, head_dim, hidden, inter = (config.num_attention_heads, hf.head_dim(config), config.hidden_size,
                                      config.intermediate_size)  # fmt: skip
    if kind == "self_attn.qkv_proj":
        return QKVLinear(hidden, head_dim, heads, hf.num_kv_heads(config))
    if kind == "mlp.gate_up_proj":
        return MergedColumnLinear(hidden, [inter, inter])
    return RowParallelLinear(heads * head_dim if kind == "self_attn.o_proj" else inter, hidden)


@pytest.mark.parametrize("fixture", FORMATS)
def test_each_rank_loads_exactly_its_slice_of_every_projection(fixture: str) -> None:
    path = checkpoint(fixture)
    for kind in KINDS:
        whole = _layer(path, kind, parallel.SINGLE)
        for rank in range(2):
            tp = TPGroup(rank, 2)
            problem = _split_problem(path, kind, tp)
            if problem is not None:
                assert fixture not in SPLITS, problem
                assert kind == "mlp.down_proj" or "g128" in fixture, problem
                continue
            part = _layer(path, kind, tp)
            assert torch.equal(dense_weight(part), _rank_slice(whole, part)), f"{kind}, rank {rank}"


def test_the_start_up_check_names_what_cannot_be_split() -> None:
    config, awq = _model(checkpoint("awq-gemm-4b-g64"))
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.mlp\.down_proj: quantization_config group_size 64: "
                                          r"a rank's 160 input rows of 320 are not whole groups"):  # fmt: skip
        _check_layer_splits(awq, config, 2)
    # AWQ packs 8 output columns per word: 4 ranks of the 2 KV heads of 32 rows are whole words,
    # 16 ranks of 8 query rows too; 32 ranks would cut them (and the heads) in 4.
    cols = Slice(0, 128, 128)
    assert awq.tp_split_problem("model.layers.0.self_attn.qkv_proj", [Slice(0, 8, 128)] * 3, cols) is None
    problem = awq.tp_split_problem("model.layers.0.self_attn.qkv_proj", [Slice(4, 4, 128)] * 3, cols)
    assert problem == ("model.layers.0.self_attn.qkv_proj.qweight packs 8 output columns per int32; a rank's "
                       "columns [4, 8) of 128 are not whole words")  # fmt: skip
    # FP8 weights split anywhere (scales per row, tensor or block), activations scaled per group
    # of 64 inputs only along whole groups.
    config, fp8_block = _model(checkpoint("ct-fp8-block"))
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.mlp\.down_proj: activations are scaled per group of 64 "
                                          r"input values; a rank's 160 inputs of 320 are not whole groups"):  # fmt: skip
        _check_layer_splits(fp8_block, config, 2)
    assert fp8_block.tp_split_problem("model.layers.0.mlp.down_proj", [Slice.whole(128)], Slice(64, 64, 320)) is None
    assert fp8_block.tp_split_problem("model.layers.0.mlp.down_proj", [Slice.whole(128)], Slice(256, 64, 320)) is None
    gptq = _model(checkpoint("gptq-4b-g32-asym-actorder"))[1]
    problem = gptq.tp_split_problem("model.layers.0.mlp.down_proj", [Slice.whole(128)], Slice(0, 164, 320))
    assert problem is not None and "mlp.down_proj.qweight packs 8 input rows per int32" in problem
    # Act-order rows carry their group: any whole words of rows split.
    assert gptq.tp_split_problem("model.layers.0.mlp.down_proj", [Slice.whole(128)], Slice(8, 8, 320)) is None


@dataclass(frozen=True)
class _WholeRowMax(TPGroup):
    """A rank of two in one process: its "all-reduce" of a row-parallel input's maxima returns
    those of the whole input the test holds."""

    whole: Any = None

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        assert op == "max"
        return self.whole.float().abs().amax(dim=-1, keepdim=True)


@pytest.mark.parametrize("fixture", ["ct-naive-w8a8", "ct-fp8-dynamic"])
def test_dynamic_activation_scales_of_row_parallel_ranks_are_the_whole_rows(fixture: str) -> None:
    """W8A8 (int8) and FP8 per-token activations: the ranks' partial outputs of down_proj sum to
    the `-tp 1` output, each token scaled by its whole row's maximum (an engine run compares at
    1e-4 only where no activation rounding amplifies the all-reduce's summation order: a residual
    1e-7 off flips an int8 code now and then)."""
    whole = _layer(checkpoint(fixture), "mlp.down_proj", parallel.SINGLE)
    x = torch.randn(7, 320, generator=torch.Generator().manual_seed(0))
    parts = []
    for rank in range(2):
        layer = _layer(checkpoint(fixture), "mlp.down_proj", TPGroup(rank, 2))
        layer.tp = _WholeRowMax(rank, 2, whole=x)
        cols = layer.tp_cols()
        parts.append(layer.quant_method.apply(layer, x[:, cols.start : cols.start + cols.length]))
    torch.testing.assert_close(parts[0] + parts[1], whole.quant_method.apply(whole, x), rtol=0, atol=1e-5)


def test_row_parallel_ranks_of_group_scaled_activations_need_no_all_reduce() -> None:
    """FP8 activations scaled per group of 64 inputs (ct-fp8-block): o_proj's ranks hold whole
    groups, so each rounds its inputs as `-tp 1` does and their partial outputs sum to its output."""
    whole = _layer(checkpoint("ct-fp8-block"), "self_attn.o_proj", parallel.SINGLE)
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(0))
    parts = []
    for rank in range(2):
        layer = _layer(checkpoint("ct-fp8-block"), "self_attn.o_proj", TPGroup(rank, 2))
        cols = layer.tp_cols()
        parts.append(layer.quant_method.apply(layer, x[:, cols.start : cols.start + cols.length]))
    torch.testing.assert_close(parts[0] + parts[1], whole.quant_method.apply(whole, x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("fixture", ["gptq-4b-g32-asym-actorder", "ct-w4a16-gptq-actorder-group", "ct-fp8-static",
                                     "-q fp8"])  # fmt: skip
def test_tp2_matches_tp1_on_quantized_checkpoints(fixture: str, tiny_model, engines: list[LLM]) -> None:
    """The tools' checkpoints: act-order g_idx and packed zeros (GPTQ v1), act-order without zeros
    (compressed-tensors), per-tensor FP8 weight scales of merged q|k|v and static input scales.
    `-q fp8`: a row-parallel rank's weight scales come from the whole rows, its dynamic FP8
    activation scales too."""
    if fixture == "-q fp8":
        path, settings = tiny_model("llama")[0], dict(ENGINE, quantization="fp8")
    else:
        path, settings = checkpoint(fixture), ENGINE
    engines.append(LLM(str(path), **settings))
    engines.append(LLM(str(path), **settings, tensor_parallel_size=2))
    _assert_same(_workload(engines[0], 96), _workload(engines[1], 96))


def test_tp2_matches_tp1_with_two_adapters_and_the_base_in_one_batch(tmp_path: Path, engines: list[LLM]) -> None:
    """Column-parallel q|k|v and gate|up take their rows of B, row-parallel o and down their
    columns of A; an adapter of rank 4 on three modules sits beside one of rank 8 on all seven."""
    base = write_tiny_llama(tmp_path / "base")
    adapters = {
        "all": make_adapter(base, tmp_path / "all", rank=8, alpha=16, seed=1),
        "some": make_adapter(base, tmp_path / "some", rank=4, target_modules=("k_proj", "o_proj", "down_proj"),
                             seed=2),
    }  # fmt: skip
    settings = dict(ENGINE, enable_lora=True, max_loras=2, max_lora_rank=8,
                    lora_modules={name: str(a.path) for name, a in adapters.items()})  # fmt: skip
    first, second, third = _prompts(96, 3, (13, 21, 30))
    prompts = [first, first, first, second, third, second]
    names = [None, "all", "some", "all", "some", None]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    outputs = []
    for size in (1, 2):
        llm = LLM(str(base.path), **settings, tensor_parallel_size=size)
        engines.append(llm)
        outputs.append(llm.generate(prompts, params, lora=names))
    _assert_same(*outputs)
    # Each adapter changes the first prompt's logprobs (else the comparison would hold without them).
    scored = [[p.logprob for p in out.prompt_logprobs[1:]] for out in outputs[0][:3]]
    assert scored[0] != scored[1] and scored[0] != scored[2] and scored[1] != scored[2]
