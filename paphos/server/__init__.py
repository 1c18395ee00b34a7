"""HTTP layer: FastAPI app, OpenAI-compatible and KoboldAI routes, auth, metrics, error shape, SSE.

Data flow (design.md §2): HTTP JSON -> CORS and API keys (auth.py) -> pydantic request models
(Kobold fields renamed into the OpenAI model) -> token ids + SamplingParams (all parsing,
validation, chat templating and tokenization happen here) -> AsyncEngine.generate -> RequestOutput
deltas -> OpenAI / Kobold JSON responses or SSE events. The engine never sees JSON; per-request
timings flow back from it into /metrics (metrics.py).
"""

from paphos.server.app import build_app

__all__ = ["build_app"]
