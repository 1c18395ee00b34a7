"""Sampler: logits of the sampling rows -> sampled token ids and logprobs (design.md §8).

Pipeline, per row and independent of batch companions (contract §4.1):
  raw logits -> logprobs of the raw distribution (what `logprobs` reports; raw - logsumexp)
  -> fixed pre-chain: allowed ids, grammar mask, logit_bias, id bans / min_tokens / phrase bans
  -> the ordered chain, per group of rows sharing an order (metadata.py), each stage one op under
     ops/ that is the identity for neutral values and runs only when some row of the group uses it
  -> skew -> select: greedy rows take the argmax; the others draw from softmax with their own
     counter-based uniforms (rng.py); mirostat rows then update their mu.
There is no host<->device synchronisation in here: the caller reads the sampled ids back once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from paphos.sample import order as st
from paphos.sample.metadata import SamplingMetadata
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


def run_chain(logits: torch.Tensor, md: SamplingMetadata, coins: torch.Tensor | None) -> torch.Tensor:
    """The ordered chain for every group of rows; top-k directly followed by top-p share one sort."""
    for group in md.groups:
        view = _Group(md, group.rows, coins)
        sub = logits if group.rows is None else logits[group.rows]
        stages = group.stages
        i = 0
        while i < len(stages):
            if stages[i] == st.TOP_K and i + 1 < len(stages) and stages[i + 1] == st.TOP_P:
                sub = apply_top_k_top_p(sub, view.col("top_k").long(), view.col("top_p"))
                i += 2
                continue
            sub = _STAGES[stages[i]](sub, view)
            i += 1
        if group.rows is None:
            logits = sub
        else:
            logits[group.rows] = sub
    return logits


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


def draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform per row, a cumsum and a binary search per row."""
    cdf = probs.cumsum(dim=-1)
    # right=True: a token of zero probability repeats its predecessor's cdf and is never hit.
    sampled = torch.searchsorted(cdf, uniform.unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1)
    return sampled.clamp_(max=probs.shape[-1] - 1)


class Sampler:
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        md = metadata
        raw = logits.float()
        # The raw distribution's normaliser: logprobs are raw - lse, never a full log_softmax pass.
        lse = raw.logsumexp(dim=-1, keepdim=True)
        new_mu = None
        if md.all_greedy and not md.groups and not md.has_pre_chain:
            sampled = raw.argmax(dim=-1)
        elif md.all_greedy:
            sampled = run_chain(apply_pre_chain(raw.clone(), md), md, None).argmax(dim=-1)
        else:
            u = uniforms(md.seeds, md.positions, NUM_DRAWS)
            logits = run_chain(apply_pre_chain(raw.clone(), md), md, u[:, 1])
            if md.skew:
                logits = apply_skew(logits, md.col("skew"))
            sampled = draw(logits.softmax(dim=-1), u[:, 0])
            if not md.all_random:
                sampled = torch.where(md.greedy_rows, logits.argmax(dim=-1), sampled)
            if md.mirostat_mu is not None:
                new_mu = update_mu(logits, sampled, md.col("mirostat_mode").long(), md.mirostat_mu,
                                   md.col("mirostat_tau"), md.col("mirostat_eta"))
        sampled_raw = raw.gather(1, sampled.unsqueeze(1))
        sampled_logprobs = (sampled_raw - lse).squeeze(1)
        ranks = top_ids = top_lps = None
        if md.max_num_logprobs is not None:
            # Only requests that asked for logprobs read ranks and alternatives.
            ranks = (raw > sampled_raw).sum(dim=-1) + 1
            if md.max_num_logprobs > 0:
                top_raw, top_ids = raw.topk(md.max_num_logprobs, dim=-1)
                top_lps = top_raw - lse
        return SamplerOutput(sampled, sampled_logprobs, ranks, top_ids, top_lps, new_mu)
