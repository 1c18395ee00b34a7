"""GGUF checkpoints: llama.cpp-compatible CPU numerics (see `llamacpp.py`) and the torch reference
of ggml-cpu's activation quantization (`activations.py`)."""

from paphos.quant.gguf.llamacpp import (
    NUMERICS_MODES,
    LlamaCppLinearMethod,
    LlamaCppQuantConfig,
    quant_config_for_source,
)

__all__ = ["NUMERICS_MODES", "LlamaCppLinearMethod", "LlamaCppQuantConfig", "quant_config_for_source"]
