"""Random weights (`--load-format dummy`) for benchmarks and tests without a real checkpoint.

Data flow: `load_model_source(..., load_format="dummy")` reads only a config (an HF directory, a
`config.json` path, or a `.gguf` file's metadata); the engine instantiates the model from it and
calls `fill_dummy_weights(model, seed)` instead of `model.load_weights(...)`. The values are small
enough that activations stay finite through many layers: linear/embedding weights ~ N(0, 0.02),
biases 0, normalization weights at their identity value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from paphos.loader.base import LoaderError

# Models whose RMSNorm multiplies by (1 + weight): their identity weight is 0, not 1.
_ZERO_CENTERED_NORM_MODEL_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text")


def load_dummy_config(path: str | Path) -> Any:
    """The HF config of an HF directory or a `config.json` file."""
    from transformers import AutoConfig

    path = Path(path)
    if path.is_dir() and not (path / "config.json").is_file():
        raise LoaderError(f"{path}: no config.json (dummy weights need at least a config)")
    if not path.exists():
        raise LoaderError(f"{path}: no such file or directory")
    try:
        return AutoConfig.from_pretrained(str(path))
    except Exception as e:  # malformed json, unknown model_type
        raise LoaderError(f"{path}: cannot read the model config: {e}") from e


def _is_norm(name: str) -> bool:
    # HF names end in e.g. input_layernorm.weight, model.norm.weight, self_attn.q_norm.weight.
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and "norm" in parts[-2]


@torch.no_grad()
def fill_dummy_weights(
    model: torch.nn.Module, seed: int = 0, *, std: float = 0.02, norm_value: float | None = None
) -> None:
    """Overwrite every floating-point parameter of `model` in place, deterministically per seed.

    `norm_value`: what normalization weights are set to; by default 1.0, or 0.0 for models whose
    config says their norms are zero-centered (Gemma). Non-float parameters (packed quantized
    weights) are left alone: their quantization method owns their meaning.
    """
    if norm_value is None:
        model_type = getattr(getattr(model, "config", None), "model_type", "")
        norm_value = 0.0 if model_type in _ZERO_CENTERED_NORM_MODEL_TYPES else 1.0
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if not param.is_floating_point():
            continue
        if _is_norm(name):
            param.fill_(norm_value)
        elif name.endswith("bias"):
            param.zero_()
        else:
            # One generator per device, so values are drawn where they live (no host round trip)
            # and the same seed gives the same model on the same device type.
            gen = generators.get(param.device)
            if gen is None:
                gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            noise = torch.randn(param.shape, generator=gen, device=param.device, dtype=torch.float32)
            param.copy_(noise.mul_(std))
