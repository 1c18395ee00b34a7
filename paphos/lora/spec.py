"""What an adapter must fit: the model's LoRA-capable projections and their shapes.

The engine core computes a `LoRAModelSpec` from the loaded model (`lora_model_spec`) and hands it
to the API process inside EngineInfo, where registration validates adapters against it
(peft.py) before any request can name them. No torch here: the API side imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Our merged projection -> the checkpoint (PEFT) modules it holds side by side, in output order.
LORA_TARGETS: Mapping[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
# PEFT target module names we apply.
SUPPORTED_MODULES: tuple[str, ...] = tuple(m for group in LORA_TARGETS.values() for m in group)


@dataclass(frozen=True)
class LoRAModelSpec:
    num_layers: int
    # PEFT module name (q_proj, ...) -> (in_features, out_features) of that projection.
    shapes: Mapping[str, tuple[int, int]]


def lora_projections(layer: Any) -> tuple[tuple[str, Any], ...]:
    """(our merged projection's name, its linear layer) of a Llama-shaped decoder layer."""
    attn, mlp = layer.self_attn, layer.mlp
    return (("qkv_proj", attn.qkv_proj), ("o_proj", attn.o_proj),
            ("gate_up_proj", mlp.gate_up_proj), ("down_proj", mlp.down_proj))  # fmt: skip


def lora_model_spec(model: Any) -> LoRAModelSpec:
    """The spec of a loaded Llama-shaped model (models/llama.py and its subclasses): the whole
    checkpoint's shapes, also when a tensor-parallel rank holds a slice of each projection."""
    shapes: dict[str, tuple[int, int]] = {}
    for ours, linear in lora_projections(model.model.layers[0]):
        for i, name in enumerate(LORA_TARGETS[ours]):
            shapes[name] = (linear.tp_cols().full, linear.tp_rows(i).full)
    return LoRAModelSpec(num_layers=len(model.model.layers), shapes=shapes)
