"""HTTP layer: FastAPI app, OpenAI-compatible routes, error shape, SSE streaming.

Data flow (design.md §2): HTTP JSON -> pydantic request models -> token ids + SamplingParams
(all parsing, validation, chat templating and tokenization happen here) -> AsyncEngine.generate
-> RequestOutput deltas -> OpenAI JSON responses or SSE chunks. The engine never sees JSON.
"""

from paphos.server.app import build_app

__all__ = ["build_app"]
