"""Model loading: from a path (HF safetensors directory, GGUF file, or config only) to an HF config,
a tokenizer and a stream of HF-named weights. See `paphos.loader.source` for the data flow."""

from paphos.loader.base import LoaderError, WeightsIterator
from paphos.loader.dummy_loader import fill_dummy_weights, load_dummy_config
from paphos.loader.gguf_loader import GGUFCheckpoint, gguf_to_hf_name, unpermute_qk
from paphos.loader.gguf_reader import GGUFFile, GGUFFormatError, GGUFTensor, read_gguf
from paphos.loader.safetensors_loader import iter_safetensors, safetensors_files
from paphos.loader.source import (
    ModelSource,
    derive_max_model_len,
    detect_format,
    find_gguf_file,
    load_model_source,
)

__all__ = [
    "GGUFCheckpoint",
    "GGUFFile",
    "GGUFFormatError",
    "GGUFTensor",
    "LoaderError",
    "ModelSource",
    "WeightsIterator",
    "derive_max_model_len",
    "detect_format",
    "fill_dummy_weights",
    "find_gguf_file",
    "gguf_to_hf_name",
    "iter_safetensors",
    "load_dummy_config",
    "load_model_source",
    "read_gguf",
    "safetensors_files",
    "unpermute_qk",
]
