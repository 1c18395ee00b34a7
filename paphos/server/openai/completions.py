"""POST /v1/completions (contract §3.1, §3.5): prompts -> engine -> text_completion JSON or SSE.

Flow: parse body -> `model` resolved to the echoed name and the LoRA adapter, if any
(state.py) -> request-level checks -> tokenize each prompt (str | [str] | [int] | [[int]])
-> length/vocab checks -> one engine request per prompt, all with that adapter (merged; choice
index = prompt_index * n + choice) -> non-streamed response, or SSE chunks of one choice each.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from paphos.sampling_params import SamplingParams
from paphos.server.errors import bad_request
from paphos.server.openai import common
from paphos.server.openai.logprobs import (
    CompletionLogprobs,
    TokenDecoder,
    prompt_logprobs_json,
    special_token_ids,
)
from paphos.server.openai.prompts import check_context, check_token_ids, encode_text, truncate_prompt
from paphos.server.openai.protocol import CompletionRequest
from paphos.server.openai.sampling import build_sampling_params
from paphos.server.openai.streaming import (
    DONE,
    ClientDisconnected,
    MergedOutputs,
    SSEResponse,
    error_event,
    run_until_disconnect,
    sse,
)
from paphos.server.openapi import json_body
from paphos.server.state import EngineClient, ModelChoice, ServerState, get_state

router = APIRouter()


@dataclass
class _Prompt:
    ids: list[int]
    echo_text: str


@dataclass
class _Plan:
    """Everything decided before the engine is called."""

    request_id: str
    model: ModelChoice
    body: CompletionRequest
    prompts: list[_Prompt]
    params: list[SamplingParams]
    # echo with max_tokens 0: the engine runs one step (for prompt logprobs) whose token is dropped.
    discard_output: bool

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.ids) for p in self.prompts)


async def _prompt_ids(body: CompletionRequest, state: ServerState, engine: EngineClient, max_tokens: int) -> list[_Prompt]:
    prompt = body.prompt
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    elif isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    prompts = []
    for item in items:
        if isinstance(item, str):
            ids = await encode_text(
                state, item, body.add_special_tokens, max_tokens=max_tokens, param="prompt",
                precheck=body.truncate_prompt_tokens is None,
            )
            ids = truncate_prompt(ids, body.truncate_prompt_tokens)
            echo_text = item
        else:
            ids = truncate_prompt(list(item), body.truncate_prompt_tokens)
            check_token_ids(ids, engine.vocab_size, "prompt")
            echo_text = engine.tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens) if body.echo else ""
        if not ids:
            raise bad_request("prompt must not be empty", "prompt")
        check_context(engine, len(ids), max_tokens, "max_tokens" if len(ids) < engine.max_model_len else "prompt")
        prompts.append(_Prompt(ids, echo_text))
    return prompts


async def _plan(body: CompletionRequest, state: ServerState) -> _Plan:
    model = state.resolve_model(body.model)
    engine = state.ready_engine()
    common.check_generation_fields(body, state)
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if body.max_tokens < 0 or (body.max_tokens == 0 and not body.echo):
        raise bad_request(f"max_tokens must be at least 1, got {body.max_tokens}", "max_tokens")
    if body.logprobs is not None and not 0 <= body.logprobs <= state.max_logprobs:
        raise bad_request(f"logprobs must be in 0..{state.max_logprobs} (--max-logprobs), got {body.logprobs}", "logprobs")
    discard = body.max_tokens == 0
    max_tokens = max(body.max_tokens, 1)
    prompts = await _prompt_ids(body, state, engine, max_tokens)
    # Echoed logprobs need the prompt's logprobs.
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        prompt_logprobs = max(body.logprobs, prompt_logprobs or 0)
    params = []
    for _ in prompts:
        p = build_sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs, prompt_logprobs=prompt_logprobs)
        p.validate_against(engine.vocab_size, state.max_logprobs)
        params.append(p)
    return _Plan(common.new_request_id("cmpl"), model, body, prompts, params, discard)


def _logprob_formatter(state: ServerState, plan: _Plan, prompt: _Prompt) -> CompletionLogprobs:
    body = plan.body
    tokenizer = state.engine.tokenizer
    # With echo the offsets run over the prompt text too, so decoding starts without context.
    decoder = TokenDecoder(
        tokenizer, [] if body.echo else prompt.ids, state.config.return_tokens_as_token_ids,
        special_token_ids(tokenizer), body.skip_special_tokens,
    )
    return CompletionLogprobs(decoder, body.logprobs or 0)


@router.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
async def create_completion(request: Request) -> Response:
    state = get_state(request)
    body = await common.parse_body(request, CompletionRequest)
    plan = await _plan(body, state)
    common.log_request(state, plan.request_id, [p.ids for p in plan.prompts], plan.params[0])
    merged = MergedOutputs(
        state.engine, plan.request_id, [p.ids for p in plan.prompts], plan.params, plan.model.lora
    )
    try:
        if body.stream:
            first = await run_until_disconnect(request, common.first_output(merged))
            return SSEResponse(_stream(state, plan, merged, first))
        collected = await run_until_disconnect(request, common.collect(merged, body.n))
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(_response(state, plan, collected))


def _response(state: ServerState, plan: _Plan, collected: common.Collected) -> dict[str, Any]:
    body = plan.body
    choices = []
    completion_tokens = 0
    for index in sorted(collected.choices):
        result = collected.choices[index]
        prompt = plan.prompts[result.prompt_index]
        text = "" if plan.discard_output else "".join(result.text)
        logprobs = None
        if body.logprobs is not None:
            formatter = _logprob_formatter(state, plan, prompt)
            parts = []
            if body.echo:
                parts.append(formatter.format(prompt.ids, collected.prompt_logprobs.get(result.prompt_index)))
            if not plan.discard_output:
                parts.append(formatter.format(result.token_ids, result.logprobs))
            logprobs = {k: [v for part in parts for v in part[k]] for k in ("text_offset", "token_logprobs", "tokens", "top_logprobs")}
        prompt_lps = None
        if body.prompt_logprobs is not None:
            prompt_lps = prompt_logprobs_json(
                state.engine.tokenizer, prompt.ids, collected.prompt_logprobs.get(result.prompt_index),
                state.config.return_tokens_as_token_ids,
            )
        completion_tokens += 0 if plan.discard_output else result.num_generated_tokens
        choices.append({
            "index": index,
            "text": (prompt.echo_text if body.echo else "") + text,
            "logprobs": logprobs,
            "finish_reason": "length" if plan.discard_output else result.finish_reason,
            "stop_reason": None if plan.discard_output else result.stop_reason,
            "prompt_logprobs": prompt_lps,
        })
    return {
        "id": plan.request_id,
        "object": "text_completion",
        "created": common.now(),
        "model": plan.model.name,
        "choices": choices,
        "usage": common.usage(plan.prompt_tokens, completion_tokens),
    }


async def _stream(state: ServerState, plan: _Plan, merged: MergedOutputs, first: Any) -> AsyncIterator[str]:
    body = plan.body
    created = common.now()
    options = body.stream_options
    formatters: dict[int, CompletionLogprobs] = {}
    generated: dict[int, int] = {}
    prompt_lps: dict[int, Any] = {}

    def chunk(index: int, text: str, logprobs: Any, finish: str | None, stop: Any) -> dict[str, Any]:
        payload = {
            "id": plan.request_id, "object": "text_completion", "created": created, "model": plan.model.name,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop}],
            "usage": None,
        }
        if options is not None and options.continuous_usage_stats:
            payload["usage"] = common.usage(plan.prompt_tokens, sum(generated.values()))
        return payload

    async def outputs() -> AsyncIterator[tuple[int, Any]]:
        if first is not None:
            yield first
        async for item in merged:
            yield item

    try:
        async for prompt_index, output in outputs():
            if output.prompt_logprobs is not None:
                prompt_lps[prompt_index] = output.prompt_logprobs
            prompt = plan.prompts[prompt_index]
            for delta in output.outputs:
                index = prompt_index * body.n + delta.index
                is_first = index not in formatters
                formatter = formatters.setdefault(index, _logprob_formatter(state, plan, prompt))
                text, token_ids, entries = delta.text, delta.token_ids, delta.logprobs
                if plan.discard_output:
                    text, token_ids, entries = "", [], []
                else:
                    generated[index] = delta.num_generated_tokens
                logprobs = None
                if body.logprobs is not None:
                    parts = []
                    if is_first and body.echo:
                        parts.append(formatter.format(prompt.ids, prompt_lps.get(prompt_index)))
                    parts.append(formatter.format(token_ids, entries))
                    logprobs = {k: [v for part in parts for v in part[k]] for k in parts[0]}
                if is_first and body.echo:
                    text = prompt.echo_text + text
                finish = delta.finish_reason
                if plan.discard_output and finish is not None:
                    finish = "length"
                if not text and finish is None and not (logprobs and logprobs["tokens"]):
                    continue  # nothing to tell yet (text held back for a possible stop string)
                stop = None if plan.discard_output else delta.stop_reason
                yield sse(chunk(index, text, logprobs, finish, stop))
        if options is not None and options.include_usage:
            yield sse({
                "id": plan.request_id, "object": "text_completion", "created": created, "model": plan.model.name,
                "choices": [], "usage": common.usage(plan.prompt_tokens, sum(generated.values())),
            })
    except Exception as exc:  # noqa: BLE001 - after the first byte the status is 200: report in-band
        yield error_event(exc)
    finally:
        await merged.aclose()
    yield DONE
