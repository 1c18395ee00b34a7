"""Device slots for adapters (engine core, model runner side).

Data flow: ModelRunner.execute -> `AdapterSlots.prepare(lora id per request, tokens per request)`
-> each adapter of the step gets a slot (copied from the host cache, host_cache.py, when not
resident; the least recently used slot no request of this step needs is reused) -> the step's
token -> slot mapping goes into the shared `LoRABatch` -> every LoRA projection (layers.py) reads it
during the forward pass.

The scheduler admits requests so that the running ones use at most `--max-loras` adapters
(core/adapter_gate.py), so a step always finds enough slots.

Hot swap without stalling the batch: a copy into a slot in `prepare` sits on the step's stream,
so every request of that step waits for it (a rank-64 adapter of Llama-3-8B is 320 MiB: ~10 ms
over PCIe). So the engine core calls `prefetch` as soon as an adapter is in host memory, before
its requests reach the scheduler: on a GPU the copy goes on a stream of its own into a slot that
no unfinished request uses, while steps go on, and the core hands the requests to the scheduler
once `is_ready` (the copy's event has completed). Where no slot is free the requests go to the
scheduler at once and `prepare` loads the adapter in the step, as before. On the CPU a prefetch
copies at once.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from paphos.layers.parallel import Slice
from paphos.lora.host_cache import AdapterHostCache
from paphos.lora.kernels import triton_sgmv
from paphos.lora.layers import LoRABatch, LoRALinear, adapter_slices
from paphos.lora.peft import LoRAAdapter
from paphos.lora.spec import LORA_TARGETS, lora_projections

logger = logging.getLogger(__name__)


def rank_slices(model: Any) -> dict[str, tuple[Slice, Slice]] | None:
    """A tensor-parallel rank's part of each PEFT module, (B's output rows, A's input columns): the
    rows and columns its base layer holds (the same in every decoder layer); None unsharded."""
    slices = {}
    for ours, linear in lora_projections(model.model.layers[0]):
        for i, module in enumerate(LORA_TARGETS[ours]):
            slices[module] = (linear.tp_rows(i), linear.tp_cols())
    return None if all(rows.is_whole and cols.is_whole for rows, cols in slices.values()) else slices


class AdapterSlots:
    def __init__(
        self, model: Any, host: AdapterHostCache, num_slots: int, max_rank: int, dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.host = host
        self.num_slots = num_slots
        self.max_rank = max_rank
        self._warming_up = False
        # The Triton kernels where they run (a GPU with 16-bit tensor cores), the reference elsewhere.
        self.batch = LoRABatch(num_slots, device, triton_sgmv.supports(device))
        # (layer index, PEFT modules of the projection, its LoRALinear), for slot loads.
        self.projections: list[tuple[int, tuple[str, ...], LoRALinear]] = []
        for layer_idx, layer in enumerate(model.model.layers):
            # This rank's sizes with tensor parallelism: the host cache holds adapters sliced alike.
            for name, linear in lora_projections(layer):
                lora = LoRALinear(linear.output_sizes, linear.input_size, max_rank, self.batch, dtype)
                linear.lora = lora
                self.projections.append((layer_idx, LORA_TARGETS[name], lora))
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, least recent first
        self._free = list(range(num_slots))
        self.slot_ranks = [0] * num_slots
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # Slot -> (the event its prefetch copy records, the adapter copied: its pinned host tensors
        # stay referenced until the copy is done).
        self._copies: dict[int, tuple[torch.cuda.Event, LoRAAdapter]] = {}
        # Adapters prefetched for requests the core still holds: not evicted by `prepare`'s loads.
        self._reserved: set[int] = set()
        nbytes = sum(p.a.numel() * p.a.element_size() + p.b.numel() * p.b.element_size() for _, _, p in self.projections)
        logger.info("LoRA: %d device slots of rank <= %d (%.1f MiB)", num_slots, max_rank, nbytes / (1 << 20))

    def prepare(self, lora_ids: list[int], counts: list[int]) -> None:
        """Sets the step's mapping: request i (adapter lora_ids[i], 0 = none) has counts[i] tokens."""
        if self._warming_up:
            self.batch.set(np.zeros(sum(counts), dtype=np.int32), [self.max_rank] + [0] * (self.num_slots - 1))
            return
        step_ids = {i for i in lora_ids if i}
        if len(step_ids) > self.num_slots:
            raise RuntimeError(f"a step uses {len(step_ids)} adapters, more than --max-loras {self.num_slots}")
        for lora_id in step_ids:
            self._reserved.discard(lora_id)
            if lora_id in self._slot_of:
                self._slot_of.move_to_end(lora_id)
                self._wait_for_copy(self._slot_of[lora_id])
            else:
                self._load(lora_id, None if self._free else self._victim(step_ids))
        slots = np.array([self._slot_of[i] if i else -1 for i in lora_ids], dtype=np.int32)
        self.batch.set(np.repeat(slots, counts), self.slot_ranks)

    def prefetch(self, lora_id: int, in_use: set[int]) -> bool:
        """Starts copying a host-resident adapter into a slot that no adapter of `in_use` (those
        of unfinished requests) holds -> whether it is resident or on its way; False when every
        slot is taken. The adapter stays reserved (kept by `prepare`'s loads) until a step uses
        it or `release_reservation`."""
        if lora_id in self._slot_of:
            self._slot_of.move_to_end(lora_id)
            self._reserved.add(lora_id)
            return True
        victim = None if self._free else self._victim(in_use | self._reserved)
        if not self._free and victim is None:
            return False
        if self._copy_stream is None:
            self._load(lora_id, victim)
        else:
            # After the work already queued (a step may still read the slot's old adapter); steps
            # queued from now on run beside the copy.
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.batch.device))
            with torch.cuda.stream(self._copy_stream):
                slot, adapter = self._load(lora_id, victim)
                event = torch.cuda.Event()
                event.record(self._copy_stream)
            self._copies[slot] = (event, adapter)
        self._reserved.add(lora_id)
        return True

    def is_ready(self, lora_id: int) -> bool:
        """Resident with its copy complete (a prefetched adapter may be evicted before that by a
        step that needed every slot: then False until it is loaded again)."""
        slot = self._slot_of.get(lora_id)
        if slot is None:
            return False
        copy = self._copies.get(slot)
        if copy is not None and copy[0].query():
            del self._copies[slot]
            copy = None
        return copy is None

    def is_resident(self, lora_id: int) -> bool:
        return lora_id in self._slot_of

    def wait_ready(self, lora_id: int) -> None:
        """Blocks the host until the adapter's prefetch copy is done (for a core with nothing else
        to run)."""
        copy = self._copies.get(self._slot_of.get(lora_id, -1))
        if copy is not None:
            copy[0].synchronize()

    def release_reservation(self, lora_id: int) -> None:
        """The core holds no more requests for this prefetched adapter."""
        self._reserved.discard(lora_id)

    def _victim(self, keep: set[int]) -> int | None:
        """The least recently used adapter outside `keep` and not reserved, else a reserved one
        outside `keep` (the core then sees it is no longer resident)."""
        victim = next((i for i in self._slot_of if i not in keep and i not in self._reserved), None)
        if victim is None:
            victim = next((i for i in self._slot_of if i not in keep), None)
        return victim

    def _load(self, lora_id: int, victim: int | None) -> tuple[int, LoRAAdapter]:
        """Copies the adapter into a free slot (victim None), else into `victim`'s, on the current
        stream."""
        if victim is None:
            slot = self._free.pop()
        else:
            slot = self._slot_of.pop(victim)
            self._reserved.discard(victim)
        self._wait_for_copy(slot)  # a prefetch into the slot may still be writing it
        adapter = self.host.get(lora_id)
        for layer_idx, modules, lora in self.projections:
            lora.load(slot, adapter_slices(adapter, layer_idx, modules))
        self.slot_ranks[slot] = adapter.rank
        self._slot_of[lora_id] = slot
        return slot, adapter

    def _wait_for_copy(self, slot: int) -> None:
        """The current stream waits (on the device) for a prefetch copy into `slot`."""
        copy = self._copies.pop(slot, None)
        if copy is not None:
            torch.cuda.current_stream(self.batch.device).wait_event(copy[0])

    def unload(self, lora_id: int) -> None:
        """An unregistered adapter's slot is free for the next one (requests still using it keep
        it: the scheduler keeps them running and `prepare` reloads it from the host if needed)."""
        slot = self._slot_of.pop(lora_id, None)
        self._reserved.discard(lora_id)
        if slot is not None:
            self.slot_ranks[slot] = 0
            self._free.append(slot)

    @contextmanager
    def warming_up(self) -> Iterator[None]:
        """Inside, every row of a step uses slot 0 at the maximal rank, whose weights are still
        zeros (before any adapter is resident): the forward launches the adapters' kernels, so
        Triton compiles their variants, and adds nothing."""
        if self._slot_of:
            raise RuntimeError("LoRA kernels are warmed up before any adapter is resident")
        self._warming_up = True
        try:
            yield
        finally:
            self._warming_up = False

    @property
    def num_resident(self) -> int:
        return len(self._slot_of)
