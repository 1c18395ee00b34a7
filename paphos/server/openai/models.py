"""GET /v1/models (contract §3.3): one model card per served name, with max_model_len."""

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
    engine = state.ready_engine()
    created = common.now()
    root = engine.model_config.model
    cards = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "paphos",
            "root": root,
            "parent": None,
            "max_model_len": engine.max_model_len,
            "permission": [_permission(created)],
        }
        for name in state.served_model_names
    ]
    return {"object": "list", "data": cards}
