"""Tensor parallelism inside the layers: which slice of each checkpoint tensor this rank holds,
and the two collectives of a forward pass (docs/tensor-parallel.md).

Data flow (`-tp N`, N > 1): worker setup builds the model inside `building(TPGroup(rank, N))`;
the parallel-aware layers read `current()` once, at construction, and keep it:
- column-parallel (`QKVLinear`, `MergedColumnLinear`, paphos/layers/linear.py): this rank's
  output rows of every checkpoint tensor (its query heads, its KV heads, its share of gate/up);
- row-parallel (`RowParallelLinear`: o_proj, down_proj): this rank's input columns, then one
  all-reduce of the partial sums (an EXL2 layer, whose stored rows are permuted, first
  all-gathers x: `all_gather_last_dim`, paphos/quant/exl2.py);
- vocab-parallel (`VocabEmbedding`, `LMHead`, paphos/layers/embedding.py): this rank's rows of
  the vocabulary; lookups are masked to them and all-reduced, logits are gathered to rank 0 (the
  only rank that samples).
Loaders copy only the rank's slice (`Slice`) of each checkpoint tensor into the parameters.

With N = 1 (`SINGLE`) no layer is sharded, no collective runs and every slice is the whole
tensor: the code path is the one without tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Slice:
    """The part of one checkpoint dimension a rank holds: `length` entries from `start` of the
    checkpoint's `full`, stored in `padded` entries (>= length; the rest are zeros: the vocabulary
    of the last rank when it does not divide evenly)."""

    start: int
    length: int
    full: int
    padded: int = -1

    def __post_init__(self) -> None:
        if self.padded < 0:
            object.__setattr__(self, "padded", self.length)

    @classmethod
    def whole(cls, size: int) -> Slice:
        return cls(0, size, size)

    @property
    def is_whole(self) -> bool:
        return self.length == self.full == self.padded

    def narrow(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This slice of `tensor`, whose `dim` holds the checkpoint dimension scaled by a constant
        (packed or blocked parameters keep their share: bytes of GGUF rows, int32 words)."""
        n = tensor.shape[dim]
        if n * self.start % self.full or n * self.length % self.full:
            raise ValueError(f"a dimension of {n} cannot be cut at [{self.start}, +{self.length}) of {self.full}")
        return tensor.narrow(dim, n * self.start // self.full, n * self.length // self.full)


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the tensor-parallel group and the collectives of the forward pass.
    `group`: the torch.distributed process group of the device tensors (NCCL on CUDA, gloo on
    the CPU); None with size 1."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def split(self, total: int) -> Slice:
        """An even split of `total` (which must divide by the group size): this rank's part."""
        if total % self.size:
            raise ValueError(f"{total} does not split evenly over {self.size} ranks")
        part = total // self.size
        return Slice(self.rank * part, part, total)

    def split_padded(self, total: int) -> Slice:
        """`total` rows in ceil(total / size) per rank, the last rank's padded with zeros."""
        part = -(-total // self.size)
        start = min(self.rank * part, total)
        return Slice(start, min(part, total - start), total, part)

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sums `x` over the ranks (`op` "max": the largest value), in place; returns it."""
        import torch.distributed as dist

        dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank: the ranks' `x` [..., n] side by side, [..., size * n] (rank order)."""
        import torch.distributed as dist

        x = x.contiguous()
        if x.device.type == "cuda":
            return _side_by_side(self._all_gather_cuda(x))
        gathered = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(gathered, x, group=self.group)
        return torch.cat(gathered, dim=-1)

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0: the ranks' `x` [..., n] side by side, [..., size * n] (rank order). Other
        ranks: their own `x` (nothing reads it; only rank 0 samples)."""
        import torch.distributed as dist

        x = x.contiguous()
        if x.device.type == "cuda":
            # The all-gather, which graphs capture; the logits of a step are small next to the weights.
            parts = self._all_gather_cuda(x)
            return _side_by_side(parts) if self.rank == 0 else x
        gathered = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, gathered, group_dst=0, group=self.group)
        return torch.cat(gathered, dim=-1) if gathered is not None else x

    def _all_gather_cuda(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's (contiguous) `x`, in one collective that CUDA graphs
        capture like the all-reduces (NCCL's gather is a group of point-to-point sends)."""
        import torch.distributed as dist

        parts = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(parts, x, group=self.group)
        return parts


def _side_by_side(parts: torch.Tensor) -> torch.Tensor:
    """[size, ..., n] -> [..., size * n]: the parts along the last dimension, in order."""
    return parts.movedim(0, -2).reshape(*parts.shape[1:-1], parts.shape[0] * parts.shape[-1])


SINGLE = TPGroup()
_CURRENT: ContextVar[TPGroup] = ContextVar("paphos_tensor_parallel", default=SINGLE)


def current() -> TPGroup:
    """The group of the model being built (SINGLE outside `building`)."""
    return _CURRENT.get()


@contextmanager
def building(tp: TPGroup) -> Iterator[None]:
    """Layers constructed inside this block are sharded for `tp` (worker/setup.py builds the model
    in it). A context variable and not a constructor argument: every model file and test builds
    layers without naming tensor parallelism, and gets the unsharded layer."""
    token = _CURRENT.set(tp)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def row_amax(tp: TPGroup, x: torch.Tensor) -> torch.Tensor:
    """max |x| of each token's whole input row [M, 1] fp32, where each rank of a row-parallel
    layer holds some columns of x: the ranks' maxima, all-reduced. Dynamic per-token activation
    quantization (FP8, int8) scales a token by its whole row, as `-tp 1` does; each rank's own
    columns would give each rank another scale, and other numbers than `-tp 1`."""
    amax = x.reshape(-1, x.shape[-1]).float().abs().amax(dim=-1, keepdim=True)
    return tp.all_reduce(amax, op="max")


def kv_head_slice(num_kv_heads: int, tp: TPGroup) -> Slice:
    """This rank's KV heads: an even share when they divide by the group size; else (fewer KV
    heads than ranks, each a multiple of them) the one KV head its query heads read, replicated
    on size / num_kv_heads ranks."""
    if num_kv_heads % tp.size == 0:
        return tp.split(num_kv_heads)
    if tp.size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be split or replicated over {tp.size} ranks")
    return Slice(tp.rank * num_kv_heads // tp.size, 1, num_kv_heads)


def qkv_rows(num_heads: int, num_kv_heads: int, head_dim: int, tp: TPGroup) -> list[Slice]:
    """The output rows of q, k and v a rank of a column-parallel q|k|v projection holds: its
    query heads and the KV heads they read (`kv_head_slice`), head_dim rows each."""
    heads, kv_heads = tp.split(num_heads), kv_head_slice(num_kv_heads, tp)
    return [Slice(s.start * head_dim, s.length * head_dim, s.full * head_dim) for s in (heads, kv_heads, kv_heads)]
