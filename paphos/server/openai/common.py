"""Pieces shared by the completions and chat routes: body parsing, request-level checks, ids,
usage, request logging, and collecting a non-streamed result from the merged engine outputs.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from paphos.core.scheduler_output import TokenLogprobs
from paphos.sampling_params import SamplingParams
from paphos.server.errors import bad_request
from paphos.server.openai.protocol import SamplerFields
from paphos.server.openai.streaming import MergedOutputs
from paphos.server.state import ServerState

logger = logging.getLogger("paphos.server")

M = TypeVar("M", bound=BaseModel)


async def parse_body(request: Request, model: type[M]) -> M:
    """JSON body -> request model, whatever the Content-Type (curl -d sends form encoding)."""
    raw = await request.body()
    if not raw.strip():
        raise bad_request("The request body is empty; expected a JSON object.")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"Malformed JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.")
    return model.model_validate(data)  # pydantic ValidationError -> 400 (errors.py)


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


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def log_request(state: ServerState, request_id: str, prompts: list[list[int]], params: SamplingParams) -> None:
    if state.config.disable_log_requests:
        return
    logger.info(
        "request %s: %d prompt(s), %s prompt tokens, n=%d, max_tokens=%s, temperature=%s",
        request_id, len(prompts), "+".join(str(len(p)) for p in prompts), params.n, params.max_tokens,
        params.temperature,
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


async def collect(merged: MergedOutputs, n: int) -> Collected:
    """Drains the engine outputs of every prompt; choice index = prompt_index * n + choice index."""
    result = Collected({}, {})
    try:
        async for prompt_index, output in merged:
            if output.prompt_logprobs is not None:
                result.prompt_logprobs[prompt_index] = output.prompt_logprobs
            for delta in output.outputs:
                index = prompt_index * n + delta.index
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
