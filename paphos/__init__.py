"""Paphos: an LLM serving engine for community-quantized models, Aphrodite-compatible."""

from paphos.sampling_params import SamplingParams
from paphos.version import __version__

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; keep `import paphos` (and paphos.core) light.
    if name == "LLM":
        from paphos.llm import LLM

        return LLM
    raise AttributeError(name)
