"""The one registry of adapter names (API process): start-up `--lora-modules` and the runtime
load/unload routes write it; completions, chat, tokenize, Kobold and /v1/models read it.

Data flow: a route resolves the request's `model` (Kobold: `lora`) to a `LoRARequest` here; the
request carries it to the engine core, which loads the adapter's weights itself (cpu_cache.py).
Registration validates eagerly (config, tensor names and shapes, rank) so that a name, once
listed, never fails a request for a reason known at load time. Unregistering removes the name at
once; requests already sent keep their `LoRARequest` and finish with it (the core is told through
`UnloadAdapter` and frees the adapter when they are done).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

from paphos.config import LoRAConfig
from paphos.core.protocol import LoRARequest
from paphos.lora.errors import LoRAError, LoRANotFoundError
from paphos.lora.spec import LoRAModelSpec


@dataclass(frozen=True)
class RegisteredAdapter:
    request: LoRARequest
    # What /v1/models lists as the adapter's parent (None: the server's first served name).
    base_model_name: str | None


class LoRARegistry:
    def __init__(self, config: LoRAConfig, spec: LoRAModelSpec | None, served_names: tuple[str, ...]) -> None:
        self.config = config
        self.spec = spec
        self.served_names = served_names
        self._adapters: dict[str, RegisteredAdapter] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.config.enable_lora and self.spec is not None

    def _check_enabled(self) -> LoRAModelSpec:
        if not self.enabled or self.spec is None:
            raise LoRAError("LoRA adapters are not enabled on this server (start it with --enable-lora).")
        return self.spec

    def register(
        self, name: str, path: str, base_model_name: str | None = None, replace: bool = False
    ) -> LoRARequest:
        """Validates the adapter at `path` (a directory or a Hugging Face repo id) and registers it
        under `name`; blocking I/O, so async callers run it in a thread. `replace` (the
        `load_inplace` of /v1/load_lora_adapter) swaps an adapter already registered under the
        name: requests already running keep the old one."""
        from paphos.lora.peft import validate_adapter

        spec = self._check_enabled()
        if not name:
            raise LoRAError("the adapter name must not be empty")
        if name in self.served_names:
            raise LoRAError(f"the name {name!r} is the base model's; choose another adapter name")
        with self._lock:
            if name in self._adapters and not replace:
                raise LoRAError(f"an adapter named {name!r} is already loaded (unload it first, or load in place)")
        local_path = validate_adapter(path, spec, self.config.max_lora_rank)
        with self._lock:
            if name in self._adapters and not replace:
                raise LoRAError(f"an adapter named {name!r} is already loaded (unload it first, or load in place)")
            request = LoRARequest(name=name, lora_id=next(self._ids), path=local_path)
            self._adapters[name] = RegisteredAdapter(request, base_model_name)
        return request

    def unregister(self, name: str) -> LoRARequest:
        """Removes the name now; returns what it named, for the core to release when unused."""
        self._check_enabled()
        with self._lock:
            adapter = self._adapters.pop(name, None)
        if adapter is None:
            raise LoRANotFoundError(f"no adapter named {name!r} is loaded")
        return adapter.request

    def get(self, name: str) -> LoRARequest | None:
        adapter = self._adapters.get(name)
        return adapter.request if adapter is not None else None

    def adapters(self) -> list[RegisteredAdapter]:
        with self._lock:
            return list(self._adapters.values())
