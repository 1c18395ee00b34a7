"""The sampler's fast paths against the reference forms (paphos/sample/fast/).

Kernels run under the Triton interpreter on CPU tensors (forced, small shapes); compaction and the
race run in torch. Random logits with -inf entries, ties (also a tie group larger than the kernel's
bucket), a single finite token and neutral rows.
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
from paphos.sample.metadata import SamplingMetadata
from paphos.sample.ops.min_p import apply_min_p
from paphos.sample.ops.top_k_top_p import apply_top_k_top_p
from paphos.sample.sampler import Sampler, _chain_group, apply_pre_chain, run_chain
from paphos.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def interpreted() -> Iterator[object]:
    """paphos.sample.fast.kernels and tail_kernels imported under the interpreter (re-imported if
    they were compiled; tail_kernels calls kernels' helpers through the module)."""
    from triton.runtime.interpreter import InterpretedFunction

    names = ("paphos.sample.fast.kernels", "paphos.sample.fast.tail_kernels")
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    modules = [importlib.import_module(name) for name in names]
    reloaded = not isinstance(modules[0]._race_kernel, InterpretedFunction)
    if reloaded:
        modules = [importlib.reload(module) for module in modules]
    if previous is None:
        os.environ.pop("TRITON_INTERPRET")
    else:
        os.environ["TRITON_INTERPRET"] = previous
    yield modules[0]
    if reloaded:
        for name in names:
            importlib.reload(sys.modules[name])


@pytest.fixture
def kernels(interpreted) -> Iterator[object]:
    """The kernels forced on CPU tensors for one test (the others run the torch formulations)."""
    with interpreted.force_kernels():
        yield interpreted


@pytest.fixture
def tail(kernels) -> object:
    """tail_kernels, interpreted, with the kernels forced."""
    return sys.modules["paphos.sample.fast.tail_kernels"]


def logits_cases(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Row 0: -inf entries; row 1: a large tie group at a high value; row 2: one finite token;
    row 3: ties around the top; the rest random."""
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, ::3] = -math.inf
    x[1, 40:140] = x[1].max() - 0.5
    x[2, 1:] = -math.inf
    x[3, 10:20] = x[3].max()
    return x


_interpreted_kernels = None


def test_temperature_division_is_ieee_division(interpreted) -> None:
    """`divide` (a product and one fma correction) gives torch's x / T bit for bit wherever
    2^-100 <= |x| and |x / T| < 2^127: random float32 bit patterns across the whole range,
    logit-sized values, zeros and infinities (benchmarks/sampler_division_check.py covers every
    float32 x on the GPU)."""
    import triton
    import triton.language as tl

    global _interpreted_kernels  # jit functions resolve names through their module's globals
    _interpreted_kernels = interpreted

    @triton.jit
    def divide_kernel(x_ptr, out_ptr, d, n, BLOCK: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + cols, mask=cols < n)
        tl.store(out_ptr + cols, _interpreted_kernels.divide(x, d, tl.math.div_rn(1.0, d)), mask=cols < n)

    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31, (3000,), generator=gen, dtype=torch.int64).to(torch.int32)
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, 1.0, -1.0, 3.4e38, -3.4e38, 1e-45])
    x = torch.cat([bits.view(torch.float32), torch.randn(3000, generator=gen) * 20, special])
    for d in (0.8, 0.7, 1.0, 1.3, 0.33, 2.0, 0.013, 7.25):
        out = torch.empty_like(x)
        divide_kernel[(1,)](x, out, d, x.numel(), BLOCK=8192)
        want = x / torch.tensor(d, dtype=torch.float32)
        same = (out.view(torch.int32) == want.view(torch.int32)) | (out.isnan() & want.isnan())
        # Out of range (|x| < 2^-100: the fma's residual underflows; |x / T| >= 2^127: the product
        # may overflow) the last place may differ.
        in_range = (x.abs() >= 2.0**-100) & (want.abs() < 2.0**127)
        assert bool(same[in_range].all()), (d, x[~same & in_range][:5].tolist())
        tiny = x.abs() < 2.0**-100
        torch.testing.assert_close(out[tiny], want[tiny], rtol=2.0**-22, atol=1e-44)


@pytest.mark.parametrize("block", [None, 64])
def test_row_stats_kernel(kernels, block: int | None) -> None:
    x = logits_cases(6, 700, 0)
    x[5] = -math.inf  # no finite entry: max and logsumexp -inf, argmax 0
    amax, arg, lse = kernels.row_stats(x, block)
    assert torch.equal(amax, x.amax(-1))
    assert torch.equal(arg, x.argmax(-1))
    torch.testing.assert_close(lse, x.logsumexp(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [None, 64])
def test_race_kernel_matches_torch(kernels, block: int | None) -> None:
    from paphos.sample.fast import race as race_mod

    x = logits_cases(6, 700, 1)
    step = race_mod.step_keys(torch.arange(6) * 11, torch.arange(6), 2)
    got = kernels.race(x, step, block)
    with kernels.force_kernels(False):
        want = race_mod.race(x, step)
    assert torch.equal(got, want)
    assert torch.isfinite(x.gather(1, got.unsqueeze(1))).all()


# (seed, cap, block, depth): the bracket gathered and sorted (large cap), or narrowed first (cap
# 16, 4 pivots: the bracket search and the tie path both run); one chunk or many per row, with one
# or several chunks in flight (more than the row holds, too).
@pytest.mark.parametrize(("seed", "cap", "block", "depth"),
                         [(0, 16, 1024, 1), (1, 16, 64, 3), (0, 256, 64, 1), (1, 256, 1024, 2), (0, 256, 32, 4)])
def test_dense_tail_kernel_survivors_tokens_and_logprobs_match_the_ops(kernels, tail, seed: int, cap: int,
                                                                       block: int, depth: int) -> None:
    from paphos.sample.fast import race as race_mod

    rows, vocab = 12, 600
    x = logits_cases(rows, vocab, seed)
    temp = torch.tensor([0.8, 1.0, 1.0, 2.0, 0.5, 1.3, 0.7, 1.0, 1.0, 0.9, 0.8, 1.3])
    top_p = torch.tensor([0.9, 0.5, 0.7, 0.95, 0.3, 0.99, 0.6, 1.0, 1.0, 0.8, 1.0, 1.0])
    # row 7 neutral; row 8 greedy; row 9: min-p far above the top-p bracket; rows 10 and 11 without
    # top-p (min-p alone, temperature alone: drawn in the second pass). Rows 1, 3, 5 and 9 (min-p
    # on) take both branches over the seeds: top-p cutting above the min-p threshold (mass above it
    # >= p, e.g. row 1) and min-p deciding alone (row 5; row 3 at seed 0).
    min_p = torch.tensor([0.0, 0.05, 0.0, 0.01, 0.0, 0.02, 0.0, 0.0, 0.0, 0.9, 0.1, 0.0])
    greedy = torch.zeros(rows, dtype=torch.bool)
    greedy[8] = True
    columns = torch.stack([temp, top_p, min_p, torch.zeros(rows)], dim=1)
    seeds, positions = torch.arange(rows) + 100 * seed, torch.arange(rows)
    got = tail.dense_tail(x, x, columns, (0, 1, 2), seeds, positions, greedy, 2, cap=cap, pivots=4,
                            launch=tail.TailLaunch(block, 4, depth))
    xs = x / temp.unsqueeze(1)
    ref = apply_min_p(apply_top_k_top_p(xs.clone(), None, top_p), min_p)
    ids = torch.arange(vocab)
    kept = (xs > got.last_value[:, None]) | ((xs == got.last_value[:, None]) & (ids <= got.last_id[:, None]))
    kept &= (xs >= xs.amax(-1, keepdim=True) + torch.log(min_p)[:, None]) & torch.isfinite(xs)
    sampling = ~greedy
    assert torch.equal(kept[sampling], torch.isfinite(ref)[sampling])
    with kernels.force_kernels(False):
        want = race_mod.race(ref, race_mod.step_keys(seeds, positions, 2))
    want[greedy] = x[greedy].argmax(-1)
    assert torch.equal(got.token, want)
    torch.testing.assert_close(got.lse, x.logsumexp(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.logprob, x.gather(1, want[:, None])[:, 0] - x.logsumexp(-1), rtol=1e-5,
                               atol=1e-5)


def test_dense_tail_kernel_reads_raw_and_prechained_logits_apart(tail) -> None:
    """With a pre-chain the kernel samples from the edited copy and scores with the raw logits."""
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(3)) * 3
    x[:, 2] = 30.0  # the raw argmax, banned below
    work = x.clone()
    work[:, :5] = -math.inf  # e.g. banned ids
    columns = torch.tensor([[0.9, 0.9, 0.05]] * 4)
    got = tail.dense_tail(x, work, columns, (0, 1, 2), torch.arange(4), torch.zeros(4, dtype=torch.int64),
                             torch.zeros(4, dtype=torch.bool), 2)
    assert (got.token >= 5).all()
    torch.testing.assert_close(got.lse, x.logsumexp(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.logprob, x.gather(1, got.token[:, None])[:, 0] - x.logsumexp(-1))


EVERY = dict(
    temperature=0.9, top_k=20, top_p=0.95, min_p=0.02, top_a=0.05, tfs=0.98, typical_p=0.97, eta_cutoff=2,
    epsilon_cutoff=2, nsigma=3, smoothing_factor=0.2, repetition_penalty=1.1, frequency_penalty=0.1,
    presence_penalty=0.1, no_repeat_ngram_size=3, dry_multiplier=0.5, xtc_probability=0.5, xtc_threshold=0.05,
    skew=0.1, dynatemp_min=0.5, dynatemp_max=1.2, custom_token_bans=[5], logit_bias={7: 2.0},
)
VOCAB = 400  # > top_k + 256: compaction engages
BREAKERS = SamplingInputs(dry_breaker_ids=(0,))  # `build` gives every row these DRY breakers


def mixed_params(n: int) -> list[SamplingParams]:
    params = []
    for i in range(n):
        if i % 5 == 4:
            p = SamplingParams(temperature=0, repetition_penalty=1.2)
        elif i % 5 == 3:
            p = SamplingParams(seed=i, **{**EVERY, "top_k": 1 + i})
        else:
            p = SamplingParams(seed=i, **EVERY)
        params.append(p)
    return params


def histories(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (12,), generator=gen).tolist() * 2 for _ in range(n)]


def build(params: list[SamplingParams], seed: int, hist: list[list[int]] | None = None) -> SamplingMetadata:
    """Every row with `BREAKERS` as its DRY sequence breakers (only DRY rows read them)."""
    hist = hist or histories(len(params), seed)
    return SamplingMetadata.build(params, [p.seed or 0 for p in params], hist, [8] * len(params), 2, VOCAB,
                                  torch.device("cpu"), sampling_inputs=[BREAKERS] * len(params))


@pytest.mark.parametrize("seed", range(3))
def test_compacted_chain_has_the_reference_survivors(seed: int) -> None:
    params = [SamplingParams(seed=i, **EVERY) for i in range(6)]
    md = build(params, seed)
    assert md.groups[0].top_k_bound == 20
    x = logits_cases(6, VOCAB, seed)
    coins = torch.rand(6, generator=torch.Generator().manual_seed(seed))
    dense = run_chain(apply_pre_chain(x.clone(), md), md, coins)
    values, ids = _chain_group(apply_pre_chain(x.clone(), md), md, md.groups[0], coins, True)
    assert ids is not None and values.shape[1] < VOCAB
    assert torch.equal(ids, ids.sort(dim=-1).values)
    from paphos.sample.fast.compact import expand

    full = expand(values, ids, VOCAB)
    assert torch.equal(torch.isinf(full), torch.isinf(dense))
    fin = torch.isfinite(dense)
    torch.testing.assert_close(full[fin], dense[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_fast_sampler_gives_the_reference_tokens(seed: int) -> None:
    params = mixed_params(20)
    md = build(params, seed)
    x = logits_cases(20, VOCAB, seed)
    fast = Sampler()(x.clone(), md)
    ref = Sampler(fast=False)(x.clone(), md)
    assert torch.equal(fast.sampled_token_ids, ref.sampled_token_ids)
    torch.testing.assert_close(fast.sampled_logprobs, ref.sampled_logprobs)


def test_compacted_rows_reproduce_alone_and_in_a_batch() -> None:
    params = mixed_params(12)
    hist = histories(12, 7)
    x = logits_cases(12, VOCAB, 7)
    together = Sampler()(x.clone(), build(params, 7, hist)).sampled_token_ids
    for i in (0, 3, 4, 5):
        alone = Sampler()(x[i:i + 1].clone(), build([params[i]], 7, [hist[i]])).sampled_token_ids
        assert int(alone[0]) == int(together[i])


def test_fused_tail_in_the_sampler_matches_the_reference(kernels) -> None:
    params = [SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05, seed=i) for i in range(5)]
    params += [SamplingParams(temperature=0), SamplingParams(top_p=0.5, seed=9)]
    md = SamplingMetadata.build(params, [p.seed or 0 for p in params], [[1, 2]] * 7, [1] * 7, None, 300,
                                torch.device("cpu"))
    x = logits_cases(7, 300, 3)
    fast = Sampler()(x.clone(), md)  # kernels forced: row stats, fused tail
    with kernels.force_kernels(False):
        ref = Sampler(fast=False)(x.clone(), md)
    assert torch.equal(fast.sampled_token_ids, ref.sampled_token_ids)
    torch.testing.assert_close(fast.sampled_logprobs, ref.sampled_logprobs)


def test_greedy_only_fast_path() -> None:
    x = logits_cases(4, VOCAB, 5).to(torch.bfloat16)
    md = SamplingMetadata.build([SamplingParams(temperature=0)] * 4, [0] * 4, [[1]] * 4, [1] * 4, None, VOCAB,
                                torch.device("cpu"))
    out = Sampler()(x, md)
    assert torch.equal(out.sampled_token_ids, x.float().argmax(-1))
    torch.testing.assert_close(out.sampled_logprobs, x.float().log_softmax(-1).gather(1, out.sampled_token_ids[:, None])
                               .squeeze(1))


def test_rows_with_their_own_orders_run_by_slot_and_match_the_groups() -> None:
    """Every row its own sampler_priority (few stages, many orders): the fast form runs the chain by
    slot, the reference one group per order; same tokens, alone and in the batch."""
    gen = torch.Generator().manual_seed(11)
    params = []
    for i in range(24):
        order = torch.randperm(14, generator=gen).tolist()
        params.append(SamplingParams(seed=i, temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, top_a=0.05,
                                     xtc_probability=0.5, xtc_threshold=0.05, sampler_priority=order))
    params[5] = SamplingParams(temperature=0, repetition_penalty=1.2)
    hist = histories(24, 3)
    md = build(params, 3, hist)
    assert md.slots is not None and len(md.groups) > 10
    assert 2 * sum(len(step) for step in md.slots) <= sum(len(g.stages) for g in md.groups)
    x = logits_cases(24, VOCAB, 3)
    fast = Sampler()(x.clone(), md).sampled_token_ids
    assert torch.equal(fast, Sampler(fast=False)(x.clone(), md).sampled_token_ids)
    for i in (0, 5, 17):
        alone = Sampler()(x[i:i + 1].clone(), build([params[i]], 3, [hist[i]])).sampled_token_ids
        assert int(alone[0]) == int(fast[i])


def test_prefix_stats_kernel(kernels) -> None:
    from paphos.sample.ops.common import entropy

    x = logits_cases(6, 700, 2)
    stats = kernels.prefix_stats(x, 64)
    finite = torch.isfinite(x)
    assert torch.equal(stats[:, 0], finite.sum(-1).float())
    torch.testing.assert_close(stats[:, 1], entropy(x), rtol=1e-5, atol=1e-5)
    std = torch.stack([row[ok].std(unbiased=False) for row, ok in zip(x, finite, strict=True)])
    torch.testing.assert_close(stats[:, 2], std, rtol=1e-5, atol=1e-5)


# Orders the fused chain takes (history stages first): default, temperature last, top-nσ before a
# static temperature, and the set stages after top-k in a custom order.
HISTORY_IDS = [7, 6, 8]
FUSED_ORDERS = (
    {}, {"temperature_last": True},
    {"sampler_priority": [*HISTORY_IDS, 9, 5, 0], "dynatemp_min": 0, "dynatemp_max": 0},
    {"sampler_priority": [*HISTORY_IDS, 5, 0, 13, 3, 4, 1, 2, 12, 9]},
)


def fused_params(n: int) -> list[SamplingParams]:
    """Every sampler on, in the orders above, top_k 1, 3, 5, ...; every fifth row greedy."""
    params = []
    for i in range(n):
        if i % 5 == 4:
            p = SamplingParams(temperature=0, repetition_penalty=1.2)
        else:
            p = SamplingParams(seed=i, **{**EVERY, "top_k": 1 + 2 * i, **FUSED_ORDERS[i % len(FUSED_ORDERS)]})
        params.append(p)
    return params


@pytest.fixture
def narrow(monkeypatch: pytest.MonkeyPatch) -> None:
    """Few candidates per row (k + max(k, 8)): the interpreter's tl.sort is slow on wide rows."""
    from paphos.sample.fast import compact

    monkeypatch.setattr(compact, "MIN_SLACK", 8)


@pytest.fixture
def fused_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused chain taken from the first batch on (past the sampler's first-batch agreement check)."""
    from paphos.sample import sampler

    monkeypatch.setattr(sampler, "_FUSED_AGREES", {"cpu": True})


def test_fused_chain_checks_itself_on_its_first_batch(kernels, narrow, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    from paphos.sample import sampler

    params = fused_params(8)
    x = logits_cases(8, VOCAB, 1)
    monkeypatch.setattr(sampler, "_FUSED_AGREES", {})
    first = Sampler()(x.clone(), build(params, 1)).sampled_token_ids
    assert sampler._FUSED_AGREES == {"cpu": True}  # a correct kernel: used from the next batch
    calls = []

    def broken(work: torch.Tensor, md: object, draws: int) -> torch.Tensor:
        calls.append(1)
        return torch.zeros(work.shape[0], dtype=torch.long)

    monkeypatch.setattr(sampler.fused_chain, "sample", broken)
    monkeypatch.setattr(sampler, "_FUSED_AGREES", {})
    with caplog.at_level("WARNING"):
        again = Sampler()(x.clone(), build(params, 1)).sampled_token_ids
    assert torch.equal(again, first) and sampler._FUSED_AGREES == {"cpu": False}
    assert "disagrees" in caplog.text
    Sampler()(x.clone(), build(params, 1))
    assert len(calls) == 1  # never again on this device


def test_fused_chain_gives_the_reference_tokens(kernels, narrow, fused_on) -> None:
    params = fused_params(8)
    md = build(params, 1)
    assert md.fused is not None and md.fused.prefix_stats
    x = logits_cases(8, VOCAB, 1)
    for _ in range(2):  # two output positions: other draws and XTC coins
        fast = Sampler()(x.clone(), md)
        with kernels.force_kernels(False):
            ref = Sampler(fast=False)(x.clone(), md)
        assert torch.equal(fast.sampled_token_ids, ref.sampled_token_ids)
        md.positions = md.positions + 1


def test_fused_rows_reproduce_alone_and_in_a_batch(kernels, narrow, fused_on) -> None:
    params = fused_params(8)
    hist = histories(8, 5)
    x = logits_cases(8, VOCAB, 5)
    together = Sampler()(x.clone(), build(params, 5, hist)).sampled_token_ids
    for i in (2, 4):
        alone = Sampler()(x[i:i + 1].clone(), build([params[i]], 5, [hist[i]])).sampled_token_ids
        assert int(alone[0]) == int(together[i])


def test_fused_plan_codes_and_refusals() -> None:
    from paphos.sample import order as st
    from paphos.sample.fast.kernels import CHAIN_CODE

    params = fused_params(6)
    md = build(params, 0)
    assert md.fused is not None and md.fused.bound == 11
    for row, p in enumerate(params):
        codes = [c for c in md.fused.codes[row].tolist() if c]
        # Greedy rows run no chain stage; the others all of them (every one enabled), in their order.
        assert codes == ([] if p.is_greedy else [CHAIN_CODE[s] for s in p.order if s in CHAIN_CODE])
    assert {s for g in md.fused.history for s in g.stages} == {st.DRY, st.PENALTIES, st.NO_REPEAT_NGRAM}
    # A truncation before top-k, mirostat, a sampling row without top-k, dynatemp after top-nσ, a
    # history stage after the chain.
    for change in ({"sampler_priority": [*HISTORY_IDS, 1, 0]}, {"mirostat_mode": 2}, {"top_k": 0},
                   {"sampler_priority": [*HISTORY_IDS, 9, 5]}, {"sampler_priority": [0]}):
        assert build([SamplingParams(seed=0, **{**EVERY, **change})], 0).fused is None
