"""GGUF checkpoints: weights kept in their quantized blocks (`linear.py`, kernels in `kernels.py`,
dequantizers in `dequant.py`), and llama.cpp-compatible CPU numerics (`llamacpp.py`, with the
torch reference of ggml-cpu's activation quantization in `activations.py`).

Data flow: worker setup -> `quant_config_for_source(source, numerics)` -> a `QuantConfig` handed
to the model, which asks it for each linear layer's method.
"""

from __future__ import annotations

from typing import Any

from paphos.loader.gguf_loader import GGUFCheckpoint
from paphos.quant.gguf.linear import GGUFLinearMethod, GGUFQuantConfig
from paphos.quant.gguf.llamacpp import LlamaCppLinearMethod, LlamaCppQuantConfig


def quant_config_for_source(
    source: Any, numerics: str = "float"
) -> GGUFQuantConfig | LlamaCppQuantConfig | None:
    """The quant config of a model source for the `--gguf-numerics {float,llamacpp}` setting.

    'float' (default, for every GGUF source): weights stay in their GGUF blocks and each layer
    runs the first kernel that accepts it (kernels.py); activations stay in the model dtype. With
    `--dtype float32` the weights are dequantized at load (bit-exact, as `gguf` computes them) and
    the result is the float32 reference (matches llama.cpp run on the F32-dequantized file).
    'llamacpp': float32 weights, activations rounded as llama.cpp's CPU backend does before every
    matmul of a quantized weight (see `llamacpp.py` for what that does and does not reproduce).
    Sources that are not GGUF files get None either way.
    """
    if getattr(source, "load_format", None) != "gguf":
        return None
    if numerics == "llamacpp":
        return LlamaCppQuantConfig.from_gguf(source.path, source.hf_config)
    checkpoint = getattr(source, "gguf", None) or GGUFCheckpoint(source.path)  # parsed once if we can
    return GGUFQuantConfig.from_checkpoint(checkpoint)


__all__ = [
    "GGUFLinearMethod",
    "GGUFQuantConfig",
    "LlamaCppLinearMethod",
    "LlamaCppQuantConfig",
    "quant_config_for_source",
]
