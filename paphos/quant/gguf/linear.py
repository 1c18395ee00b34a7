"""GGUF weights kept in their quantized blocks: `GGUFQuantConfig` and `GGUFLinearMethod`.

Data flow (engine start-up; chosen for every .gguf model):
`quant_config_for_source` -> `GGUFQuantConfig` (the file's tensor table) -> the model asks
`get_linear_method(prefix)` per linear layer -> `GGUFLinearMethod.create_weights` registers
`weight`: flat uint8, the raw bytes of each checkpoint tensor of the layer side by side (q|k|v or
gate|up may have different types; `shards` lists them) -> `ModelSource.load_into` asks the GGUF
loader for those tensors raw (`raw_tensor_names`) and the shard loader copies their bytes ->
`process_weights_after_loading` picks a kernel (kernels.py; first whose `can_implement` accepts)
and lets it repack -> `apply(x)` runs it.

So weight memory is the file's tensor bytes (plus whatever a kernel's repacking adds; the CPU
fallback for types without a packed kernel dequantizes at load, see kernels.py). Layers whose
weights the file stores as F32, and the output head (tied to the embedding or not), stay float:
the embedding is a row gather that the loader dequantizes at load.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import nn

from paphos.layers.linear import LinearBase
from paphos.layers.weights import copy_checked
from paphos.loader.gguf_loader import GGUFCheckpoint
from paphos.loader.gguf_reader import GGUFTensor
from paphos.quant.gguf.dequant import SUPPORTED_TYPES
from paphos.quant.gguf.kernels import GGUFKernel, GGUFShard, raw_shard, select_kernel

logger = logging.getLogger(__name__)

# Our merged layers -> the checkpoint projections they hold, in output order (the model's
# stacking, as vLLM's `packed_modules_mapping`).
PACKED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def checkpoint_names(prefix: str) -> list[str]:
    """The HF weight names that fill the layer at module path `prefix`, in output order."""
    parent, _, leaf = prefix.rpartition(".")
    if leaf in PACKED_MODULES:
        return [f"{parent}.{part}.weight" if parent else f"{part}.weight" for part in PACKED_MODULES[leaf]]
    return [f"{prefix}.weight"]


class GGUFLinearMethod:
    """A linear layer over raw GGUF blocks. `tensors`: (HF name, GGUF tensor) of each shard, in
    output order. One instance per layer (it keeps the layer's shard table and kernel)."""

    def __init__(self, tensors: list[tuple[str, GGUFTensor]]) -> None:
        # Only the table is kept, not the tensors: their data are views that pin the file mapping.
        self.layout = [(name, t.tensor_type.name, t.shape, t.n_bytes) for name, t in tensors]
        self.raw_tensor_names: tuple[str, ...] = tuple(name for name, _ in tensors)
        self.shards: tuple[GGUFShard, ...] = ()
        self.dtype = torch.float32
        self.kernel: GGUFKernel | None = None

    def create_weights(
        self, layer: LinearBase, input_size: int, output_size: int, params_dtype: torch.dtype
    ) -> None:
        shards, row, offset = [], 0, 0
        for name, type_name, shape, n_bytes in self.layout:
            if len(shape) != 2 or shape[1] != input_size:
                raise ValueError(f"{name}: GGUF shape {list(shape)} does not take {input_size} inputs")
            shard = GGUFShard(name, type_name, shape[0], n_bytes // shape[0], row, offset)
            shards.append(shard)
            row, offset = row + shard.rows, offset + shard.n_bytes
        if row != output_size:
            raise ValueError(f"{'+'.join(self.raw_tensor_names)}: {row} GGUF rows for {output_size} outputs")
        self.shards, self.dtype = tuple(shards), params_dtype
        weight = nn.Parameter(torch.empty(offset, dtype=torch.uint8), requires_grad=False)

        def load_shard(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
            index = 0 if shard_id is None else layer.shard_index(shard_id)
            copy_checked(raw_shard(param.data, self.shards[index]), loaded)

        weight.weight_loader = load_shard  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        self.kernel = select_kernel(self.shards, layer.weight.device, self.dtype)
        self.kernel.prepare(layer, self.shards, self.dtype)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernel is None:
            raise RuntimeError(f"{'+'.join(self.raw_tensor_names)}: GGUF weights used before loading")
        y = self.kernel.apply(layer, x.reshape(-1, x.shape[-1]))
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


class GGUFQuantConfig:
    """Gives every linear layer whose checkpoint tensors are quantized (or F16/BF16) a
    `GGUFLinearMethod`. `tensors`: the file's tensors by HF name (as the GGUF loader names them)."""

    def __init__(self, tensors: Mapping[str, GGUFTensor]) -> None:
        self.tensors = dict(tensors)

    @classmethod
    def from_checkpoint(cls, checkpoint: GGUFCheckpoint) -> GGUFQuantConfig:
        return cls(checkpoint.tensors_by_hf_name())

    def get_linear_method(self, prefix: str) -> GGUFLinearMethod | None:
        if prefix == "lm_head":
            return None  # loaded as a float parameter (see the module docstring)
        names = checkpoint_names(prefix)
        tensors = [self.tensors.get(n) for n in names]
        if any(t is None for t in tensors):
            logger.warning("%s: no GGUF tensor for %s; the layer stays float", prefix, names)
            return None
        types = {t.tensor_type.name for t in tensors}  # type: ignore[union-attr]
        if types == {"F32"} or not types <= set(SUPPORTED_TYPES):
            return None  # float32 as stored, or a type only the loader's numpy path knows
        return GGUFLinearMethod(list(zip(names, tensors, strict=True)))  # type: ignore[arg-type]
