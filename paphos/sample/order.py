"""Sampler order: which chain stages a request runs, in which order (contract §4.2).

Torch-free: `SamplingParams` resolves its order here once, at validation (so a bad
`sampler_priority` is a 400 naming the field), and `SamplingMetadata` groups the rows of a step by
the resolved order. The chain runs internal stages, finer than the contract's 14 ids because
KoboldCpp splits top-k from top-p and puts smoothing right after temperature:

    contract id -> internal stages        KoboldCpp id -> internal stages
    0 top_p_top_k -> top_k, top_p          0 -> top_k        4 -> typical_p
    5 temperature -> temperature           1 -> top_a        5 -> temperature, quadratic
    (every other id -> one stage)          2 -> top_p, min_p 6 -> penalties
                                           3 -> tfs

Rules (stated in the report and in the contract):
- default order `[7,6,8,5,9,0,1,2,3,10,11,4,12,13]`; `temperature_last` moves temperature last;
- `sampler_priority` (ids and/or names, case-insensitive, synonyms allowed): listed stages first in
  the given order, every unlisted stage after them in default relative order; never drops a stage;
  it beats `temperature_last`;
- `sampler_order` of at most 7 integers in 0..6: KoboldCpp semantics: DRY and no-repeat-ngram
  first, then the listed blocks in order (absent blocks are skipped, as in KoboldCpp), then top-nσ,
  η, ε and XTC; any other `sampler_order` is read as `sampler_priority`;
  `sampler_priority` wins when both are sent;
- mirostat requests run `dry, penalties, no_repeat_ngram, temperature` then the mirostat
  selection; every other truncation stage, XTC and skew are skipped for that request only.
"""

from __future__ import annotations

from collections.abc import Sequence

# Internal stage names, the unit the chain dispatches on.
TOP_K, TOP_P, TOP_A, MIN_P, TFS, TYPICAL_P = "top_k", "top_p", "top_a", "min_p", "tfs", "typical_p"
TEMPERATURE, PENALTIES, DRY, NO_REPEAT_NGRAM = "temperature", "penalties", "dry", "no_repeat_ngram"
TOP_NSIGMA, ETA, EPSILON, QUADRATIC, XTC = "top_nsigma", "eta_cutoff", "epsilon_cutoff", "quadratic", "xtc"
MIROSTAT = "mirostat"

# Contract §4.2 ids -> internal stages.
CONTRACT_STAGES: dict[int, tuple[str, ...]] = {
    0: (TOP_K, TOP_P), 1: (TOP_A,), 2: (MIN_P,), 3: (TFS,), 4: (TYPICAL_P,), 5: (TEMPERATURE,),
    6: (PENALTIES,), 7: (DRY,), 8: (NO_REPEAT_NGRAM,), 9: (TOP_NSIGMA,), 10: (ETA,), 11: (EPSILON,),
    12: (QUADRATIC,), 13: (XTC,),
}
# Names (case-insensitive) and synonyms -> contract id.
STAGE_NAMES: dict[str, int] = {
    "top_p_top_k": 0, "top_k": 0, "top_p": 0, "top_a": 1, "min_p": 2, "tfs": 3, "typical_p": 4,
    "typical": 4, "temperature": 5, "temp": 5, "dynatemp": 5, "penalties": 6, "rep_pen": 6,
    "repetition_penalty": 6, "dry": 7, "no_repeat_ngram": 8, "top_nsigma": 9, "nsigma": 9,
    "eta_cutoff": 10, "epsilon_cutoff": 11, "quadratic": 12, "smoothing": 12, "xtc": 13,
}
DEFAULT_IDS = (7, 6, 8, 5, 9, 0, 1, 2, 3, 10, 11, 4, 12, 13)
KOBOLD_STAGES: dict[int, tuple[str, ...]] = {
    0: (TOP_K,), 1: (TOP_A,), 2: (TOP_P, MIN_P), 3: (TFS,), 4: (TYPICAL_P,), 5: (TEMPERATURE, QUADRATIC),
    6: (PENALTIES,),
}
_KOBOLD_BEFORE = (DRY, NO_REPEAT_NGRAM)
_KOBOLD_AFTER = (TOP_NSIGMA, ETA, EPSILON, XTC)
MIROSTAT_ORDER = (DRY, PENALTIES, NO_REPEAT_NGRAM, TEMPERATURE, MIROSTAT)


def _flatten(ids: Sequence[int]) -> tuple[str, ...]:
    return tuple(stage for i in ids for stage in CONTRACT_STAGES[i])


DEFAULT_ORDER = _flatten(DEFAULT_IDS)
TEMPERATURE_LAST_ORDER = tuple(s for s in DEFAULT_ORDER if s != TEMPERATURE) + (TEMPERATURE,)


class OrderError(ValueError):
    """An invalid order list; `param` names the field it came from."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _stage_id(entry: int | str, param: str) -> int:
    if isinstance(entry, bool):
        entry = str(entry)
    if isinstance(entry, int) and entry in CONTRACT_STAGES:
        return entry
    if isinstance(entry, str):
        text = entry.strip().lower()
        if text.lstrip("-").isdigit() and int(text) in CONTRACT_STAGES:
            return int(text)
        if text in STAGE_NAMES:
            return STAGE_NAMES[text]
    names = ", ".join(sorted(STAGE_NAMES))
    raise OrderError(param, f"Invalid sampler name '{entry}'. Must be one of: {names} (or an id 0-13)")


def priority_order(priority: Sequence[int | str], param: str = "sampler_priority") -> tuple[str, ...]:
    """Listed stages first, in the given order; the rest after them in default relative order."""
    ids: list[int] = []
    for entry in priority:
        stage = _stage_id(entry, param)
        if stage in ids:
            raise OrderError(param, f"Duplicate sampler '{entry}' in {param}")
        ids.append(stage)
    ids += [i for i in DEFAULT_IDS if i not in ids]
    return _flatten(ids)


def is_kobold_order(order: Sequence[int | str]) -> bool:
    return len(order) <= 7 and all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= 6 for x in order
    )


def kobold_order(order: Sequence[int]) -> tuple[str, ...]:
    if len(set(order)) != len(order):
        raise OrderError("sampler_order", f"Duplicate sampler in sampler_order {list(order)}")
    return _KOBOLD_BEFORE + tuple(s for i in order for s in KOBOLD_STAGES[i]) + _KOBOLD_AFTER


def resolve_order(
    sampler_priority: Sequence[int | str] | None,
    sampler_order: Sequence[int | str] | None,
    temperature_last: bool,
    mirostat: bool,
) -> tuple[str, ...]:
    """The internal stages one request runs, in order (see the module docstring for the rule)."""
    if mirostat:
        return MIROSTAT_ORDER
    if sampler_priority:
        return priority_order(sampler_priority)
    if sampler_order:
        if is_kobold_order(sampler_order):
            return kobold_order([int(x) for x in sampler_order])
        return priority_order(sampler_order, "sampler_order")
    return TEMPERATURE_LAST_ORDER if temperature_last else DEFAULT_ORDER
