"""KoboldAI / KoboldCpp API (contract §5), on the same port as the OpenAI routes, always on.

`/api/v1/*` (mirrored at `/api/latest/*`) and `/api/extra/*`. generate.py turns Kobold requests
into the OpenAI request model and runs them through the same engine path; jobs.py tracks them by
genkey for check/abort; extra.py and info.py hold the remaining routes.
"""

from fastapi import APIRouter

from paphos.server.kobold import extra, generate, info

router = APIRouter()
for _prefix in ("/api/v1", "/api/latest"):
    router.include_router(generate.v1, prefix=_prefix)
    router.include_router(info.v1, prefix=_prefix)
router.include_router(generate.extra, prefix="/api/extra")
router.include_router(extra.extra, prefix="/api/extra")
router.include_router(info.extra, prefix="/api/extra")

__all__ = ["router"]
