"""POST /v1/chat/completions (contract §3.2, §3.5): messages -> chat template -> engine -> chat JSON or SSE.

Flow: parse body -> `model` resolved to the echoed name and the LoRA adapter, if any (state.py)
-> request-level checks -> render the chat template (request template, else the
server's --chat-template, else the tokenizer's) -> tokenize -> length checks (max_tokens defaults
to what is left of the context) -> one engine request -> chat.completion, or chunks where each
choice first gets `delta: {"role": "assistant", "content": ""}`.
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
from paphos.server.openai.logprobs import ChatLogprobs, TokenDecoder, prompt_logprobs_json, special_token_ids
from paphos.server.openai.prompts import (
    check_context,
    context_overflow,
    encode_text,
    message_text,
    render_chat,
    truncate_prompt,
)
from paphos.server.openai.protocol import ChatCompletionRequest
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
from paphos.server.state import ModelChoice, ServerState, get_state

router = APIRouter()

ROLE = "assistant"


@dataclass
class _Plan:
    request_id: str
    model: ModelChoice
    body: ChatCompletionRequest
    prompt_ids: list[int]
    params: SamplingParams
    num_top_logprobs: int | None
    echo_text: str


def _check_tools(body: ChatCompletionRequest) -> None:
    choice = body.tool_choice
    if choice is None or choice == "none":
        return
    if not body.tools:
        raise bad_request("tool_choice requires tools", "tool_choice")
    if choice == "auto":
        raise bad_request("tool_choice 'auto' requires the server to run with --enable-auto-tool-choice", "tool_choice")
    raise bad_request("tool_choice 'required' or a named tool is not available on this server", "tool_choice")


def _num_top_logprobs(body: ChatCompletionRequest, state: ServerState) -> int | None:
    if not body.logprobs:
        if body.top_logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        return None
    top = body.top_logprobs or 0
    if not 0 <= top <= state.max_logprobs:
        raise bad_request(f"top_logprobs must be in 0..{state.max_logprobs} (--max-logprobs), got {top}", "top_logprobs")
    return top


async def _plan(body: ChatCompletionRequest, state: ServerState) -> _Plan:
    model = state.resolve_model(body.model)
    engine = state.ready_engine()
    common.check_generation_fields(body, state)
    _check_tools(body)
    num_top = _num_top_logprobs(body, state)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if requested is not None and requested < 1:
        raise bad_request(f"max_tokens must be at least 1, got {requested}", "max_tokens")
    text = render_chat(
        engine, body.messages, add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message, chat_template=body.chat_template,
        chat_template_kwargs=body.chat_template_kwargs, tools=body.tools, documents=body.documents,
    )
    ids = await encode_text(
        state, text, body.add_special_tokens, max_tokens=requested or 1, param="messages",
        precheck=body.truncate_prompt_tokens is None,
    )
    ids = truncate_prompt(ids, body.truncate_prompt_tokens)
    if not ids:
        raise bad_request("the rendered prompt is empty", "messages")
    if requested is None:
        max_tokens = engine.max_model_len - len(ids)
        if max_tokens < 1:
            raise context_overflow(engine.max_model_len, len(ids), 1, "messages")
    else:
        max_tokens = requested
        check_context(engine, len(ids), max_tokens, "max_tokens" if len(ids) < engine.max_model_len else "messages")
    params = build_sampling_params(body, max_tokens=max_tokens, logprobs=num_top, prompt_logprobs=body.prompt_logprobs)
    params.validate_against(engine.vocab_size, state.max_logprobs)
    echo_text = ""
    last = body.messages[-1]
    if body.echo and last.role == ROLE:
        echo_text = message_text(last.content)
    return _Plan(common.new_request_id("chatcmpl"), model, body, ids, params, num_top, echo_text)


def _logprob_formatter(state: ServerState, plan: _Plan) -> ChatLogprobs:
    tokenizer = state.engine.tokenizer
    decoder = TokenDecoder(
        tokenizer, plan.prompt_ids, state.config.return_tokens_as_token_ids, special_token_ids(tokenizer),
        plan.params.skip_special_tokens,
    )
    return ChatLogprobs(decoder, plan.num_top_logprobs or 0)


@router.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
async def create_chat_completion(request: Request) -> Response:
    state = get_state(request)
    body = await common.parse_body(request, ChatCompletionRequest)
    plan = await _plan(body, state)
    common.log_request(state, plan.request_id, [plan.prompt_ids], plan.params)
    merged = MergedOutputs(state.engine, plan.request_id, [plan.prompt_ids], [plan.params], plan.model.lora)
    try:
        if body.stream:
            first = await run_until_disconnect(request, common.first_output(merged))
            return SSEResponse(_stream(state, plan, merged, first))
        collected = await run_until_disconnect(request, common.collect(merged, body.n))
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(_response(state, plan, collected))


def _response(state: ServerState, plan: _Plan, collected: common.Collected) -> dict[str, Any]:
    choices = []
    completion_tokens = 0
    for index in sorted(collected.choices):
        result = collected.choices[index]
        logprobs = None
        if plan.num_top_logprobs is not None:
            logprobs = {"content": _logprob_formatter(state, plan).format(result.token_ids, result.logprobs)}
        completion_tokens += result.num_generated_tokens
        choices.append({
            "index": index,
            "message": {"role": ROLE, "content": plan.echo_text + "".join(result.text), "tool_calls": []},
            "logprobs": logprobs,
            "finish_reason": result.finish_reason,
            "stop_reason": result.stop_reason,
        })
    response = {
        "id": plan.request_id,
        "object": "chat.completion",
        "created": common.now(),
        "model": plan.model.name,
        "choices": choices,
        "usage": common.usage(len(plan.prompt_ids), completion_tokens),
    }
    if plan.body.prompt_logprobs is not None:
        response["prompt_logprobs"] = prompt_logprobs_json(
            state.engine.tokenizer, plan.prompt_ids, collected.prompt_logprobs.get(0),
            state.config.return_tokens_as_token_ids,
        )
    return response


async def _stream(state: ServerState, plan: _Plan, merged: MergedOutputs, first: Any) -> AsyncIterator[str]:
    body = plan.body
    created = common.now()
    options = body.stream_options
    prompt_tokens = len(plan.prompt_ids)
    generated: dict[int, int] = {}
    formatters: dict[int, ChatLogprobs] = {}

    def chunk(index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None, stop: Any = None) -> str:
        payload: dict[str, Any] = {
            "id": plan.request_id, "object": "chat.completion.chunk", "created": created, "model": plan.model.name,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop}],
            "usage": None,
        }
        if options is not None and options.continuous_usage_stats:
            payload["usage"] = common.usage(prompt_tokens, sum(generated.values()))
        return sse(payload)

    async def outputs() -> AsyncIterator[tuple[int, Any]]:
        if first is not None:
            yield first
        async for item in merged:
            yield item

    try:
        for index in range(body.n):
            yield chunk(index, {"role": ROLE, "content": ""})
            if plan.echo_text:
                yield chunk(index, {"content": plan.echo_text})
        async for _, output in outputs():
            for delta in output.outputs:
                index = delta.index
                generated[index] = delta.num_generated_tokens
                logprobs = None
                if plan.num_top_logprobs is not None and delta.token_ids:
                    formatter = formatters.setdefault(index, _logprob_formatter(state, plan))
                    logprobs = {"content": formatter.format(delta.token_ids, delta.logprobs)}
                if not delta.text and delta.finish_reason is None and logprobs is None:
                    continue  # nothing to tell yet (text held back for a possible stop string)
                content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
                yield chunk(index, content, logprobs, delta.finish_reason, delta.stop_reason)
        if options is not None and options.include_usage:
            yield sse({
                "id": plan.request_id, "object": "chat.completion.chunk", "created": created, "model": plan.model.name,
                "choices": [], "usage": common.usage(prompt_tokens, sum(generated.values())),
            })
    except Exception as exc:  # noqa: BLE001 - after the first byte the status is 200: report in-band
        yield error_event(exc)
    finally:
        await merged.aclose()
    yield DONE
