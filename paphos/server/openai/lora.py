"""LoRA adapter management, the admin routes of contract §3.6, in both Aphrodite spellings.

`POST /v1/lora/load` and `DELETE /v1/lora/unload` (0.6) answer `{"status": "success"}`;
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM / 0.2x) answer a text/plain
sentence. All four write the engine's one adapter registry (paphos/lora/registry.py) through
`engine.add_lora` / `engine.remove_lora`, which validate the adapter eagerly off the event loop;
a name loaded here is at once usable as `model` on completions, chat and tokenize, as Kobold's
`lora`, and listed by /v1/models. auth.py lets only the admin key reach these routes.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Annotated, TypeVar

from fastapi import APIRouter, Query, Request
from fastapi.responses import PlainTextResponse

from paphos.lora.errors import LoRAError, LoRANotFoundError
from paphos.server.errors import APIError
from paphos.server.openai import common
from paphos.server.openai.protocol import LoadLoRAAdapterRequest, LoRALoadRequest, UnloadLoRAAdapterRequest
from paphos.server.openapi import json_body
from paphos.server.state import get_state

logger = logging.getLogger("paphos.server")
router = APIRouter()

T = TypeVar("T")

SUCCESS = {"status": "success"}


async def _registry_call(call: Awaitable[T], not_found_param: str) -> T:
    """Awaits an engine registry change; LoRA errors become the contract's statuses (§3.6):
    an adapter or name that does not exist is a 404 on `not_found_param`, anything else a 400."""
    try:
        return await call
    except LoRANotFoundError as exc:
        raise APIError(404, str(exc), not_found_param) from None
    except LoRAError as exc:
        raise APIError(400, str(exc)) from None


async def _load(request: Request, name: str, path: str, base_model_name: str | None, replace: bool,
                path_param: str) -> None:
    engine = get_state(request).ready_engine()
    lora = await _registry_call(engine.add_lora(name, path, base_model_name, replace), path_param)
    logger.info("LoRA adapter %r loaded from %s (id %d)", lora.name, lora.path, lora.lora_id)


async def _unload(request: Request, name: str) -> None:
    engine = get_state(request).ready_engine()
    await _registry_call(engine.remove_lora(name), "lora_name")
    logger.info("LoRA adapter %r unloaded", name)


@router.post("/v1/lora/load", openapi_extra=json_body(LoRALoadRequest))
async def lora_load(request: Request) -> dict[str, str]:
    body = await common.parse_body(request, LoRALoadRequest)
    await _load(request, body.name, body.path, body.base_model_name, False, "path")
    return SUCCESS


@router.delete("/v1/lora/unload")
async def lora_unload(request: Request, lora_name: Annotated[str, Query()]) -> dict[str, str]:
    await _unload(request, lora_name)
    return SUCCESS


@router.post("/v1/load_lora_adapter", openapi_extra=json_body(LoadLoRAAdapterRequest))
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    body = await common.parse_body(request, LoadLoRAAdapterRequest)
    await _load(request, body.lora_name, body.lora_path, None, body.load_inplace, "lora_path")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", openapi_extra=json_body(UnloadLoRAAdapterRequest))
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    body = await common.parse_body(request, UnloadLoRAAdapterRequest)
    await _unload(request, body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
