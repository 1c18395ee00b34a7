"""The OpenAPI document's request bodies: what each POST route reads, from its pydantic model.

The routes parse their bodies themselves (any Content-Type, the contract's 400s instead of
FastAPI's 422s), so FastAPI cannot see those models. `json_body(Model)` declares one in a route's
`openapi_extra`; `install_openapi` adds the models' schemas to the document's components. Clients'
generators and the schema-driven fuzz test (tests/server/test_fuzz.py) read this document.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"
# Every model named by json_body, in declaration order (routes are declared at import time).
_BODY_MODELS: dict[str, type[BaseModel]] = {}


def json_body(model: type[BaseModel], *, required: bool = True, description: str | None = None) -> dict[str, Any]:
    """`openapi_extra` declaring a JSON request body of `model` (optional for bodiless-capable routes)."""
    _BODY_MODELS[model.__name__] = model
    body: dict[str, Any] = {
        "required": required,
        "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}},
    }
    if description:
        body["description"] = description
    return {"requestBody": body}


def install_openapi(app: FastAPI) -> None:
    """Makes `app.openapi()` include the schemas of the models named by `json_body`."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = get_openapi(
            title=app.title, version=app.version, openapi_version=app.openapi_version, routes=app.routes,
            description=app.description,
        )
        if _BODY_MODELS:
            _, defs = models_json_schema(
                [(model, "validation") for model in _BODY_MODELS.values()], ref_template=_REF
            )
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for name, schema in defs.get("$defs", {}).items():
                schemas.setdefault(name, schema)
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]
