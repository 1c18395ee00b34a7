"""The sampler on CUDA agrees with the CPU (skipped without a GPU): the counter-based uniforms
bit for bit, every stage within float tolerance, and whole mixed batches token for token, plus
seeded reproducibility alone and in a batch on the GPU."""

from __future__ import annotations

import pytest
import torch

from paphos.core.protocol import SamplingInputs
from paphos.sample.metadata import SamplingMetadata
from paphos.sample.rng import uniforms
from paphos.sample.sampler import Sampler, apply_pre_chain, run_chain
from paphos.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
VOCAB = 4096
CUDA = torch.device("cuda")
CPU = torch.device("cpu")
BREAKERS = SamplingInputs(dry_breaker_ids=(0, 1))  # every row's DRY sequence breakers


def batch_params() -> list[SamplingParams]:
    everything = dict(
        temperature=0.9, top_k=200, top_p=0.95, min_p=0.01, top_a=0.02, tfs=0.99, typical_p=0.98, eta_cutoff=1.0,
        epsilon_cutoff=1.0, nsigma=3.0, smoothing_factor=0.1, repetition_penalty=1.1, repetition_penalty_range=64,
        rep_pen_slope=0.5, frequency_penalty=0.1, presence_penalty=0.1, no_repeat_ngram_size=3, dry_multiplier=0.8,
        xtc_probability=0.5, xtc_threshold=0.01, skew=0.2, dynatemp_min=0.6, dynatemp_max=1.3,
    )
    params = []
    for i in range(32):
        if i % 8 == 0:
            p = SamplingParams(mirostat_mode=1 + i % 2, seed=i)
        elif i % 8 == 1:
            p = SamplingParams(temperature=0, repetition_penalty=1.3)
        elif i % 8 == 2:
            p = SamplingParams(sampler_priority=["xtc", "min_p", 5], seed=i, **everything)
        elif i % 8 == 3:
            p = SamplingParams(sampler_order=[6, 0, 1, 3, 4, 2, 5], seed=i, **everything)
        else:
            p = SamplingParams(seed=i, temperature_last=bool(i % 2), **everything)
        params.append(p)
    return params


def metadata(params: list[SamplingParams], device: torch.device, histories: list[list[int]]) -> SamplingMetadata:
    return SamplingMetadata.build(params, [p.seed or 0 for p in params], histories, [8] * len(params), 2, VOCAB,
                                  device, position_bans=[[3]] * len(params),
                                  sampling_inputs=[BREAKERS] * len(params))


def histories(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    base = torch.randint(0, VOCAB, (n, 20), generator=gen).tolist()
    return [h + h[:12] for h in base]  # repeats, so DRY and no-repeat-ngram fire


def test_uniforms_are_bit_identical() -> None:
    seeds = torch.tensor([0, 1, 2**62, -5, 123456789])
    positions = torch.tensor([0, 7, 3, 100, 2**20])
    assert torch.equal(uniforms(seeds, positions, 2), uniforms(seeds.to(CUDA), positions.to(CUDA), 2).cpu())


def test_chain_matches_cpu() -> None:
    params = batch_params()
    hist = histories(len(params))
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    coins = torch.rand(len(params), generator=torch.Generator().manual_seed(2))
    outs = []
    for device in (CPU, CUDA):
        md = metadata(params, device, hist)
        out = run_chain(apply_pre_chain(logits.to(device).clone(), md), md, coins.to(device))
        outs.append(out.cpu())
    cpu, gpu = outs
    assert (torch.isinf(cpu) != torch.isinf(gpu)).sum() <= 2  # a boundary token may flip in float32
    both = torch.isfinite(cpu) & torch.isfinite(gpu)
    torch.testing.assert_close(gpu[both], cpu[both], rtol=1e-3, atol=1e-3)


def test_sampled_tokens_match_cpu_and_reproduce_alone() -> None:
    params = batch_params()
    hist = histories(len(params))
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    cpu = Sampler()(logits.clone(), metadata(params, CPU, hist)).sampled_token_ids
    gpu = Sampler()(logits.to(CUDA), metadata(params, CUDA, hist)).sampled_token_ids.cpu()
    assert (cpu == gpu).sum() >= len(params) - 1
    for i in (2, 3, 4):
        alone = Sampler()(logits[i:i + 1].to(CUDA), metadata([params[i]], CUDA, [hist[i]])).sampled_token_ids
        assert int(alone[0]) == int(gpu[i])
