"""Request fields -> SamplingParams, shared by completions and chat.

Sits between the pydantic request (protocol.py) and the engine. Core fields are mapped by name.
Extended samplers (§4.3) are forwarded to SamplingParams as soon as it has a field of that name;
until then a value that would change sampling is refused with 400 `Sampler 'x' is not available
on this server` (§4.5: an accepted sampler must take effect, never be silently dropped), while
neutral values, which clients such as SillyTavern send all the time, pass.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from paphos.sampling_params import ParamError, SamplingParams
from paphos.server.openai.protocol import SamplerFields

_PARAM_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) - {"extra_eos_token_ids"}

# Extended fields that switch a sampler on, with the value (or values) that leave it off.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "temperature_last": (False,),
    "dynatemp_min": (0.0,),
    "dynatemp_max": (0.0,),
    "top_a": (0.0,),
    "tfs": (1.0,),
    "typical_p": (1.0,),
    "eta_cutoff": (0.0,),
    "epsilon_cutoff": (0.0,),
    "nsigma": (0.0,),
    "smoothing_factor": (0.0,),
    "repetition_penalty": (1.0,),
    "frequency_penalty": (0.0,),
    "presence_penalty": (0.0,),
    "no_repeat_ngram_size": (0,),
    "dry_multiplier": (0.0,),
    "xtc_probability": (0.0,),
    "skew": (0.0,),
    "mirostat_mode": (0,),
    "sampler_priority": ([],),
    "sampler_order": ([],),
    "custom_token_bans": ([],),
    "bad_words": ([],),
    "banned_strings": ([],),
    "ban_eos_token": (False,),
    "allowed_token_ids": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
    "grammar": (),
}

# Extended fields that only tune a sampler switched on above; forwarded when supported, otherwise
# irrelevant (their sampler is off, or the request was refused).
_MODIFIERS = (
    "dynatemp_exponent", "smoothing_curve", "repetition_penalty_range", "rep_pen_slope", "dry_base",
    "dry_allowed_length", "dry_range", "dry_sequence_breakers", "dry_max_ngram", "dry_max_occurrences",
    "dry_early_exit_match_len", "xtc_threshold", "mirostat_tau", "mirostat_eta",
    "banned_strings_case_sensitive", "guided_whitespace_pattern", "guided_decoding_backend",
)


def _not_available(name: str) -> ParamError:
    return ParamError(name, f"Sampler '{name}' is not available on this server")


def _extended_kwargs(req: SamplerFields) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for name, neutral in _NEUTRAL.items():
        value = getattr(req, name)
        if value is None:
            continue
        if name in _PARAM_FIELDS:
            kwargs[name] = value
        elif value not in neutral:
            raise _not_available(name)
    for name in _MODIFIERS:
        value = getattr(req, name)
        if value is not None and name in _PARAM_FIELDS:
            kwargs[name] = value
    fmt = req.response_format
    if fmt is not None and fmt.get("type", "text") != "text":
        if "response_format" not in _PARAM_FIELDS:
            raise _not_available("response_format")
        kwargs["response_format"] = fmt
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
