"""The Sampler as a whole: pre-chain, per-request order, draws against the contract's
probabilities (chi-square), and reproducibility of seeded rows alone and in a batch."""

from __future__ import annotations

import pytest
import torch

from paphos.core.protocol import SamplingInputs
from paphos.sample.metadata import SamplingMetadata
from paphos.sample.rng import uniform_reference, uniforms
from paphos.sample.sampler import Sampler
from paphos.sampling_params import SamplingParams
from tests.sample import references as ref

VOCAB = 50


def build(params: list[SamplingParams], seeds: list[int] | None = None, histories: list[list[int]] | None = None,
          eos: int | None = None, **kwargs) -> SamplingMetadata:
    histories = histories or [[1, 2, 3]] * len(params)
    return SamplingMetadata.build(
        params, seeds or list(range(len(params))), histories, [len(h) for h in histories], eos, VOCAB,
        torch.device("cpu"), **kwargs,
    )


def test_greedy_rows_take_argmax_after_bias_and_min_tokens_mask() -> None:
    logits = torch.randn(3, VOCAB)
    eos = int(logits[1].argmax())
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, min_tokens=2),
        SamplingParams(temperature=0, logit_bias={7: 100.0}),
    ]
    out = Sampler()(logits, build(params, eos=eos))
    assert out.sampled_token_ids[0] == logits[0].argmax()
    assert out.sampled_token_ids[1] != eos
    assert out.sampled_token_ids[2] == 7
    # Logprobs report the raw distribution, not the biased one.
    assert out.sampled_logprobs[2] == pytest.approx(float(logits[2].log_softmax(-1)[7]), abs=1e-5)


def test_greedy_rows_still_get_penalties_and_bans() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 5] = 2.0
    logits[:, 6] = 1.9
    params = [SamplingParams(temperature=0, repetition_penalty=1.5), SamplingParams(temperature=0, custom_token_bans="5, 9"),
              SamplingParams(temperature=0, allowed_token_ids=[8, 9])]
    out = Sampler()(logits, build(params, histories=[[5], [1], [1]]))
    assert out.sampled_token_ids.tolist() == [6, 6, 8]


def test_rng_matches_its_plain_reference() -> None:
    seeds = torch.tensor([0, 1, 2**62, -5])
    positions = torch.tensor([0, 7, 3, 100])
    u = uniforms(seeds, positions, 2)
    for r in range(4):
        for d in range(2):
            assert float(u[r, d]) == uniform_reference(int(seeds[r]), int(positions[r]), d, 2)
    assert ((u >= 0) & (u < 1)).all()


EVERYTHING = dict(
    temperature=0.9, top_k=20, top_p=0.95, min_p=0.02, top_a=0.05, tfs=0.98, typical_p=0.97, eta_cutoff=2,
    epsilon_cutoff=2, nsigma=3, smoothing_factor=0.2, repetition_penalty=1.1, frequency_penalty=0.1,
    presence_penalty=0.1, no_repeat_ngram_size=4, dry_multiplier=0.5, xtc_probability=0.5, xtc_threshold=0.05,
    skew=0.1, dynatemp_min=0.5, dynatemp_max=1.2,
)


def test_seeded_rows_reproduce_alone_and_in_a_batch_of_32() -> None:
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(1, VOCAB, generator=gen)
    mine = [SamplingParams(seed=1234, **EVERYTHING), SamplingParams(seed=99, xtc_probability=1.0, xtc_threshold=0.01),
            SamplingParams(seed=5, mirostat_mode=2), SamplingParams(seed=6, sampler_priority=["xtc", "temperature"],
                                                                    xtc_probability=0.7, temperature=1.4)]
    history = [3, 4, 5, 3, 4, 5, 3, 4]
    breakers = SamplingInputs(dry_breaker_ids=(0,))  # the target row's; the others have none
    for p in mine:
        alone = [int(Sampler()(target.clone(), build([p], [777], [history], sampling_inputs=[breakers]))
                     .sampled_token_ids[0]) for _ in range(2)]
        assert alone[0] == alone[1]
        others = [SamplingParams(temperature=0.3 + 0.05 * i, top_k=i % 7, min_p=0.01 * (i % 3), xtc_probability=0.3,
                                 mirostat_mode=i % 3 if i % 5 == 0 else 0, temperature_last=bool(i % 2))
                  for i in range(31)]
        batch = torch.cat([torch.randn(31, VOCAB, generator=gen), target])
        histories = [[i, i + 1, i] for i in range(31)] + [history]
        together = Sampler()(batch, build([*others, p], [*range(31), 777], histories,
                                          sampling_inputs=[SamplingInputs()] * 31 + [breakers]))
        assert int(together.sampled_token_ids[-1]) == alone[0]


def test_rows_with_different_orders_each_get_their_own() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1)) * 2
    first = SamplingParams(temperature=3.0, min_p=0.3)  # default order: temperature, then min-p
    last = SamplingParams(temperature=3.0, min_p=0.3, temperature_last=True)  # min-p on the sharp logits
    kobold = SamplingParams(temperature=3.0, min_p=0.3, sampler_order=[6, 0, 1, 3, 4, 2, 5])
    md = build([first, last, kobold])
    assert len(md.groups) == 2  # kobold's order runs min-p before temperature too: same as `last`
    from paphos.sample.sampler import apply_pre_chain, run_chain

    out = run_chain(apply_pre_chain(logits.expand(3, -1).clone(), md), md, torch.zeros(3))
    row = logits[0].tolist()
    expected_first = ref.min_p(ref.temperature(row, 3.0), 0.3)
    expected_last = ref.temperature(ref.min_p(row, 0.3), 3.0)
    assert torch.isinf(out[0]).tolist() == [v == -ref.INF for v in expected_first]
    assert torch.isinf(out[1]).tolist() == [v == -ref.INF for v in expected_last]
    assert torch.equal(out[1], out[2])
    assert torch.isinf(out[0]).sum() < torch.isinf(out[1]).sum()


def test_default_order_batch_is_one_group_with_only_enabled_stages() -> None:
    params = [SamplingParams(top_p=0.9), SamplingParams(min_p=0.1), SamplingParams(temperature=0.5),
              SamplingParams(temperature=0)]
    md = build(params)
    assert [(g.stages, g.rows) for g in md.groups] == [(("temperature", "top_p", "min_p"), None)]


def test_mirostat_mu_moves_toward_tau() -> None:
    # Flat enough that a surprise of tau = 3 bits is reachable (the max is log2(50) = 5.6).
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(mirostat_mode=2, mirostat_tau=3.0, mirostat_eta=0.5)
    mu = None
    for step in range(30):
        out = Sampler()(logits.clone(), build([p], [step], mirostat_mu=[mu]))
        mu = out.mirostat_mu[0]
    assert 0.5 < float(mu) < 6.0


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    from scipy.stats import chisquare

    keep = probs > 0
    expected = probs[keep].double() / probs[keep].double().sum() * counts.sum().double()
    return float(chisquare(counts[keep].double().numpy(), expected.numpy()).pvalue)


DISTRIBUTIONS = {
    "temperature": (dict(temperature=0.8), lambda r: ref.temperature(r, 0.8)),
    "top_k": (dict(top_k=4), lambda r: ref.top_k(r, 4)),
    "top_p": (dict(top_p=0.7), lambda r: ref.top_p(r, 0.7)),
    "min_p": (dict(min_p=0.2), lambda r: ref.min_p(r, 0.2)),
    "typical": (dict(typical_p=0.6), lambda r: ref.typical_p(r, 0.6)),
    "tfs": (dict(tfs=0.7), lambda r: ref.tfs(r, 0.7)),
    "top_a": (dict(top_a=0.3), lambda r: ref.top_a(r, 0.3)),
    "combined": (dict(temperature=1.5, top_k=6, top_p=0.9, min_p=0.05),
                 lambda r: ref.min_p(ref.top_p(ref.top_k(ref.temperature(r, 1.5), 6), 0.9), 0.05)),
}


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_draws_follow_the_reference_distribution(name: str) -> None:
    kwargs, reference = DISTRIBUTIONS[name]
    draws = 10_000
    base = torch.randn(1, 12, generator=torch.Generator().manual_seed(3)) * 1.5
    logits = torch.cat([base, torch.full((1, VOCAB - 12), -30.0)], dim=1)
    params = SamplingParams(**kwargs)
    md = build([params] * draws, seeds=list(range(draws)), histories=[[1]] * draws)
    sampled = Sampler()(logits.expand(draws, -1).clone(), md).sampled_token_ids
    counts = torch.bincount(sampled, minlength=VOCAB)
    probs = torch.tensor(ref.probs_of(reference(logits[0].tolist())))
    assert counts[probs == 0].sum() == 0
    assert chi_square_p_value(counts, probs) > 0.001


def test_bad_words_and_position_bans_mask_their_tokens() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 9] = 5.0
    logits[:, 8] = 4.0
    words = SamplingInputs(bad_words_ids=((3, 9), (8,)))  # 9 only right after an output 3; 8 always
    params = [SamplingParams(temperature=0)] * 3
    md = SamplingMetadata.build(params, [0, 1, 2], [[1, 3], [1, 2], [1]], [1, 1, 1], None, VOCAB,
                                torch.device("cpu"), position_bans=[[], [], [9]],
                                sampling_inputs=[words, words, SamplingInputs()])
    out = Sampler()(logits, md).sampled_token_ids.tolist()
    assert out == [0, 9, 8]


@pytest.mark.parametrize("cap", [None, 3])
def test_min_p_rows_on_cpu_sort_only_survivors_and_draw_as_the_whole_row_chain(
    cap: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Temperature, top-p and min-p on CPU: only min-p's survivors are sorted (dense_tail.
    sample_min_p_head), and every token and logprob equals the reference form's, which sorts
    whole rows: top-p cutting above min-p's threshold and below it, min-p alone, a greedy row,
    ties, -inf entries and a logit bias. With a cap below the survivor count the ops run instead."""
    from paphos.sample.fast import dense_tail

    if cap is not None:
        monkeypatch.setattr(dense_tail, "MIN_P_HEAD_CAP", cap)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, VOCAB, generator=gen) * 2
    logits[1, :10] = logits[1].max()  # ten-way tie at the top
    logits[2, ::3] = float("-inf")
    params = [SamplingParams(temperature=0.8, top_p=0.5, min_p=0.02), SamplingParams(temperature=1.3, top_p=0.9, min_p=0.05),
              SamplingParams(temperature=0.7, min_p=0.1), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, top_p=0.99, min_p=0.3, logit_bias={4: 3.0}),
              SamplingParams(temperature=2.0, top_p=0.3, min_p=0.001)]  # fmt: skip
    calls = []
    head = dense_tail.sample_min_p_head
    monkeypatch.setattr(dense_tail, "sample_min_p_head", lambda *a: calls.append(head(*a)) or calls[-1])
    for position in range(8):
        md = build(params, [11, 12, 13, 14, 15, 16], [[1, 2, 3] + [7] * position] * 6)
        assert dense_tail.min_p_head_applicable(md, logits)
        fast, reference = Sampler()(logits, md), Sampler(fast=False)(logits, md)
        assert torch.equal(fast.sampled_token_ids, reference.sampled_token_ids), position
        assert torch.allclose(fast.sampled_logprobs, reference.sampled_logprobs, atol=1e-6)
    assert len(calls) == 8 and all((c is None) == (cap is not None) for c in calls)
