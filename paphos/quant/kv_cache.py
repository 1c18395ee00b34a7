"""FP8 KV-cache scales that a quantized checkpoint carries (llm-compressor's `kv_cache_scheme`,
AutoFP8's `kv_cache_scheme: "static"`).

Data flow (start-up): the format's config (compressed_tensors.from_quant_config, Fp8Config)
validates `quantization_config.kv_cache_scheme` with `check_scheme` and sets its QuantConfig's
`kv_cache_scales` -> each attention layer (models/llama.py `LlamaAttention`, which Gemma 3 and the
Qwen models reuse) registers `k_scale` / `v_scale` (`add_scale_params`: fp32 scalars, optional in
the checkpoint) -> `load_weights` fills them from `model.layers.N.self_attn.k_scale` / `v_scale`
(older compressed-tensors and AutoFP8: `self_attn.k_proj.output_scale` / `v_proj.output_scale`,
renamed by `checkpoint_name`) -> after loading, the layer reads them once as Python floats
(`read_scales`) and hands them to its attention backend on every call (`kv_scales`), so a step
reads no tensor for them and a captured CUDA graph holds each layer's constants -> worker setup
logs `startup_line`.

Semantics (vLLM's): the scales are per tensor, whole on every tensor-parallel rank. With an fp8
KV cache (`--kv-cache-dtype fp8`) K is stored as k / k_scale (after RoPE), saturated to e4m3,
and read back as stored * k_scale; likewise V. Any other cache dtype ignores them (the backends
apply scales to fp8 caches only), so the output equals the checkpoint's without them. A layer the
checkpoint gives no scales keeps 1.0, the value a cache without scales uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from paphos.attention.backend import FP8_KV_DTYPES
from paphos.layers.weights import ShapeMismatchError
from paphos.quant.errors import QuantConfigError, field_value

# The one scheme the scales can mean: compressed-tensors QuantizationArgs fields and their values.
FP8_PER_TENSOR = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
# QuantizationArgs' defaults for fields a config leaves out (strategy None resolves to tensor).
_DEFAULTS = {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False, "symmetric": True}
_WHY = "FP8 KV-cache scales must be 8-bit float, per tensor, static and symmetric"
# Older checkpoint names -> ours (the k/v projections' output scales before compressed-tensors
# moved them to the attention module; AutoFP8 before it did the same).
_RENAMES = (
    (".self_attn.k_proj.output_scale", ".self_attn.k_scale"),
    (".self_attn.v_proj.output_scale", ".self_attn.v_scale"),
)


def check_scheme(scheme: Any, field: str = "kv_cache_scheme", static_string: bool = False) -> str:
    """Validate a `kv_cache_scheme`: compressed-tensors QuantizationArgs (a mapping) for FP8 per
    tensor, static and symmetric, or with `static_string` AutoFP8's plain "static" (the `fp8`
    format). Returns a short description for the log; QuantConfigError names the field at fault."""
    if static_string and scheme == "static":
        return "static, per tensor"
    if not isinstance(scheme, Mapping):
        raise QuantConfigError(field_value(field, scheme, f"{_WHY} (a QuantizationArgs mapping)"))
    for key, want in FP8_PER_TENSOR.items():
        got = scheme.get(key)
        got = _DEFAULTS[key] if got is None else got
        if got != want:
            raise QuantConfigError(field_value(f"{field}.{key}", got, _WHY))
    return "fp8 e4m3, static, per tensor"


def checkpoint_name(name: str) -> str:
    """Our name for a checkpoint tensor: an older KV scale name renamed, any other unchanged."""
    for theirs, ours in _RENAMES:
        if name.endswith(theirs):
            return name[: -len(theirs)] + ours
    return name


def add_scale_params(attn: nn.Module) -> None:
    """Register `k_scale` and `v_scale` on an attention module: fp32 scalars, 1.0 until the
    checkpoint fills them, optional in it (a layer without them keeps 1.0)."""
    for name in ("k_scale", "v_scale"):
        param = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)
        param.optional_in_checkpoint = True  # type: ignore[attr-defined]
        param.weight_loader = _load_scale  # type: ignore[attr-defined]
        param.from_checkpoint = False  # type: ignore[attr-defined]  # set by the loader
        attn.register_parameter(name, param)


def _load_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    """One per-tensor scale ([] or [1], any float dtype: compressed-tensors writes the model's),
    the same on every tensor-parallel rank."""
    if shard_id is not None:
        raise ValueError(f"a KV-cache scale takes no shards, got shard {shard_id!r}")
    if loaded.numel() != 1:
        raise ShapeMismatchError((1,), tuple(loaded.shape))
    value = float(loaded.reshape(()).float())
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"a KV-cache scale must be positive and finite, got {value}")
    with torch.no_grad():
        param.data.fill_(value)
    param.from_checkpoint = True  # type: ignore[attr-defined]


def read_scales(attn: nn.Module) -> tuple[float, float] | None:
    """(k_scale, v_scale) as Python floats, read once after loading; None where the checkpoint
    gave the layer neither (the backend's own scales, 1.0, then apply)."""
    k, v = getattr(attn, "k_scale", None), getattr(attn, "v_scale", None)
    if k is None or not (k.from_checkpoint or v.from_checkpoint):
        return None
    return float(k), float(v)


def startup_line(model: nn.Module, quant_config: Any, kv_dtype: torch.dtype) -> tuple[str, bool] | None:
    """The start-up log's line on the checkpoint's KV-cache scales and whether it is a warning,
    or None when the checkpoint neither declares nor carries any."""
    declared = getattr(quant_config, "kv_cache_scheme", None)
    layers = [m for m in model.modules() if isinstance(getattr(m, "k_scale", None), nn.Parameter)]
    scales = [m.kv_scales for m in layers if getattr(m, "kv_scales", None) is not None]
    if not scales:
        if declared is None:
            return None
        return (f"the checkpoint declares FP8 KV-cache scales (kv_cache_scheme: {declared}) but carries no "
                "k_scale / v_scale tensors: an fp8 KV cache would use 1.0", True)  # fmt: skip
    ks, vs = [s[0] for s in scales], [s[1] for s in scales]
    what = (f"KV-cache scales from the checkpoint ({len(scales)} of {len(layers)} layers, k_scale "
            f"{min(ks):.4g}..{max(ks):.4g}, v_scale {min(vs):.4g}..{max(vs):.4g})")  # fmt: skip
    if kv_dtype in FP8_KV_DTYPES:
        rest = f"; the other {len(layers) - len(scales)} use 1.0" if len(scales) < len(layers) else ""
        return f"{what}: used, the KV cache is {_name(kv_dtype)}{rest}", False
    return f"{what}: ignored, the KV cache is {_name(kv_dtype)} (they apply to --kv-cache-dtype fp8)", False


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
