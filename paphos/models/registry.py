"""HF architecture name (config.json `architectures[0]`) -> model class.

Data flow: loader reads the HF config -> resolve_model_class -> model runner builds the model.
Classes are imported lazily so listing support never imports every model file.
"""

from __future__ import annotations

import importlib
from typing import Any

from paphos.models.errors import UnsupportedModelError

# architecture -> (module, class)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("paphos.models.llama", "LlamaForCausalLM"),
    # Mistral is the Llama decoder; its sliding window comes from the config.
    "MistralForCausalLM": ("paphos.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("paphos.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("paphos.models.qwen3", "Qwen3ForCausalLM"),
    "Gemma3ForCausalLM": ("paphos.models.gemma3", "Gemma3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(hf_config: Any) -> type:
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise UnsupportedModelError(
            "config.json names no architecture ('architectures' is empty); supported: "
            + ", ".join(supported_architectures())
        )
    arch = archs[0]
    if arch not in _MODELS:
        raise UnsupportedModelError(
            f"model architecture {arch!r} is not supported; supported: {', '.join(supported_architectures())}"
        )
    module, cls = _MODELS[arch]
    return getattr(importlib.import_module(module), cls)
