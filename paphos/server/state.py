"""What every route needs: the engine, the served names, server settings (stored on `app.state`).

Routes reach the engine only through `ServerState.ready_engine()`, which answers 503 while the
model is still loading or after the engine died, so no route touches a half-built engine. A
request's `model` is resolved here (`ServerState.resolve_model`) into the name its response echoes
and the LoRA adapter it runs with, read from the engine's one adapter registry (paphos/lora).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import Request

from paphos.config import ModelConfig, ServerConfig
from paphos.core.protocol import LoRARequest
from paphos.lora.registry import LoRARegistry
from paphos.outputs import RequestOutput
from paphos.sampling_params import SamplingParams
from paphos.server.errors import APIError

if TYPE_CHECKING:
    from paphos.engine.async_engine import RequestStats


class EngineClient(Protocol):
    """The part of `paphos.engine.async_engine.AsyncEngine` the HTTP layer uses."""

    is_ready: bool
    errored: bool
    error: BaseException | None
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    model_config: ModelConfig
    # The adapter names (contract §3.6); usable once the engine is ready.
    lora_registry: LoRARegistry

    async def start(self) -> None: ...

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        lora: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    async def add_lora(
        self, name: str, path: str, base_model_name: str | None = None, replace: bool = False
    ) -> LoRARequest:
        """Validates and registers an adapter (off the event loop); raises LoRAError (400) or
        LoRANotFoundError (404)."""
        ...

    async def remove_lora(self, name: str) -> None:
        """Unregisters `name` now (running requests finish with it); raises LoRANotFoundError (404)
        or LoRAError (400, LoRA disabled)."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict[str, float]: ...

    def cache_config_info(self) -> dict[str, str]: ...

    def lora_info(self) -> dict[str, str] | None: ...

    def add_request_observer(self, observer: Callable[[RequestStats], None]) -> None: ...

    async def shutdown(self) -> None: ...


@dataclass(frozen=True)
class ModelChoice:
    """What a request runs with: the name its response echoes, and its adapter (None: the base)."""

    name: str
    lora: LoRARequest | None = None


@dataclass
class ServerState:
    engine: EngineClient
    config: ServerConfig
    served_model_names: tuple[str, ...]
    # Set when engine.start() raised; the engine may not have flagged itself as errored.
    start_error: BaseException | None = None
    # Longest vocabulary entry in characters, for the cheap "prompt is surely too long" check.
    _max_token_chars: int | None = field(default=None, repr=False)

    @property
    def model_name(self) -> str:
        """The name echoed in responses (contract §1.2: the first served name)."""
        return self.served_model_names[0]

    def ready_engine(self) -> EngineClient:
        engine = self.engine
        if engine.errored or self.start_error is not None:
            raise APIError(503, f"The engine is not running: {engine.error or self.start_error or 'it stopped'}")
        if not engine.is_ready:
            raise APIError(503, "The model is still loading; retry when GET /health returns 200.")
        return engine

    def resolve_model(self, name: str | None) -> ModelChoice:
        """`model` is optional; a given one must be a served name or a loaded adapter (404 otherwise).

        Responses echo the first served name for the base model and the adapter's own name for an
        adapter (contract §3.1). Adapter names are known only once the engine is ready, so a name
        that is not served answers 503 while the model loads.
        """
        if not name or name in self.served_model_names:
            return ModelChoice(self.model_name)
        lora = self.ready_engine().lora_registry.get(name)
        if lora is None:
            raise APIError(404, f"The model `{name}` does not exist.", "model")
        return ModelChoice(name, lora)

    @property
    def max_logprobs(self) -> int:
        return self.engine.model_config.max_logprobs

    @property
    def max_token_chars(self) -> int:
        if self._max_token_chars is None:
            self._max_token_chars = _longest_token_chars(self.engine.tokenizer)
        return self._max_token_chars


def _longest_token_chars(tokenizer: Any) -> int:
    # Vocabulary strings are at least as long as the text they decode to (byte-level BPE spells
    # each byte as one char; byte-fallback pieces like <0x0A> are longer), so this bounds from
    # above how many characters one token can cover.
    try:
        vocab = tokenizer.hf.get_vocab()
        return max(8, max(len(t) for t in vocab))
    except Exception:  # noqa: BLE001 - any tokenizer without a vocab listing: be generous
        return 1024


def get_state(request: Request) -> ServerState:
    return request.app.state.paphos
