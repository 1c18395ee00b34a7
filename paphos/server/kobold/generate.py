"""POST /api/v1/generate and /api/extra/generate/stream (contract §5.1, §5.2).

Flow: raw JSON -> KoboldGenerateRequest (lengths, memory, genkey; `lora` looked up in the engine's
adapter registry) -> tokenize memory (with BOS) and prompt, dropping the oldest prompt tokens
beyond max_context_length - max_length -> sampler fields renamed into a CompletionRequest and
checked exactly as /v1/completions checks them -> SamplingParams -> the same MergedOutputs /
collect / SSE machinery as the OpenAI routes, with a KoboldJob (jobs.py) recording the text for
check/abort. Results: `{"results": [{"text", ...}]}`; the stream sends `event: message` +
`data: {"token": ...}` and a last event with `finish_reason`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from paphos.core.protocol import LoRARequest
from paphos.outputs import RequestOutput
from paphos.sampling_params import SamplingParams
from paphos.server.errors import APIError, bad_request
from paphos.server.kobold.jobs import KoboldJob, client_of, get_jobs
from paphos.server.kobold.protocol import KoboldGenerateBody, KoboldGenerateRequest, to_completion_request
from paphos.server.openai import common
from paphos.server.openai.logprobs import ChatLogprobs, TokenDecoder, special_token_ids
from paphos.server.openai.prompts import context_overflow, encode_text
from paphos.server.openai.protocol import CompletionRequest
from paphos.server.openai.sampling import build_sampling_params
from paphos.server.openai.streaming import (
    ClientDisconnected,
    MergedOutputs,
    SSEResponse,
    run_until_disconnect,
    sse,
)
from paphos.server.openapi import json_body
from paphos.server.state import EngineClient, ServerState, get_state

v1 = APIRouter()  # mounted at /api/v1 and /api/latest
extra = APIRouter()  # mounted at /api/extra

# KoboldCpp answers `logprobs: true` with this many alternatives per token.
DEFAULT_TOP_LOGPROBS = 5


@dataclass
class _Plan:
    request_id: str
    body: KoboldGenerateRequest
    completion: CompletionRequest
    prompt_ids: list[int]
    params: SamplingParams
    lora: LoRARequest | None


def _adapter(engine: EngineClient, name: str | None) -> LoRARequest | None:
    """The Kobold `lora` field (contract §5.1): null or "" is the base model, else a loaded adapter.

    Only adapter names are accepted here (the base model's names are not adapters); OpenAI routes
    choose adapters through `model` instead (ServerState.resolve_model).
    """
    if not name:
        return None
    registry = engine.lora_registry
    if not registry.enabled:
        raise bad_request("LoRA adapters are not enabled on this server.", "lora")
    lora = registry.get(name)
    if lora is None:
        raise APIError(404, f"The LoRA adapter `{name}` does not exist.", "lora")
    return lora


def _default_bad_words(state: ServerState) -> list[int]:
    """`use_default_badwordsids`: EOS and every vocabulary token containing `[` or `]` (minus pad)."""
    tokenizer = state.engine.tokenizer
    pad = getattr(tokenizer, "pad_token_id", None)
    ids = {i for piece, i in tokenizer.hf.get_vocab().items() if ("[" in piece or "]" in piece) and i != pad}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


async def _input_ids(state: ServerState, body: KoboldGenerateRequest, max_length: int, max_context: int) -> list[int]:
    """memory (with the special prefix) + the newest prompt tokens that fit (§5.1)."""
    memory = await encode_text(state, body.memory, True, max_tokens=max_length, param="memory", precheck=False)
    prompt = await encode_text(state, body.prompt, False, max_tokens=max_length, param="prompt", precheck=False)
    room = max_context - max_length - len(memory)
    if room < 0 or (room == 0 and not memory):
        raise context_overflow(max_context, len(memory), max_length, "memory" if body.memory else "max_length")
    return memory + (prompt[-room:] if room else [])


async def _plan(raw: dict[str, Any], state: ServerState, stream: bool) -> _Plan:
    body = KoboldGenerateRequest.model_validate(raw)
    engine = state.ready_engine()
    if body.images:
        raise bad_request("This model does not accept images.", "images")
    lora = _adapter(engine, body.lora)
    max_context = engine.max_model_len if body.max_context_length is None else body.max_context_length
    max_context = min(max_context, engine.max_model_len)
    if max_context < 2:
        raise bad_request(f"max_context_length must be at least 2, got {max_context}", "max_context_length")
    if body.max_length is None:
        max_length = min(state.config.kobold_default_max_length, max_context - 1)
    else:
        max_length = body.max_length
        if max_length < 1:
            raise bad_request(f"max_length must be at least 1, got {max_length}", "max_length")
        if max_length > max_context:
            raise bad_request("max_length must not be larger than max_context_length", "max_length")
    num_logprobs = None
    if body.logprobs is not False:
        num_logprobs = min(DEFAULT_TOP_LOGPROBS, state.max_logprobs) if body.logprobs is True else body.logprobs
        if not 0 <= num_logprobs <= state.max_logprobs:
            raise bad_request(f"logprobs must be in 0..{state.max_logprobs}, got {num_logprobs}", "logprobs")
    prompt_ids = await _input_ids(state, body, max_length, max_context)
    completion = to_completion_request(
        raw, prompt_ids, max_tokens=max_length, n=1 if stream else body.n, logprobs=num_logprobs
    )
    if body.use_default_badwordsids:
        completion.custom_token_bans = [*(completion.custom_token_bans or []), *_default_bad_words(state)]
    common.check_generation_fields(completion, state)
    params = build_sampling_params(completion, max_tokens=max_length, logprobs=num_logprobs)
    params.validate_against(engine.vocab_size, state.max_logprobs)
    return _Plan(common.new_request_id("kobold"), body, completion, prompt_ids, params, lora)


def _logprobs_json(state: ServerState, plan: _Plan, token_ids: list[int], entries: list[Any]) -> dict[str, Any]:
    """KoboldCpp's shape: {"content": [{"token", "logprob", "top_logprobs": [...]}]} (chat-style entries)."""
    decoder = TokenDecoder(
        state.engine.tokenizer, plan.prompt_ids, state.config.return_tokens_as_token_ids,
        special_token_ids(state.engine.tokenizer), plan.completion.skip_special_tokens,
    )
    return {"content": ChatLogprobs(decoder, plan.params.logprobs or 0).format(token_ids, entries)}


async def _start(request: Request, stream: bool) -> tuple[ServerState, _Plan, KoboldJob, MergedOutputs]:
    state = get_state(request)
    plan = await _plan(await common.read_json_object(request), state, stream)
    job = get_jobs(request).start(plan.body.genkey, client_of(request), len(plan.prompt_ids))
    if not plan.body.quiet:
        common.log_request(state, plan.request_id, [plan.prompt_ids], plan.params)
    job.merged = MergedOutputs(state.engine, plan.request_id, [plan.prompt_ids], [plan.params], plan.lora)
    return state, plan, job, job.merged


@v1.post("/generate", openapi_extra=json_body(KoboldGenerateBody))
async def generate(request: Request) -> Response:
    state, plan, job, merged = await _start(request, stream=False)
    jobs = get_jobs(request)
    n = plan.completion.n
    try:
        collected = await run_until_disconnect(request, common.collect(merged, n, on_delta=job.record))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        jobs.finish(job)
    results = []
    for index in range(n):
        choice = collected.choices.get(index)
        result: dict[str, Any] = {
            "text": "".join(choice.text) if choice else "",
            "finish_reason": (choice.finish_reason if choice else None) or "abort",
            "prompt_tokens": len(plan.prompt_ids),
            "completion_tokens": choice.num_generated_tokens if choice else 0,
        }
        if plan.params.logprobs is not None:
            result["logprobs"] = _logprobs_json(state, plan, choice.token_ids, choice.logprobs) if choice else None
        results.append(result)
    if plan.params.logprobs is not None:
        job.logprobs_json = results[0]["logprobs"]
    return JSONResponse({"results": results})


def _event(payload: dict[str, Any]) -> str:
    """One Kobold stream event: `event: message` then the `data:` line (§5.2)."""
    return "event: message\n" + sse(payload)


async def _events(
    request: Request, state: ServerState, plan: _Plan, job: KoboldJob, merged: MergedOutputs, first: Any
) -> AsyncIterator[str]:
    async def outputs() -> AsyncIterator[tuple[int, RequestOutput]]:
        if first is not None:
            yield first
        async for item in merged:
            yield item

    try:
        async for _, output in outputs():
            for delta in output.outputs:
                job.record(delta.index, delta)
                if delta.text:
                    yield _event({"token": delta.text})
        final: dict[str, Any] = {"token": "", "finish_reason": job.finish_reason or "abort"}
    except Exception as exc:  # noqa: BLE001 - after the first byte: report in-band, then close
        message = exc.message if isinstance(exc, APIError) else f"{type(exc).__name__}: {exc}"
        final = {"token": "", "finish_reason": "error", "error": {"message": message}}
    finally:
        await merged.aclose()
        if plan.params.logprobs is not None:
            job.logprobs_json = _logprobs_json(state, plan, job.token_ids, job.logprobs)
        get_jobs(request).finish(job)
    yield _event(final)


@extra.post("/generate/stream", openapi_extra=json_body(KoboldGenerateBody))
async def generate_stream(request: Request) -> Response:
    state, plan, job, merged = await _start(request, stream=True)
    try:
        first = await run_until_disconnect(request, common.first_output(merged))
    except ClientDisconnected:
        get_jobs(request).finish(job)
        return Response(status_code=499)
    except BaseException:
        get_jobs(request).finish(job)
        raise
    headers = {"Connection": "keep-alive"}
    return SSEResponse(_events(request, state, plan, job, merged, first), headers=headers)
