"""GET /v1/models (contract §3.3): one model card per served name and per loaded LoRA adapter.

Answers 200 whenever the server is up, loading included (SillyTavern's status check, §6.1); 503
only after the engine died. Adapters come from the engine's one registry (paphos/lora/registry.py),
so a name loaded through the admin routes (openai/lora.py) is listed at once and gone once
unloaded; while the model loads there is no registry yet, and only the served names are listed.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from paphos.server.openai import common
from paphos.server.state import get_state

router = APIRouter()


def _permission(created: int) -> dict[str, Any]:
    return {
        "id": common.new_request_id("modelperm"),
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = get_state(request)
    engine = state.engine
    if engine.errored or state.start_error is not None:
        state.ready_engine()  # 503: the engine died
    # While the model loads the list still answers 200 (SillyTavern treats anything else as
    # offline); max_model_len is then the configured one (null when it comes from the model).
    max_model_len = engine.max_model_len if engine.is_ready else engine.model_config.max_model_len
    created = common.now()

    def card(name: str, root: str, parent: str | None) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "paphos",
            "root": root,
            "parent": parent,
            "max_model_len": max_model_len,
            "permission": [_permission(created)],
        }

    cards = [card(name, engine.model_config.model, None) for name in state.served_model_names]
    if engine.is_ready:
        cards += [
            card(adapter.request.name, adapter.request.path, adapter.base_model_name or state.model_name)
            for adapter in engine.lora_registry.adapters()
        ]
    return {"object": "list", "data": cards}
