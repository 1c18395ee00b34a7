"""Request bodies of the OpenAI-compatible routes (contract §3, §4.3), as pydantic models.

First stop of a request after the raw JSON: field types, aliases and the contract's input rules
(unknown fields ignored, `null` and the listed empty values mean "not set", numeric strings
accepted) are handled here. Cross-field rules and everything needing the model (vocabulary,
context length) are checked later, in the route modules and `sampling.py`.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any

from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

# Contract §2.4: for these fields "", {}, [] and null all mean "not set".
EMPTY_MEANS_UNSET = frozenset({
    "guided_json", "guided_grammar", "grammar", "json_schema", "banned_strings", "banned_tokens",
    "custom_token_bans", "stop", "logit_bias", "sampler_priority",
})


def _int_from_str(value: Any) -> Any:
    # pydantic's lax mode takes "5" but not "5.0"; clients that stringify floats send the latter.
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {value!r}") from None
        if not number.is_integer():
            raise ValueError(f"expected an integer, got {value!r}")
        return int(number)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_int_from_str)]


def _alias(*names: str) -> Any:
    # The first name is canonical and wins over the aliases when both are sent (§2.4).
    return Field(default=None, validation_alias=AliasChoices(*names))


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_unset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {
            k: v for k, v in data.items()
            if v is not None and not (k in EMPTY_MEANS_UNSET and v in ("", {}, []))
        }


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplerFields(OpenAIModel):
    """Generation fields shared by completions and chat: core samplers, stops, extended samplers."""

    n: Int = 1
    best_of: Int | None = None
    temperature: float | None = _alias("temperature", "temp")
    top_p: float = 1.0
    top_k: Int = 0
    min_p: float = 0.0
    seed: Int | None = _alias("seed", "sampler_seed")
    stop: list[str] | None = None
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: Int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    truncate_prompt_tokens: Int | None = None
    prompt_logprobs: Int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    # Extended samplers (§4.3). `None` = not sent; sampling.py forwards each to SamplingParams.
    temperature_last: bool | None = None
    dynatemp_min: float | None = None
    dynatemp_max: float | None = None
    dynatemp_exponent: float | None = None
    top_a: float | None = None
    tfs: float | None = _alias("tfs", "tfs_z")
    typical_p: float | None = _alias("typical_p", "typical")
    eta_cutoff: float | None = None
    epsilon_cutoff: float | None = _alias("epsilon_cutoff", "eps_cutoff")
    nsigma: float | None = _alias("nsigma", "top_n_sigma")
    smoothing_factor: float | None = None
    smoothing_curve: float | None = None
    repetition_penalty: float | None = _alias("repetition_penalty", "rep_pen", "repeat_penalty")
    repetition_penalty_range: Int | None = _alias("repetition_penalty_range", "rep_pen_range", "repeat_last_n")
    rep_pen_slope: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    no_repeat_ngram_size: Int | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: Int | None = None
    dry_range: Int | None = _alias("dry_range", "dry_penalty_last_n")
    dry_sequence_breakers: list[str] | None = None
    dry_max_ngram: Int | None = None
    dry_max_occurrences: Int | None = None
    dry_early_exit_match_len: Int | None = None
    xtc_threshold: float | None = None
    xtc_probability: float | None = None
    skew: float | None = None
    mirostat_mode: Int | None = _alias("mirostat_mode", "mirostat")
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    sampler_priority: list[Int | str] | None = None
    sampler_order: list[Int | str] | None = None
    custom_token_bans: list[Int] | None = None
    bad_words: list[str] | None = None
    banned_strings: list[str] | None = _alias("banned_strings", "banned_tokens")
    banned_strings_case_sensitive: bool | None = None
    ban_eos_token: bool | None = None
    allowed_token_ids: list[Int] | None = None
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    structured_outputs: dict[str, Any] | None = None
    grammar: str | None = None
    aphrodite_xargs: dict[str, Any] | None = None
    # Beam search (vLLM's fields): not implemented. Read only so that a request asking for it is
    # refused (common.check_generation_fields) instead of silently sampled; the neutral values
    # SillyTavern sends (`early_stopping: false`) pass.
    use_beam_search: bool = False
    length_penalty: float | None = None
    early_stopping: bool | str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("dry_sequence_breakers", mode="before")
    @classmethod
    def _breakers_json(cls, value: Any) -> Any:
        # SillyTavern sends the breaker list as a JSON-encoded string.
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError("must be a list of strings or a JSON string of one") from exc
        return value

    @field_validator("custom_token_bans", mode="before")
    @classmethod
    def _bans_csv(cls, value: Any) -> Any:
        # KoboldCpp-style clients send "12, 34"; newer ones an int array.
        if isinstance(value, str):
            return [p.strip() for p in value.split(",") if p.strip()]
        return value

    @model_validator(mode="before")
    @classmethod
    def _dynatemp_aliases(cls, data: Any) -> Any:
        # Older SillyTavern: dynatemp_low/high only count with dynamic_temperature=true;
        # dynatemp_range r around T. The canonical dynatemp_min/max win.
        if not isinstance(data, dict) or "dynatemp_min" in data or "dynatemp_max" in data:
            return data
        data = dict(data)
        if data.get("dynamic_temperature") in (True, "true", 1) and "dynatemp_low" in data:
            data["dynatemp_min"] = data.get("dynatemp_low")
            data["dynatemp_max"] = data.get("dynatemp_high", data.get("dynatemp_low"))
        elif data.get("dynatemp_range") not in (None, 0, "0", ""):
            try:
                t, r = float(data.get("temperature", data.get("temp", 1.0)) or 1.0), float(data["dynatemp_range"])
            except (TypeError, ValueError):
                return data
            if r > 0:
                if not math.isfinite(t + r):
                    # The sum overflows (or a bound was NaN/inf): a 400 on the range, not an
                    # infinite temperature handed to the sampler.
                    raise ValueError(f"dynatemp_range {r} around temperature {t} is out of range")
                data["dynatemp_min"], data["dynatemp_max"] = max(0.0, t - r), t + r
        return data


_PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"


def _token_ids(value: list[Any]) -> list[int] | None:
    ids = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int):
            return None
        ids.append(item)
    return ids


def _prompt_shape(value: Any) -> str | list[str] | list[int] | list[list[int]]:
    # One readable error instead of one per member of a four-way union.
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if all(isinstance(v, str) for v in value):
            return value
        ids = _token_ids(value)
        if ids is not None:
            return ids
        if all(isinstance(v, list) for v in value):
            nested = [_token_ids(v) for v in value]
            if all(n is not None for n in nested):
                return nested  # type: ignore[return-value]
    raise ValueError(f"prompt must be {_PROMPT_SHAPES}")


class CompletionRequest(SamplerFields):
    model: str | None = None
    prompt: Annotated[str | list[str] | list[int] | list[list[int]], BeforeValidator(_prompt_shape)]
    max_tokens: Int = 16
    echo: bool = False
    suffix: str | None = None
    logprobs: Int | None = None
    add_special_tokens: bool = True
    user: str | None = None


class ChatMessage(BaseModel):
    # Extra keys (tool_calls, reasoning_content, ...) are kept: chat templates may read them.
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        # OpenAI's rule: every message needs content except an assistant message that carries
        # tool calls (or the legacy function_call). Without it a template renders an empty turn.
        if self.content is not None:
            return self
        extra = self.model_extra or {}
        if self.role == "assistant" and (extra.get("tool_calls") or extra.get("function_call")):
            return self
        raise ValueError(
            f"content is required for a {self.role!r} message (only an assistant message with tool_calls may omit it)"
        )


class ChatCompletionRequest(SamplerFields):
    model: str | None = None
    messages: list[ChatMessage]
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # Default depends on the form: true for prompt, false for messages (§3.4).
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[Int]


class LoRALoadRequest(OpenAIModel):
    """POST /v1/lora/load (Aphrodite 0.6 spelling, §3.6)."""

    name: str
    # A local directory or a Hugging Face repo id.
    path: str
    # The parent /v1/models lists; by default the first served name.
    base_model_name: str | None = None


class LoadLoRAAdapterRequest(OpenAIModel):
    """POST /v1/load_lora_adapter (vLLM / Aphrodite 0.2x spelling, §3.6)."""

    lora_name: str
    lora_path: str
    # Replace an adapter already loaded under the name (running requests keep the old one).
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(OpenAIModel):
    """POST /v1/unload_lora_adapter (§3.6)."""

    lora_name: str
