"""SamplingParams: what one request asks of the sampler and of stop handling.

Built by the HTTP layer (or by the user of `paphos.LLM`) and validated here, once; the engine
trusts it afterwards. Field names and defaults follow the Aphrodite contract
(`docs/api.md` §3-§4); the client spellings SillyTavern sends (seed -1,
`custom_token_bans` as a comma string, `dry_sequence_breakers` as a JSON string) are accepted here
too, so every API front end can pass them through. A violation raises `ParamError` naming the
field, which the server turns into a 400 with `param` set.

It is never written to after validation: what the engine derives from it per request (token ids
of DRY breakers and bad words, the compiled grammar, phrase-ban rollback state) lives on the
engine's `Request` (paphos/request.py), so one params object can serve many requests.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from paphos.sample.order import OrderError, resolve_order

GREEDY_TEMPERATURE = 1e-5
MIN_SAMPLING_TEMPERATURE = 0.01
DEFAULT_DRY_BREAKERS = ("\n", ":", '"', "*")
MAX_BANNED_STRINGS = 2048
MAX_BANNED_STRING_CHARS = 256
MAX_DRY_BREAKERS = 64
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "response_format")


class ParamError(ValueError):
    """A request parameter is invalid; `param` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _is_empty(value: Any) -> bool:
    return value is None or value in ("", {}, [])


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    # Temperature and dynamic temperature (§4.4.1).
    temperature: float = 1.0
    dynatemp_min: float = 0.0
    dynatemp_max: float = 0.0
    dynatemp_exponent: float = 1.0
    temperature_last: bool = False
    # Truncation (§4.4.2-§4.4.9).
    top_k: int = 0
    top_p: float = 1.0
    top_a: float = 0.0
    min_p: float = 0.0
    tfs: float = 1.0
    typical_p: float = 1.0
    eta_cutoff: float = 0.0  # unit 1e-4
    epsilon_cutoff: float = 0.0  # unit 1e-4
    nsigma: float = 0.0
    smoothing_factor: float = 0.0
    smoothing_curve: float = 1.0
    # Penalties (§4.4.13-15).
    repetition_penalty: float = 1.0
    repetition_penalty_range: int = 0
    rep_pen_slope: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    no_repeat_ngram_size: int = 0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_range: int = 0
    dry_sequence_breakers: list[str] | str = field(default_factory=lambda: list(DEFAULT_DRY_BREAKERS))
    dry_max_ngram: int = 50
    dry_max_occurrences: int = 0
    dry_early_exit_match_len: int = 0
    # XTC, skew, mirostat (§4.4.10, 11, 16).
    xtc_threshold: float = 0.1
    xtc_probability: float = 0.0
    skew: float = 0.0
    mirostat_mode: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    # Order (§4.2).
    sampler_priority: list[int | str] | None = None
    sampler_order: list[int | str] | None = None
    seed: int | None = None
    # Pre-chain: bias, allowed ids, bans (§4.1, §4.4.12).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    custom_token_bans: list[int] | str | None = None
    bad_words: list[str] | None = None
    banned_strings: list[str] | None = None
    banned_strings_case_sensitive: bool = False
    ban_eos_token: bool = False
    # Guided decoding: at most one of these (empty values mean not set).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    response_format: dict[str, Any] | None = None
    # Length and stops.
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Derived: the internal chain stages this request runs, in order (paphos/sample/order.py).
    order: tuple[str, ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.seed is not None and self.seed == -1:
            self.seed = None
        if self.best_of is None:
            self.best_of = self.n
        if self.logit_bias:
            self.logit_bias = {int(k): max(-100.0, min(100.0, float(v))) for k, v in self.logit_bias.items()}
        if 0 < self.temperature < MIN_SAMPLING_TEMPERATURE and self.temperature >= GREEDY_TEMPERATURE:
            self.temperature = MIN_SAMPLING_TEMPERATURE
        self._normalise_client_forms()
        self._validate()
        self._validate_extended()
        try:
            self.order = resolve_order(
                self.sampler_priority, self.sampler_order, self.temperature_last, self.mirostat_mode > 0
            )
        except OrderError as exc:
            raise ParamError(exc.param, str(exc)) from None

    def _normalise_client_forms(self) -> None:
        if isinstance(self.custom_token_bans, str):
            try:
                self.custom_token_bans = [int(p) for p in self.custom_token_bans.split(",") if p.strip()]
            except ValueError:
                raise ParamError(
                    "custom_token_bans", "custom_token_bans must be token ids, as a list or a comma-separated string"
                ) from None
        if isinstance(self.dry_sequence_breakers, str):
            try:
                breakers = json.loads(self.dry_sequence_breakers)
            except json.JSONDecodeError:
                breakers = None
            if not isinstance(breakers, list) or not all(isinstance(b, str) for b in breakers):
                raise ParamError(
                    "dry_sequence_breakers", "dry_sequence_breakers must be a list of strings or a JSON string of one"
                )
            self.dry_sequence_breakers = breakers
        if isinstance(self.guided_json, str) and self.guided_json.strip():
            try:
                self.guided_json = json.loads(self.guided_json)
            except json.JSONDecodeError as exc:
                raise ParamError("guided_json", f"guided_json is not valid JSON: {exc}") from None
        for name in ("custom_token_bans", "bad_words", "banned_strings", "allowed_token_ids", "sampler_priority",
                     "sampler_order", *GUIDED_FIELDS):
            if _is_empty(getattr(self, name)):
                setattr(self, name, None)
        if self.response_format is not None and self.response_format.get("type", "text") == "text":
            self.response_format = None

    def _validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ParamError("n", f"n must be at least 1, got {self.n}")
        if self.best_of < self.n:
            raise ParamError("best_of", f"best_of must be >= n, got best_of={self.best_of}, n={self.n}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ParamError("temperature", f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < -1:
            raise ParamError("top_k", f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ParamError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ParamError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ParamError("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError(
                "min_tokens", f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}"
            )
        if any(not s for s in self.stop):
            raise ParamError("stop", "stop strings must not be empty")
        if self.logprobs is not None and self.logprobs < 0:
            raise ParamError("logprobs", f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ParamError("prompt_logprobs", f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        if self.is_greedy and self.best_of > 1:
            raise ParamError("n", "n and best_of must be 1 under greedy sampling (temperature 0)")

    def _validate_extended(self) -> None:
        def check(name: str, ok: bool, rule: str) -> None:
            value = getattr(self, name)
            if not ok or (isinstance(value, float) and math.isnan(value)):
                raise ParamError(name, f"{name} must be {rule}, got {value}")

        check("dynatemp_min", self.dynatemp_min >= 0, ">= 0")
        check("dynatemp_max", self.dynatemp_max >= self.dynatemp_min, ">= dynatemp_min")
        check("dynatemp_exponent", self.dynatemp_exponent > 0, "> 0")
        check("top_a", self.top_a >= 0, ">= 0")
        check("tfs", 0 < self.tfs <= 1, "in (0, 1]")
        check("typical_p", 0 < self.typical_p <= 1, "in (0, 1]")
        check("eta_cutoff", self.eta_cutoff >= 0, ">= 0 (unit 1e-4)")
        check("epsilon_cutoff", 0 <= self.epsilon_cutoff <= 10000, "in [0, 10000] (unit 1e-4)")
        check("nsigma", self.nsigma >= 0, ">= 0")
        check("smoothing_factor", self.smoothing_factor >= 0, ">= 0")
        check("smoothing_curve", self.smoothing_curve >= 1, ">= 1")
        check("repetition_penalty", math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
              "a finite number > 0")
        check("repetition_penalty_range", self.repetition_penalty_range >= -1, ">= -1")
        check("rep_pen_slope", 0 <= self.rep_pen_slope <= 1, "in [0, 1]")
        check("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]")
        check("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]")
        check("no_repeat_ngram_size", self.no_repeat_ngram_size >= 0, ">= 0")
        check("dry_multiplier", self.dry_multiplier >= 0, ">= 0")
        check("dry_base", self.dry_multiplier == 0 or self.dry_base > 1, "> 1")
        check("dry_allowed_length", self.dry_allowed_length >= 1, ">= 1")
        check("dry_range", self.dry_range >= -1, ">= -1")
        check("dry_sequence_breakers", len(self.dry_sequence_breakers) <= MAX_DRY_BREAKERS,
              f"at most {MAX_DRY_BREAKERS} strings")
        check("dry_max_ngram", self.dry_max_ngram >= 1, ">= 1")
        check("dry_max_occurrences", self.dry_max_occurrences >= 0, ">= 0")
        check("dry_early_exit_match_len", self.dry_early_exit_match_len >= 0, ">= 0")
        check("xtc_threshold", 0 <= self.xtc_threshold <= 1, "in [0, 1]")
        check("xtc_probability", 0 <= self.xtc_probability <= 1, "in [0, 1]")
        check("skew", math.isfinite(self.skew), "finite")
        check("mirostat_mode", self.mirostat_mode in (0, 1, 2), "0, 1 or 2")
        check("mirostat_tau", self.mirostat_tau >= 0, ">= 0")
        check("mirostat_eta", self.mirostat_eta >= 0, ">= 0")
        if self.banned_strings is not None:
            check("banned_strings", len(self.banned_strings) <= MAX_BANNED_STRINGS
                  and all(1 <= len(s) <= MAX_BANNED_STRING_CHARS for s in self.banned_strings),
                  f"at most {MAX_BANNED_STRINGS} phrases of 1-{MAX_BANNED_STRING_CHARS} characters")
        if self.guided_choice is not None:
            check("guided_choice", all(isinstance(c, str) and c for c in self.guided_choice),
                  "a list of non-empty strings")
        guided = [name for name in GUIDED_FIELDS if getattr(self, name) is not None]
        if len(guided) > 1:
            raise ParamError(guided[1], f"at most one guided decoding constraint may be set, got {guided}")
        if self.response_format is not None and self.response_format.get("type") not in ("json_object", "json_schema"):
            raise ParamError("response_format", "response_format.type must be text, json_object or json_schema")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def guided(self) -> tuple[str, Any] | None:
        """The guided decoding constraint as (field name, value), or None."""
        for name in GUIDED_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    def validate_against(self, vocab_size: int, max_logprobs: int) -> None:
        """Checks that need the model: token ids within the vocabulary and the logprobs cap."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias or {}),
            ("allowed_token_ids", self.allowed_token_ids or []), ("custom_token_bans", self.custom_token_bans or []),
        ):
            for token_id in ids:
                if not 0 <= token_id < vocab_size:
                    raise ParamError(name, f"token id {token_id} is outside the vocabulary (size {vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > max_logprobs:
                raise ParamError(name, f"{name} must be <= {max_logprobs} (--max-logprobs), got {value}")
