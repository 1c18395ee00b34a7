"""Kobold discovery and configuration routes (contract §5.3): versions, model name, lengths,
soft-prompt stubs.

What Kobold Lite, SillyTavern's Kobold types and Horde workers ask before generating. The version
strings are the ones their feature gates expect; `protected` tells Kobold Lite to ask for a key.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from paphos.server.state import get_state

v1 = APIRouter()  # mounted at /api/v1 and /api/latest
extra = APIRouter()  # mounted at /api/extra

# Clients need >= 1.2.2 for stop_sequence and >= 1.2.4 for use_default_badwordsids.
KOBOLD_API_VERSION = "1.2.4"
# "KoboldCpp" passes SillyTavern's feature checks; the version those of KoboldCpp clients.
KOBOLDCPP_VERSION = "1.63"


@v1.get("/info/version")
async def api_version() -> dict[str, str]:
    return {"result": KOBOLD_API_VERSION}


@v1.get("/model")
async def model(request: Request) -> dict[str, str]:
    return {"result": f"aphrodite/{get_state(request).model_name}"}


@v1.get("/config/max_length")
async def max_length(request: Request) -> dict[str, int]:
    """The default generation length (not the context size)."""
    return {"value": get_state(request).config.kobold_default_max_length}


@v1.get("/config/max_context_length")
async def max_context_length(request: Request) -> dict[str, int]:
    return {"value": get_state(request).ready_engine().max_model_len}


@v1.get("/config/soft_prompts_list")
async def soft_prompts_list() -> dict[str, list[Any]]:
    return {"values": []}


@v1.get("/config/soft_prompt")
async def soft_prompt() -> dict[str, str]:
    return {"value": ""}


@v1.put("/config/soft_prompt")
async def set_soft_prompt() -> dict[str, Any]:
    return {}


@extra.get("/true_max_context_length")
async def true_max_context_length(request: Request) -> dict[str, int]:
    return {"value": get_state(request).ready_engine().max_model_len}


@extra.get("/version")
async def koboldcpp_version(request: Request) -> dict[str, Any]:
    return {
        "result": "KoboldCpp",
        "version": KOBOLDCPP_VERSION,
        "protected": bool(get_state(request).config.api_keys),
        "txt2img": False,
        "vision": False,
    }
