"""GGUF weights kept in their quantized blocks: `GGUFQuantConfig` and `GGUFLinearMethod`.

Data flow (engine start-up; chosen for every .gguf model):
`quant_config_for_source` -> `GGUFQuantConfig` (the file's tensor table) -> the model asks
`get_linear_method(prefix)` per linear layer -> `GGUFLinearMethod.create_weights` registers
`weight`: flat uint8, the raw bytes of each checkpoint tensor of the layer side by side (q|k|v or
gate|up may have different types; `shards` lists them) -> `ModelSource.load_into` asks the GGUF
loader for those tensors raw (`raw_tensor_names`) and the shard loader copies their bytes ->
`process_weights_after_loading` picks a kernel (kernels.py; first whose `can_implement` accepts)
and lets it repack -> `apply(x)` runs it.

The token embedding and the output head use the same class (paphos/layers/embedding.py wires
them): `get_embedding_method('model.embed_tokens')` keeps `token_embd.weight` in its blocks and
`embed(layer, ids)` dequantizes only the gathered rows (Triton planes + one gather kernel on CUDA,
raw blocks + the torch dequantizer elsewhere), bit-equal to the table dequantized at load.
`get_linear_method('lm_head')` gives an untied head (`output.weight`) its method like any linear
layer; a tied head runs through the embedding's method (`use_as_head`): one copy of the blocks, a
matmul kernel chosen from `KERNELS`, and lookups that read that kernel's layout.

Tensor parallelism (layers/parallel.py): the layer says which slice of each checkpoint tensor
the rank holds (`tp_rows(i)`, `tp_cols()`); the shard table and the loader keep that slice of
the raw blocks: whole rows for a column-parallel layer or a vocabulary slice, a byte range of
every row for a row-parallel one, which must start and end on a block boundary of the tensor's
type (else the file cannot be split that many ways: a start-up error naming the tensor).

So weight memory is the file's tensor bytes (plus whatever a kernel's repacking adds; the CPU
fallback for types without a packed kernel dequantizes at load, see kernels.py; a tied Q8_0 head
on CPU, as in SmolLM2 and Gemma 3, is therefore one bf16 table for head and embedding, as before).
Layers whose weights the file stores as F32 stay float.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import nn

from paphos.layers import x_int8
from paphos.layers.linear import LinearBase
from paphos.layers.parallel import Slice
from paphos.layers.weights import ShapeMismatchError, copy_checked
from paphos.layers.x_int8_blocks import BlockLayout
from paphos.loader.gguf_loader import GGUFCheckpoint
from paphos.loader.gguf_reader import GGUFTensor
from paphos.quant.gguf.dequant import SUPPORTED_TYPES, dequantize
from paphos.quant.gguf.kernels import (
    DequantPerCallKernel,
    GGUFKernel,
    GGUFShard,
    embed_raw,
    raw_shard,
    select_embedding_kernel,
    select_kernel,
)
from paphos.quant.modules import checkpoint_modules

logger = logging.getLogger(__name__)

def checkpoint_names(prefix: str) -> list[str]:
    """The HF weight names that fill the layer at module path `prefix`, in output order."""
    return [f"{module}.weight" for module in checkpoint_modules(prefix)]


class GGUFLinearMethod:
    """A linear layer over raw GGUF blocks. `tensors`: (HF name, GGUF tensor) of each shard, in
    output order. One instance per layer (it keeps the layer's shard table and kernel).

    `embedding=True`: the weight is a token embedding ([vocab, hidden], one tensor): `embed(layer,
    ids)` gives its rows, bit-equal to the table dequantized at load (after the same cast). Such a
    weight serves row lookups only (kernel from `EMBEDDING_KERNELS`: never dequantized whole)
    unless `use_as_head()` is called (a head tied to the embedding): then the kernel is chosen
    like any linear layer's (`KERNELS`) and the lookups read that kernel's layout, one copy of
    the blocks for both; a kernel that cannot give exact rows (int4pack) keeps the raw blocks
    beside its own layout."""

    def __init__(self, tensors: list[tuple[str, GGUFTensor]], *, embedding: bool = False) -> None:
        # Only the table is kept, not the tensors: their data are views that pin the file mapping.
        self.layout = [(name, t.tensor_type.name, t.shape, t.n_bytes) for name, t in tensors]
        self.raw_tensor_names: tuple[str, ...] = tuple(name for name, _ in tensors)
        self.shards: tuple[GGUFShard, ...] = ()
        self.dtype = torch.float32
        self.kernel: GGUFKernel | None = None
        self.embedding = embedding
        self.matmul = not embedding
        self.rows_from_raw = False  # lookups read the raw blocks kept as `gguf_rows` (see above)

    def use_as_head(self) -> None:
        """The weight is also an output head (tied embeddings): pick a matmul kernel for it."""
        self.matmul = True

    def create_weights(
        self, layer: LinearBase, input_size: int, output_size: int, params_dtype: torch.dtype
    ) -> None:
        # This rank's slice of each tensor (tensor parallelism; the whole tensor otherwise).
        cols: Slice = layer.tp_cols() if hasattr(layer, "tp_cols") else Slice.whole(input_size)
        shards, cuts, row, offset = [], [], 0, 0
        for index, (name, type_name, shape, n_bytes) in enumerate(self.layout):
            if len(shape) != 2 or shape[1] != cols.full:
                raise ValueError(f"{name}: GGUF shape {list(shape)} does not take {cols.full} inputs")
            rows: Slice = layer.tp_rows(index) if hasattr(layer, "tp_rows") else Slice.whole(shape[0])
            if rows.full != shape[0]:
                raise ValueError(f"{name}: GGUF shape {list(shape)} has {shape[0]} rows, the layer {rows.full}")
            row_bytes, byte_start = n_bytes // shape[0], 0
            if not cols.is_whole:
                byte_start, row_bytes = _column_bytes(name, type_name, row_bytes, cols)
            shard = GGUFShard(name, type_name, rows.padded, row_bytes, row, offset)
            shards.append(shard)
            cuts.append((rows, byte_start, n_bytes // shape[0]))
            row, offset = row + shard.rows, offset + shard.n_bytes
        if row != output_size:
            raise ValueError(f"{'+'.join(self.raw_tensor_names)}: {row} GGUF rows for {output_size} outputs")
        self.shards, self.dtype = tuple(shards), params_dtype
        weight = nn.Parameter(torch.empty(offset, dtype=torch.uint8), requires_grad=False)

        def load_shard(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
            index = 0 if shard_id is None else layer.shard_index(shard_id)
            shard, (rows, byte_start, full_row_bytes) = self.shards[index], cuts[index]
            if rows.is_whole and shard.row_bytes == full_row_bytes:
                copy_checked(raw_shard(param.data, shard), loaded)
                return
            if tuple(loaded.shape) != (rows.full, full_row_bytes):
                raise ShapeMismatchError((rows.full, full_row_bytes), tuple(loaded.shape))
            part = loaded[rows.start : rows.start + rows.length, byte_start : byte_start + shard.row_bytes]
            dst = raw_shard(param.data, shard)
            copy_checked(dst[: rows.length], part)
            dst[rows.length :].zero_()  # vocabulary padding: zero blocks dequantize to zeros

        weight.weight_loader = load_shard  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        device = layer.weight.device
        select = select_kernel if self.matmul else select_embedding_kernel
        self.kernel = select(self.shards, device, self.dtype)
        raw = layer.weight.data  # kept alive past `prepare` (which may free the parameter's blocks)
        self.kernel.prepare(layer, self.shards, self.dtype)
        if not self.embedding or self._exact_rows(layer, raw):
            return
        name = self.raw_tensor_names[0]
        if self.matmul:  # a tied head: keep its kernel, and the raw blocks beside it for lookups
            logger.info(
                "%s: no exact rows from the %s kernel; lookups read raw blocks", name, self.kernel.name
            )
            layer.register_buffer("gguf_rows", raw.view(self.shards[0].rows, -1), persistent=False)
            self.rows_from_raw = True
            return
        logger.warning(
            "%s: the %s kernel's rows are not exact; lookups read raw blocks", name, self.kernel.name
        )
        for buffer in [b for b in layer._buffers if b.startswith("gguf_")]:
            delattr(layer, buffer)  # the kernel's layout, unused from now on
        layer.weight.data = raw
        self.kernel = DequantPerCallKernel()
        self.kernel.prepare(layer, self.shards, self.dtype)

    def _exact_rows(self, layer: nn.Module, raw: torch.Tensor) -> bool:
        """Whether the kernel's lookups equal the dequantized blocks, on rows spread over the table."""
        if not hasattr(self.kernel, "embed"):
            return False
        shard = self.shards[0]
        ids = torch.linspace(0, shard.rows - 1, min(shard.rows, 64), device=raw.device).long()
        want = dequantize(raw_shard(raw, shard).index_select(0, ids), shard.type_name).to(self.dtype)
        try:
            return torch.equal(self.kernel.embed(layer, ids), want)  # type: ignore[union-attr]
        except Exception as e:  # noqa: BLE001 (a lookup kernel that fails to build -> the raw blocks)
            logger.warning("%s: embedding lookup failed (%s)", self.raw_tensor_names[0], e)
            return False

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of an embedding weight: [*ids.shape, hidden] in the model dtype."""
        if self.kernel is None:
            raise RuntimeError(f"{self.raw_tensor_names[0]}: GGUF weights used before loading")
        if self.rows_from_raw:
            return embed_raw(layer.gguf_rows.view(-1), self.shards, ids, self.dtype)
        return self.kernel.embed(layer, ids)  # type: ignore[union-attr]

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernel is None:
            raise RuntimeError(f"{'+'.join(self.raw_tensor_names)}: GGUF weights used before loading")
        # x itself when it is 2-D: a view would drop the int8 parts its producer attached (x_int8)
        y = self.kernel.apply(layer, x if x.dim() == 2 else x.reshape(-1, x.shape[-1]))
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def int8_input_layout(self, layer: LinearBase) -> x_int8.Int8Layout | None:
        """The layout of int8 parts of x the kernel's batch-1 GEMV reads (x_int8_outputs.feed), if any."""
        layout = getattr(self.kernel, "int8_input_layout", None)
        return layout() if layout is not None else None

    def int8_block_layout(self, layer: LinearBase) -> BlockLayout | None:
        """The layout of int8 parts of x the kernel's int8 tensor-core GEMM reads at a few tokens
        (x_int8_outputs.feed), if any."""
        layout = getattr(self.kernel, "int8_block_layout", None)
        return layout() if layout is not None else None


def _column_bytes(name: str, type_name: str, row_bytes: int, cols: Slice) -> tuple[int, int]:
    """(first byte, bytes) of input columns `cols` in every row of a tensor of `type_name`: the
    columns must fall on the type's block boundaries."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    if cols.start % block or cols.length % block:
        raise ValueError(
            f"{name}: its input dimension {cols.full} split for tensor parallelism gives {cols.length} "
            f"columns per rank, not a multiple of the {type_name} block of {block} values; this GGUF "
            "file cannot be split that many ways (use a smaller --tensor-parallel-size)"
        )
    return cols.start // block * type_size, cols.length // block * type_size


class GGUFQuantConfig:
    """Gives every linear layer whose checkpoint tensors are quantized (or F16/BF16) a
    `GGUFLinearMethod`. `tensors`: the file's tensors by HF name (as the GGUF loader names them)."""

    def __init__(self, tensors: Mapping[str, GGUFTensor]) -> None:
        self.tensors = dict(tensors)

    @classmethod
    def from_checkpoint(cls, checkpoint: GGUFCheckpoint) -> GGUFQuantConfig:
        return cls(checkpoint.tensors_by_hf_name())

    def get_linear_method(self, prefix: str) -> GGUFLinearMethod | None:
        if prefix == "lm_head" and "lm_head.weight" not in self.tensors:
            # Tied to the embedding: the head runs through the embedding's method
            # (`get_embedding_method`, `GGUFLinearMethod.use_as_head`), one copy of the blocks.
            return None
        return self._method(prefix, checkpoint_names(prefix))

    def get_embedding_method(self, prefix: str) -> GGUFLinearMethod | None:
        """The token embedding at module path `prefix` (e.g. 'model.embed_tokens'), kept in its
        blocks; None (a float table dequantized at load) for F32 or types torch cannot decode."""
        return self._method(prefix, [f"{prefix}.weight"], embedding=True)

    def _method(self, prefix: str, names: list[str], embedding: bool = False) -> GGUFLinearMethod | None:
        tensors = [self.tensors.get(n) for n in names]
        if any(t is None for t in tensors):
            logger.warning("%s: no GGUF tensor for %s; the layer stays float", prefix, names)
            return None
        types = {t.tensor_type.name for t in tensors}  # type: ignore[union-attr]
        if types == {"F32"} or not types <= set(SUPPORTED_TYPES):
            return None  # float32 as stored, or a type only the loader's numpy path knows
        return GGUFLinearMethod(list(zip(names, tensors, strict=True)), embedding=embedding)  # type: ignore[arg-type]
