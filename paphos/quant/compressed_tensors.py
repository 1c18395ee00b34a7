"""compressed-tensors checkpoints (llm-compressor): `quantization_config.quant_method ==
"compressed-tensors"`.

Data flow: registry.select -> `from_quant_config(qc)` -> by `format`:
  - "pack-quantized" / "naive-quantized" / "int-quantized" (integer weights with 16-bit activations: W4A16, W8A16;
    or with dynamic per-token int8 activations, W8A8, run as rounded activations times the weight) ->
    `CompressedTensorsIntConfig`: each targeted linear gets an `IntLinearMethod` with `PackedLayout`
    or `NaiveLayout` (the int kernel family, shared with GPTQ and AWQ);
  - "float-quantized" (FP8 weights, FP8 activations dynamic per token or static per tensor) ->
    paphos/quant/fp8.py;
  - "dense" with no config groups (a recipe that quantizes only the KV cache) -> `KVCacheOnlyConfig`:
    float weights.
`kv_cache_scheme` (FP8 per tensor, static: the checkpoint's per-layer k_scale / v_scale, applied to
an fp8 KV cache) is validated for every format and sets the config's `kv_cache_scales`
(paphos/quant/kv_cache.py). Anything else (static or asymmetric activation quantization, sparsity,
transforms, other KV-cache schemes, other formats) is refused at start-up naming the field and value.

Integer layouts, per linear (codes stored unsigned: q + 2**(bits-1); zero points likewise):
  pack-quantized   weight_packed      int32 [N, K * bits / 32]  codes packed along the input K
                   weight_scale       bf16/fp16 [N, G]          G = 1 for per-channel
                   weight_zero_point  int32 [N * bits / 32, G]  asymmetric only, packed along N
                   weight_shape       int64 [2]                 [N, K] of the shard
                   weight_g_idx       int32 [K]                 act-order "group"/"weight" only
  naive-quantized  weight             int8  [N, K]              codes as signed values (int-quantized,
                                                                 what W8A8 INT8 checkpoints say, is the
                                                                 same compressor under another name)
                   weight_scale, weight_zero_point (int8 [N, G], signed), as above
w[n, k] = (q[n, k] - z[n, g]) * scale[n, g].

Tensor parallelism (int_linear.py): rows of N slice freely (the packed zero points by whole
words); a row-parallel rank takes whole groups of K with their scales and zeros, or with act-order
its rows' g_idx entries and every group's scales and zeros; per-channel scales stay whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paphos.quant.errors import QuantConfigError, field_value
from paphos.quant.int_linear import (
    IntKernelLog,
    IntLinearMethod,
    IntQuantConfig,
    Unpacked,
    add_param,
    groups_of,
    num_shards,
    per_shard_loader,
    unpack_along_cols,
    unpack_along_rows,
)
from paphos.quant.kv_cache import check_scheme
from paphos.quant.modules import checkpoint_modules, matches

INT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized")
NAIVE_FORMATS = ("naive-quantized", "int-quantized")
@dataclass(frozen=True)
class IntScheme:
    bits: int
    group_size: int  # -1: per output channel
    symmetric: bool
    act_order: bool
    int8_activations: bool  # W8A8: activations rounded to int8 per token, as the tool's forward does


def _int_scheme(group: str, weights: dict[str, Any], activations: Any) -> IntScheme:
    where = f"config_groups.{group}"
    int8_dynamic = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}
    if activations and any(activations.get(k) != v for k, v in int8_dynamic.items()):
        raise QuantConfigError(field_value(
            f"{where}.input_activations", activations,
            "integer weights take 16-bit activations (W4A16, W8A16) or dynamic per-token int8 (W8A8)",
        ))
    if weights.get("type") != "int":
        raise QuantConfigError(field_value(f"{where}.weights.type", weights.get("type"), "this format takes int weights"))
    bits = weights.get("num_bits")
    if bits not in (4, 8):
        raise QuantConfigError(field_value(f"{where}.weights.num_bits", bits, "4 or 8 bits are supported"))
    strategy = weights.get("strategy")
    if strategy == "group":
        group_size = weights.get("group_size")
        if not isinstance(group_size, int) or group_size <= 0 or group_size % 8:
            raise QuantConfigError(field_value(f"{where}.weights.group_size", group_size, "a positive multiple of 8"))
    elif strategy == "channel":
        group_size = -1
    else:
        raise QuantConfigError(field_value(f"{where}.weights.strategy", strategy, "group or channel"))
    if weights.get("dynamic"):
        raise QuantConfigError(field_value(f"{where}.weights.dynamic", True, "weights must be static"))
    actorder = weights.get("actorder")
    if actorder not in (None, "static", "group", "weight"):
        raise QuantConfigError(field_value(f"{where}.weights.actorder", actorder, "static, group or weight"))
    return IntScheme(
        bits, group_size, bool(weights.get("symmetric", True)), actorder in ("group", "weight"), bool(activations)
    )


@dataclass(frozen=True)
class _SchemeLayout:
    scheme: IntScheme

    @property
    def bits(self) -> int:
        return self.scheme.bits

    @property
    def group_size(self) -> int:
        return self.scheme.group_size

    @property
    def int8_activations(self) -> bool:
        return self.scheme.int8_activations

    @property
    def regroups_inputs(self) -> bool:
        return self.scheme.act_order


class PackedLayout(_SchemeLayout):
    """pack-quantized (module docstring)."""

    packed_along_input = ("weight_packed",)

    @property
    def packed_along_output(self) -> tuple[str, ...]:
        return () if self.scheme.symmetric else ("weight_zero_point",)

    def create_params(self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        per = 32 // self.bits
        add_param(layer, "weight_packed", (output_size, -(-input_size // per)), torch.int32, output_dim=0, input_dim=1)
        _add_common(layer, self.scheme, input_size, output_size, packed_zeros=True)

    def unpack(self, layer: nn.Module) -> Unpacked:
        k = int(layer.weight_shape[0, 1])
        codes = unpack_along_cols(layer.weight_packed.data, self.bits)[:, :k]
        return _unpacked(layer, self.scheme, codes, packed_zeros=True)


class NaiveLayout(_SchemeLayout):
    """naive-quantized: signed codes one per int8 (module docstring)."""

    packed_along_output = ()
    packed_along_input = ()

    def create_params(self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        add_param(layer, "weight", (output_size, input_size), torch.int8, output_dim=0, input_dim=1)
        _add_common(layer, self.scheme, input_size, output_size, packed_zeros=False)

    def unpack(self, layer: nn.Module) -> Unpacked:
        codes = layer.weight.data.to(torch.int64) + (1 << (self.bits - 1))
        return _unpacked(layer, self.scheme, codes, packed_zeros=False)


def _add_common(layer: nn.Module, scheme: IntScheme, input_size: int, output_size: int, packed_zeros: bool) -> None:
    # A row-parallel rank's scale groups: its own (whole groups of its input rows), or every
    # group (per channel: the one; act-order: its rows may use any of them).
    whole = scheme.act_order or scheme.group_size < 0
    groups = groups_of(layer, scheme.group_size, replicated=whole)
    input_dim = None if whole else 1
    # float32 holds the file's bf16/fp16 scales exactly; the kernels take them in the model dtype
    add_param(layer, "weight_scale", (output_size, groups), torch.float32, output_dim=0, input_dim=input_dim, replicated=whole)
    shards = num_shards(layer)
    add_param(layer, "weight_shape", (shards, 2), torch.int64, None, per_shard_loader(layer))
    layer.weight_shape.optional_in_checkpoint = True  # naive-quantized files do not write it
    layer.weight_shape.data.copy_(torch.tensor([output_size, input_size]))
    if not scheme.symmetric:
        if packed_zeros:
            rows = -(-output_size * scheme.bits // 32)
            add_param(layer, "weight_zero_point", (rows, groups), torch.int32, output_dim=0, input_dim=input_dim, replicated=whole)
        else:
            add_param(layer, "weight_zero_point", (output_size, groups), torch.int8, output_dim=0, input_dim=input_dim, replicated=whole)
    if scheme.act_order:
        add_param(layer, "weight_g_idx", (shards, input_size), torch.int32, None, per_shard_loader(layer, True))


def _unpacked(layer: nn.Module, scheme: IntScheme, codes: torch.Tensor, packed_zeros: bool) -> Unpacked:
    n = codes.shape[0]
    zeros = None
    if not scheme.symmetric:
        stored = layer.weight_zero_point.data
        if packed_zeros:
            zeros = unpack_along_rows(stored, scheme.bits)[:n]
        else:
            zeros = stored.to(torch.int64) + (1 << (scheme.bits - 1))
        zeros = zeros.to(torch.float32)
    return Unpacked(
        codes=codes.contiguous(),
        scales=layer.weight_scale.data,
        zeros=zeros,
        groups=layer.weight_g_idx.data.long() if scheme.act_order else None,
        shard_rows=tuple(getattr(layer, "output_sizes", (n,))),
        bits=scheme.bits,
    )


class CompressedTensorsIntConfig(IntQuantConfig):
    """The QuantConfig of an integer-weight compressed-tensors checkpoint."""

    name = "compressed-tensors"

    def __init__(self, groups: list[tuple[list[str], IntScheme]], ignore: list[str], naive: bool) -> None:
        self.groups = groups
        self.ignore = ignore
        self.naive = naive
        self.log = IntKernelLog("compressed-tensors")
        # the checkpoint's validated kv_cache_scheme (paphos/quant/kv_cache.py), set by from_quant_config
        self.kv_cache_scheme: str | None = None
        self.kv_cache_scales = False

    def scheme_of(self, module: str) -> IntScheme | None:
        if matches(module, self.ignore):
            return None
        for targets, scheme in self.groups:
            if "Linear" in targets or matches(module, targets):
                return scheme
        return None

    def get_linear_method(self, prefix: str) -> IntLinearMethod | None:
        schemes = {self.scheme_of(m) for m in checkpoint_modules(prefix)}
        if len(schemes) > 1:
            raise QuantConfigError(
                f"quantization_config gives {', '.join(checkpoint_modules(prefix))} different schemes; "
                "they run as one merged layer and must share one"
            )
        scheme = schemes.pop()
        if scheme is None:
            return None
        layout = NaiveLayout(scheme) if self.naive else PackedLayout(scheme)
        return IntLinearMethod(layout, self.log, prefix)

    def summary(self) -> list[str]:
        return self.log.summary()


class KVCacheOnlyConfig:
    """A compressed-tensors checkpoint that quantizes only its KV cache (`config_groups` empty,
    `format: "dense"`): float weights, and the per-layer FP8 KV-cache scales."""

    name = "compressed-tensors"
    kv_cache_scales = True

    def __init__(self, kv_cache_scheme: str) -> None:
        self.kv_cache_scheme = kv_cache_scheme

    def get_linear_method(self, prefix: str) -> None:
        return None

    def summary(self) -> list[str]:
        return []


def from_quant_config(qc: dict[str, Any], tied_embeddings: bool) -> Any:
    """The QuantConfig of a compressed-tensors checkpoint (module docstring). `tied_embeddings`:
    the head is the unquantized embedding, whatever the targets say."""
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise QuantConfigError(field_value(key, qc[key], "not supported"))
    kv_scheme = check_scheme(qc["kv_cache_scheme"]) if qc.get("kv_cache_scheme") else None
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise QuantConfigError(field_value("quantization_status", status, "only compressed checkpoints are supported"))
    groups = qc.get("config_groups") or {}
    if not groups:
        if kv_scheme is not None and qc.get("format") in (None, "dense"):
            return KVCacheOnlyConfig(kv_scheme)
        raise QuantConfigError(field_value("config_groups", groups, "at least one quantization scheme is needed"))
    formats = {g.get("format") or qc.get("format") for g in groups.values()}
    if len(formats) != 1:
        raise QuantConfigError(field_value("format", sorted(map(str, formats)), "one format for the whole model"))
    fmt = formats.pop()
    if fmt == "float-quantized":
        from paphos.quant.fp8 import Fp8Config

        return Fp8Config.from_compressed_tensors(qc, tied_embeddings=tied_embeddings)
    if fmt not in INT_FORMATS:
        raise QuantConfigError(field_value("format", fmt, f"supported: {', '.join((*INT_FORMATS, 'float-quantized'))}"))
    schemes = [
        (list(g.get("targets") or []), _int_scheme(name, g.get("weights") or {}, g.get("input_activations")))
        for name, g in groups.items()
    ]
    ignore = [*(qc.get("ignore") or ()), *(["lm_head"] if tied_embeddings else [])]
    config = CompressedTensorsIntConfig(schemes, ignore, naive=fmt in NAIVE_FORMATS)
    config.kv_cache_scheme, config.kv_cache_scales = kv_scheme, kv_scheme is not None
    return config
