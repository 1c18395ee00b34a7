"""Our layers and the checkpoint modules behind them, for every format's QuantConfig: a merged
layer (`qkv_proj`, `gate_up_proj`) holds several checkpoint projections, and checkpoints name
the modules they quantize or skip by those projections' names (compressed-tensors' `targets` /
`ignore`, FP8's `ignored_layers`, GGUF's tensor table)."""

from __future__ import annotations

import re
from collections.abc import Iterable

# Our merged layers -> the checkpoint projections they hold, in output order (the model's
# stacking, as vLLM's `packed_modules_mapping`).
PACKED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def checkpoint_modules(prefix: str) -> list[str]:
    """The checkpoint module paths behind the layer at `prefix`, in output order
    ('model.layers.0.self_attn.qkv_proj' -> its q_proj, k_proj, v_proj)."""
    parent, _, leaf = prefix.rpartition(".")
    return [f"{parent}.{part}" if parent else part for part in PACKED_MODULES.get(leaf, (leaf,))]


def matches(name: str, patterns: Iterable[str]) -> bool:
    """compressed-tensors' matching of a module name: "re:<regex>" is `re.match`ed, anything else
    compared whole. (Class names such as "Linear" are the caller's business.)"""
    return any(re.match(p[3:], name) is not None if p.startswith("re:") else p == name for p in patterns)
