"""Sampler stages against plain per-row references, and the sampler's draws against the
probabilities the contract specifies (contract §4.4)."""

from __future__ import annotations

import math

import pytest
import torch

from paphos.sample.metadata import SamplingMetadata
from paphos.sample.ops.min_p import apply_min_p
from paphos.sample.ops.top_k_top_p import apply_top_k_top_p
from paphos.sample.sampler import Sampler
from paphos.sampling_params import SamplingParams

VOCAB = 50


def reference_top_k_top_p(row: list[float], k: int, p: float) -> set[int]:
    """Surviving ids, computed one row at a time with Python lists."""
    order = sorted(range(len(row)), key=lambda i: (-row[i], i))
    if k > 0:
        kth = row[order[k - 1]]
        order = [i for i in order if row[i] >= kth]
    finite = [row[i] for i in order]
    top = max(finite)
    weights = [math.exp(v - top) for v in finite]
    total = sum(weights)
    kept, mass = [], 0.0
    for i, w in zip(order, weights, strict=True):
        if mass >= p and kept:
            break
        kept.append(i)
        mass += w / total
    return set(kept)


def survivors(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(r)).flatten().tolist()) for r in logits]


@pytest.mark.parametrize("seed", range(5))
def test_top_k_top_p_matches_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, VOCAB, generator=gen) * 3
    logits[0, :10] = float("-inf")  # -inf entries stay removed
    logits[1, 5:9] = logits[1, 4]  # ties at a boundary are kept together
    top_k = torch.tensor([5, 5, VOCAB, 1, 3, VOCAB])
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0, 0.3, 1.0])
    out = apply_top_k_top_p(logits.clone(), top_k, top_p)
    for r in range(6):
        row = logits[r].tolist()
        k = int(top_k[r]) if int(top_k[r]) < VOCAB else 0
        expected = reference_top_k_top_p(row, k, float(top_p[r])) - {i for i, v in enumerate(row) if v == -math.inf}
        assert survivors(out[r : r + 1])[0] == expected


def test_neutral_top_k_top_p_is_identity() -> None:
    logits = torch.randn(3, VOCAB)
    out = apply_top_k_top_p(logits.clone(), torch.full((3,), VOCAB), torch.ones(3))
    assert torch.equal(out, logits)


def test_min_p_keeps_tokens_above_fraction_of_max() -> None:
    logits = torch.randn(4, VOCAB)
    min_p = torch.tensor([0.0, 0.1, 0.5, 1.0])
    out = apply_min_p(logits.clone(), min_p)
    probs = logits.softmax(-1)
    for r in range(4):
        expected = {i for i in range(VOCAB) if probs[r, i] >= min_p[r] * probs[r].max() - 1e-7}
        assert survivors(out[r : r + 1])[0] == expected
    assert survivors(out[3:4])[0] == {int(logits[3].argmax())}  # single survivor


def build(params: list[SamplingParams], seeds: list[int | None], num_out: list[int] | None = None,
          eos: int | None = None) -> SamplingMetadata:
    gens = [torch.Generator().manual_seed(s) if s is not None else None for s in seeds]
    return SamplingMetadata.build(params, gens, num_out or [0] * len(params), eos, VOCAB, torch.device("cpu"))


def test_greedy_rows_take_argmax_after_bias_and_min_tokens_mask() -> None:
    logits = torch.randn(3, VOCAB)
    eos = int(logits[1].argmax())
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, min_tokens=2),
        SamplingParams(temperature=0, logit_bias={7: 100.0}),
    ]
    out = Sampler()(logits, build(params, [None] * 3, [0, 0, 0], eos=eos))
    assert out.sampled_token_ids[0] == logits[0].argmax()
    assert out.sampled_token_ids[1] != eos
    assert out.sampled_token_ids[2] == 7
    # Logprobs report the raw distribution, not the biased one.
    assert out.sampled_logprobs[2] == pytest.approx(float(logits[2].log_softmax(-1)[7]), abs=1e-5)


def test_seeded_rows_reproduce_regardless_of_batch_companions() -> None:
    logits = torch.randn(1, VOCAB)
    alone = Sampler()(logits.clone(), build([SamplingParams(temperature=1.0)], [1234]))
    batch = torch.cat([torch.randn(2, VOCAB), logits])
    params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0), SamplingParams()]
    together = Sampler()(batch, build(params, [None, None, 1234]))
    assert int(together.sampled_token_ids[2]) == int(alone.sampled_token_ids[0])


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    from scipy.stats import chisquare

    keep = probs > 0
    expected = probs[keep].double() / probs[keep].double().sum() * counts.sum().double()
    return float(chisquare(counts[keep].double().numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.8), SamplingParams(top_k=4), SamplingParams(top_p=0.7),
     SamplingParams(min_p=0.2), SamplingParams(temperature=1.5, top_k=6, top_p=0.9, min_p=0.05)],
    ids=["temperature", "top_k", "top_p", "min_p", "combined"],
)
def test_draws_follow_the_truncated_distribution(params: SamplingParams) -> None:
    draws = 10_000
    base = torch.randn(1, 12, generator=torch.Generator().manual_seed(3)) * 1.5
    logits = torch.cat([base, torch.full((1, VOCAB - 12), -30.0)], dim=1)
    md = SamplingMetadata.build([params] * draws, [None] * draws, [0] * draws, None, VOCAB, torch.device("cpu"))
    torch.manual_seed(0)
    sampled = Sampler()(logits.expand(draws, -1).clone(), md).sampled_token_ids
    counts = torch.bincount(sampled, minlength=VOCAB)
    # Reference distribution: the stages applied one at a time in the contract's order.
    ref = logits[0].clone() / params.temperature
    keep = reference_top_k_top_p(ref.tolist(), params.top_k, params.top_p)
    probs = torch.zeros(VOCAB)
    probs[list(keep)] = ref[list(keep)].softmax(-1)
    probs[probs < params.min_p * probs.max()] = 0
    probs /= probs.sum()
    assert counts[probs == 0].sum() == 0
    assert chi_square_p_value(counts, probs) > 0.001
