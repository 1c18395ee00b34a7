"""Linear layers with a quantization hook.

Data flow: model -> layer.forward(x) -> layer.quant_method.apply(layer, x, bias). The layer owns
shapes, shard layout and checkpoint loading; the quant method owns the parameters that hold the
weight and the matmul. So one model file runs unquantized, GGUF, GPTQ, AWQ, EXL2 or FP8 weights by
handing each layer a different method (via a `QuantConfig`); LoRA adds its delta after `apply`.

Merged layers (`QKVLinear`, `MergedColumnLinear`) hold several checkpoint tensors side by side on
the output dimension so one GEMM replaces two or three; `weight_loader(param, loaded, shard_id)`
copies one checkpoint tensor into its slice.

Tensor parallelism (`-tp N`, layers/parallel.py): the merged layers are column-parallel (each rank
holds its heads / its share of gate and up), `RowParallelLinear` (o_proj, down_proj) holds its
input columns and sums the ranks' partial outputs with one all-reduce. `tp_rows(i)` / `tp_cols()`
say which slice of checkpoint tensor i the rank holds; the loaders (this one, and quant methods
that keep their own layout, e.g. GGUF blocks) copy only that slice. Plain `Linear` is replicated.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from paphos.layers import parallel
from paphos.layers.parallel import SINGLE, Slice, TPGroup
from paphos.layers.weights import copy_checked


class LinearMethod(Protocol):
    def create_weights(
        self, layer: LinearBase, input_size: int, output_size: int, params_dtype: torch.dtype
    ) -> None:
        """Register the parameters holding the weight on `layer`, each with a `weight_loader`
        attribute and, where the output dimension is sharded by merged layers, `output_dim`."""

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., input_size] -> [..., output_size]."""

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Repack once after every shard is loaded (e.g. into a faster kernel's layout)."""


class AdapterDelta(Protocol):
    """What LoRA adds beside the base matmul (paphos/lora/layers.py): y += delta(x), in place.
    `begin(x)` is called before the base matmul (the part that needs only x may run beside it)
    and its result is handed to `finish` with the base output."""

    def begin(self, x: torch.Tensor) -> object: ...

    def finish(self, pending: object, y: torch.Tensor) -> torch.Tensor: ...


class QuantConfig(Protocol):
    """Chooses the linear method of each layer by its module path (e.g.
    'model.layers.3.self_attn.qkv_proj'); None means unquantized."""

    def get_linear_method(self, prefix: str) -> LinearMethod | None: ...


class UnquantizedLinearMethod:
    def create_weights(
        self, layer: LinearBase, input_size: int, output_size: int, params_dtype: torch.dtype
    ) -> None:
        weight = nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype), requires_grad=False)
        weight.output_dim = 0  # type: ignore[attr-defined]
        weight.input_dim = 1  # type: ignore[attr-defined]
        weight.weight_loader = layer.weight_loader  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        return None


class LinearBase(nn.Module):
    """y = x W^T (+ b), with W laid out as the concatenation of `output_sizes` shards."""

    # The tensor-parallel group of a sharded layer (set by the parallel-aware subclasses before
    # their weights are created); unsharded layers hold whole checkpoint tensors.
    tp: TPGroup = SINGLE
    sharded: bool = False

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        params_dtype = params_dtype or torch.get_default_dtype()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(output_sizes)
        self.quant_method: LinearMethod = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, input_size, self.output_size, params_dtype)
        # Attached by the engine when LoRA is enabled (paphos/lora/slots.py).
        self.lora: AdapterDelta | None = None
        if bias:
            # Biases stay unquantized in every format we support.
            b = nn.Parameter(torch.empty(self.output_size, dtype=params_dtype), requires_grad=False)
            b.output_dim = 0  # type: ignore[attr-defined]
            b.weight_loader = self.weight_loader  # type: ignore[attr-defined]
            self.bias = b
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is None:
            return self.quant_method.apply(self, x, self.bias)
        pending = self.lora.begin(x)
        return self.lora.finish(pending, self.quant_method.apply(self, x, self.bias))

    def shard_index(self, shard_id: object) -> int:
        raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")

    def tp_rows(self, index: int) -> Slice:
        """The output rows of checkpoint tensor `index` (q/k/v, gate/up, ...) this rank holds."""
        return Slice.whole(self.output_sizes[index])

    def tp_cols(self) -> Slice:
        """The input columns of the checkpoint tensors this rank holds."""
        return Slice.whole(self.input_size)

    def _rank_part(self, param: torch.Tensor, loaded: torch.Tensor, index: int) -> torch.Tensor:
        """This rank's slice of a checkpoint tensor, along the parameter's `output_dim` /
        `input_dim` (scaled: a packed parameter keeps its share). A row-parallel bias is added
        once, by rank 0: the other ranks hold zeros. A parameter marked `tp_replicated` holds
        values for every input column and is copied whole by a row-parallel layer."""
        rows, cols = self.tp_rows(index), self.tp_cols()
        if not rows.is_whole:
            loaded = rows.narrow(loaded, getattr(param, "output_dim", 0))
        if not cols.is_whole:
            if param is self.bias:
                return loaded if self.tp.rank == 0 else torch.zeros_like(loaded)
            if getattr(param, "tp_replicated", False):
                return loaded  # the same on every rank (e.g. per-output-channel scales)
            dim = getattr(param, "input_dim", None)
            if dim is None:
                raise ValueError(f"{type(self).__name__}: a parameter without input_dim cannot be split by input")
            loaded = cols.narrow(loaded, dim)
        return loaded

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        if self.sharded:
            loaded = self._rank_part(param, loaded, 0 if shard_id is None else self.shard_index(shard_id))
        if shard_id is None:
            copy_checked(param.data, loaded)
            return
        index = self.shard_index(shard_id)
        dim = getattr(param, "output_dim", 0)
        # Slice proportionally: a packed or grouped parameter (e.g. 8 int4 per int32 on the output
        # axis) keeps each shard's share of the output dimension.
        n = param.shape[dim]
        start = sum(self.output_sizes[:index]) * n // self.output_size
        length = self.output_sizes[index] * n // self.output_size
        copy_checked(param.data.narrow(dim, start, length), loaded)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_sizes}, bias={self.bias is not None}"


class Linear(LinearBase):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_method: LinearMethod | None = None,
    ) -> None:
        super().__init__(input_size, [output_size], bias, params_dtype, quant_method)


class RowParallelLinear(Linear):
    """A linear layer whose input dimension is split over the tensor-parallel ranks (o_proj,
    down_proj): each rank multiplies its columns of x by its columns of W and one all-reduce sums
    the partial outputs. `input_size` is the whole layer's; unsharded outside tensor parallelism."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_method: LinearMethod | None = None,
    ) -> None:
        self.tp = parallel.current()
        self.sharded = self.tp.size > 1
        self._cols = self.tp.split(input_size)
        super().__init__(self._cols.length, output_size, bias, params_dtype, quant_method)

    def tp_cols(self) -> Slice:
        return self._cols

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return self.tp.all_reduce(y) if self.sharded else y


class MergedColumnLinear(LinearBase):
    """Several projections of the same input stacked on the output axis; shard ids are 0, 1, ...
    (e.g. gate_proj -> 0, up_proj -> 1). Column-parallel: each rank holds an even share of each
    projection's rows (`output_sizes` are the whole layer's)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_method: LinearMethod | None = None,
    ) -> None:
        self.tp = parallel.current()
        self.sharded = self.tp.size > 1
        self._rows = [self.tp.split(n) for n in output_sizes]
        super().__init__(input_size, [r.length for r in self._rows], bias, params_dtype, quant_method)

    def tp_rows(self, index: int) -> Slice:
        return self._rows[index]

    def shard_index(self, shard_id: object) -> int:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard id must be 0..{len(self.output_sizes) - 1}, got {shard_id!r}")
        return shard_id


class QKVLinear(LinearBase):
    """Fused q/k/v projection: output [q (Hq*D) | k (Hkv*D) | v (Hkv*D)]; shard ids 'q','k','v'.
    Column-parallel by heads: each rank holds its query heads and the KV heads they read
    (`num_heads` / `num_kv_heads` are this rank's; layers/parallel.py `kv_head_slice`)."""

    SHARDS = ("q", "k", "v")

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_method: LinearMethod | None = None,
    ) -> None:
        self.tp = parallel.current()
        self.sharded = self.tp.size > 1
        self._rows = parallel.qkv_rows(num_heads, num_kv_heads, head_dim, self.tp)
        self.num_heads, self.num_kv_heads = self._rows[0].length // head_dim, self._rows[1].length // head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(
            hidden_size, [self.q_size, self.kv_size, self.kv_size], bias, params_dtype, quant_method
        )

    def tp_rows(self, index: int) -> Slice:
        return self._rows[index]

    def shard_index(self, shard_id: object) -> int:
        if shard_id not in self.SHARDS:
            raise ValueError(f"shard id must be one of {self.SHARDS}, got {shard_id!r}")
        return self.SHARDS.index(shard_id)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
