"""The per-step token -> adapter slot mapping the LoRA kernels read.

Data flow: the model runner knows each scheduled token's adapter slot (-1: none) and the rank of
the adapter in every device slot; once per step it calls `build_mapping` (numpy, on the host) and
writes the result into the step's `LoRAMapping` (`LoRAMapping.write`), whose device buffers every
projection's LoRA apply hands to the kernels (reference.py, triton_sgmv.py). The buffers are
allocated once per capacity and only written afterwards, so a CUDA graph captured with them
replays with each step's mapping.

Besides the tokens grouped by slot (what the reference reads), the mapping lists the kernels'
work tiles: each slot's tokens cut into tiles of `tile_rows(capacity)` rows, a tile's slot, rank
and token rows side by side, so that a kernel program finds everything it needs in one round trip
to memory (two loads that depend on nothing) rather than a prefix sum over the slots followed by a
gather of token ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Up to this many tokens of capacity a step is a decode step: tiles of 16 token rows (the smallest
# tl.dot tile), since a slot holds a few tokens; above, tiles of 64 rows of prefill chunks.
DECODE_MAX_TOKENS = 64


def tile_rows(capacity: int) -> int:
    """Token rows per kernel tile for a mapping of this capacity."""
    return 16 if capacity <= DECODE_MAX_TOKENS else 64


def max_tiles(capacity: int, num_slots: int) -> int:
    """Tiles the slots' tokens can need: each slot's last tile may be partial."""
    return -(-capacity // tile_rows(capacity)) + num_slots


@dataclass(frozen=True)
class HostMapping:
    """`build_mapping`'s result: what `LoRAMapping` holds, as int32 numpy arrays."""

    sorted_token_ids: np.ndarray  # [capacity]: token rows grouped by slot; past slot_starts[-1]: 0
    slot_starts: np.ndarray  # [S + 1]: slot s's tokens are sorted_token_ids[slot_starts[s]:slot_starts[s + 1]]
    slot_ranks: np.ndarray  # [S]: the rank of slot s's adapter, 0 for an empty slot
    tile_meta: np.ndarray  # [max_tiles, 2]: (slot, rank) of each tile; rank 0 past the last tile
    tile_ids: np.ndarray  # [max_tiles, tile_rows]: each tile's token rows, -1 where it has fewer


@dataclass
class LoRAMapping:
    """Device int32 tensors of one step's mapping (shapes fixed by the number of slots and the
    capacity, so a captured launch replays with whatever mapping is written into them), and the
    host copy of slot_starts that the torch reference reads without a device sync."""

    sorted_token_ids: torch.Tensor  # [capacity]
    slot_starts: torch.Tensor  # [S + 1]
    slot_ranks: torch.Tensor  # [S]
    tile_meta: torch.Tensor  # [max_tiles, 2]
    tile_ids: torch.Tensor  # [max_tiles, tile_rows]
    slot_starts_host: list[int] | None = None

    @property
    def capacity(self) -> int:
        return self.sorted_token_ids.shape[0]

    @property
    def num_slots(self) -> int:
        return self.slot_ranks.shape[0]

    @property
    def tile_rows(self) -> int:
        return self.tile_ids.shape[1]

    @property
    def num_tiles(self) -> int:
        return self.tile_ids.shape[0]

    @classmethod
    def empty(cls, num_slots: int, capacity: int, device: torch.device | str) -> LoRAMapping:
        """Buffers for `write`: no token uses an adapter until then."""
        tiles = max_tiles(capacity, num_slots)
        return cls(
            torch.zeros(capacity, dtype=torch.int32, device=device),
            torch.zeros(num_slots + 1, dtype=torch.int32, device=device),
            torch.zeros(num_slots, dtype=torch.int32, device=device),
            torch.zeros(tiles, 2, dtype=torch.int32, device=device),
            torch.full((tiles, tile_rows(capacity)), -1, dtype=torch.int32, device=device),
            [0] * (num_slots + 1),
        )

    @classmethod
    def from_host(cls, host: HostMapping, device: torch.device | str) -> LoRAMapping:
        mapping = cls.empty(host.slot_ranks.shape[0], host.sorted_token_ids.shape[0], device)
        mapping.write(host)
        return mapping

    def write(self, host: HostMapping) -> None:
        """Copies `host` into the existing buffers (same slots and capacity): no reallocation, so
        graphs captured with them see the new mapping."""
        if host.sorted_token_ids.shape != self.sorted_token_ids.shape or host.slot_ranks.shape != self.slot_ranks.shape:
            raise ValueError(
                f"mapping for {host.slot_ranks.shape[0]} slots x {host.sorted_token_ids.shape[0]} tokens written into "
                f"buffers for {self.num_slots} x {self.capacity}"
            )
        self.sorted_token_ids.copy_(torch.from_numpy(host.sorted_token_ids))
        self.slot_starts.copy_(torch.from_numpy(host.slot_starts))
        self.slot_ranks.copy_(torch.from_numpy(host.slot_ranks))
        self.tile_meta.copy_(torch.from_numpy(host.tile_meta))
        self.tile_ids.copy_(torch.from_numpy(host.tile_ids))
        self.slot_starts_host = host.slot_starts.tolist()


def build_mapping(token_slots: np.ndarray, slot_ranks: list[int], num_slots: int, capacity: int) -> HostMapping:
    """token_slots [T]: each token row's slot in [0, num_slots), or -1 (no adapter) -> the mapping,
    its token ids padded to `capacity` (>= T: the rows of h the kernels may write). A stable sort,
    so each slot's tokens keep their batch order. A token in a slot of rank 0 (no adapter loaded
    there) is a caller's bug and is refused."""
    slots = np.asarray(token_slots)
    ranks = np.asarray(slot_ranks, dtype=np.int32)
    if slots.ndim != 1 or slots.shape[0] > capacity:
        raise ValueError(f"token_slots of shape {slots.shape} for a capacity of {capacity} tokens")
    if ranks.shape != (num_slots,) or (ranks < 0).any():
        raise ValueError(f"slot_ranks {slot_ranks} for {num_slots} slots")
    used = slots >= 0
    if (slots >= num_slots).any() or (slots < -1).any():
        raise ValueError(f"token slots outside [-1, {num_slots}): {np.unique(slots[(slots >= num_slots) | (slots < -1)])}")
    if (ranks[slots[used]] == 0).any():
        raise ValueError(f"tokens in empty slots (rank 0): {np.unique(slots[used][ranks[slots[used]] == 0])}")
    rows = np.flatnonzero(used)
    order = rows[np.argsort(slots[rows], kind="stable")]
    sorted_ids = np.zeros(capacity, dtype=np.int32)
    sorted_ids[: order.shape[0]] = order
    counts = np.bincount(slots[rows], minlength=num_slots)
    starts = np.zeros(num_slots + 1, dtype=np.int32)
    np.cumsum(counts, out=starts[1:])
    return HostMapping(sorted_ids, starts, ranks, *_tiles(order, counts, ranks, capacity))


def _tiles(order: np.ndarray, counts: np.ndarray, ranks: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Each slot with tokens and a nonzero rank cut into tiles of tile_rows(capacity) rows, in slot
    order: (tile_meta, tile_ids) of HostMapping. order: the token rows grouped by slot."""
    bm = tile_rows(capacity)
    num_slots = counts.shape[0]
    meta = np.zeros((max_tiles(capacity, num_slots), 2), dtype=np.int32)
    ids = np.full((meta.shape[0], bm), -1, dtype=np.int32)
    per_slot = np.where(ranks > 0, -(-counts // bm), 0)
    tile_slot = np.repeat(np.arange(num_slots, dtype=np.int32), per_slot)
    meta[: tile_slot.shape[0], 0] = tile_slot
    meta[: tile_slot.shape[0], 1] = ranks[tile_slot]
    # a token's place within its slot -> its slot's first tile + place // bm, row place % bm
    slot_of = np.repeat(np.arange(num_slots), counts)
    place = np.arange(order.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)
    first_tile = np.cumsum(per_slot) - per_slot
    ids[first_tile[slot_of] + place // bm, place % bm] = order
    return meta, ids
