"""Tensor parallelism of EXL2 checkpoints (paphos/quant/exl2.py, docs/tensor-parallel.md):

- every projection of layer 0 and the head of both exllamav2 fixtures
  (tests/quant/data/checkpoints/exl2-*), loaded as each rank of `-tp 2` loads it, decodes to
  exactly its part of the `-tp 1` weight: column-parallel q|k|v, gate|up and the head their output
  rows (the head over 5 ranks too: ranks that start inside a q_scale word, a padded last rank);
  row-parallel o_proj and down_proj the columns of the stored rows they hold, which cover the
  input once; their partial outputs, each from the all-gathered x, sum to the `-tp 1` output;
- the split of stored rows: between 32-row runs (inside a group too), near-equal q_weight bytes;
  one that cannot be made (fewer runs than ranks) is refused at start-up naming the tensor;
- the engine (CPU, gloo, two processes, fp32) gives the same greedy tokens and logprobs within
  1e-4 at `-tp 2` as at `-tp 1` on both fixtures;
- the CUDA path of a shard under the Triton interpreter: a rank's column slice and a rank's
  stored rows, packed, dequantize exactly and multiply as their dense decode does, and the linear
  method of a row-parallel rank runs the kernels on its stored rows.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from paphos import LLM
from paphos.config import ConfigError
from paphos.layers import parallel
from paphos.layers.linear import RowParallelLinear
from paphos.layers.parallel import Slice, TPGroup
from paphos.quant.exl2 import (
    CHECKPOINT_TENSORS,
    EXL2Config,
    EXL2LinearMethod,
    Group,
    dequantize,
    output_columns,
    parse_groups,
    split_stored_rows,
    stored_rows,
)
from paphos.quant.kernels import exl2_layout
from tests.engine.conftest import _build
from tests.quant.test_checkpoint_parity import checkpoint, dense_weight
from tests.quant.test_exl2 import QC, Encoded, encode, random_encoded, write_exl2
from tests.quant.test_exl2_kernels import _MODULES
from tests.quant.test_exl2_layout import _shard
from tests.triton_interpreted import interpreted
from tests.worker.test_tensor_parallel import ENGINE, _assert_same, _workload
from tests.worker.test_tensor_parallel_formats import KINDS, _head, _layer, _model, _rank_slice

FIXTURES = ("exl2-4.0bpw-h6", "exl2-6.0bpw-h8")
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


@dataclass(frozen=True)
class _WholeInput(TPGroup):
    """A rank of a row-parallel layer in one process: its "all-gather" of x returns the whole x
    the test holds."""

    whole: Any = None

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        assert x.shape[-1] * self.size == self.whole.shape[-1]
        return self.whole


@pytest.mark.parametrize("fixture", FIXTURES)
def test_each_rank_decodes_exactly_its_part_of_every_projection(fixture: str) -> None:
    path = checkpoint(fixture)
    for kind in KINDS:
        whole = _layer(path, kind, parallel.SINGLE)
        inputs = []
        for rank in range(2):
            part = _layer(path, kind, TPGroup(rank, 2))
            if kind in ROW_PARALLEL:  # its stored rows: whole columns of the weight, wherever they are
                inputs.append(part.exl2_inputs.long())
                expected = dense_weight(whole)[:, inputs[-1]]
            else:
                expected = _rank_slice(whole, part)
            assert torch.equal(dense_weight(part), expected), f"{kind}, rank {rank}"
        if inputs:  # the ranks' stored rows cover every input once
            assert torch.equal(torch.cat(inputs).sort().values, torch.arange(whole.input_size))


@pytest.mark.parametrize("fixture", FIXTURES)
def test_the_quantized_head_splits_by_vocabulary_rows(fixture: str) -> None:
    """96 rows over 5 ranks: 20 each (ranks 1 and 3 start inside a word of 8 scale codes), the
    last rank's 16 padded with 4 zero rows."""
    path = checkpoint(fixture)
    whole = dense_weight(_head(path, parallel.SINGLE))
    for rank in range(5):
        head = _head(path, TPGroup(rank, 5))
        rows, weight = head.rows, dense_weight(head)
        assert weight.shape[0] == rows.padded
        assert torch.equal(weight[: rows.length], whole[rows.start : rows.start + rows.length]), rank
        assert not weight[rows.length :].any()


@pytest.mark.parametrize("fixture", FIXTURES)
def test_row_parallel_ranks_sum_to_the_whole_output(fixture: str) -> None:
    """4.0bpw o_proj is one group of 128 rows (the ranks cut it between runs); 6.0bpw down_proj
    has ten groups of 8, 6 and 5 bits. A rank's bias is rank 0's alone (none here)."""
    path = checkpoint(fixture)
    gen = torch.Generator().manual_seed(0)
    for kind in ROW_PARALLEL:
        whole = _layer(path, kind, parallel.SINGLE)
        x = torch.randn(5, whole.input_size, generator=gen)
        total = torch.zeros(5, whole.output_size)
        for rank in range(2):
            layer = _layer(path, kind, TPGroup(rank, 2))
            layer.tp = _WholeInput(rank, 2, whole=x)
            cols = layer.tp_cols()
            total += layer.quant_method.apply(layer, x[:, cols.start : cols.start + cols.length])
        torch.testing.assert_close(total, whole.quant_method.apply(whole, x), rtol=0, atol=1e-5)


def _groups(layout: list[tuple[int, int]]) -> list[Group]:
    """Groups of (bits, rows) in order, as parse_groups reads them from a checkpoint."""
    starts, word = [], 0
    for bits, rows in layout:
        starts.append(word)
        word += -(-rows * bits // 32)
    pairs = [v for (bits, _), start in zip(layout, starts, strict=True) for v in (bits, start)]
    return parse_groups(torch.tensor(pairs, dtype=torch.int16), word, sum(rows for _, rows in layout))


def test_stored_rows_split_between_runs_by_bytes() -> None:
    # 8-, 4- and 2-bit groups of 128 rows: 32 + 16 + 8 words. Two ranks: 24 and 32 words, 96 rows
    # against 288 (a cut after 32 words is as far from 28, and the first of equals wins); an even
    # split of rows would give rank 0 40 words of 56.
    groups = _groups([(8, 128), (4, 128), (2, 128)])
    assert split_stored_rows(groups, 2) == [(0, 96), (96, 384)]
    assert split_stored_rows(groups, 3) == [(0, 64), (64, 160), (160, 384)]
    # K = 200: a last run of 8 rows; every rank keeps at least one run.
    assert split_stored_rows(_groups([(8, 64), (2, 136)]), 7) == [
        (0, 32), (32, 64), (64, 96), (96, 128), (128, 160), (160, 192), (192, 200)
    ]  # fmt: skip


def test_the_start_up_check_names_the_layer_that_cannot_split() -> None:
    """4.0bpw's o_proj has 128 stored rows: 4 runs, so 4 ranks but not 5 (the config check would
    refuse 5 ranks for the 4 heads first; the EXL2 check is asked directly)."""
    quant_config = _model(checkpoint("exl2-4.0bpw-h6"))[1]
    files = [checkpoint("exl2-4.0bpw-h6") / "output.safetensors"]
    assert quant_config.tp_split_problem(files, 4) is None
    assert quant_config.tp_split_problem(files, 5) == (
        "EXL2 tensor model.layers.0.self_attn.o_proj.q_groups: its 128 stored rows are 4 run(s) of 32, fewer than "
        "the 5 tensor-parallel ranks (a row-parallel rank holds whole runs, at least one)"
    )


def test_an_exl2_model_that_cannot_split_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    """A tiny Llama whose o_proj takes 32 inputs (4 heads of 8): one run, which two ranks cannot share."""
    path, hf = _build(tmp_path, "llama", hidden_size=32)
    write_exl2(path, hf, seed=1)
    before = set(multiprocessing.active_children())
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 2: EXL2 tensor model\.layers\.0\.self_attn\.o_proj"
                                          r"\.q_groups: its 32 stored rows are 1 run\(s\) of 32, fewer than the 2 "):  # fmt: skip
        LLM(str(path), tensor_parallel_size=2, dtype="float32", max_model_len=64)
    assert set(multiprocessing.active_children()) <= before, "a refused model must not start any rank"


@pytest.mark.parametrize("fixture", FIXTURES)
def test_tp2_matches_tp1(fixture: str, engines: list[LLM]) -> None:
    """The engine's whole path: q|k|v and gate|up by output columns, o and down by stored rows
    after an all-gather of x, the quantized head by vocabulary rows."""
    path = checkpoint(fixture)
    engines.append(LLM(str(path), **ENGINE))
    engines.append(LLM(str(path), **ENGINE, tensor_parallel_size=2))
    _assert_same(_workload(engines[0], 96), _workload(engines[1], 96))


# ---------------------------------------------------------------------------- the kernels' path


@pytest.fixture(scope="module")
def te() -> Iterator[object]:
    """paphos.quant.kernels.triton_exl2 with its kernels interpreted (test_exl2_kernels.py's)."""
    with interpreted(_MODULES, "_gemv_kernel") as module:
        yield module


def _layout(seed: int) -> Encoded:
    """64 outputs over K = 200 inputs: 8/6/5/4/3/2-bit groups of 32/64/128 rows, a short last run."""
    return random_encoded(64, 200, torch.Generator().manual_seed(seed), (8, 6, 5, 4, 3, 2))


def test_kernels_on_a_ranks_output_columns(te) -> None:  # noqa: ANN001
    """Columns [20, 45): the scale codes re-packed from inside a word, the groups and permutation whole."""
    enc = _layout(50)
    columns = Slice(20, 25, 64)
    part = {name: output_columns(name, t, columns) for name, t in enc.tensors.items()}
    planes = exl2_layout.pack([_shard(Encoded(part, enc.weight), 25)])
    weight = dequantize(**enc.tensors)[20:45]
    assert torch.equal(dequantize(**part), weight) and torch.equal(exl2_layout.reference_weight(planes), weight)
    out = torch.full((200, 25), float("nan"))
    te.dequantize_into(planes, 0, 25, out)
    assert torch.equal(out, weight.t())
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(51))
    ref = x.double() @ weight.double().t()
    assert ((te.gemv(x, planes, split=2) - ref).abs().max() / ref.abs().max()).item() < 1e-3  # the GEMV: x to ~15 bits, weights unrounded (test_exl2_kernels.py)


def test_kernels_on_a_ranks_stored_rows(te) -> None:  # noqa: ANN001
    """Each of two ranks' stored rows (cut between runs, K = 200) packed alone: the dequantized
    weight is exactly the columns of its inputs, and the GEMVs of the ranks sum to x W^T."""
    enc = _layout(52)
    t = enc.tensors
    groups = parse_groups(t["q_groups"], t["q_weight"].shape[0], 200)
    weight = dequantize(**t)
    x = torch.randn(2, 200, generator=torch.Generator().manual_seed(53))
    total = torch.zeros(2, 64, dtype=torch.float64)
    for rows in split_stored_rows(groups, 2):
        part, inputs = stored_rows(t, groups, rows)
        planes = exl2_layout.pack([_shard(Encoded(part, enc.weight), 64)])
        k = rows[1] - rows[0]
        out = torch.full((k, 64), float("nan"))
        te.dequantize_into(planes, 0, 64, out)
        assert torch.equal(out, weight[:, inputs.long()].t()), rows
        total += te.gemv(x[:, inputs.long()].contiguous(), planes).double()
    ref = x.double() @ weight.double().t()
    assert ((total - ref).abs().max() / ref.abs().max()).item() < 1e-3  # the GEMV: x to ~15 bits, weights unrounded (test_exl2_kernels.py)


def test_a_row_parallel_rank_runs_the_kernels_on_its_stored_rows(te, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """The linear method of each rank of a down_proj: its stored rows packed for the kernels
    (the checkpoint tensors freed), x all-gathered and picked, the ranks' outputs summing to x W^T."""
    monkeypatch.setattr(EXL2LinearMethod, "_kernel_problem", lambda self, shards, device: None)
    # 8-bit runs first, then 3 bits: rank 0 takes fewer rows than rank 1 (bytes are balanced)
    gen = torch.Generator().manual_seed(54)
    codes = [torch.randint(256, (64, 32), generator=gen), torch.randint(8, (128, 32), generator=gen)]
    enc = encode(codes, [8, 3], torch.randint(16, (2, 32), generator=gen), torch.tensor([0.5, 0.25]),
                 torch.randperm(192, generator=gen))  # fmt: skip
    x = torch.randn(3, 192, generator=gen)
    total = torch.zeros(3, 32, dtype=torch.float64)
    for rank in range(2):
        config = EXL2Config.from_quant_config(QC)
        with parallel.building(TPGroup(rank, 2)):
            layer = RowParallelLinear(192, 32, params_dtype=torch.float32,
                                      quant_method=config.get_linear_method("model.layers.0.mlp.down_proj"))  # fmt: skip
        for name, tensor in enc.tensors.items():
            getattr(layer, name).weight_loader(getattr(layer, name), tensor)
        layer.quant_method.process_weights_after_loading(layer)
        assert config.summary() == ["Using EXL2 kernels for 1 layers"]
        assert not any(hasattr(layer, name) for name in CHECKPOINT_TENSORS)
        assert layer.exl2_perm.numel() == layer.exl2_inputs.numel() == (64 if rank == 0 else 128)
        layer.tp = _WholeInput(rank, 2, whole=x)
        total += layer.quant_method.apply(layer, x[:, rank * 96 : (rank + 1) * 96]).double()
    ref = x.double() @ enc.weight.double().t()
    assert ((total - ref).abs().max() / ref.abs().max()).item() < 1e-3  # the GEMV: x to ~15 bits, weights unrounded (test_exl2_kernels.py)
