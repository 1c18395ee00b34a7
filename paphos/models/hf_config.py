"""Reading HF `transformers` config objects the same way across transformers 4.x and 5.x.

Data flow: loader reads config.json into an HF config -> model __init__ asks these helpers for
head size, RoPE parameters and per-layer sliding windows.
"""

from __future__ import annotations

from typing import Any


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads(config: Any) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def rope_parameters(config: Any, layer_type: str | None = None) -> tuple[float, dict[str, Any] | None, float]:
    """(theta, scaling dict or None, partial_rotary_factor) of the layers of `layer_type`
    ('sliding_attention' / 'full_attention' for models whose layer kinds differ in RoPE, Gemma 3).

    transformers 5 keeps everything in `config.rope_parameters` (rope_theta, rope_type, ...),
    nested by layer type where types differ; 4.x has `rope_theta` and an optional `rope_scaling`
    dict (with 'type' or 'rope_type'), and Gemma 3's sliding layers use `rope_local_base_freq`
    without scaling."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    elif layer_type == "sliding_attention" and getattr(config, "rope_local_base_freq", None) is not None:
        return float(config.rope_local_base_freq), None, 1.0
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling: dict[str, Any] | None = params
    else:
        theta = float(getattr(config, "rope_theta", 10000.0))
        scaling = getattr(config, "rope_scaling", None)
    partial = float(
        (scaling or {}).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    )
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, scaling, partial


def layer_sliding_window(config: Any, layer_idx: int) -> int | None:
    """The attention window of one layer (None: full causal attention)."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return int(window) if layer_types[layer_idx] == "sliding_attention" else None
    # transformers 4.x Qwen2: the window is opt-in and only applies from max_window_layers on.
    if getattr(config, "use_sliding_window", True) is False:
        return None
    max_window_layers = getattr(config, "max_window_layers", None)
    if max_window_layers is not None and layer_idx < max_window_layers:
        return None
    return int(window)
