"""Device slots for adapters (engine core, model runner side).

Data flow: ModelRunner.execute -> `AdapterSlots.prepare(lora id per request, tokens per request)`
-> each adapter of the step gets a slot (copied from the host cache, host_cache.py, when not
resident; the least recently used slot no request of this step needs is reused) -> the step's
token -> slot mapping goes into the shared `LoRABatch` -> every LoRA projection (layers.py) reads it
during the forward pass.

The scheduler admits requests so that the running ones use at most `--max-loras` adapters
(core/adapter_gate.py), so a step always finds enough slots.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from paphos.lora.host_cache import AdapterHostCache
from paphos.lora.kernels import triton_sgmv
from paphos.lora.layers import LoRABatch, LoRALinear, adapter_slices
from paphos.lora.spec import LORA_TARGETS

logger = logging.getLogger(__name__)


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
            for name, linear in (("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
                                 ("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)):
                lora = LoRALinear(linear.output_sizes, linear.input_size, max_rank, self.batch, dtype)
                linear.lora = lora
                self.projections.append((layer_idx, LORA_TARGETS[name], lora))
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, least recent first
        self._free = list(range(num_slots))
        self.slot_ranks = [0] * num_slots
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
            if lora_id in self._slot_of:
                self._slot_of.move_to_end(lora_id)
            else:
                self._load(lora_id, step_ids)
        slots = np.array([self._slot_of[i] if i else -1 for i in lora_ids], dtype=np.int32)
        self.batch.set(np.repeat(slots, counts), self.slot_ranks)

    def _load(self, lora_id: int, step_ids: set[int]) -> None:
        if self._free:
            slot = self._free.pop()
        else:
            victim = next(i for i in self._slot_of if i not in step_ids)
            slot = self._slot_of.pop(victim)
        adapter = self.host.get(lora_id)
        for layer_idx, modules, lora in self.projections:
            lora.load(slot, adapter_slices(adapter, layer_idx, modules))
        self.slot_ranks[slot] = adapter.rank
        self._slot_of[lora_id] = slot

    def unload(self, lora_id: int) -> None:
        """An unregistered adapter's slot is free for the next one (requests still using it keep
        it: the scheduler keeps them running and `prepare` reloads it from the host if needed)."""
        slot = self._slot_of.pop(lora_id, None)
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
