"""The history kernel (paphos/sample/fast/history_kernels.py) against the torch ops it replaces.

The kernel runs under the Triton interpreter on CPU tensors (forced, small shapes); block=16 splits
the histories into several chunks, so the cross-chunk lookups run too. Histories draw from a few
ids (repeats, long DRY matches, n-gram hits) and include empty, short and periodic rows.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Iterator

import pytest
import torch

from paphos.core.protocol import SamplingInputs
from paphos.sample import order as st
from paphos.sample.fast import history as fast_history
from paphos.sample.fast.kernels import force_kernels
from paphos.sample.metadata import COL, COLUMNS, SamplingMetadata
from paphos.sample.ops.dry import apply_dry
from paphos.sample.ops.no_repeat_ngram import apply_no_repeat_ngram
from paphos.sample.ops.penalties import apply_penalties
from paphos.sample.sampler import _run_groups
from paphos.sampling_params import SamplingParams

ROWS, LENGTH, VOCAB = 8, 40, 48
PENALTIES, DRY, NGRAM = 1, 2, 3  # history kernel codes (checked against HISTORY_CODE below)


@pytest.fixture(scope="module")
def hk() -> Iterator[object]:
    """paphos.sample.fast.history_kernels imported under the interpreter (re-imported if compiled)."""
    from triton.runtime.interpreter import InterpretedFunction

    name = "paphos.sample.fast.history_kernels"
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    module = importlib.import_module(name)
    reloaded = not isinstance(module._history_kernel, InterpretedFunction)
    if reloaded:
        module = importlib.reload(module)
    if previous is None:
        os.environ.pop("TRITON_INTERPRET")
    else:
        os.environ["TRITON_INTERPRET"] = previous
    assert module.HISTORY_CODE == {st.PENALTIES: PENALTIES, st.DRY: DRY, st.NO_REPEAT_NGRAM: NGRAM}
    yield module
    if reloaded:
        importlib.reload(sys.modules[name])


def logits(seed: int) -> torch.Tensor:
    """Random logits with a -inf and a 0.0 entry at ids that recur in the histories."""
    x = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, 1] = -math.inf
    x[3, 2] = 0.0
    return x


def histories(seed: int) -> torch.Tensor:
    """Right-aligned [ROWS, LENGTH] over ids 0..5: row 1 has 30 tokens, row 2 none, row 3 five,
    row 5 a period-4 text (matches as long as the history), the rest full and random; rows 0, 1,
    6 and 7 end with a copy of an earlier stretch (DRY matches of up to 6 tokens and more)."""
    gen = torch.Generator().manual_seed(seed)
    hist = torch.randint(0, 6, (ROWS, LENGTH), generator=gen)
    hist[[0, 1, 6, 7], -6:] = hist[[0, 1, 6, 7], 12:18]
    hist[1, :10] = -1
    hist[2] = -1
    hist[3, :-5] = -1
    hist[5] = torch.tensor([1, 2, 3, 4] * (LENGTH // 4))
    return hist


def columns(**values: list[float]) -> torch.Tensor:
    """[ROWS, len(COLUMNS)] of neutral history parameters, the given columns set per row."""
    cols = torch.zeros(ROWS, len(COLUMNS))
    cols[:, COL["repetition_penalty"]] = 1.0
    cols[:, COL["rep_pen_slope"]] = 1.0
    cols[:, COL["dry_base"]] = 1.75
    cols[:, COL["dry_allowed_length"]] = 2.0
    cols[:, COL["dry_max_ngram"]] = 50.0
    for name, per_row in values.items():
        cols[:, COL[name]] = torch.tensor(per_row, dtype=torch.float32)
    return cols


def codes(*per_row: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([row + (0,) * (3 - len(row)) for row in per_row], dtype=torch.int32)


def run(hk, x: torch.Tensor, hist: torch.Tensor, num_output: torch.Tensor, breakers: torch.Tensor | None,
        cols: torch.Tensor, row_codes: torch.Tensor, block: int | None) -> torch.Tensor:
    return hk.apply_history(x.clone(), hist, num_output, breakers, cols, COL["repetition_penalty"], row_codes, block)


def assert_only_history_ids_changed(out: torch.Tensor, x: torch.Tensor, hist: torch.Tensor) -> None:
    for r in range(x.shape[0]):
        seen = torch.zeros(x.shape[1], dtype=torch.bool)
        seen[hist[r][hist[r] >= 0]] = True
        assert torch.equal(out[r][~seen], x[r][~seen]), f"row {r}: an id outside the history changed"


NUM_OUTPUT = torch.tensor([5, 10, 0, 3, 40, 12, 0, 4])


@pytest.mark.parametrize("block", [None, 16])
def test_penalties_match_the_op(hk, block: int | None) -> None:
    x, hist = logits(0), histories(0)
    hist[[0, 7], :20] = torch.randint(6, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))  # old-only ids
    # Range 0 (all), inside and beyond the history; slope < 1 with rp above and below 1; row 6 neutral.
    cols = columns(
        repetition_penalty=[1.3, 0.8, 1.2, 1.5, 1.0, 1.1, 1.0, 2.0],
        repetition_penalty_range=[0, 5, 0, 3, 0, 12, 0, 100],
        rep_pen_slope=[0.5, 0.5, 1.0, 0.3, 1.0, 0.0, 1.0, 0.5],
        frequency_penalty=[0.1, 0.0, 0.3, 0.2, 0.5, 0.0, 0.0, -0.4],
        presence_penalty=[0.2, 0.1, 0.0, 0.2, 0.0, 1.0, 0.0, 0.3],
    )
    col = {name: cols[:, COL[name]] for name in COLUMNS}
    expected = apply_penalties(
        x.clone(), hist, NUM_OUTPUT, col["repetition_penalty"], col["repetition_penalty_range"].long(),
        col["rep_pen_slope"], col["frequency_penalty"], col["presence_penalty"],
    )  # fmt: skip
    out = run(hk, x, hist, NUM_OUTPUT, None, cols, codes(*[(PENALTIES,)] * ROWS), block)
    assert torch.equal(out, expected)
    assert not torch.equal(out[0], x[0]) and torch.equal(out[6], x[6]) and torch.equal(out[2], x[2])


DRY_CASES = {
    "plain": dict(dry_multiplier=[0.8, 1.0, 2.0, 0.5, 1.0, 0.3, 1.0, 0.0]),
    # Row 0: early exit reached in two chunks (the newest one counts); 1: only the newest occurrence;
    # 5: a range cutting the periodic text's matches; 6, 7: short ranges and n-grams; bases vary.
    "limits": dict(
        dry_multiplier=[0.8, 1.0, 2.0, 0.5, 1.0, 0.3, 1.0, 1.5], dry_base=[1.75, 2.0, 1.5, 1.1, 3.0, 1.75, 1.2, 1.9],
        dry_allowed_length=[2, 1, 2, 1, 3, 2, 1, 1], dry_range=[0, 0, 0, 0, 20, 10, 6, 7],
        dry_max_ngram=[50, 50, 5, 50, 50, 50, 2, 2], dry_max_occurrences=[0, 1, 2, 0, 1, 0, 2, 0],
        dry_early_exit_match_len=[2, 0, 0, 0, 0, 0, 1, 1],
    ),
}


@pytest.mark.parametrize("block", [None, 16])
@pytest.mark.parametrize("case", list(DRY_CASES))
def test_dry_matches_the_op(hk, case: str, block: int | None) -> None:
    x, hist = logits(1), histories(1)
    hist[4, -1] = 3  # row 4's last token is a breaker: DRY does nothing there
    hist[0, 28:31] = torch.tensor([0, 3, 5])  # a newer match of the suffix (..., 0, 3) than at 16, 17
    breakers = torch.full((ROWS, 2), -1)
    breakers[0, 0] = 4  # inside the copied stretch: the long match stops at it
    breakers[4] = torch.tensor([3, 4])
    cols = columns(**DRY_CASES[case])
    col = {name: cols[:, COL[name]] for name in COLUMNS}
    expected = apply_dry(
        x.clone(), hist, breakers, col["dry_multiplier"], col["dry_base"], col["dry_allowed_length"],
        col["dry_range"].long(), col["dry_max_ngram"].long(), col["dry_max_occurrences"].long(),
        col["dry_early_exit_match_len"].long(), min(LENGTH, int(col["dry_max_ngram"].max())),
    )  # fmt: skip
    out = run(hk, x, hist, NUM_OUTPUT, breakers, cols, codes(*[(DRY,)] * ROWS), block)
    torch.testing.assert_close(out, expected, rtol=2e-7, atol=0.0)  # base^x: at most the last bit
    assert int((expected != x).any(dim=1).sum()) >= 4  # penalties in several rows
    assert torch.equal(out[2], x[2]) and torch.equal(out[4], x[4])
    assert_only_history_ids_changed(out, x, hist)


@pytest.mark.parametrize("block", [None, 16])
def test_no_repeat_ngram_matches_the_op(hk, block: int | None) -> None:
    x, hist = logits(2), histories(2)
    # Sizes 1..4, 0 (neutral) and 7 on row 3, whose 5 tokens cannot hold a 6-token suffix.
    sizes = [1, 2, 3, 7, 4, 3, 0, 2]
    cols = columns(no_repeat_ngram_size=sizes)
    expected = apply_no_repeat_ngram(x.clone(), hist, torch.tensor(sizes), max(sizes) - 1)
    out = run(hk, x, hist, NUM_OUTPUT, None, cols, codes(*[(NGRAM,)] * ROWS), block)
    assert torch.equal(out, expected)
    banned = torch.isinf(out) & ~torch.isinf(x)
    assert torch.isinf(out[0, hist[0]]).all()  # size 1: every seen id
    assert banned[5].any() and not banned[3].any() and torch.equal(out[6], x[6])


HISTORY_IDS = {st.DRY: 7, st.PENALTIES: 6, st.NO_REPEAT_NGRAM: 8}
ROW_ORDERS = [
    (st.DRY, st.PENALTIES, st.NO_REPEAT_NGRAM), (st.PENALTIES, st.DRY, st.NO_REPEAT_NGRAM),
    (st.NO_REPEAT_NGRAM, st.PENALTIES, st.DRY), (st.PENALTIES, st.NO_REPEAT_NGRAM, st.DRY),
]
ORDER_INPUTS = SamplingInputs(dry_breaker_ids=(5,))  # every row of order_params breaks DRY at 5


def order_params() -> list[SamplingParams]:
    """Every history stage on, in the four orders above (fused-chain batches: top-k after them);
    row 3 greedy with penalties only, row 6 without a history stage, row 7 DRY with a range."""
    every = dict(
        top_k=5, repetition_penalty=1.4, repetition_penalty_range=20, rep_pen_slope=0.5, frequency_penalty=0.3,
        presence_penalty=0.2, no_repeat_ngram_size=3, dry_multiplier=1.0, dry_base=1.5, dry_allowed_length=1,
        dry_max_occurrences=0,
    )  # fmt: skip
    params = []
    for i in range(ROWS):
        if i == 3:
            p = SamplingParams(temperature=0, repetition_penalty=1.2)
        elif i == 6:
            p = SamplingParams(seed=i, top_k=5)
        else:
            order = ROW_ORDERS[i % len(ROW_ORDERS)]
            extra = {"dry_range": 8, "no_repeat_ngram_size": 1} if i == 7 else {}
            p = SamplingParams(seed=i, sampler_priority=[HISTORY_IDS[s] for s in order], **{**every, **extra})
        params.append(p)
    return params


def test_row_orders_in_one_batch_match_the_groups(hk) -> None:
    params = order_params()
    tokens = [[t for t in row if t >= 0] for row in histories(3).tolist()]
    md = SamplingMetadata.build(params, [0] * ROWS, tokens, [len(t) // 2 for t in tokens], None, 300,
                                torch.device("cpu"), sampling_inputs=[ORDER_INPUTS] * ROWS)  # fmt: skip
    assert md.fused is not None and len(md.fused.history) >= 4  # the orders are separate groups
    wanted = [[hk.HISTORY_CODE[s] for s in ROW_ORDERS[i % len(ROW_ORDERS)]] for i in range(ROWS)]
    wanted[3], wanted[6] = [PENALTIES, 0, 0], [0, 0, 0]
    assert md.fused.history_codes.tolist() == wanted
    x = torch.randn(ROWS, 300, generator=torch.Generator().manual_seed(3)) * 3
    expected = _run_groups(x.clone(), md, md.fused.history, None, False)
    assert not fast_history.applicable(md, x)  # CPU tensors: the torch ops, unless forced
    with force_kernels():
        assert fast_history.applicable(md, x)
        out = fast_history.apply(x.clone(), md)
    torch.testing.assert_close(out, expected, rtol=2e-7, atol=0.0)
    assert torch.equal(out[6], x[6]) and torch.equal(out[2], x[2])  # no history stage; no history
    # Each row's own order is what ran: the same stages in the reverse order give other values.
    reverse = torch.tensor([row[::-1] if all(row) else row for row in wanted], dtype=torch.int32)
    hist, num_output, breakers = md.history, md.num_output, md.dry_breakers
    swapped = run(hk, x, hist, num_output, breakers, md.columns, reverse, None)
    assert not torch.equal(swapped[0], out[0]) and not torch.equal(swapped[1], out[1])
