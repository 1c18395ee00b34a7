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
channel ([N, 1] or [N]) or per tensor ([1] or 0-d); input_scale per tensor. Per-tensor scales are
expanded to the rows of their shard at load, so a merged q|k|v or gate|up layer keeps each part's
own scale; merged static input scales take the max over the parts (the weight scales being per
row, that costs nothing but a slightly coarser activation grid for the smaller parts).

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

from paphos.layers.parallel import row_amax
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
from paphos.quant.modules import checkpoint_modules, matches

logger = logging.getLogger(__name__)

Activation = Literal["dynamic", "static", "none"]
FP8_GEMM = "FP8 GEMM (Triton for a few tokens, torch._scaled_mm for more)"
DEQUANTIZED = "dequantized at load"

_logged: set[str] = set()


def _shard_rows(layer: nn.Module, shard_id: object, n: int) -> slice:
    """The output rows of shard `shard_id` (all n rows for an unmerged layer)."""
    if shard_id is None:
        return slice(0, n)
    index = layer.shard_index(shard_id)
    start = sum(layer.output_sizes[:index])
    return slice(start, start + layer.output_sizes[index])


class Fp8LinearMethod:
    """A linear layer with an fp8 weight and per-output-channel fp32 scales.

    `activation`: "dynamic" (per-token scales computed each call), "static" (the checkpoint's
    per-tensor `input_scale`) or "none" (weight-only checkpoints: activations stay in the model
    dtype). `from_checkpoint=False` is `-q fp8`: the float weight is loaded as is and quantized
    after loading (per-channel amax / 448). One instance per layer; `kernel` records the choice."""

    def __init__(self, activation: Activation = "dynamic", from_checkpoint: bool = True) -> None:
        if activation not in ("dynamic", "static", "none"):
            raise ValueError(f"activation must be dynamic, static or none, got {activation!r}")
        if activation == "static" and not from_checkpoint:
            raise ValueError("static activation scales come from a checkpoint")
        self.activation = activation
        self.from_checkpoint = from_checkpoint
        self.out_dtype = torch.float32
        self.kernel: str | None = None  # FP8_GEMM or DEQUANTIZED once loaded
        self.reason: str | None = None  # why not FP8_GEMM
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
        if self.reason is None:
            self.kernel = FP8_GEMM
            return
        self.kernel = DEQUANTIZED
        if self.reason not in _logged:
            _logged.add(self.reason)
            logger.warning("FP8 weights dequantized to %s at load: %s", self.out_dtype, self.reason)
        w = layer.weight.data.to(torch.float32) * layer.weight_scale.data[:, None]
        layer.weight = nn.Parameter(w.to(self.out_dtype), requires_grad=False)
        del layer.weight_scale

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        input_scale = layer.input_scale if self.activation == "static" else None
        if self.activation == "dynamic" and self.row_parallel:  # each token scaled by its whole row
            input_scale = amax_scales(row_amax(layer.tp, x))
        if self.kernel == FP8_GEMM:
            return fp8_linear(x, layer.weight, layer.weight_scale, input_scale, self.out_dtype, bias)
        if self.kernel is None:
            raise RuntimeError("FP8 weights used before loading")
        if self.activation != "none":
            x = fake_quantize(x, input_scale)
        return F.linear(x, layer.weight, bias)


@dataclass(frozen=True)
class _Group:
    """Linears matched by `targets` ("Linear", an exact HF module name or "re:<regex>") share one
    activation scheme."""

    targets: tuple[str, ...]
    activation: Activation


class Fp8Config:
    """Gives each linear layer an `Fp8LinearMethod`, or None (unquantized) for the layers the
    checkpoint leaves out: its ignore list (HF module names, e.g. 'lm_head' or
    'model.layers.0.mlp.down_proj', or 're:' regexes) and layers no group targets. Merged layers
    (qkv_proj, gate_up_proj) are ignored only when every checkpoint part is; a mix is an error.
    Build with `from_hf_quant_config`, `from_compressed_tensors` or `runtime`, then log `summary()`
    after loading."""

    def __init__(
        self, groups: Iterable[_Group], ignore: Iterable[str], from_checkpoint: bool, source: str
    ) -> None:
        self.groups = tuple(groups)
        self.ignore = tuple(ignore)
        self.from_checkpoint = from_checkpoint
        self.source = source
        self.methods: dict[str, Fp8LinearMethod] = {}

    # ---------------------------------------------------------------- constructors

    @classmethod
    def from_hf_quant_config(cls, qc: Mapping[str, Any]) -> Fp8Config:
        """vLLM / Aphrodite's `quant_method: "fp8"` (AutoFP8 and others): per-tensor (or per-channel)
        weight scales, `activation_scheme` "dynamic" (here per token) or "static" (`input_scale`),
        `ignored_layers`. The output head is never quantized in this format."""
        if qc.get("quant_method") != "fp8":
            raise QuantConfigError(
                f"quantization_config.quant_method: {qc.get('quant_method')!r} is not 'fp8'"
            )
        if qc.get("weight_block_size") is not None:
            raise QuantConfigError(
                f"quantization_config.weight_block_size: {qc['weight_block_size']!r} (block-wise FP8 "
                "scales, as DeepSeek checkpoints use) is not supported"
            )
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise QuantConfigError(f"quantization_config.activation_scheme: {scheme!r} is not supported")
        ignore = [*(qc.get("ignored_layers") or ()), "lm_head"]
        return cls([_Group(("Linear",), scheme)], ignore, True, f"fp8 checkpoint, {scheme} activations")

    @classmethod
    def from_compressed_tensors(cls, qc: Mapping[str, Any], *, tied_embeddings: bool = False) -> Fp8Config:
        """compressed-tensors `format: "float-quantized"` (llm-compressor FP8, FP8_DYNAMIC and
        weight-only FP8): every config group must be 8-bit float weights per channel or per tensor,
        with activations dynamic per token, static per tensor or absent. `tied_embeddings`: the
        head is the (unquantized) embedding, whatever the targets say."""
        if qc.get("format") != "float-quantized":
            raise QuantConfigError(
                f"quantization_config.format: {qc.get('format')!r} is not 'float-quantized' (FP8)"
            )
        if qc.get("kv_cache_scheme") is not None:
            raise QuantConfigError(
                f"quantization_config.kv_cache_scheme: {qc['kv_cache_scheme']!r} is not supported"
            )
        groups = [_compressed_tensors_group(name, g) for name, g in (qc.get("config_groups") or {}).items()]
        if not groups:
            raise QuantConfigError("quantization_config.config_groups: no FP8 group")
        ignore = [*(qc.get("ignore") or ()), *(["lm_head"] if tied_embeddings else [])]
        kinds = "/".join(sorted({g.activation for g in groups}))
        return cls(groups, ignore, True, f"compressed-tensors float-quantized, {kinds} activations")

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
        method = Fp8LinearMethod(groups[0].activation, self.from_checkpoint)  # type: ignore[union-attr]
        self.methods[prefix] = method
        return method

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
    if weights.get("strategy") not in ("channel", "tensor"):
        raise QuantConfigError(
            f"{where}.weights.strategy: {weights.get('strategy')!r} is not supported (channel or tensor)"
        )
    if group.get("output_activations") is not None:
        raise QuantConfigError(
            f"{where}.output_activations: {group['output_activations']!r} is not supported"
        )
    acts = group.get("input_activations")
    if acts is None:
        activation: Activation = "none"
    else:
        _require(f"{where}.input_activations", acts, num_bits=8, type="float", symmetric=True)
        strategy, dynamic = acts.get("strategy"), acts.get("dynamic", False)
        if dynamic is True and strategy == "token":
            activation = "dynamic"
        elif dynamic is False and strategy == "tensor":
            activation = "static"
        else:
            raise QuantConfigError(
                f"{where}.input_activations: strategy {strategy!r} with dynamic {dynamic!r} is not supported "
                "(token + dynamic, or tensor + static)"
            )
    targets = group.get("targets") or ()
    return _Group(tuple([targets] if isinstance(targets, str) else targets), activation)


def _require(where: str, args: Mapping[str, Any], **want: Any) -> None:
    """Each key of `want` must have that value; absent keys take compressed-tensors' defaults
    (symmetric true, dynamic false)."""
    defaults = {"symmetric": True, "dynamic": False}
    for key, value in want.items():
        got = args.get(key, defaults.get(key))
        if got != value:
            raise QuantConfigError(f"{where}.{key}: {got!r} is not supported (FP8 needs {value!r})")
