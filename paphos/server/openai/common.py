"""Pieces shared by the completions and chat routes: body parsing, request-level checks, ids,
usage, request logging, and collecting a non-streamed result from the merged engine outputs.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from paphos.core.protocol import TokenLogprobs
from paphos.outputs import CompletionOutput
from paphos.sampling_params import SamplingParams
from paphos.server.errors import bad_request
from paphos.server.openai.protocol import SamplerFields
from paphos.server.openai.streaming import MergedOutputs
from paphos.server.state import ServerState

logger = logging.getLogger("paphos.server")

M = TypeVar("M", bound=BaseModel)


async def read_json_object(request: Request, *, allow_empty: bool = False) -> dict[str, Any]:
    """The body as a JSON object, whatever the Content-Type (curl -d sends form encoding).

    With `allow_empty`, an empty body reads as `{}` (Kobold's abort and check are sent bodiless).
    """
    raw = await request.body()
    if not raw.strip():
        if allow_empty:
            return {}
        raise bad_request("The request body is empty; expected a JSON object.")
    try:
        data = json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"Malformed JSON body: {exc}") from None
    except _NonFinite as exc:
        raise bad_request(f"Malformed JSON body: {exc}") from None
    except RecursionError:
        # Python's decoder recurses per nesting level: a body of 100k `[` would be a 500.
        raise bad_request("Malformed JSON body: nested too deeply.") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.")
    if _SURROGATE_ESCAPE.search(raw):
        data = _replace_lone_surrogates(data)
    return data


class _NonFinite(ValueError):
    pass


def _no_constant(name: str) -> float:
    # Python's json accepts NaN and Infinity, JSON does not; they would reach the samplers as
    # non-finite logit biases or temperatures.
    raise _NonFinite(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NonFinite(f"number {text[:40]} is out of range")
    return value


# A `\uD800`-`\uDFFF` escape: the only way a JSON text can carry a lone UTF-16 surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _replace_lone_surrogates(value: Any) -> Any:
    """Lone surrogates (JSON escapes a UTF-8 body cannot otherwise carry) -> U+FFFD.

    json.loads joins valid pairs, so what is left is unpaired: a JavaScript client's string cut in
    the middle of an emoji. Such a str cannot be encoded to UTF-8 (tokenizer, logs, the response
    echoing it), so it is replaced as a UTF-8 decoder replaces a broken sequence.
    """
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_replace_lone_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {_replace_lone_surrogates(k): _replace_lone_surrogates(v) for k, v in value.items()}
    return value


async def parse_body(request: Request, model: type[M]) -> M:
    """JSON body -> request model; pydantic's ValidationError becomes a 400 (errors.py)."""
    return model.model_validate(await read_json_object(request))


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def check_generation_fields(body: SamplerFields, state: ServerState) -> None:
    """Checks that need neither the prompt nor the model."""
    max_n = state.config.max_n
    if body.n > max_n:
        raise bad_request(f"n must be at most {max_n}, got {body.n}", "n")
    if body.best_of is not None and body.best_of > max_n:
        raise bad_request(f"best_of must be at most {max_n}, got {body.best_of}", "best_of")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options can only be set when stream is true", "stream_options")
    if body.stream and body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of must equal n when streaming (the best choices are known only at the end)", "best_of")
    if body.stream and body.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is not available with stream", "prompt_logprobs")
    _refuse_beam_search(body)
    _check_seed(body)


# Seeds go to the sampler as signed 64-bit integers, one per sequence (seed + sequence index).
_SEED_MAX = 2**63 - 1


def _check_seed(body: SamplerFields) -> None:
    if body.seed is None or body.seed == -1:
        return
    sequences = max(body.n, body.best_of or 0)
    if not -(2**63) <= body.seed <= _SEED_MAX - (sequences - 1):
        raise bad_request(f"seed must be a signed 64-bit integer, got {body.seed}", "seed")


def _refuse_beam_search(body: SamplerFields) -> None:
    """Beam search is not implemented: asking for it is a 400, never a silent fallback to sampling."""
    if body.use_beam_search:
        raise bad_request("use_beam_search is not available on this server", "use_beam_search")
    if body.length_penalty is not None and body.length_penalty != 1.0:
        raise bad_request("length_penalty only applies to beam search, which is not available on this server",
                          "length_penalty")
    if body.early_stopping not in (None, False):
        raise bad_request("early_stopping only applies to beam search, which is not available on this server",
                          "early_stopping")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def log_request(state: ServerState, request_id: str, prompts: list[list[int]], params: SamplingParams) -> None:
    """One line per request; the prompt's token ids are shown up to --max-log-len of them."""
    if state.config.disable_log_requests:
        return
    limit = state.config.max_log_len
    shown = [p if limit is None else p[:limit] for p in prompts]
    logger.info(
        "request %s: %d prompt(s), %s prompt tokens, n=%d, max_tokens=%s, temperature=%s, prompt_token_ids=%s",
        request_id, len(prompts), "+".join(str(len(p)) for p in prompts), params.n, params.max_tokens,
        params.temperature, shown[0] if len(shown) == 1 else shown,
    )


@dataclass
class ChoiceResult:
    """One choice of a non-streamed response, assembled from its deltas."""

    prompt_index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_generated_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class Collected:
    choices: dict[int, ChoiceResult]
    prompt_logprobs: dict[int, list[TokenLogprobs | None]]


async def collect(
    merged: MergedOutputs, n: int, on_delta: Callable[[int, CompletionOutput], None] | None = None
) -> Collected:
    """Drains the engine outputs of every prompt; choice index = prompt_index * n + choice index.

    `on_delta(choice index, delta)` sees each delta as it arrives (Kobold's generate/check).
    """
    result = Collected({}, {})
    try:
        async for prompt_index, output in merged:
            if output.prompt_logprobs is not None:
                result.prompt_logprobs[prompt_index] = output.prompt_logprobs
            for delta in output.outputs:
                index = prompt_index * n + delta.index
                if on_delta is not None:
                    on_delta(index, delta)
                choice = result.choices.setdefault(index, ChoiceResult(prompt_index))
                choice.text.append(delta.text)
                choice.token_ids.extend(delta.token_ids)
                if delta.logprobs:
                    choice.logprobs.extend(delta.logprobs)
                choice.num_generated_tokens = delta.num_generated_tokens
                if delta.finish_reason is not None:
                    choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
    finally:
        await merged.aclose()
    return result


async def first_output(merged: MergedOutputs) -> Any:
    """The first merged output, or None when there is none; errors propagate (and close the merge)."""
    try:
        return await merged.__anext__()
    except StopAsyncIteration:
        return None
    except BaseException:
        await merged.aclose()
        raise
