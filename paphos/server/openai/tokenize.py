"""POST /v1/tokenize, /v1/detokenize and their /tokenize, /detokenize aliases (contract §3.4).

Completion form `{prompt}` or chat form `{messages}` (the chat template applied first) -> token
ids; ids -> text. These routes count, they do not generate, so prompts longer than the context
are counted rather than refused. `model` may name a served name or a loaded adapter (an adapter
shares the base model's tokenizer, so the answer is the same); any other name is a 404.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from paphos.server.errors import bad_request
from paphos.server.openai import common
from paphos.server.openai.prompts import check_token_ids, encode_text, render_chat
from paphos.server.openai.protocol import DetokenizeRequest, TokenizeRequest
from paphos.server.openapi import json_body
from paphos.server.state import get_state

router = APIRouter()


@router.post("/v1/tokenize", openapi_extra=json_body(TokenizeRequest))
@router.post("/tokenize", openapi_extra=json_body(TokenizeRequest))
async def tokenize(request: Request) -> dict[str, Any]:
    state = get_state(request)
    body = await common.parse_body(request, TokenizeRequest)
    state.resolve_model(body.model)
    engine = state.ready_engine()
    if body.prompt is not None and body.messages is not None:
        raise bad_request("send either prompt or messages, not both", "messages")
    if body.messages is not None:
        text = render_chat(
            engine, body.messages, add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, chat_template=body.chat_template,
            chat_template_kwargs=body.chat_template_kwargs, tools=body.tools,
        )
        add_special = False if body.add_special_tokens is None else body.add_special_tokens
    elif body.prompt is not None:
        text = body.prompt
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
    else:
        raise bad_request("prompt or messages is required", "prompt")
    ids = await encode_text(state, text, add_special, max_tokens=0, param="prompt", precheck=False)
    token_strs = None
    if body.return_token_strs:
        token_strs = list(engine.tokenizer.convert_ids_to_tokens(ids))
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": token_strs}


@router.post("/v1/detokenize", openapi_extra=json_body(DetokenizeRequest))
@router.post("/detokenize", openapi_extra=json_body(DetokenizeRequest))
async def detokenize(request: Request) -> dict[str, Any]:
    state = get_state(request)
    body = await common.parse_body(request, DetokenizeRequest)
    state.resolve_model(body.model)
    engine = state.ready_engine()
    check_token_ids(body.tokens, engine.vocab_size, "tokens")
    return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}
