"""Tiny PEFT LoRA adapters made with `peft` itself, for the LoRA tests of every directory.

`write_tiny_llama` writes the random Llama of tests/engine/conftest.py (vocab 96, hidden 64, 2 layers,
4 heads, 2 KV heads, tokenizer included); `make_adapter` puts a PEFT LoRA on a copy of it, with
lora_B random (PEFT starts B at zero, which would make every comparison pass vacuously), saves it
with `save_pretrained` and returns PEFT's merged model, the reference any Paphos output is
checked against.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from paphos.lora.spec import SUPPORTED_MODULES, LoRAModelSpec
from tests.engine.conftest import _build

ALL_MODULES = SUPPORTED_MODULES


@dataclass
class TinyLlama:
    path: Path  # config, safetensors weights and tokenizer
    model: torch.nn.Module  # the HF model (float32, eval); adapters never modify it
    spec: LoRAModelSpec


@dataclass
class Adapter:
    path: Path
    merged: torch.nn.Module  # PEFT's merge_and_unload of the adapter on a copy of the base


def write_tiny_llama(folder: Path, seed: int = 0) -> TinyLlama:
    path, model = _build(folder, "llama", seed=seed)
    return as_tiny_llama(path, model)


def as_tiny_llama(path: Path, model: torch.nn.Module) -> TinyLlama:
    """Any HF Llama-shaped model (e.g. a quantized checkpoint's dequantized reference) as the base
    `make_adapter` puts adapters on; `path` is what the engine loads."""
    layer = model.model.layers[0]
    shapes = {}
    for name in SUPPORTED_MODULES:
        linear = getattr(layer.self_attn if hasattr(layer.self_attn, name) else layer.mlp, name)
        shapes[name] = (linear.in_features, linear.out_features)
    return TinyLlama(path, model, LoRAModelSpec(num_layers=len(model.model.layers), shapes=shapes))


def make_adapter(
    base: TinyLlama,
    folder: Path,
    *,
    rank: int = 8,
    alpha: float = 16,
    use_rslora: bool = False,
    target_modules: tuple[str, ...] | str = ALL_MODULES,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    layers_to_transform: list[int] | None = None,
    seed: int = 0,
    safetensors: bool = True,
) -> Adapter:
    """A PEFT adapter saved to `folder` (adapter_model.safetensors, or .bin when not `safetensors`).
    `target_modules` as a str is PEFT's regex form."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank, lora_alpha=alpha, use_rslora=use_rslora,
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        rank_pattern=rank_pattern or {}, alpha_pattern=alpha_pattern or {},
        layers_to_transform=layers_to_transform, lora_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)  # PEFT draws lora_A from the global generator
    peft_model = get_peft_model(copy.deepcopy(base.model), config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    peft_model.save_pretrained(folder, safe_serialization=safetensors)
    return Adapter(folder, peft_model.merge_and_unload().eval())
