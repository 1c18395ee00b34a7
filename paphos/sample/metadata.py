"""SamplingMetadata: the per-row sampling parameters of one step as batched tensors.

Built by the model runner from the `SamplingParams` and token history of the rows that sample this
step, consumed by `Sampler`. Every chain parameter of a row lives in one float32 matrix
`columns` [R, len(COLUMNS)], copied to the device in one transfer; a request's row of values and
its set of enabled stages are computed once per request (`sampler_row`, kept by the runner on
its request state: a serving step must not pay Python work per row per sampler).

Rows are grouped by their resolved order (paphos/sample/order.py); groups whose enabled stages
come out the same are merged, so a batch where every row uses the default order is one group that
pays one pass per stage some row enables, and rows with custom orders pay only for their group.
When many groups share few stages in different orders (every row its own `sampler_priority`),
the chain runs by slot instead (`slots`): step s applies, to the rows whose s-th unit is a given
stage, that stage, so the work grows with the number of distinct (step, stage) pairs (at most
steps x stages) instead of one chain per group.
On CUDA, a batch whose rows all run history stages, then at most temperature and top-nσ, then
top-k, then set stages (the default order, `temperature_last`, ...) gets a `FusedChain` plan: each
row's chain stages as kernel codes in its own order (cached per request), run by one kernel on the
top-k candidates (sample/fast/chain.py), and its history stages as codes for one history kernel
(sample/fast/history.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from paphos.core.protocol import SamplingInputs
from paphos.sample import order as st
from paphos.sample.fast.compact import SET_STAGES, capacity
from paphos.sample.fast.history_kernels import HISTORY_CODE, HISTORY_PARAMS
from paphos.sample.fast.kernels import CHAIN_CODE, CHAIN_MAX_WIDTH, CHAIN_PARAMS
from paphos.sampling_params import SamplingParams

# The chain kernel's parameters first, then the history kernel's (each reads its own at fixed offsets).
COLUMNS = CHAIN_PARAMS + HISTORY_PARAMS + ("mirostat_mode", "mirostat_tau", "mirostat_eta")
COL = {name: i for i, name in enumerate(COLUMNS)}
_NO_INPUTS = SamplingInputs()
HISTORY_STAGES = frozenset({st.PENALTIES, st.DRY, st.NO_REPEAT_NGRAM})
SKEW = "skew"  # runs after the chain, not a chain stage
_CUTOFF_UNIT = 1e-4  # eta/epsilon cutoffs arrive in 1e-4 units (contract §4.4.6)


@dataclass(frozen=True)
class SamplerRow:
    values: tuple[float, ...]
    enabled: frozenset[str]  # chain stages (and "skew") this row changes anything in
    # Its enabled fused-chain stages in its order, as kernel codes, 0-padded to len(CHAIN_STAGES).
    codes: tuple[int, ...]
    # Its enabled history stages in its order, as history kernel codes, 0-padded to len(HISTORY_CODE).
    history_codes: tuple[int, ...]


def sampler_row(p: SamplingParams) -> SamplerRow:
    """Column values and enabled stages of one request; greedy rows neutralise what cannot change
    their argmax (temperature, truncation, XTC, skew, mirostat) but keep penalties, DRY, no-repeat."""
    greedy = p.is_greedy
    dynatemp = not greedy and (p.dynatemp_min > 0 or p.dynatemp_max > 0)
    values = {
        "temperature": 1.0 if greedy else p.temperature,
        "dynatemp_min": p.dynatemp_min if dynatemp else 0.0,
        "dynatemp_max": p.dynatemp_max if dynatemp else 0.0,
        "dynatemp_exponent": p.dynatemp_exponent,
        "top_k": 0 if greedy or p.top_k < 0 else p.top_k,
        "top_p": 1.0 if greedy else p.top_p,
        "top_a": 0.0 if greedy else p.top_a,
        "min_p": 0.0 if greedy else p.min_p,
        "tfs": 1.0 if greedy else p.tfs,
        "typical_p": 1.0 if greedy else p.typical_p,
        "eta": 0.0 if greedy else p.eta_cutoff * _CUTOFF_UNIT,
        "epsilon": 0.0 if greedy else p.epsilon_cutoff * _CUTOFF_UNIT,
        "nsigma": 0.0 if greedy else p.nsigma,
        "smoothing_factor": 0.0 if greedy else p.smoothing_factor,
        "smoothing_curve": p.smoothing_curve,
        "repetition_penalty": p.repetition_penalty,
        "repetition_penalty_range": p.repetition_penalty_range,
        "rep_pen_slope": p.rep_pen_slope,
        "frequency_penalty": p.frequency_penalty,
        "presence_penalty": p.presence_penalty,
        "no_repeat_ngram_size": p.no_repeat_ngram_size,
        "dry_multiplier": p.dry_multiplier,
        "dry_base": p.dry_base,
        "dry_allowed_length": p.dry_allowed_length,
        "dry_range": p.dry_range,
        "dry_max_ngram": p.dry_max_ngram,
        "dry_max_occurrences": p.dry_max_occurrences,
        "dry_early_exit_match_len": p.dry_early_exit_match_len,
        "xtc_threshold": p.xtc_threshold,
        "xtc_probability": 0.0 if greedy else p.xtc_probability,
        "skew": 0.0 if greedy or p.mirostat_mode else p.skew,
        "mirostat_mode": 0 if greedy else p.mirostat_mode,
        "mirostat_tau": p.mirostat_tau,
        "mirostat_eta": p.mirostat_eta,
    }
    v = values
    checks = {
        st.TEMPERATURE: v["temperature"] != 1.0 or dynatemp,
        st.TOP_K: v["top_k"] > 0,
        st.TOP_P: v["top_p"] < 1.0,
        st.TOP_A: v["top_a"] > 0,
        st.MIN_P: v["min_p"] > 0,
        st.TFS: v["tfs"] < 1.0,
        st.TYPICAL_P: v["typical_p"] < 1.0,
        st.ETA: v["eta"] > 0,
        st.EPSILON: v["epsilon"] > 0,
        st.TOP_NSIGMA: v["nsigma"] > 0,
        st.QUADRATIC: v["smoothing_factor"] > 0,
        st.PENALTIES: v["repetition_penalty"] != 1.0 or v["frequency_penalty"] != 0 or v["presence_penalty"] != 0,
        st.NO_REPEAT_NGRAM: v["no_repeat_ngram_size"] > 0,
        st.DRY: v["dry_multiplier"] > 0,
        st.XTC: v["xtc_probability"] > 0,
        st.MIROSTAT: v["mirostat_mode"] > 0,
        SKEW: v["skew"] != 0,
    }
    enabled = frozenset(s for s, on in checks.items() if on)
    codes = tuple(CHAIN_CODE[s] for s in p.order if s in enabled and s in CHAIN_CODE)
    codes += (0,) * (len(CHAIN_CODE) - len(codes))
    history = tuple(HISTORY_CODE[s] for s in p.order if s in enabled and s in HISTORY_CODE)
    history += (0,) * (len(HISTORY_CODE) - len(history))
    return SamplerRow(tuple(float(values[c]) for c in COLUMNS), enabled, codes, history)


@dataclass
class StageGroup:
    stages: tuple[str, ...]  # chain stages to run, in this group's order
    rows: torch.Tensor | None  # int64 row indices; None = every row of the batch
    # Largest top_k of the group's sampling rows when every one of them has top_k > 0, else 0
    # (greedy rows keep only their argmax): bounds the survivors of top-k (sample/fast/compact.py).
    top_k_bound: int = 0


@dataclass
class FusedChain:
    """The batch's chain as one kernel on top-k candidates (sample/fast/chain.py)."""

    history: list[StageGroup]  # the groups' history stages, run first on [R, V] by the torch ops
    codes: torch.Tensor  # int32 [R, S]: each row's chain stages in its order, 0-padded
    # int32 [R, len(HISTORY_CODE)]: each row's history stages in its order, 0-padded (the history
    # kernel, sample/fast/history.py, runs them instead of `history` on CUDA)
    history_codes: torch.Tensor
    bound: int  # largest top_k of the sampling rows (the candidates: compact.capacity(bound, V))
    # Some row runs dynatemp or top-nσ before its top-k: they need full-vocabulary statistics.
    prefix_stats: bool


@dataclass
class SamplingMetadata:
    num_rows: int
    vocab_size: int
    columns: torch.Tensor  # float32 [R, len(COLUMNS)]
    groups: list[StageGroup]
    # Chain by slot (see the module docstring), or None: the groups run one after the other (they
    # always describe the chain, the reference form runs them). Each step lists (unit, rows) with
    # disjoint rows; a unit is one stage or top_k + top_p.
    slots: list[list[StageGroup]] | None
    fused: FusedChain | None  # the fused-kernel plan where the batch allows it (module docstring)
    greedy_rows: torch.Tensor  # bool [R]
    all_greedy: bool
    all_random: bool  # no greedy row
    skew: bool  # some row applies skew after the chain
    dynatemp: bool  # some row uses dynamic temperature (the entropy is computed only then)
    # Counter-based RNG inputs (rng.py): per-row seed and output position being sampled.
    seeds: torch.Tensor  # int64 [R]
    positions: torch.Tensor  # int64 [R]
    # Right-aligned prompt + output ids [R, T] (-1 = none) and output lengths; only when a history
    # stage is enabled. dry_breakers [R, B] (-1 padded); *_max_k: match lengths to look back on.
    history: torch.Tensor | None
    num_output: torch.Tensor | None
    dry_breakers: torch.Tensor | None
    dry_max_k: int
    ngram_max_k: int
    # Mirostat mu per row (rows without mirostat hold 0), when some row uses mirostat.
    mirostat_mu: torch.Tensor | None
    # Pre-chain, sparse: allowed (row, id) pairs of restricted rows; the grammar bitmask of the
    # guided rows; additive bias triples; (row, id) pairs masked to -inf.
    allowed_rows: torch.Tensor | None
    allowed_pair_rows: torch.Tensor | None
    allowed_ids: torch.Tensor | None
    bitmask_rows: torch.Tensor | None
    bitmask: torch.Tensor | None
    bias_rows: torch.Tensor | None
    bias_token_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    mask_rows: torch.Tensor | None
    mask_token_ids: torch.Tensor | None
    # Largest `logprobs` asked by any row (None when no row asks).
    max_num_logprobs: int | None

    @property
    def has_pre_chain(self) -> bool:
        return any(t is not None for t in (self.allowed_rows, self.bitmask, self.bias_rows, self.mask_rows))

    def col(self, name: str, rows: torch.Tensor | None = None) -> torch.Tensor:
        values = self.columns[:, COL[name]]
        return values if rows is None else values[rows]

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        token_ids: Sequence[Sequence[int]],
        num_prompt_tokens: Sequence[int],
        eos_token_id: int | None,
        vocab_size: int,
        device: torch.device,
        mirostat_mu: Sequence[torch.Tensor | None] | None = None,
        position_bans: Sequence[Sequence[int]] | None = None,
        grammar_bitmask: tuple[list[int], torch.Tensor] | None = None,
        sampler_rows: Sequence[SamplerRow] | None = None,
        sampling_inputs: Sequence[SamplingInputs] | None = None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> SamplingMetadata:
        """token_ids: prompt + output of each row (the runner's state); position_bans: ids banned
        at the position each row samples now (phrase-ban rollbacks); grammar_bitmask: (rows, int32
        bitmask [len(rows), ceil(V/32)]) of the guided rows; sampler_rows: each row's
        `sampler_row(params)` when the caller keeps them (computed here otherwise);
        sampling_inputs: each row's tokenizer-derived inputs (DRY breakers, bad words);
        extra_eos_token_ids: the model's end-of-generation ids besides `eos_token_id`."""
        num_rows = len(params)
        rows_info = list(sampler_rows) if sampler_rows is not None else [sampler_row(p) for p in params]
        inputs = list(sampling_inputs) if sampling_inputs is not None else [_NO_INPUTS] * num_rows
        columns = torch.tensor([r.values for r in rows_info], dtype=torch.float32).reshape(num_rows, len(COLUMNS))
        top_k = columns[:, COL["top_k"]]
        columns[:, COL["top_k"]] = torch.where((top_k <= 0) | (top_k >= vocab_size), float(vocab_size), top_k)
        enabled_any = frozenset().union(*(r.enabled for r in rows_info))
        num_output = [len(t) - n for t, n in zip(token_ids, num_prompt_tokens, strict=True)]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        history = out_len = breakers = None
        dry_k = ngram_k = 0
        if enabled_any & HISTORY_STAGES:
            users = [i for i, r in enumerate(rows_info) if r.enabled & HISTORY_STAGES]
            lengths = np.zeros(num_rows, dtype=np.int64)
            lengths[users] = [len(token_ids[i]) for i in users]
            length = max(1, int(lengths.max()))
            # Right-aligned in one C-level copy: row-major order of the mask is the rows' order.
            hist = np.full((num_rows, length), -1, dtype=np.int64)
            hist[np.arange(length) >= (length - lengths)[:, None]] = np.fromiter(
                itertools.chain.from_iterable(token_ids[i] for i in users), dtype=np.int64, count=int(lengths.sum())
            )
            history = torch.from_numpy(hist).to(device)
            out_len = tensor(num_output, torch.int64)
            if st.DRY in enabled_any:
                dry_users = [i for i in users if st.DRY in rows_info[i].enabled]
                dry_k = min(length, max(params[i].dry_max_ngram for i in dry_users))
                width = max(1, max(len(inputs[i].dry_breaker_ids) for i in dry_users))
                brk = np.full((num_rows, width), -1, dtype=np.int64)
                for i in dry_users:
                    ids = inputs[i].dry_breaker_ids
                    brk[i, : len(ids)] = ids
                breakers = torch.from_numpy(brk).to(device)
            if st.NO_REPEAT_NGRAM in enabled_any:
                # A match longer than the history is impossible: cap the look-back there.
                ngram_k = min(length, max(params[i].no_repeat_ngram_size for i in users) - 1)

        mu = None
        if st.MIROSTAT in enabled_any:
            zero = torch.zeros((), device=device)
            given = mirostat_mu or [None] * num_rows
            mu = torch.stack([
                (m if m is not None else zero + 2 * p.mirostat_tau) if p.mirostat_mode else zero
                for p, m in zip(params, given, strict=True)
            ])

        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_vals: list[float] = []
        mask_rows: list[int] = []
        mask_ids: list[int] = []
        allowed_rows: list[int] = []
        pair_rows: list[int] = []
        pair_ids: list[int] = []
        for row, (p, n_out) in enumerate(zip(params, num_output, strict=True)):
            if p.allowed_token_ids:
                allowed_rows.append(row)
                pair_rows.extend([row] * len(p.allowed_token_ids))
                pair_ids.extend(p.allowed_token_ids)
            if p.logit_bias:
                bias_rows.extend([row] * len(p.logit_bias))
                bias_ids.extend(p.logit_bias.keys())
                bias_vals.extend(p.logit_bias.values())
            masked = _masked_ids(p, inputs[row].bad_words_ids, n_out, token_ids[row], eos_token_id,
                                 extra_eos_token_ids)
            if position_bans is not None:
                masked.update(position_bans[row])
            mask_rows.extend([row] * len(masked))
            mask_ids.extend(masked)

        groups, slots, fused = _groups(params, rows_info, num_rows, vocab_size, device)
        greedy = [p.is_greedy for p in params]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        bitmask_rows = bitmask = None
        if grammar_bitmask is not None and grammar_bitmask[0]:
            bitmask_rows = tensor(grammar_bitmask[0], torch.int64)
            bitmask = grammar_bitmask[1].to(device, non_blocking=True)
        return cls(
            num_rows=num_rows,
            vocab_size=vocab_size,
            columns=columns.to(device),
            groups=groups,
            slots=slots,
            fused=fused,
            greedy_rows=tensor(greedy, torch.bool),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            skew=SKEW in enabled_any,
            dynatemp=bool((columns[:, COL["dynatemp_max"]] > 0).any()),
            seeds=tensor(list(seeds), torch.int64),
            positions=tensor(num_output, torch.int64),
            history=history,
            num_output=out_len,
            dry_breakers=breakers,
            dry_max_k=dry_k,
            ngram_max_k=ngram_k,
            mirostat_mu=mu,
            allowed_rows=tensor(allowed_rows, torch.int64) if allowed_rows else None,
            allowed_pair_rows=tensor(pair_rows, torch.int64) if allowed_rows else None,
            allowed_ids=tensor(pair_ids, torch.int64) if allowed_rows else None,
            bitmask_rows=bitmask_rows,
            bitmask=bitmask,
            bias_rows=tensor(bias_rows, torch.int64) if bias_rows else None,
            bias_token_ids=tensor(bias_ids, torch.int64) if bias_rows else None,
            bias_values=tensor(bias_vals, torch.float32) if bias_rows else None,
            mask_rows=tensor(mask_rows, torch.int64) if mask_rows else None,
            mask_token_ids=tensor(mask_ids, torch.int64) if mask_rows else None,
            max_num_logprobs=max(logprobs) if logprobs else None,
        )


def _masked_ids(
    p: SamplingParams, bad_words_ids: Sequence[Sequence[int]], num_output: int, token_ids: Sequence[int],
    eos_token_id: int | None, extra_eos_token_ids: Sequence[int],
) -> set[int]:
    """Ids masked to -inf at this step: bans, EOS bans, stop ids under min_tokens, bad words."""
    masked = set(p.custom_token_bans or ())
    if p.ban_eos_token or num_output < p.min_tokens:
        masked.update(extra_eos_token_ids)
        if eos_token_id is not None:
            masked.add(eos_token_id)
    if num_output < p.min_tokens:
        masked.update(p.stop_token_ids)
    for word in bad_words_ids:
        # The output ends with all but the last token of a bad word: mask that last token.
        prefix = len(word) - 1
        if prefix == 0 or (num_output >= prefix and tuple(token_ids[len(token_ids) - prefix:]) == tuple(word[:-1])):
            masked.add(word[-1])
    return masked


def _units(stages: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The chain's units: top_k directly followed by top_p is one (a single sort serves both)."""
    units: list[tuple[str, ...]] = []
    for stage in stages:
        if stage == st.TOP_P and units and units[-1] == (st.TOP_K,):
            units[-1] = (st.TOP_K, st.TOP_P)
        else:
            units.append((stage,))
    return units


def _fused_plan(
    params: Sequence[SamplingParams], rows_info: Sequence[SamplerRow], by_stages: dict[tuple[str, ...], list[int]],
    bounds: list[int], vocab_size: int,
) -> tuple[int, bool] | None:
    """(largest top_k, prefix stats needed) when every group runs history stages, then a subset of
    (temperature, top-nσ), then top-k with a bound, then set stages only; greedy-only groups may
    stop after the history. None otherwise: the group / slot chains run instead."""
    bound, prefix_stats = 0, False
    for (stages, rows), group_bound in zip(by_stages.items(), bounds, strict=True):
        head = tuple(s for s in stages if s in HISTORY_STAGES)
        rest = stages[len(head):]
        if stages[: len(head)] != head:
            return None
        if not rest:
            if not all(params[i].is_greedy for i in rows):
                return None  # random sampling from the whole vocabulary
            continue
        if group_bound <= 0:
            return None
        cut = rest.index(st.TOP_K)
        before, after = rest[:cut], rest[cut + 1:]
        if not set(before) <= {st.TEMPERATURE, st.TOP_NSIGMA} or not set(after) <= SET_STAGES:
            return None
        dynatemp = any(rows_info[i].values[COL["dynatemp_min"]] > 0 or rows_info[i].values[COL["dynatemp_max"]] > 0
                       for i in rows)
        # Dynatemp after top-nσ would need the entropy of nσ's survivors over the whole vocabulary.
        if dynatemp and before == (st.TOP_NSIGMA, st.TEMPERATURE):
            return None
        prefix_stats |= st.TOP_NSIGMA in before or (dynatemp and st.TEMPERATURE in before)
        bound = max(bound, group_bound)
    width = capacity(bound, vocab_size)
    if bound == 0 or width >= vocab_size or width > CHAIN_MAX_WIDTH:
        return None
    return bound, prefix_stats


def _groups(
    params: Sequence[SamplingParams], rows_info: Sequence[SamplerRow], num_rows: int, vocab_size: int,
    device: torch.device,
) -> tuple[list[StageGroup], list[list[StageGroup]] | None, FusedChain | None]:
    """Rows grouped by order, then merged where the stages they actually run are the same; the
    slot plan when it runs at most half the stage applications of the groups' chains together;
    the fused plan where it applies."""
    by_order: dict[tuple[str, ...], list[int]] = {}
    for i, p in enumerate(params):
        by_order.setdefault(p.order, []).append(i)
    by_stages: dict[tuple[str, ...], list[int]] = {}
    for order, rows in by_order.items():
        enabled = frozenset().union(*(rows_info[i].enabled for i in rows))
        stages = tuple(s for s in order if s in enabled)
        by_stages.setdefault(stages, []).extend(rows)
    by_stages.pop((), None)
    slot_rows: list[dict[tuple[str, ...], list[int]]] = []
    for stages, rows in by_stages.items():
        for step, unit in enumerate(_units(stages)):
            if step == len(slot_rows):
                slot_rows.append({})
            slot_rows[step].setdefault(unit, []).extend(rows)
    use_slots = bool(slot_rows) and 2 * sum(len(step) for step in slot_rows) <= sum(len(_units(s)) for s in by_stages)
    # Every row index list in one host-to-device transfer; the groups' and steps' rows are views.
    lists = [sorted(rows) for rows in by_stages.values() if len(rows) < num_rows]
    if use_slots:
        lists += [sorted(rows) for step in slot_rows for rows in step.values()]
    views = iter(())
    if lists:
        index = torch.tensor([i for rows in lists for i in rows], dtype=torch.int64).to(device)
        views = iter(index.split([len(rows) for rows in lists]))
    top_k = COL["top_k"]
    bounds = []
    for stages, rows in by_stages.items():
        ks = [int(rows_info[i].values[top_k]) for i in rows if not params[i].is_greedy]
        bounds.append(max(ks) if st.TOP_K in stages and ks and min(ks) > 0 else 0)
    groups = [StageGroup(stages, None if len(rows) == num_rows else next(views), bound)
              for stages, bound, rows in zip(by_stages, bounds, by_stages.values(), strict=True)]
    slots = [[StageGroup(unit, next(views)) for unit in step] for step in slot_rows] if use_slots else None
    fused = None
    plan = _fused_plan(params, rows_info, by_stages, bounds, vocab_size) if by_stages else None
    if plan is not None:
        codes = np.array([r.codes for r in rows_info], dtype=np.int32)
        codes = codes[:, : max(1, int((codes != 0).sum(axis=1).max()))]
        history_codes = np.array([r.history_codes for r in rows_info], dtype=np.int32)
        # Both code tables in one transfer, each a contiguous view of it.
        both = torch.from_numpy(np.concatenate([codes.ravel(), history_codes.ravel()])).to(device)
        history = [StageGroup(tuple(s for s in g.stages if s in HISTORY_STAGES), g.rows) for g in groups]
        fused = FusedChain([g for g in history if g.stages], both[: codes.size].view(codes.shape),
                           both[codes.size:].view(history_codes.shape), *plan)
    return groups, slots, fused
