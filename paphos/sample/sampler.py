"""Sampler: logits of the sampling rows -> sampled token ids and logprobs (design.md §8).

Pipeline, per row and independent of batch companions (contract §4.1):
  raw logits -> row max / first argmax / logsumexp in one read (fast/rowstats.py; logprobs are
     raw - lse, and greedy-only batches stop here)
  -> fixed pre-chain: allowed ids, grammar mask, logit_bias, id bans / min_tokens / phrase bans
  -> the ordered chain, per group of rows sharing an order (metadata.py), each stage one op under
     ops/ that is the identity for neutral values and runs only when some row of the group uses it;
     from a top-k with a host-known bound on, the chain runs on compacted [R, C] candidates
     (fast/compact.py); a batch-wide (temperature, top-p, min-p) group is one kernel on CUDA,
     row stats and the draw included (fast/dense_tail.py), and elsewhere, with min-p on in every
     sampling row, sorts only min-p's survivors (dense_tail.sample_min_p_head); many orders over few stages run by
     slot (metadata.py); on CUDA a batch with a `fused` plan runs its history stages in one
     kernel (fast/history.py), then one kernel from top-k to the draw, every row in its own
     order (fast/chain.py)
  -> skew -> select: greedy rows take the argmax; the others the exponential race with their own
     counter-based per-token uniforms (fast/race.py); mirostat rows then update their mu.
On CUDA there is no host<->device synchronisation in here: the caller reads the sampled ids back
once (the CPU path's checks on the min-p head read values on the host, where that costs nothing).
`Sampler(fast=False)` is the reference form (full vocabulary, torch ops, same draw).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from paphos.sample import order as st
from paphos.sample.fast import chain as fused_chain
from paphos.sample.fast import compact as fast_compact
from paphos.sample.fast import dense_tail
from paphos.sample.fast import history as fast_history
from paphos.sample.fast.race import race, step_keys
from paphos.sample.fast.rowstats import row_stats
from paphos.sample.metadata import SamplingMetadata, StageGroup
from paphos.sample.ops.dry import apply_dry
from paphos.sample.ops.epsilon_cutoff import apply_epsilon_cutoff
from paphos.sample.ops.eta_cutoff import apply_eta_cutoff
from paphos.sample.ops.logits_processors import (
    apply_allowed_ids,
    apply_logit_bias,
    apply_token_bitmask,
    apply_token_mask,
)
from paphos.sample.ops.min_p import apply_min_p
from paphos.sample.ops.mirostat import apply_mirostat, update_mu
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
from paphos.sample.rng import uniforms

# Uniforms per row per step: 0 = the draw, 1 = the XTC coin.
NUM_DRAWS = 2
logger = logging.getLogger(__name__)
# device -> whether the fused chain kernel gave the unfused fast path's tokens on its first batch
# there (checked once per process and device; a disagreement turns the fused path off there)
_FUSED_AGREES: dict[str, bool] = {}


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [R]
    sampled_logprobs: torch.Tensor  # float32 [R], under the raw distribution
    sampled_ranks: torch.Tensor | None  # int64 [R], 1 = most probable; None when no row asked for logprobs
    # [R, K] when some row asked for logprobs, K = the largest request.
    top_token_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    # float32 [R]: mirostat mu after this step (rows without mirostat: unchanged 0), or None.
    mirostat_mu: torch.Tensor | None = None


@dataclass
class _Group:
    """The view of the metadata one stage sees: the rows of its group."""

    md: SamplingMetadata
    rows: torch.Tensor | None
    coins: torch.Tensor | None

    def col(self, name: str) -> torch.Tensor:
        return self.md.col(name, self.rows)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.rows is None else tensor[self.rows]


def _temperature(logits: torch.Tensor, g: _Group) -> torch.Tensor:
    if not g.md.dynatemp:
        return apply_temperature(logits, g.col("temperature"))
    return apply_temperature(
        logits, g.col("temperature"), g.col("dynatemp_min"), g.col("dynatemp_max"), g.col("dynatemp_exponent")
    )


def _penalties(logits: torch.Tensor, g: _Group) -> torch.Tensor:
    assert g.md.history is not None and g.md.num_output is not None
    return apply_penalties(
        logits, g.take(g.md.history), g.take(g.md.num_output), g.col("repetition_penalty"),
        g.col("repetition_penalty_range").long(), g.col("rep_pen_slope"), g.col("frequency_penalty"),
        g.col("presence_penalty"),
    )


def _dry(logits: torch.Tensor, g: _Group) -> torch.Tensor:
    assert g.md.history is not None and g.md.dry_breakers is not None
    return apply_dry(
        logits, g.take(g.md.history), g.take(g.md.dry_breakers), g.col("dry_multiplier"), g.col("dry_base"),
        g.col("dry_allowed_length"), g.col("dry_range").long(), g.col("dry_max_ngram").long(),
        g.col("dry_max_occurrences").long(), g.col("dry_early_exit_match_len").long(), g.md.dry_max_k,
    )


def _no_repeat_ngram(logits: torch.Tensor, g: _Group) -> torch.Tensor:
    assert g.md.history is not None
    return apply_no_repeat_ngram(logits, g.take(g.md.history), g.col("no_repeat_ngram_size").long(),
                                 g.md.ngram_max_k)


def _xtc(logits: torch.Tensor, g: _Group) -> torch.Tensor:
    assert g.coins is not None
    return apply_xtc(logits, g.col("xtc_threshold"), g.col("xtc_probability"), g.take(g.coins))


def _mirostat(logits: torch.Tensor, g: _Group) -> torch.Tensor:
    assert g.md.mirostat_mu is not None
    return apply_mirostat(logits, g.col("mirostat_mode").long(), g.take(g.md.mirostat_mu), g.md.vocab_size)


_STAGES: dict[str, Callable[[torch.Tensor, _Group], torch.Tensor]] = {
    st.TEMPERATURE: _temperature,
    st.TOP_K: lambda x, g: apply_top_k_top_p(x, g.col("top_k").long(), None),
    st.TOP_P: lambda x, g: apply_top_k_top_p(x, None, g.col("top_p")),
    st.TOP_A: lambda x, g: apply_top_a(x, g.col("top_a")),
    st.MIN_P: lambda x, g: apply_min_p(x, g.col("min_p")),
    st.TFS: lambda x, g: apply_tfs(x, g.col("tfs")),
    st.TYPICAL_P: lambda x, g: apply_typical_p(x, g.col("typical_p")),
    st.ETA: lambda x, g: apply_eta_cutoff(x, g.col("eta")),
    st.EPSILON: lambda x, g: apply_epsilon_cutoff(x, g.col("epsilon")),
    st.TOP_NSIGMA: lambda x, g: apply_top_nsigma(x, g.col("nsigma")),
    st.QUADRATIC: lambda x, g: apply_quadratic(x, g.col("smoothing_factor"), g.col("smoothing_curve")),
    st.PENALTIES: _penalties,
    st.DRY: _dry,
    st.NO_REPEAT_NGRAM: _no_repeat_ngram,
    st.XTC: _xtc,
    st.MIROSTAT: _mirostat,
}


def _chain_group(x: torch.Tensor, md: SamplingMetadata, group: StageGroup, coins: torch.Tensor | None,
                 compact: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One group's chain on its rows x; with `compact`, from top-k on (when the group allows it)
    the chain runs on the [r, C] candidates: returns (values, token ids of the columns or None)."""
    view = _Group(md, group.rows, coins)
    stages = group.stages
    ids = None
    i = 0
    while i < len(stages):
        if (compact and ids is None and stages[i] == st.TOP_K
                and fast_compact.compactable(stages[i + 1:], group.top_k_bound, md.vocab_size)):
            k = view.col("top_k")
            if not md.all_random:
                k = torch.where(view.take(md.greedy_rows), 1.0, k)
            x, ids, _ = fast_compact.compact_top_k(x, k, group.top_k_bound)
            i += 1
            continue
        if ids is None and stages[i] == st.TOP_K and i + 1 < len(stages) and stages[i + 1] == st.TOP_P:
            x = apply_top_k_top_p(x, view.col("top_k").long(), view.col("top_p"))
            i += 2
            continue
        x = _STAGES[stages[i]](x, view)
        i += 1
    return x, ids


def _run_groups(logits: torch.Tensor, md: SamplingMetadata, groups: list[StageGroup], coins: torch.Tensor | None,
                compact: bool) -> torch.Tensor:
    """Each group's chain on its rows (disjoint), results back in [R, V]."""
    for group in groups:
        sub, sub_ids = _chain_group(logits if group.rows is None else logits[group.rows], md, group, coins, compact)
        if sub_ids is not None:
            sub = fast_compact.expand(sub, sub_ids, md.vocab_size)
        if group.rows is None:
            logits = sub
        else:
            logits[group.rows] = sub
    return logits


def run_chain(logits: torch.Tensor, md: SamplingMetadata, coins: torch.Tensor | None) -> torch.Tensor:
    """The ordered chain for every group of rows, on the full vocabulary (the reference form)."""
    return _run_groups(logits, md, md.groups, coins, False)


def apply_pre_chain(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    if md.allowed_rows is not None:
        logits = apply_allowed_ids(logits, md.allowed_pair_rows, md.allowed_rows, md.allowed_ids)
    if md.bitmask is not None and md.bitmask_rows is not None:
        logits = apply_token_bitmask(logits, md.bitmask_rows, md.bitmask)
    if md.bias_rows is not None:
        logits = apply_logit_bias(logits, md.bias_rows, md.bias_token_ids, md.bias_values)
    if md.mask_rows is not None:
        logits = apply_token_mask(logits, md.mask_rows, md.mask_token_ids)
    return logits


class Sampler:
    """`fast=False` runs the reference form: the whole chain on [R, V], torch ops only (same
    algorithm and draw; tests and the benchmark compare the two)."""

    def __init__(self, fast: bool = True) -> None:
        self.fast = fast

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        md = metadata
        if self.fast and dense_tail.applicable(md, logits):
            # one kernel: the raw logsumexp, the chain and the draw (the pre-chain edits a copy)
            work = apply_pre_chain(logits.to(torch.float32, copy=True), md) if md.has_pre_chain else logits
            tail = dense_tail.sample(logits, work, md, NUM_DRAWS)
            return self._output(logits, md, tail.token, tail.logprob, tail.lse, None)
        if self.fast and dense_tail.min_p_head_applicable(md, logits):
            work = apply_pre_chain(logits.to(torch.float32, copy=True), md) if md.has_pre_chain else logits
            sampled = dense_tail.sample_min_p_head(work, md, NUM_DRAWS)
            if sampled is not None:
                _, _, lse = row_stats(logits)
                sampled_raw = logits.gather(1, sampled.unsqueeze(1)).float().squeeze(1)
                return self._output(logits, md, sampled, sampled_raw - lse, lse, None)
        if self.fast:
            amax, argmax, lse = row_stats(logits)
        else:
            raw = logits.float()
            amax, argmax, lse = raw.amax(dim=-1), raw.argmax(dim=-1), raw.logsumexp(dim=-1)
        new_mu = None
        if md.all_greedy and not md.groups and not md.has_pre_chain:
            sampled = argmax
            sampled_raw = amax.unsqueeze(1)
        else:
            work = logits.float()
            work = apply_pre_chain(work.clone() if work is logits else work, md)
            sampled, new_mu = self._select(work, md)
            sampled_raw = logits.gather(1, sampled.unsqueeze(1)).float()
        return self._output(logits, md, sampled, (sampled_raw - lse.unsqueeze(1)).squeeze(1), lse, new_mu)

    @staticmethod
    def _output(logits: torch.Tensor, md: SamplingMetadata, sampled: torch.Tensor, sampled_logprobs: torch.Tensor,
                lse: torch.Tensor, new_mu: torch.Tensor | None) -> SamplerOutput:
        """The output, with ranks and alternatives when some row asked for logprobs."""
        ranks = top_ids = top_lps = None
        if md.max_num_logprobs is not None:
            raw = logits.float()
            ranks = (raw > raw.gather(1, sampled.unsqueeze(1))).sum(dim=-1) + 1
            if md.max_num_logprobs > 0:
                top_raw, top_ids = raw.topk(md.max_num_logprobs, dim=-1)
                top_lps = top_raw - lse.unsqueeze(1)
        return SamplerOutput(sampled, sampled_logprobs, ranks, top_ids, top_lps, new_mu)

    def _select(self, work: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chain, skew and the choice (greedy argmax / race) on the pre-chained logits."""
        if self.fast and not md.all_greedy and fused_chain.applicable(md, work):
            device = str(work.device)
            agrees = _FUSED_AGREES.get(device)
            if agrees:
                return self._fused(work, md), None
            if agrees is None:
                fused = self._fused(work.clone(), md)
                sampled, new_mu = self._unfused(work, md)
                differ = int((fused != sampled).sum())
                # a token on a float32 rounding boundary may move (chain.py); more means a fault
                _FUSED_AGREES[device] = differ <= max(1, sampled.numel() // 100)
                if not _FUSED_AGREES[device]:
                    logger.warning("fused sampler chain disagrees with the ops on %d of %d rows on %s; not used",
                                   differ, sampled.numel(), device)  # fmt: skip
                return sampled, new_mu
        return self._unfused(work, md)

    @staticmethod
    def _fused(work: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        assert md.fused is not None
        if fast_history.applicable(md, work):
            work = fast_history.apply(work, md)
        else:
            work = _run_groups(work, md, md.fused.history, None, False)
        return fused_chain.sample(work, md, NUM_DRAWS)

    def _unfused(self, work: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        step = None if md.all_greedy else step_keys(md.seeds, md.positions, NUM_DRAWS)
        coins = None
        if any(st.XTC in g.stages for g in md.groups):
            coins = uniforms(md.seeds, md.positions, NUM_DRAWS)[:, 1]
        ids = None
        if self.fast and md.slots is not None:
            for entries in md.slots:
                work = _run_groups(work, md, entries, coins, False)
            values = work
        elif len(md.groups) == 1 and md.groups[0].rows is None:
            values, ids = _chain_group(work, md, md.groups[0], coins, self.fast)
        else:
            values = _run_groups(work, md, md.groups, coins, self.fast)
        if md.skew:
            values = apply_skew(values, md.col("skew"))
        if step is None:
            col = values.argmax(dim=-1)
        else:
            col = race(values, step, ids)
            if not md.all_random:
                col = torch.where(md.greedy_rows, values.argmax(dim=-1), col)
        new_mu = None
        if md.mirostat_mu is not None:
            new_mu = update_mu(values, col, md.col("mirostat_mode").long(), md.mirostat_mu,
                               md.col("mirostat_tau"), md.col("mirostat_eta"))
        sampled = col if ids is None else ids.gather(1, col.unsqueeze(1)).squeeze(1)
        return sampled, new_mu
