"""Request fields -> SamplingParams, shared by completions and chat.

Sits between the pydantic request (protocol.py) and the engine. Every sampler field of the contract
(§4.3) is forwarded under its canonical name; SamplingParams validates ranges and raises
`ParamError` naming the field (-> 400). The spellings that only exist on the wire are resolved
here: `grammar` (GBNF) and `structured_outputs` (the 0.2x form) become the `guided_*` fields, and
`aphrodite_xargs.banned_strings(_case_sensitive)` fills the phrase bans when the top-level fields
are absent.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import TypeAdapter, ValidationError

from paphos.sampling_params import ParamError, SamplingParams
from paphos.server.openai.protocol import SamplerFields

# Fields copied by name when sent (None = not sent).
_EXTENDED = (
    "temperature_last", "dynatemp_min", "dynatemp_max", "dynatemp_exponent", "top_a", "tfs", "typical_p",
    "eta_cutoff", "epsilon_cutoff", "nsigma", "smoothing_factor", "smoothing_curve", "repetition_penalty",
    "repetition_penalty_range", "rep_pen_slope", "frequency_penalty", "presence_penalty", "no_repeat_ngram_size",
    "dry_multiplier", "dry_base", "dry_allowed_length", "dry_range", "dry_sequence_breakers", "dry_max_ngram",
    "dry_max_occurrences", "dry_early_exit_match_len", "xtc_threshold", "xtc_probability", "skew",
    "mirostat_mode", "mirostat_tau", "mirostat_eta", "sampler_priority", "sampler_order", "custom_token_bans",
    "bad_words", "banned_strings", "banned_strings_case_sensitive", "ban_eos_token", "allowed_token_ids",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_whitespace_pattern",
    "response_format",
)
_PARAM_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
assert set(_EXTENDED) <= _PARAM_FIELDS
# structured_outputs keys -> guided fields.
_STRUCTURED = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}
# The types the guided_* fields have in protocol.py: structured_outputs and aphrodite_xargs are free
# objects, so their members are checked here before they reach SamplingParams.
_TYPES: dict[str, TypeAdapter[Any]] = {
    "guided_json": TypeAdapter(dict[str, Any] | str), "guided_regex": TypeAdapter(str),
    "guided_choice": TypeAdapter(list[str]), "guided_grammar": TypeAdapter(str),
    "banned_strings": TypeAdapter(list[str]), "banned_strings_case_sensitive": TypeAdapter(bool),
}


def _typed(field: str, target: str, value: Any) -> Any:
    try:
        return _TYPES[target].validate_python(value)
    except ValidationError:
        expected = {"guided_json": "an object or a string", "guided_choice": "a list of strings",
                    "banned_strings": "a list of strings", "banned_strings_case_sensitive": "a boolean"}
        raise ParamError(field, f"{field} must be {expected.get(target, 'a string')}, got {value!r:.80}") from None


def _extended_kwargs(req: SamplerFields) -> dict[str, Any]:
    kwargs = {name: getattr(req, name) for name in _EXTENDED if getattr(req, name) is not None}
    if req.grammar and "guided_grammar" not in kwargs:
        kwargs["guided_grammar"] = req.grammar
    for key, value in (req.structured_outputs or {}).items():
        if value in (None, "", {}, [], False):
            continue
        if key == "json_object":
            kwargs.setdefault("response_format", {"type": "json_object"})
        elif key in _STRUCTURED:
            kwargs.setdefault(_STRUCTURED[key], _typed(f"structured_outputs.{key}", _STRUCTURED[key], value))
        else:
            raise ParamError("structured_outputs", f"unknown structured_outputs key {key!r}")
    xargs = req.aphrodite_xargs or {}
    if "banned_strings" not in kwargs and xargs.get("banned_strings") not in (None, "", [], {}):
        kwargs["banned_strings"] = _typed("aphrodite_xargs.banned_strings", "banned_strings", xargs["banned_strings"])
    if "banned_strings_case_sensitive" not in kwargs and xargs.get("banned_strings_case_sensitive") is not None:
        kwargs["banned_strings_case_sensitive"] = _typed(
            "aphrodite_xargs.banned_strings_case_sensitive", "banned_strings_case_sensitive",
            xargs["banned_strings_case_sensitive"],
        )
    return kwargs


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    if not raw:
        return None
    bias: dict[int, float] = {}
    for key, value in raw.items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise ParamError("logit_bias", f"logit_bias keys must be token ids, got {key!r}") from None
    return bias


def build_sampling_params(
    req: SamplerFields,
    *,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The route computes max_tokens and the logprobs count (their defaults differ per route)."""
    temperature = 1.0 if req.temperature is None else req.temperature
    return SamplingParams(
        n=req.n,
        best_of=req.best_of,
        temperature=temperature,
        top_k=req.top_k,  # 0 and -1 both mean off; SamplingParams accepts both
        top_p=req.top_p,
        min_p=req.min_p,
        seed=req.seed,
        logit_bias=_logit_bias(req.logit_bias),
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        stop=list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []),
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        **_extended_kwargs(req),
    )
