"""KoboldCpp's /api/extra routes besides the stream (contract §5.3): check, abort, token counting,
tokenize/detokenize, last_logprobs, perf, preloadstory.

Read-side companions of generate.py: check/abort/last_logprobs look generations up in the job
registry (jobs.py) by genkey, or by the caller's address when no genkey is sent; the tokenizer
routes use the same tokenization helper as the OpenAI routes, without special tokens.

tokencount, tokenize and abort are public (auth.py). A keyless abort stops only a generation it can
name by genkey and only from the address that started it; a keyless bodiless abort stops nothing,
because behind a reverse proxy every client shares one address and "the caller's generations" would
be everyone's. SillyTavern's bodiless abort then gets `{"success": false}`, and its generation still
ends: SillyTavern drops the generate connection right after, and a disconnect aborts the request.
Keyless token counts queue on a few slots, so strangers cannot take every worker thread.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from paphos.server.auth import is_authenticated
from paphos.server.errors import APIError, validation_error_body
from paphos.server.kobold.jobs import client_of, get_jobs
from paphos.server.kobold.protocol import GenkeyRequest, IdsRequest, TextRequest
from paphos.server.openai import common
from paphos.server.openai.prompts import check_token_ids, encode_text
from paphos.server.openapi import json_body
from paphos.server.state import get_state

extra = APIRouter()  # mounted at /api/extra

# Keyless tokencount/tokenize requests tokenizing at once, per app.
PUBLIC_TOKENIZE_SLOTS = 2


async def _genkey(request: Request) -> str | None:
    body = GenkeyRequest.model_validate(await common.read_json_object(request, allow_empty=True))
    return body.genkey or request.query_params.get("genkey") or None


@extra.get("/generate/check")
@extra.post("/generate/check", openapi_extra=json_body(GenkeyRequest, required=False))
async def check(request: Request) -> dict[str, Any]:
    job = get_jobs(request).find(await _genkey(request), client_of(request))
    return {"results": [{"text": "".join(job.text) if job else ""}]}


@extra.post("/abort", openapi_extra=json_body(GenkeyRequest, required=False))
async def abort(request: Request) -> dict[str, bool]:
    """By genkey; without one, every running genkey-less generation of the caller (SillyTavern).

    Without a key (the route is public), only by genkey and from the generating address.
    """
    jobs = get_jobs(request)
    genkey = await _genkey(request)
    trusted = is_authenticated(request.scope)
    if genkey is not None:
        job = jobs.get(genkey)
        if job is None or (not trusted and job.client != client_of(request)):
            return {"success": False}
        return {"success": await job.abort()}
    if not trusted:
        return {"success": False}
    aborted = [await job.abort() for job in jobs.running_anonymous(client_of(request))]
    return {"success": any(aborted)}


def _public_slots(request: Request) -> asyncio.Semaphore:
    slots = getattr(request.app.state, "kobold_public_tokenize", None)
    if slots is None:
        slots = request.app.state.kobold_public_tokenize = asyncio.Semaphore(PUBLIC_TOKENIZE_SLOTS)
    return slots


async def _count_ids(request: Request) -> list[int]:
    """Token ids of `{"prompt"}`, no special tokens; any malformed request is a 400 with `value: -1`."""
    state = get_state(request)
    try:
        body = TextRequest.model_validate(await common.read_json_object(request))
    except ValidationError as exc:
        body_json = validation_error_body(list(exc.errors()))
        raise APIError(400, body_json["message"], body_json["param"], extra={"value": -1}) from None
    except APIError as exc:
        raise APIError(exc.status, exc.message, exc.param, extra={"value": -1}) from None
    state.ready_engine()
    if is_authenticated(request.scope):
        return await encode_text(state, body.prompt, False, max_tokens=0, param="prompt", precheck=False)
    async with _public_slots(request):
        return await encode_text(state, body.prompt, False, max_tokens=0, param="prompt", precheck=False)


@extra.post("/tokencount", openapi_extra=json_body(TextRequest))
async def tokencount(request: Request) -> dict[str, Any]:
    ids = await _count_ids(request)
    return {"value": len(ids), "ids": ids}


@extra.post("/tokenize", openapi_extra=json_body(TextRequest))
async def tokenize(request: Request) -> dict[str, Any]:
    ids = await _count_ids(request)
    return {"result": ids, "ids": ids, "value": len(ids)}


@extra.post("/detokenize", openapi_extra=json_body(IdsRequest))
async def detokenize(request: Request) -> dict[str, Any]:
    state = get_state(request)
    body = await common.parse_body(request, IdsRequest)
    engine = state.ready_engine()
    check_token_ids(body.ids, engine.vocab_size, "ids")
    return {"result": engine.tokenizer.decode(body.ids, skip_special_tokens=True), "success": True}


@extra.post("/last_logprobs", openapi_extra=json_body(GenkeyRequest, required=False))
async def last_logprobs(request: Request) -> dict[str, Any]:
    """Logprobs of the genkey's generation, else of the caller's latest; empty when none were asked."""
    jobs = get_jobs(request)
    genkey = await _genkey(request)
    job = jobs.get(genkey) if genkey is not None else jobs.latest(client_of(request))
    content = job.logprobs_json if job is not None and job.logprobs_json is not None else {"content": []}
    return {"logprobs": content}


@extra.get("/perf")
async def perf(request: Request) -> dict[str, Any]:
    state = get_state(request)
    jobs = get_jobs(request)
    stats = state.engine.stats()
    last = jobs.perf
    busy = stats["num_running"] + stats["num_waiting"]
    return {
        "last_process": last.last_process,
        "last_eval": last.last_eval,
        "last_token_count": last.last_token_count,
        "last_input_count": last.last_input_count,
        "total_gens": last.total_gens,
        "stop_reason": last.stop_reason,
        "queue": int(stats["num_waiting"]),
        "idle": 0 if busy else 1,
        "uptime": time.monotonic() - jobs.started,
    }


@extra.get("/preloadstory")
async def preloadstory() -> dict[str, Any]:
    return {}
