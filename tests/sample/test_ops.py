"""Each batched sampler op against its plain reference (references.py) on random logits with -inf
entries, ties, a row with a single finite token, and neutral parameters (identity)."""

from __future__ import annotations

import math

import pytest
import torch

from paphos.sample.ops.dry import apply_dry
from paphos.sample.ops.epsilon_cutoff import apply_epsilon_cutoff
from paphos.sample.ops.eta_cutoff import apply_eta_cutoff
from paphos.sample.ops.min_p import apply_min_p
from paphos.sample.ops.mirostat import _mirostat_v1_k, apply_mirostat, update_mu
from paphos.sample.ops.no_repeat_ngram import apply_no_repeat_ngram
from paphos.sample.ops.penalties import apply_penalties
from paphos.sample.ops.quadratic import apply_quadratic
from paphos.sample.ops.skew import apply_skew
from paphos.sample.ops.temperature import apply_temperature
from paphos.sample.ops.tfs import apply_tfs
from paphos.sample.ops.top_a import apply_top_a
from paphos.sample.ops.top_k_top_p import apply_top_k_top_p
from paphos.sample.ops.top_nsigma import apply_top_nsigma
from paphos.sample.ops.typical_p import apply_typical_p
from paphos.sample.ops.xtc import apply_xtc
from tests.sample import references as ref

VOCAB = 40


def cases(seed: int, rows: int) -> torch.Tensor:
    """Random logits; row 0 has -inf entries, row 1 ties, row 2 a single finite token."""
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
    logits[0, ::3] = -math.inf
    logits[1, 10:16] = logits[1, 3]
    logits[2, 1:] = -math.inf
    return logits


def assert_rows_match(out: torch.Tensor, logits: torch.Tensor, expected_fn) -> None:
    for r in range(logits.shape[0]):
        expected = torch.tensor(expected_fn(r, logits[r].tolist()), dtype=torch.float32)
        got = out[r]
        assert torch.equal(torch.isinf(got), torch.isinf(expected)), f"row {r}: survivors differ"
        fin = torch.isfinite(expected)
        torch.testing.assert_close(got[fin], expected[fin], rtol=1e-4, atol=1e-4)


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# (batched call, reference call, per-row params; the last row's params are neutral)
TRUNCATIONS = {
    "top_k": (lambda x, p: apply_top_k_top_p(x, p.long(), None), ref.top_k, [3, 5, 1, 7, 2, VOCAB]),
    "top_p": (lambda x, p: apply_top_k_top_p(x, None, p), ref.top_p, [0.5, 0.9, 0.3, 0.7, 0.95, 1.0]),
    "top_a": (apply_top_a, ref.top_a, [0.2, 0.5, 0.9, 0.1, 1.0, 0.0]),
    "min_p": (apply_min_p, ref.min_p, [0.1, 0.3, 0.5, 0.05, 1.0, 0.0]),
    "tfs": (apply_tfs, ref.tfs, [0.5, 0.9, 0.7, 0.95, 0.3, 1.0]),
    "typical_p": (apply_typical_p, ref.typical_p, [0.5, 0.9, 0.2, 0.7, 0.95, 1.0]),
    "eta": (apply_eta_cutoff, ref.eta_cutoff, [3e-3, 1e-2, 5e-2, 2e-3, 0.5, 0.0]),
    "epsilon": (apply_epsilon_cutoff, ref.epsilon_cutoff, [3e-3, 1e-2, 5e-2, 2e-3, 0.9, 0.0]),
    "top_nsigma": (apply_top_nsigma, ref.top_nsigma, [1.0, 0.5, 2.0, 1.5, 0.1, 0.0]),
    "skew": (apply_skew, ref.skew, [0.5, -0.5, 1.0, 2.0, -1.0, 0.0]),
}


@pytest.mark.parametrize("name", sorted(TRUNCATIONS))
@pytest.mark.parametrize("seed", range(3))
def test_single_parameter_ops_match_reference(name: str, seed: int) -> None:
    op, reference, values = TRUNCATIONS[name]
    logits = cases(seed, len(values))
    out = op(logits.clone(), t(values))
    assert_rows_match(out, logits, lambda r, row: reference(row, values[r]))
    assert torch.equal(out[-1], logits[-1])  # neutral = identity
    assert torch.isfinite(out).any(dim=-1).all()  # never empties a row


def test_temperature_and_dynatemp_match_reference() -> None:
    logits = cases(1, 6)
    temp = [0.5, 2.0, 0.7, 1.0, 1.3, 1.0]
    dmin = [0.0, 0.5, 0.2, 0.1, 0.0, 0.0]
    dmax = [0.0, 1.5, 2.0, 0.9, 0.0, 0.0]
    expo = [1.0, 0.5, 2.0, 1.0, 1.0, 1.0]
    out = apply_temperature(logits.clone(), t(temp), t(dmin), t(dmax), t(expo))
    assert_rows_match(out, logits, lambda r, row: ref.temperature(row, temp[r], dmin[r], dmax[r], expo[r]))
    assert torch.equal(out[-1], logits[-1])


def test_quadratic_matches_reference() -> None:
    logits = cases(2, 4)
    factor, curve = [0.3, 1.0, 0.5, 0.0], [1.0, 2.0, 3.5, 1.0]
    out = apply_quadratic(logits.clone(), t(factor), t(curve))
    assert_rows_match(out, logits, lambda r, row: ref.quadratic(row, factor[r], curve[r]))
    assert torch.equal(out[-1], logits[-1])


@pytest.mark.parametrize("seed", range(3))
def test_xtc_matches_reference(seed: int) -> None:
    logits = cases(seed, 5) / 2
    logits[3, 5:8] = logits[3].max()  # tied top tokens: the highest id of them survives
    thr, prob, coin = [0.05, 0.1, 0.1, 0.02, 0.1], [1.0, 1.0, 1.0, 1.0, 0.0], [0.5, 0.2, 0.0, 0.9, 0.0]
    out = apply_xtc(logits.clone(), t(thr), t(prob), t(coin))
    assert_rows_match(out, logits, lambda r, row: ref.xtc(row, thr[r], coin[r] < prob[r]))
    assert torch.equal(out[-1], logits[-1])


def right_aligned(histories: list[list[int]]) -> torch.Tensor:
    length = max(len(h) for h in histories)
    return torch.tensor([[-1] * (length - len(h)) + h for h in histories])


HISTORIES = [
    [5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7],  # repeats: DRY and no-repeat-ngram fire
    [1, 2, 3, 1, 2, 3, 1, 2],
    [4, 4, 4, 4],
    [9, 3, 9, 3, 30, 9, 3],
    [7],
    [2, 3, 4, 2, 3],
]


def test_penalties_match_reference() -> None:
    logits = cases(4, len(HISTORIES))
    prompt = [4, 2, 0, 3, 1, 2]
    rp, rng, slope = [1.3, 1.2, 0.8, 1.5, 1.1, 1.0], [0, 4, 0, 5, 0, 0], [1.0, 0.5, 1.0, 0.2, 1.0, 1.0]
    freq, pres = [0.5, 0.0, 0.2, -0.3, 0.1, 0.0], [0.3, 0.4, 0.0, 0.5, 0.0, 0.0]
    num_output = torch.tensor([len(h) - p for h, p in zip(HISTORIES, prompt, strict=True)])
    out = apply_penalties(logits.clone(), right_aligned(HISTORIES), num_output, t(rp), torch.tensor(rng),
                          t(slope), t(freq), t(pres))
    assert_rows_match(out, logits, lambda r, row: ref.penalties(
        row, HISTORIES[r], prompt[r], rp[r], rng[r], slope[r], freq[r], pres[r]))
    assert torch.equal(out[-1], logits[-1])


@pytest.mark.parametrize(
    "extra", [dict(), dict(dry_range=6), dict(max_ngram=2), dict(max_occ=1), dict(early_exit=2)],
    ids=["plain", "range", "max_ngram", "max_occurrences", "early_exit"],
)
def test_dry_matches_reference(extra: dict) -> None:
    # 1 is a breaker: a match stops there; the last row is neutral (multiplier 0).
    histories = [*HISTORIES, [5, 6, 1, 5, 6, 1, 5, 6], [3, 3, 3]]
    n = len(histories)
    logits = cases(5, n)
    breakers = {1}
    mult = [0.8, 1.0, 2.0, 0.5, 1.0, 1.2, 1.0, 0.0]
    base = [1.75, 2.0, 1.5, 1.75, 1.75, 1.75, 1.75, 1.75]
    allowed = [2, 1, 2, 1, 1, 1, 1, 2]
    kw = {"dry_range": 0, "max_ngram": 50, "max_occ": 0, "early_exit": 0} | extra
    out = apply_dry(
        logits.clone(), right_aligned(histories), torch.tensor([[1]] * n), t(mult), t(base), t(allowed),
        torch.full((n,), kw["dry_range"]), torch.full((n,), kw["max_ngram"]), torch.full((n,), kw["max_occ"]),
        torch.full((n,), kw["early_exit"]), max_k=min(kw["max_ngram"], 12),
    )
    assert_rows_match(out, logits, lambda r, row: ref.dry(
        row, histories[r], breakers, mult[r], base[r], allowed[r], kw["dry_range"], kw["max_ngram"],
        kw["max_occ"], kw["early_exit"]))
    assert torch.equal(out[-1], logits[-1])


def test_no_repeat_ngram_matches_reference() -> None:
    logits = cases(6, len(HISTORIES))
    sizes = [3, 2, 1, 3, 2, 0]
    out = apply_no_repeat_ngram(logits.clone(), right_aligned(HISTORIES), torch.tensor(sizes), max(sizes) - 1)
    assert_rows_match(out, logits, lambda r, row: ref.no_repeat_ngram(row, HISTORIES[r], sizes[r]))
    assert torch.equal(out[-1], logits[-1])


def test_mirostat_matches_reference() -> None:
    logits = cases(7, 4)
    mu = [3.0, 6.0, 0.5, 10.0]
    mode = torch.tensor([2, 1, 2, 0])
    out = apply_mirostat(logits.clone(), mode, t(mu), VOCAB)
    assert_rows_match(out[[0, 2]], logits[[0, 2]], lambda r, row: ref.mirostat_v2(row, mu[[0, 2][r]]))
    k = ref.mirostat_v1_k(logits[1].tolist(), mu[1], VOCAB)
    assert int(_mirostat_v1_k(logits[1:2], t(mu[1:2]), VOCAB)) == k
    assert torch.isfinite(out[1]).sum() == k
    assert torch.equal(out[3], logits[3])
    sampled = out.argmax(dim=-1)
    new_mu = update_mu(out, sampled, mode, t(mu), t([5.0] * 4), t([0.1] * 4))
    for r in (0, 1, 2):
        surprise = -math.log2(ref.probs_of(out[r].tolist())[int(sampled[r])])
        assert float(new_mu[r]) == pytest.approx(mu[r] - 0.1 * (surprise - 5.0), abs=1e-4)
    assert float(new_mu[3]) == mu[3]
