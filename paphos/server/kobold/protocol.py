"""Kobold request bodies (contract §5) and their translation into the OpenAI request model.

First stop of a Kobold request after the raw JSON. Kobold-only fields (memory, lengths, genkey,
images, lora, logprobs, quiet) are read into `KoboldGenerateRequest`. Every sampler and stop field
is renamed to its OpenAI/contract name through the one table `KOBOLD_TO_OPENAI` and validated by the
same `CompletionRequest` model as `/v1/completions`, so both APIs share parsing, the "not available
on this server" rule and the SamplingParams builder (`openai/sampling.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import TypeAdapter, ValidationError, create_model

from paphos.server.errors import bad_request
from paphos.server.openai.protocol import CompletionRequest, Int, OpenAIModel, SamplerFields


class KoboldGenerateRequest(OpenAIModel):
    """The fields of `POST /api/v1/generate` that are not samplers (§5.1)."""

    prompt: str
    memory: str = ""
    max_context_length: Int | None = None
    max_length: Int | None = None
    genkey: str | None = None
    n: Int = 1
    images: list[str] | None = None
    lora: str | None = None
    # KoboldCpp: true asks for the sampled token's logprob and alternatives (read back through
    # /api/extra/last_logprobs); an integer sets how many alternatives.
    logprobs: bool | Int = False
    use_default_badwordsids: bool = False
    quiet: bool = False


class TextRequest(OpenAIModel):
    """tokencount / tokenize: `{"prompt": text}`."""

    prompt: str


class IdsRequest(OpenAIModel):
    """detokenize: `{"ids": [int]}`."""

    ids: list[Int]


class GenkeyRequest(OpenAIModel):
    """check / abort / last_logprobs: an optional `genkey`."""

    genkey: str | None = None


def _same(_: str, value: Any) -> Any:
    return value


def _negated(name: str, value: Any) -> bool:
    try:
        return not TypeAdapter(bool).validate_python(value)
    except ValidationError:
        raise bad_request(f"{name} must be a boolean, got {value!r}", name) from None


# Kobold field -> (OpenAI/contract field, conversion). Fields not listed keep their name
# (temperature, top_k, top_p, top_a, min_p, tfs, presence_penalty, rep_pen_slope, dynatemp_*,
# smoothing_*, xtc_*, nsigma, dry_*, mirostat_tau/eta, sampler_order, custom_token_bans,
# logit_bias, grammar, ban_eos_token) and are validated under it.
KOBOLD_TO_OPENAI: dict[str, tuple[str, Callable[[str, Any], Any]]] = {
    "stop_sequence": ("stop", _same),
    "sampler_seed": ("seed", _same),
    "rep_pen": ("repetition_penalty", _same),
    "rep_pen_range": ("repetition_penalty_range", _same),
    "typical": ("typical_p", _same),
    "eps_cutoff": ("epsilon_cutoff", _same),
    "mirostat": ("mirostat_mode", _same),
    "dry_penalty_last_n": ("dry_range", _same),
    "banned_tokens": ("banned_strings", _same),
    "bypass_eos": ("ignore_eos", _same),
    "trim_stop": ("include_stop_str_in_output", _negated),
    "render_special": ("skip_special_tokens", _negated),
}

# Read by KoboldGenerateRequest, or fields of CompletionRequest that the Kobold route sets itself.
_NOT_SAMPLERS = frozenset(KoboldGenerateRequest.model_fields) | {
    "max_tokens", "echo", "suffix", "stream", "stream_options", "best_of", "add_special_tokens", "model",
    "truncate_prompt_tokens", "prompt_logprobs", "user",
}


# The generate body as the OpenAPI document describes it (openapi.py): the Kobold fields plus every
# sampler under its canonical name. Documentation only; requests are parsed as described above.
KoboldGenerateBody = create_model(
    "KoboldGenerateBody",
    __base__=KoboldGenerateRequest,
    __doc__="POST /api/v1/generate and /api/extra/generate/stream (contract §5.1): Kobold fields and samplers.",
    **{name: (field.annotation, field) for name, field in SamplerFields.model_fields.items()
       if name not in _NOT_SAMPLERS},  # type: ignore[call-overload]
)


def to_completion_request(
    raw: dict[str, Any], prompt_ids: list[int], *, max_tokens: int, n: int, logprobs: int | None
) -> CompletionRequest:
    """Kobold body -> CompletionRequest over already tokenized input; OpenAI names win over Kobold ones."""
    fields = {k: v for k, v in raw.items() if k not in _NOT_SAMPLERS and k not in KOBOLD_TO_OPENAI}
    for name, (target, convert) in KOBOLD_TO_OPENAI.items():
        if raw.get(name) is not None and target not in fields:
            fields[target] = convert(name, raw[name])
    fields.update(prompt=prompt_ids, max_tokens=max_tokens, n=n, logprobs=logprobs)
    return CompletionRequest.model_validate(fields)
