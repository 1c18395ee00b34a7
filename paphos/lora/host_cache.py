"""Adapters' weights in host memory, loaded from disk off the engine core's step loop.

Data flow: EngineCore.add_request -> `acquire(lora)` (one reference per unfinished request;
starts a background load when the adapter is not cached) -> the core parks the request until
`poll()` reports its adapter loaded -> the scheduler runs it -> the model runner's device slots
(slots.py) copy the adapter's tensors from `get(lora_id)` -> `release` when the request is gone.

The cache keeps at most `capacity` adapters (--max-cpu-loras); least recently used ones without
references are evicted first. Adapters referenced by unfinished requests are never evicted, so
the cache may exceed its capacity while more distinct adapters than that are in flight, and
shrinks back as they finish. On a GPU the tensors are pinned, so slot loads copy asynchronously at
full bus speed.

Tensor parallelism (`-tp N`): every rank's cache holds its rank's part of each adapter (`slices`,
peft.py `LoRAAdapter.rank_part`). Requests reach the engine core (rank 0) only, so rank 0's cache
lists each adapter it starts loading (`take_announced`); the step message carries them to the
other ranks, whose caches start loading them at once (`announce`) and wait for the load, or load
again what they evicted, when a step's slot needs it (`get`).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from paphos.core.protocol import LoRARequest
from paphos.layers.parallel import Slice
from paphos.lora.peft import LoRAAdapter, load_adapter
from paphos.lora.spec import LoRAModelSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadFailure:
    lora_id: int
    message: str


class AdapterHostCache:
    def __init__(
        self, spec: LoRAModelSpec, max_rank: int, dtype: torch.dtype, capacity: int, pin_memory: bool,
        slices: Mapping[str, tuple[Slice, Slice]] | None = None, announces: bool = False,
    ) -> None:  # fmt: skip
        """`slices`: this tensor-parallel rank's part of each PEFT module (None: whole adapters);
        `announces`: rank 0 of a tensor-parallel group (module docstring)."""
        self.spec = spec
        self.max_rank = max_rank
        self.dtype = dtype
        self.capacity = capacity
        self.pin_memory = pin_memory
        self.slices = slices
        self._announced: list[LoRARequest] | None = [] if announces else None
        # A follower's adapters by id, as rank 0 announced them: loaded again when evicted.
        self._known: dict[int, LoRARequest] = {}
        self._entries: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._loading: dict[int, Future[LoRAAdapter]] = {}
        self._users: Counter[int] = Counter()
        self._unloaded: set[int] = set()
        # One thread: loads are disk- and memcpy-bound, and one at a time keeps the step loop's
        # share of the cores predictable.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="paphos-lora-load")

    def acquire(self, lora: LoRARequest) -> None:
        self._users[lora.lora_id] += 1
        if lora.lora_id in self._entries:
            self._entries.move_to_end(lora.lora_id)
        elif lora.lora_id not in self._loading:
            self._loading[lora.lora_id] = self._executor.submit(self._load, lora)
            if self._announced is not None:
                self._announced.append(lora)

    def take_announced(self) -> list[LoRARequest]:
        """Rank 0: the adapters it started loading since the last call, for the other ranks."""
        if self._announced is None:
            return []
        announced, self._announced = self._announced, []
        return announced

    def announce(self, lora: LoRARequest) -> None:
        """A follower rank: rank 0 started loading `lora`; load this rank's part beside the steps.
        Not referenced by requests (rank 0 counts those): trimmed least recently used."""
        self._known[lora.lora_id] = lora
        if lora.lora_id not in self._entries and lora.lora_id not in self._loading:
            self._loading[lora.lora_id] = self._executor.submit(self._load, lora)

    def release(self, lora_id: int) -> None:
        self._users[lora_id] -= 1
        if self._users[lora_id] <= 0:
            del self._users[lora_id]
            if lora_id in self._unloaded:
                self._unloaded.discard(lora_id)
                self._entries.pop(lora_id, None)
        self._trim()

    def unload(self, lora_id: int) -> None:
        """The name was unregistered: drop the weights as soon as no request uses them."""
        if self._users[lora_id] > 0:
            self._unloaded.add(lora_id)
        else:
            self._users.pop(lora_id, None)
            self._entries.pop(lora_id, None)

    def is_ready(self, lora_id: int) -> bool:
        return lora_id in self._entries

    def get(self, lora_id: int) -> LoRAAdapter:
        if lora_id not in self._entries and lora_id in self._known:  # a follower's (`announce`)
            future = self._loading.pop(lora_id, None)
            self._entries[lora_id] = future.result() if future is not None else self._load(self._known[lora_id])
            self._trim()
        adapter = self._entries[lora_id]
        self._entries.move_to_end(lora_id)
        return adapter

    @property
    def loading(self) -> bool:
        return bool(self._loading)

    def wait(self, timeout: float) -> None:
        """Blocks until a load finishes or `timeout` seconds pass (the core has nothing else to do)."""
        if self._loading:
            wait(list(self._loading.values()), timeout=timeout, return_when="FIRST_COMPLETED")

    def poll(self) -> tuple[list[int], list[LoadFailure]]:
        """Loads finished since the last call: the adapters now ready, and those that failed."""
        ready: list[int] = []
        failed: list[LoadFailure] = []
        for lora_id, future in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[lora_id]
            error = future.exception()
            if error is not None:
                logger.error("adapter %d could not be loaded: %s", lora_id, error)
                failed.append(LoadFailure(lora_id, f"the LoRA adapter could not be loaded: {error}"))
                continue
            self._entries[lora_id] = future.result()
            ready.append(lora_id)
        if ready:
            self._trim()
        return ready, failed

    def _load(self, lora: LoRARequest) -> LoRAAdapter:
        adapter = load_adapter(lora.path, self.spec, self.max_rank, self.dtype)
        if self.slices is not None:
            adapter = adapter.rank_part(self.slices)
        if self.pin_memory:
            adapter.weights = {k: (a.pin_memory(), b.pin_memory()) for k, (a, b) in adapter.weights.items()}
        logger.info("LoRA adapter %r loaded into host memory (rank %d, %.1f MiB)", lora.name, adapter.rank,
                    adapter.num_bytes() / (1 << 20))
        return adapter

    def _trim(self) -> None:
        idle = [lora_id for lora_id in self._entries if self._users[lora_id] <= 0]
        for lora_id in idle[: max(0, len(self._entries) - self.capacity)]:
            del self._entries[lora_id]
            self._users.pop(lora_id, None)

    @property
    def num_cached(self) -> int:
        return len(self._entries)
