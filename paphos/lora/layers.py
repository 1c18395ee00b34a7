"""The adapters' contribution to one projection: y += B_s (A_s x) for each token's adapter slot s.

Data flow: model layer -> LinearBase.forward -> `LoRALinear.begin(x)` (the shrink, h = A x) -> base
matmul (any weight format) -> `LoRALinear.finish` (the expand, y += B h) -> kernels/ over the
step's `LoRABatch` mapping. The adapter acts on the activations beside the base weights, so no
weight format is dequantized for it.

On the GPU the shrink runs on a side stream, forked after x is ready and joined before the
expand, so it overlaps the base matmul (CUDA graphs record the two branches): a decode step's
shrink is a few microseconds of latency, not of bandwidth, and hides behind a weight-bound GEMM.

Per projection the device holds every slot's weights stacked and zero-padded to --max-lora-rank:
`a` [S, n_slices * R, in] and `b` [S, out, R], where a merged projection (q|k|v, gate|up) keeps
each checkpoint module's A in its own R-row band and its B rows at that module's output offset.
The PEFT scale is already folded into B (peft.py).
"""

from __future__ import annotations

import numpy as np
import torch

from paphos.lora.kernels.mapping import HostMapping, LoRAMapping, build_mapping
from paphos.lora.kernels.reference import expand_ref, shrink_ref
from paphos.lora.kernels.triton_sgmv import lora_expand, lora_shrink
from paphos.lora.peft import LoRAAdapter


class LoRABatch:
    """The step's token -> slot mapping, shared by every LoRA projection of the model.

    The kernels' launch grids follow the mapping's capacity (rows of the batch), so each forward
    gets a mapping of its own row count: a fresh one for an eager step, and for each CUDA graph
    batch size a fixed set of device buffers, rewritten in place before its replays (and before
    its capture, outside it), so the graph recorded with them reads the current step's mapping.
    """

    def __init__(self, num_slots: int, device: torch.device, use_triton: bool) -> None:
        self.num_slots = num_slots
        self.device = device
        # The Triton kernels' stream for the shrinks beside the base matmuls (module docstring);
        # None: the torch reference, in order.
        self.side_stream = torch.cuda.Stream(device) if use_triton else None
        # Whether the forward runs the adapters: some token of the step uses one, or a CUDA
        # graph is being recorded (its replays then always run them).
        self.active = False
        self._token_slots = np.zeros(0, dtype=np.int32)
        self._slot_ranks: list[int] = [0] * num_slots
        self._mapping: LoRAMapping | None = None
        # Graph batch size -> (its buffers, the host mapping last written into them).
        self._graph_buffers: dict[int, tuple[LoRAMapping, HostMapping | None]] = {}

    def set(self, token_slots: np.ndarray, slot_ranks: list[int]) -> None:
        """The step's slot per token row (-1: no adapter) and the rank in each slot."""
        self._token_slots = token_slots
        self._slot_ranks = list(slot_ranks)
        self.active = bool((token_slots >= 0).any())
        self._mapping = None

    def record_graphs(self, batch_sizes: list[int]) -> None:
        """Fixed buffers for these graph batch sizes; the kernels are recorded in every graph."""
        for rows in batch_sizes:
            self._graph_buffers[rows] = (LoRAMapping.empty(self.num_slots, rows, self.device), None)
        self.active = True

    def mapping_for(self, rows: int) -> LoRAMapping:
        """The step's mapping for a forward over `rows` rows (the step's tokens, or a graph's
        padded batch)."""
        if self._mapping is not None and self._mapping.capacity == rows:
            return self._mapping
        host = build_mapping(self._token_slots, self._slot_ranks, self.num_slots, rows)
        graph = self._graph_buffers.get(rows)
        if graph is None:
            self._mapping = LoRAMapping.from_host(host, self.device)
        else:
            buffers, written = graph
            if written is None or not _same(written, host):
                buffers.write(host)
                self._graph_buffers[rows] = (buffers, host)
            self._mapping = buffers
        return self._mapping


def _same(a: HostMapping, b: HostMapping) -> bool:
    return (
        np.array_equal(a.slot_starts, b.slot_starts) and np.array_equal(a.slot_ranks, b.slot_ranks)
        and np.array_equal(a.sorted_token_ids, b.sorted_token_ids)
    )


class LoRALinear:
    def __init__(
        self, out_sizes: list[int], in_size: int, max_rank: int, batch: LoRABatch, dtype: torch.dtype,
    ) -> None:
        self.max_rank = max_rank
        self.batch = batch
        self.num_slices = len(out_sizes)
        starts = np.concatenate([[0], np.cumsum(out_sizes)]).tolist()
        self.slice_starts: tuple[int, ...] = tuple(int(s) for s in starts)
        n = batch.num_slots
        self.a = torch.zeros(n, self.num_slices * max_rank, in_size, dtype=dtype, device=batch.device)
        self.b = torch.zeros(n, self.slice_starts[-1], max_rank, dtype=dtype, device=batch.device)

    def load(self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Writes one adapter's (A, B) per slice into `slot` (None: the adapter skips that module)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for j, pair in enumerate(weights):
            if pair is None:
                continue
            a, b = pair
            rank = a.shape[0]
            r0 = j * self.max_rank
            self.a[slot, r0 : r0 + rank].copy_(a, non_blocking=True)
            self.b[slot, self.slice_starts[j] : self.slice_starts[j + 1], :rank].copy_(b, non_blocking=True)

    def begin(self, x: torch.Tensor) -> tuple[torch.Tensor, LoRAMapping] | None:
        """h = x A^T per token (None when no token of the step uses an adapter). h is allocated
        on the main stream before the fork: the main stream frees it after the expand, which
        follows the join."""
        batch = self.batch
        if not batch.active:
            return None
        mapping = batch.mapping_for(x.shape[0])
        h = torch.empty(mapping.capacity, self.a.shape[1], dtype=torch.float32, device=x.device)
        side = batch.side_stream
        if side is None:
            shrink_ref(x, self.a, mapping, h)
        else:
            side.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(side):
                lora_shrink(x, self.a, mapping, h, n_slices=self.num_slices)
        return h, mapping

    def finish(self, pending: tuple[torch.Tensor, LoRAMapping] | None, y: torch.Tensor) -> torch.Tensor:
        """y += h B^T per token, in place."""
        if pending is None:
            return y
        h, mapping = pending
        side = self.batch.side_stream
        if side is None:
            expand_ref(h, self.b, self.slice_starts, mapping, y)
        else:
            torch.cuda.current_stream(y.device).wait_stream(side)
            lora_expand(h, self.b, self.slice_starts, mapping, y)
        return y


def adapter_slices(adapter: LoRAAdapter, layer_idx: int, modules: tuple[str, ...]) -> list[
    tuple[torch.Tensor, torch.Tensor] | None
]:
    return [adapter.weights.get((layer_idx, m)) for m in modules]
