"""FP8 weights: checkpoints in vLLM's `fp8` or compressed-tensors' `float-quantized` format, and
`-q fp8` (quantize a float checkpoint at load).

Data flow (engine start-up): the checkpoint's `quantization_config` -> `Fp8Config.from_hf_quant_config`
/ `from_compressed_tensors` (or `Fp8Config.runtime()` for `-q fp8`) -> the model asks
`get_linear_method(prefix)` per linear layer -> `Fp8LinearMethod.create_weights` registers
`weight` (float8_e4m3fn [N, K]; the model dtype for `-q fp8`), `weight_scale` (fp32 [N]) and, for
static activations, `input_scale` -> `load_weights` fills them shard by shard ->
`process_weights_after_loading` quantizes (`-q fp8`), then picks the kernel: the FP8 GEMM
(paphos/quant/kernels/fp8.py) where it runs, else the weight dequantized once into the model dtype
and F.linear (the activation rounding is kept, so the numbers stay the checkpoint's reference).

Checkpoint layouts (quant-toolchain.md §3): weight F8_E4M3 [N, K]; weight_scale BF16/F32 per output
channel ([N, 1] or [N]) or per tensor ([1] or 0-d); input_scale per tensor. Block-wise: one scale
per [rows, cols] block, [ceil(N / rows), ceil(K / cols)], named `weight_scale_inv` in the `fp8`
format (`weight_block_size`) and `weight_scale` in compressed-tensors (`strategy: block`), with
activations scaled per token and run of input values; the scales are held per row while loading
(merged shards and ranks need not start on a block), then either one per block again for the
block-scaled kernels (`fp8_block_linear`) or multiplied into the dequantized weight. Per-tensor scales are
expanded to the rows of their shard at load, so a merged q|k|v or gate|up layer keeps each part's
own scale; merged static input scales take the max over the parts (the weight scales being per
row, that costs nothing but a slightly coarser activation grid for the smaller parts).

A `kv_cache_scheme` (compressed-tensors' FP8 per tensor, AutoFP8's "static") and the per-layer
`k_scale` / `v_scale` it comes with are the attention layers' business: the config validates it
and says so (`kv_cache_scales`), paphos/quant/kv_cache.py does the rest.

Tensor parallelism (`-tp N`): the weight slices like a float one (output rows for q|k|v and
gate|up, input columns for o_proj and down_proj); per-channel scales follow the output rows and
stay whole in row-parallel layers; per-tensor weight scales (expanded to their shard's rows) and
static input scales are the same on every rank. Scales that `-tp 1` takes over a whole row stay
whole-row scales, so every rank rounds exactly as `-tp 1` does: `-q fp8` weight scales are
computed at load from the checkpoint's whole rows (not the rank's columns), and a row-parallel
layer's dynamic per-token activation scales from the token's whole row, its maximum all-reduced
over the ranks (one small all-reduce of M values, layers/parallel.py `row_amax`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from paphos.layers.parallel import Slice, row_amax
from paphos.layers.weights import ShapeMismatchError, copy_checked
from paphos.quant.errors import QuantConfigError
from paphos.quant.kernels.fp8 import (
    FP8_DTYPE,
    amax_scales,
    fake_quantize,
    fp8_linear,
    quantize_rows,
    reference_quantize,
    row_scales,
    scaled_mm_unsupported,
)
from paphos.quant.kernels.fp8_blocks import (
    BlockScales,
    block_kernel_unsupported,
    cublas_blocks_unsupported,
    fp8_block_linear,
)
from paphos.quant.kv_cache import check_scheme
from paphos.quant.modules import checkpoint_modules, matches

logger = logging.getLogger(__name__)

Activation = Literal["dynamic", "static", "group", "none"]
FP8_GEMM = "FP8 GEMM (Triton for a few tokens, torch._scaled_mm for more)"
FP8_BLOCK_GEMM = "block-scaled FP8 GEMM (Triton)"
FP8_BLOCK_GEMM_CUBLAS = "block-scaled FP8 GEMM (Triton for a few tokens, cuBLAS for more)"
DEQUANTIZED = "dequantized at load"
DEQUANT_ROWS = 1024  # output rows dequantized at a time

_logged: set[str] = set()


@dataclass(frozen=True)
class Blocks:
    """Block-wise weight scales: one per `rows` x `cols` block of the weight (DeepSeek-V3 and
    Qwen3-FP8's `weight_block_size`, compressed-tensors' `strategy: block`), stored as
    `scale_name` [ceil(N / rows), ceil(K / cols)] (short blocks at the edges)."""

    rows: int
    cols: int
    scale_name: str


def _shard_rows(layer: nn.Module, shard_id: object, n: int) -> slice:
    """The output rows of shard `shard_id` (all n rows for an unmerged layer)."""
    if shard_id is None:
        return slice(0, n)
    index = layer.shard_index(shard_id)
    start = sum(layer.output_sizes[:index])
    return slice(start, start + layer.output_sizes[index])


class Fp8LinearMethod:
    """A linear layer with an fp8 weight and per-output-channel fp32 scales, or `blocks` of them.

    `activation`: "dynamic" (per-token scales computed each call), "static" (the checkpoint's
    per-tensor `input_scale`), "group" (dynamic per token and run of `act_group` input values)
    or "none" (weight-only checkpoints: activations stay in the model dtype).
    `from_checkpoint=False` is `-q fp8`: the float weight is loaded as is and quantized after
    loading (per-channel amax / 448). One instance per layer; `kernel` records the choice."""

    def __init__(
        self, activation: Activation = "dynamic", from_checkpoint: bool = True, blocks: Blocks | None = None,
        act_group: int = 0,
    ) -> None:  # fmt: skip
        if activation not in ("dynamic", "static", "group", "none"):
            raise ValueError(f"activation must be dynamic, static, group or none, got {activation!r}")
        if activation == "static" and not from_checkpoint:
            raise ValueError("static activation scales come from a checkpoint")
        if (activation == "group") != (act_group > 0):
            raise ValueError(f"group activations need a group size, got {activation!r} with {act_group}")
        if blocks is not None and not from_checkpoint:
            raise ValueError("block-wise scales come from a checkpoint")
        self.activation = activation
        self.from_checkpoint = from_checkpoint
        self.blocks = blocks
        self.act_group = act_group
        self.out_dtype = torch.float32
        self.kernel: str | None = None  # FP8_GEMM, FP8_BLOCK_GEMM(_CUBLAS) or DEQUANTIZED once loaded
        self.reason: str | None = None  # why not an FP8 GEMM
        self.row_parallel = False

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype
    ) -> None:
        self.out_dtype = params_dtype
        # A rank of a row-parallel layer: it holds some of the input columns.
        self.row_parallel = not layer.tp_cols().is_whole
        if not self.from_checkpoint:
            weight = nn.Parameter(
                torch.empty(output_size, input_size, dtype=params_dtype), requires_grad=False
            )
            weight.output_dim = 0  # type: ignore[attr-defined]
            weight.input_dim = 1  # type: ignore[attr-defined]
            weight.weight_loader = layer.weight_loader  # type: ignore[attr-defined]
            layer.register_parameter("weight", weight)
            if self.row_parallel:
                self._scale_whole_rows(layer, weight, output_size)
            return

        def load_weight(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
            if loaded.dtype != FP8_DTYPE:
                raise ValueError(f"an FP8 checkpoint's weight must be F8_E4M3, got {loaded.dtype}")
            layer.weight_loader(param, loaded, shard_id)

        def load_weight_scale(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
            rows = param.data[_shard_rows(layer, shard_id, output_size)]
            n = rows.shape[0]
            if loaded.numel() == 1:  # per tensor: every row of the shard
                rows.fill_(float(loaded.reshape(())))
                return
            mine = layer.tp_rows(0 if shard_id is None else layer.shard_index(shard_id))
            if loaded.shape[0] == mine.full != n:  # per channel, column-parallel: this rank's rows
                loaded = mine.narrow(loaded, 0)
            if tuple(loaded.shape) in ((n,), (n, 1)):
                copy_checked(rows, loaded.reshape(n))
            else:
                raise ShapeMismatchError((n, 1), tuple(loaded.shape))

        weight = nn.Parameter(torch.empty(output_size, input_size, dtype=FP8_DTYPE), requires_grad=False)
        weight.output_dim = 0  # type: ignore[attr-defined]
        weight.input_dim = 1  # type: ignore[attr-defined]
        weight.weight_loader = load_weight  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)
        if self.activation == "group" and (problem := _group_split_problem(layer.tp_cols(), self.act_group)):
            raise QuantConfigError(problem)  # start-up checks this first (Fp8Config.tp_split_problem)
        if self.blocks is not None:
            self._create_block_scales(layer, output_size)
            return
        scale = nn.Parameter(torch.empty(output_size, dtype=torch.float32), requires_grad=False)
        scale.output_dim = 0  # type: ignore[attr-defined]
        scale.weight_loader = load_weight_scale  # type: ignore[attr-defined]
        layer.register_parameter("weight_scale", scale)
        if self.activation == "static":
            shards = len(getattr(layer, "output_sizes", [output_size]))

            def load_input_scale(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
                if loaded.numel() != 1:
                    raise ShapeMismatchError((1,), tuple(loaded.shape))
                index = 0 if shard_id is None else layer.shard_index(shard_id)
                param.data[index] = float(loaded.reshape(()))

            input_scale = nn.Parameter(torch.empty(shards, dtype=torch.float32), requires_grad=False)
            input_scale.weight_loader = load_input_scale  # type: ignore[attr-defined]
            layer.register_parameter("input_scale", input_scale)

    def _create_block_scales(self, layer: nn.Module, output_size: int) -> None:
        """The block scales, held per output row of this rank ([rows, K blocks of the whole
        checkpoint tensor]): merged shards and a rank's rows then need not start on a block
        boundary, and a row-parallel rank finds its columns' blocks from its first column."""
        blocks = self.blocks
        assert blocks is not None
        k_blocks = -(-layer.tp_cols().full // blocks.cols)

        def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
            rows = layer.tp_rows(0 if shard_id is None else layer.shard_index(shard_id))
            want = (-(-rows.full // blocks.rows), k_blocks)
            if tuple(loaded.shape) != want:
                raise ShapeMismatchError(want, tuple(loaded.shape))
            per_row = loaded.float().repeat_interleave(blocks.rows, dim=0)[: rows.full]
            if not rows.is_whole:
                per_row = rows.narrow(per_row, 0)
            copy_checked(param.data[_shard_rows(layer, shard_id, output_size)], per_row)

        scale = nn.Parameter(torch.empty(output_size, k_blocks, dtype=torch.float32), requires_grad=False)
        scale.weight_loader = load  # type: ignore[attr-defined]
        layer.register_parameter(blocks.scale_name, scale)

    def _scale_whole_rows(self, layer: nn.Module, weight: nn.Parameter, output_size: int) -> None:
        """`-q fp8` on a row-parallel layer: the per-channel scales of the whole rows, computed
        as each checkpoint tensor arrives whole (before the layer's loader takes this rank's
        columns), into `weight_scale`."""
        scale = nn.Parameter(torch.empty(output_size, dtype=torch.float32), requires_grad=False)
        scale.optional_in_checkpoint = True  # type: ignore[attr-defined]  # filled by the weight's loader
        layer.register_parameter("weight_scale", scale)
        load_columns = weight.weight_loader  # type: ignore[attr-defined]

        def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
            # In the model dtype first, as `-tp 1` computes them from the loaded parameter.
            copy_checked(scale.data, row_scales(loaded.to(param.dtype)).view(-1))
            load_columns(param, loaded, shard_id)

        weight.weight_loader = load  # type: ignore[attr-defined]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.from_checkpoint:
            if hasattr(layer, "weight_scale"):  # whole rows' scales, from the loader
                q, scale = quantize_rows(layer.weight.data, layer.weight_scale.data[:, None]), layer.weight_scale.data
            else:
                q, scale = reference_quantize(layer.weight.data)  # per output channel: amax / 448
            # New parameters, so the float weight's memory goes with the old one.
            layer.weight = nn.Parameter(q, requires_grad=False)
            layer.weight_scale = nn.Parameter(scale.view(-1), requires_grad=False)
        if self.activation == "static":
            layer.input_scale = nn.Parameter(layer.input_scale.data.max().reshape(1), requires_grad=False)
        n, k = layer.weight.shape
        self.reason = scaled_mm_unsupported(layer.weight.device, self.out_dtype, n, k)
        if self.reason is None and self.activation == "none":
            self.reason = "weight-only FP8 checkpoint (no FP8 weight-only kernel yet)"
        if self.reason is None and self.blocks is not None:
            self.reason = self._block_kernel_problem(layer)
        if self.reason is None:
            self.kernel = FP8_GEMM
            if self.blocks is not None:  # one scale per block again: the rows of a block are equal
                rows, cols = self.blocks.rows, self.blocks.cols
                cublas = cublas_blocks_unsupported(layer.weight.device, self.out_dtype, rows, cols, n, k) is None
                self.kernel = FP8_BLOCK_GEMM_CUBLAS if cublas else FP8_BLOCK_GEMM
                first = layer.tp_cols().start // self.blocks.cols
                scales = getattr(layer, self.blocks.scale_name).data[:: self.blocks.rows]
                compact = scales[:, first : first + -(-k // self.blocks.cols)].contiguous()
                setattr(layer, self.blocks.scale_name, nn.Parameter(compact, requires_grad=False))
            return
        self.kernel = DEQUANTIZED
        if self.reason not in _logged:
            _logged.add(self.reason)
            logger.warning("FP8 weights dequantized to %s at load: %s", self.out_dtype, self.reason)
        fp8 = layer.weight.data
        if self.blocks is not None:
            scales = getattr(layer, self.blocks.scale_name).data
            # the block of each of the rank's columns, counted from the checkpoint's first
            column_block = (layer.tp_cols().start + torch.arange(k, device=fp8.device)) // self.blocks.cols
            delattr(layer, self.blocks.scale_name)
        else:
            scales, column_block = layer.weight_scale.data[:, None], None
            del layer.weight_scale
        # In float32 as the tools' dequantizers compute it, rounded once; in row chunks, so that a
        # float32 copy of a large layer never exists whole.
        w = torch.empty(n, k, dtype=self.out_dtype, device=fp8.device)
        for r in range(0, n, DEQUANT_ROWS):
            rows = scales[r : r + DEQUANT_ROWS]
            w[r : r + DEQUANT_ROWS] = fp8[r : r + DEQUANT_ROWS].float() * (rows if column_block is None else rows[:, column_block])
        layer.weight = nn.Parameter(w, requires_grad=False)

    def _block_kernel_problem(self, layer: nn.Module) -> str | None:
        """Why the block-wise FP8 kernels cannot take this layer (None when they can): their
        activation runs are the weight's column blocks, and every checkpoint shard and this
        rank's rows and columns start on a block."""
        blocks = self.blocks
        assert blocks is not None
        if self.activation != "group" or self.act_group != blocks.cols:
            return (f"activations scaled {self.activation} (group {self.act_group}) with weight blocks "
                    f"{blocks.rows}x{blocks.cols} (the kernel scales activations per block)")  # fmt: skip
        if problem := block_kernel_unsupported(blocks.cols):
            return problem
        starts = [sum(layer.output_sizes[:i]) for i in range(len(layer.output_sizes))]
        starts += [layer.tp_rows(i).start for i in range(len(layer.output_sizes))]
        if any(start % blocks.rows for start in starts) or layer.tp_cols().start % blocks.cols:
            return f"a shard or rank starting inside a {blocks.rows}x{blocks.cols} weight block"
        return None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernel in (FP8_BLOCK_GEMM, FP8_BLOCK_GEMM_CUBLAS):
            scales = BlockScales(getattr(layer, self.blocks.scale_name), self.blocks.rows, self.blocks.cols,
                                 cublas=self.kernel == FP8_BLOCK_GEMM_CUBLAS)  # fmt: skip
            return fp8_block_linear(x, layer.weight, scales, self.out_dtype, bias)
        input_scale = layer.input_scale if self.activation == "static" else None
        if self.activation == "dynamic" and self.row_parallel:  # each token scaled by its whole row
            input_scale = amax_scales(row_amax(layer.tp, x))
        if self.kernel == FP8_GEMM:
            return fp8_linear(x, layer.weight, layer.weight_scale, input_scale, self.out_dtype, bias)
        if self.kernel is None:
            raise RuntimeError("FP8 weights used before loading")
        if self.activation != "none":
            x = fake_quantize(x, input_scale, self.act_group)
        return F.linear(x, layer.weight, bias)


@dataclass(frozen=True)
class _Group:
    """Linears matched by `targets` ("Linear", an exact HF module name or "re:<regex>") share one
    activation scheme."""

    targets: tuple[str, ...]
    activation: Activation
    blocks: Blocks | None = None
    act_group: int = 0


class Fp8Config:
    """Gives each linear layer an `Fp8LinearMethod`, or None (unquantized) for the layers the
    checkpoint leaves out: its ignore list (HF module names, e.g. 'lm_head' or
    'model.layers.0.mlp.down_proj', or 're:' regexes) and layers no group targets. Merged layers
    (qkv_proj, gate_up_proj) are ignored only when every checkpoint part is; a mix is an error.
    Build with `from_hf_quant_config`, `from_compressed_tensors` or `runtime`, then log `summary()`
    after loading."""

    def __init__(
        self, groups: Iterable[_Group], ignore: Iterable[str], from_checkpoint: bool, source: str,
        kv_cache_scheme: str | None = None, kv_cache_scales: bool = False,
    ) -> None:  # fmt: skip
        self.groups = tuple(groups)
        self.ignore = tuple(ignore)
        self.from_checkpoint = from_checkpoint
        self.source = source
        # The checkpoint's validated kv_cache_scheme, and whether its attention layers take
        # k_scale / v_scale tensors (paphos/quant/kv_cache.py).
        self.kv_cache_scheme = kv_cache_scheme
        self.kv_cache_scales = kv_cache_scales
        self.methods: dict[str, Fp8LinearMethod] = {}

    # ---------------------------------------------------------------- constructors

    @classmethod
    def from_hf_quant_config(cls, qc: Mapping[str, Any]) -> Fp8Config:
        """vLLM / Aphrodite's `quant_method: "fp8"` (AutoFP8 and others): per-tensor (or per-channel)
        weight scales, `activation_scheme` "dynamic" (here per token) or "static" (`input_scale`),
        `ignored_layers`. With `weight_block_size` [rows, cols] (DeepSeek-V3, Qwen3-FP8): a scale
        per block as `weight_scale_inv` (the factor the codes are multiplied by, despite its name)
        and dynamic activations per token and run of `cols` values, DeepSeek's 1 x 128. The
        output head is never quantized in this format. Attention layers take per-tensor
        `k_scale` / `v_scale` where the checkpoint has them (as vLLM loads them: AutoFP8 writes
        them with `kv_cache_scheme: "static"`, a QuantizationArgs mapping is checked as
        compressed-tensors' is)."""
        if qc.get("quant_method") != "fp8":
            raise QuantConfigError(
                f"quantization_config.quant_method: {qc.get('quant_method')!r} is not 'fp8'"
            )
        kv = check_scheme(qc["kv_cache_scheme"], static_string=True) if qc.get("kv_cache_scheme") else None
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise QuantConfigError(f"quantization_config.activation_scheme: {scheme!r} is not supported")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise QuantConfigError(f"quantization_config.fmt: {qc['fmt']!r} is not supported (e4m3)")
        ignore = [*(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ()), "lm_head"]
        if qc.get("weight_block_size") is None:
            return cls([_Group(("Linear",), scheme)], ignore, True, f"fp8 checkpoint, {scheme} activations", kv, True)
        blocks = _blocks("quantization_config.weight_block_size", qc["weight_block_size"], "weight_scale_inv")
        if scheme != "dynamic":
            raise QuantConfigError(
                "quantization_config.activation_scheme: 'static' with weight_block_size is not supported "
                "(block-wise checkpoints scale activations dynamically)"
            )
        if qc.get("scale_fmt") not in (None, "float32", "fp32"):
            raise QuantConfigError(f"quantization_config.scale_fmt: {qc['scale_fmt']!r} is not supported (float32)")
        group = _Group(("Linear",), "group", blocks, blocks.cols)
        return cls([group], ignore, True, f"fp8 checkpoint, {blocks.rows}x{blocks.cols} weight blocks, dynamic "
                   f"activations per {blocks.cols} values", kv, True)  # fmt: skip

    @classmethod
    def from_compressed_tensors(cls, qc: Mapping[str, Any], *, tied_embeddings: bool = False) -> Fp8Config:
        """compressed-tensors `format: "float-quantized"` (llm-compressor FP8, FP8_DYNAMIC and
        weight-only FP8): every config group must be 8-bit float weights per channel or per tensor,
        with activations dynamic per token, static per tensor or absent; a `kv_cache_scheme` must
        be FP8 per tensor, static (the attention layers then take `k_scale` / `v_scale`).
        `tied_embeddings`: the head is the (unquantized) embedding, whatever the targets say."""
        if qc.get("format") != "float-quantized":
            raise QuantConfigError(
                f"quantization_config.format: {qc.get('format')!r} is not 'float-quantized' (FP8)"
            )
        kv = check_scheme(qc["kv_cache_scheme"]) if qc.get("kv_cache_scheme") else None
        groups = [_compressed_tensors_group(name, g) for name, g in (qc.get("config_groups") or {}).items()]
        if not groups:
            raise QuantConfigError("quantization_config.config_groups: no FP8 group")
        ignore = [*(qc.get("ignore") or ()), *(["lm_head"] if tied_embeddings else [])]
        kinds = "/".join(sorted({g.activation for g in groups}))
        return cls(groups, ignore, True, f"compressed-tensors float-quantized, {kinds} activations", kv, kv is not None)

    @classmethod
    def runtime(cls) -> Fp8Config:
        """`-q fp8`: a float checkpoint's linears (not the head) quantized at load, per-channel
        weight scales and dynamic per-token activations."""
        return cls([_Group(("Linear",), "dynamic")], ["lm_head"], False, "-q fp8")

    # ---------------------------------------------------------------- QuantConfig

    def get_linear_method(self, prefix: str) -> Fp8LinearMethod | None:
        parts = checkpoint_modules(prefix)
        groups = [None if matches(p, self.ignore) else self._group(p) for p in parts]
        if all(g is None for g in groups):
            return None
        if len(set(groups)) > 1:
            detail = ", ".join(
                f"{p}: {'not quantized' if g is None else g.activation}"
                for p, g in zip(parts, groups, strict=True)
            )
            raise QuantConfigError(
                f"{prefix}: its checkpoint parts are quantized differently ({detail})"
            )
        group = groups[0]
        assert group is not None
        method = Fp8LinearMethod(group.activation, self.from_checkpoint, group.blocks, group.act_group)
        self.methods[prefix] = method
        return method

    def tp_split_problem(self, prefix: str, rows: list[Slice], cols: Slice) -> str | None:
        """Why a tensor-parallel rank cannot hold input columns `cols` of the layer at `prefix`,
        or None: activations scaled per group of input values need whole groups on every rank
        (weights scaled per row, tensor or block split anywhere)."""
        for part in checkpoint_modules(prefix):
            group = None if matches(part, self.ignore) else self._group(part)
            if group is not None and (problem := _group_split_problem(cols, group.act_group)):
                return f"{prefix}: {problem}"
        return None

    def _group(self, name: str) -> _Group | None:
        for group in self.groups:
            if "Linear" in group.targets or matches(name, group.targets):
                return group
        return None

    def summary(self) -> list[str]:
        """The start-up log's line, e.g. 'FP8 (-q fp8): FP8 GEMM (...) for 154 layers'."""
        counts = Counter(m.kernel or "not loaded" for m in self.methods.values())
        parts = [f"{kernel} for {n} layer{'s' if n != 1 else ''}" for kernel, n in counts.most_common()]
        reasons = sorted({m.reason for m in self.methods.values() if m.reason})
        why = f" ({'; '.join(reasons)})" if reasons else ""
        return [f"FP8 ({self.source}): {', '.join(parts) or 'no layers'}{why}"]


def _compressed_tensors_group(name: str, group: Mapping[str, Any]) -> _Group:
    where = f"quantization_config.config_groups.{name}"
    weights = group.get("weights")
    if not weights:
        raise QuantConfigError(
            f"{where}.weights: {weights!r} (activation-only quantization) is not supported"
        )
    _require(f"{where}.weights", weights, num_bits=8, type="float", symmetric=True, dynamic=False)
    blocks = None
    if weights.get("strategy") == "block":
        blocks = _blocks(f"{where}.weights.block_structure", weights.get("block_structure"), "weight_scale")
    elif weights.get("strategy") not in ("channel", "tensor"):
        raise QuantConfigError(
            f"{where}.weights.strategy: {weights.get('strategy')!r} is not supported (channel, tensor or block)"
        )
    if group.get("output_activations") is not None:
        raise QuantConfigError(
            f"{where}.output_activations: {group['output_activations']!r} is not supported"
        )
    acts = group.get("input_activations")
    act_group = 0
    if acts is None:
        activation: Activation = "none"
    else:
        _require(f"{where}.input_activations", acts, num_bits=8, type="float", symmetric=True)
        strategy, dynamic = acts.get("strategy"), acts.get("dynamic", False)
        if dynamic is True and strategy == "token":
            activation = "dynamic"
        elif dynamic is False and strategy == "tensor":
            activation = "static"
        elif dynamic is True and strategy == "group":
            activation, act_group = "group", acts.get("group_size")
            if not isinstance(act_group, int) or act_group <= 0:
                raise QuantConfigError(f"{where}.input_activations.group_size: {act_group!r} is not a positive integer")
        else:
            raise QuantConfigError(
                f"{where}.input_activations: strategy {strategy!r} with dynamic {dynamic!r} is not supported "
                "(token + dynamic, group + dynamic, or tensor + static)"
            )
    targets = group.get("targets") or ()
    return _Group(tuple([targets] if isinstance(targets, str) else targets), activation, blocks, act_group)


def _group_split_problem(cols: Slice, group: int) -> str | None:
    """Why a rank holding input columns `cols` would cut activation groups of `group` values."""
    if group and not cols.is_whole and (cols.start % group or (cols.length % group and cols.start + cols.length != cols.full)):
        return (f"activations are scaled per group of {group} input values; a rank's {cols.length} inputs of "
                f"{cols.full} are not whole groups")  # fmt: skip
    return None


def _blocks(where: str, size: Any, scale_name: str) -> Blocks:
    """A [rows, cols] block size from the config (`where` names the field in errors)."""
    if not (isinstance(size, list | tuple) and len(size) == 2 and all(isinstance(v, int) and v > 0 for v in size)):
        raise QuantConfigError(f"{where}: {size!r} is not a [rows, cols] pair of positive integers")
    return Blocks(size[0], size[1], scale_name)


def _require(where: str, args: Mapping[str, Any], **want: Any) -> None:
    """Each key of `want` must have that value; absent keys take compressed-tensors' defaults
    (symmetric true, dynamic false)."""
    defaults = {"symmetric": True, "dynamic": False}
    for key, value in want.items():
        got = args.get(key, defaults.get(key))
        if got != value:
            raise QuantConfigError(f"{where}.{key}: {got!r} is not supported (FP8 needs {value!r})")
