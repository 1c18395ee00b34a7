"""GGUF checkpoints: llama.cpp-compatible CPU numerics (see `llamacpp.py`) and the torch reference
of ggml-cpu's activation quantization (`activations.py`)."""

from paphos.quant.gguf.llamacpp import (
    LlamaCppLinearMethod,
    LlamaCppQuantConfig,
    quant_config_for_source,
)

__all__ = ["LlamaCppLinearMethod", "LlamaCppQuantConfig", "quant_config_for_source"]
