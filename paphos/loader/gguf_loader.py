"""A single-file GGUF checkpoint (llama.cpp format) as HF config, tokenizer and HF-named weights.

Data flow: `load_model_source` -> `GGUFCheckpoint(path)` -> `hf_config` (built from the file's
metadata), `tokenizer()` (transformers' GGUF tokenizer conversion) and `iter_weights()` ->
`(hf_name, float32 tensor)` pairs -> the model's `load_weights`, exactly as for a safetensors
checkpoint. Quantized tensors are dequantized with `gguf.quants.dequantize` (the reference numpy
dequantizers of the format's own package), one tensor at a time, from the memory-mapped file.

Two layout differences between llama.cpp and HF are undone here:
- llama.cpp's converter permutes the rows of Q and K (and their biases) of llama-architecture models
  so that each head's rotary pairs are interleaved (GPT-J style RoPE); HF models rotate halves
  (NeoX style). `unpermute_qk` is the exact inverse of that permutation. Qwen2 is converted without
  it (llama.cpp runs it with NeoX RoPE), so its weights are taken as they are.
- A model with tied embeddings has no `output.weight`; then `tie_word_embeddings` is set and no
  `lm_head.weight` is yielded, as in an HF checkpoint of such a model.

The header comes from `gguf_reader.py` (fast; see why there). The config is built from the
metadata here rather than by `AutoConfig.from_pretrained(gguf_file=...)`, whose legacy path for
these architectures re-parses every vocabulary string of the file (seconds) to read the same dozen
keys. The tests check config, names and values against transformers' own GGUF conversion.

Adding an architecture: an `_ArchSpec` entry, its extra tensor names, and any value transform
llama.cpp's converter applied (e.g. Gemma stores RMSNorm weights as 1 + w).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paphos.loader.base import LoaderError, WeightsIterator, progress
from paphos.loader.gguf_reader import GGUFFormatError, GGUFTensor, read_gguf

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _ArchSpec:
    model_type: str  # HF `model_type`
    hf_architecture: str  # HF `architectures[0]`, what the model registry resolves
    permute_qk: bool  # llama.cpp permuted Q/K rows for interleaved RoPE


_ARCHS: dict[str, _ArchSpec] = {
    "llama": _ArchSpec("llama", "LlamaForCausalLM", permute_qk=True),
    "qwen2": _ArchSpec("qwen2", "Qwen2ForCausalLM", permute_qk=False),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors llama.cpp stores that have no HF parameter: precomputed RoPE frequency factors of
# Llama 3.1-style scaling (see the warning where they are met).
_SKIPPED = {"rope_freqs.weight"}

# Token texts llama.cpp treats as end-of-generation in addition to the file's eos/eot/eom ids
# (llama-vocab.cpp detects them by text because converters rarely record them).
_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
)  # fmt: skip


# general.sampling.<key> -> SamplingParams field.
_SAMPLING_KEYS = {
    "temp": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "penalty_repeat": "repetition_penalty",
}


def gguf_to_hf_name(name: str) -> str | None:
    """The HF parameter name of GGUF tensor `name`, or None if it has no HF counterpart."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (weights `[out, in]` or biases `[out]`).

    The converter reshapes each head's rows as `[2, head_dim/2]` (the two rotated halves) and
    transposes to `[head_dim/2, 2]`, interleaving the halves. Reshaping as `[head_dim/2, 2]` and
    transposing back restores HF's order.
    """
    rows = weight.shape[0]
    half = rows // n_head // 2
    w = weight.reshape(n_head, half, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape).contiguous()


class GGUFCheckpoint:
    """One `.gguf` file, memory-mapped. Cheap to keep; tensors are read when iterated."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise LoaderError(f"{self.path}: GGUF file not found")
        try:
            gguf_file = read_gguf(self.path)
        except (GGUFFormatError, OSError) as e:
            raise LoaderError(f"{self.path}: not a readable GGUF file: {e}") from e
        # Key/values; arrays longer than 256 items (vocabulary, merges) appear as their length.
        self.metadata: dict[str, Any] = gguf_file.metadata
        self.tensors: list[GGUFTensor] = gguf_file.tensors
        self.architecture: str = str(self.metadata.get("general.architecture", ""))
        spec = _ARCHS.get(self.architecture)
        if spec is None:
            raise LoaderError(
                f"{self.path}: GGUF architecture {self.architecture!r} is not supported yet "
                f"(supported: {', '.join(sorted(_ARCHS))})"
            )
        self._spec = spec
        self.tensor_names: list[str] = [t.name for t in self.tensors]
        self.hf_config = self._build_config()

    # ---- metadata -----------------------------------------------------------------------------

    def _key(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def _require(self, key: str) -> Any:
        value = self._key(key)
        if value is None:
            raise LoaderError(f"{self.path}: metadata key {self.architecture}.{key} is missing")
        if isinstance(value, list):
            raise LoaderError(f"{self.path}: per-layer {self.architecture}.{key} is not supported yet")
        return value

    def _build_config(self) -> Any:
        from transformers import AutoConfig

        heads = int(self._require("attention.head_count"))
        hidden = int(self._require("embedding_length"))
        names = set(self.tensor_names)
        vocab = self._key("vocab_size") or self.metadata.get("tokenizer.ggml.tokens")
        if isinstance(vocab, list):  # a vocabulary short enough to be kept as a list
            vocab = len(vocab)
        kwargs: dict[str, Any] = {
            "architectures": [self._spec.hf_architecture],
            "hidden_size": hidden,
            "intermediate_size": int(self._require("feed_forward_length")),
            "num_hidden_layers": int(self._require("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._key("attention.head_count_kv", heads)),
            "head_dim": int(self._key("attention.key_length", hidden // heads)),
            "max_position_embeddings": int(self._require("context_length")),
            "rms_norm_eps": float(self._key("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(self._key("rope.freq_base", 10000.0)),
            "vocab_size": int(vocab) if vocab is not None else None,
            # llama.cpp writes output.weight only when it differs from the embedding.
            "tie_word_embeddings": "output.weight" not in names,
            "bos_token_id": self.metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.metadata.get("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self.metadata.get("tokenizer.ggml.padding_token_id"),
        }
        if self._spec.model_type == "llama":
            kwargs["attention_bias"] = "blk.0.attn_q.bias" in names
        rope_scaling = self._rope_scaling()
        if rope_scaling is not None:
            kwargs["rope_scaling"] = rope_scaling
        if kwargs["vocab_size"] is None:
            raise LoaderError(f"{self.path}: no vocabulary size in the metadata")
        return AutoConfig.for_model(self._spec.model_type, **kwargs)

    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = self._key("rope.scaling.type")
        if kind in (None, "none"):
            return None
        if kind not in ("linear", "yarn"):
            raise LoaderError(f"{self.path}: RoPE scaling type {kind!r} is not supported yet")
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(self._require("rope.scaling.factor"))}
        original = self._key("rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling

    def tokenizer(self, chat_template: str | None = None) -> Any:
        """The file's tokenizer as a `paphos.tokenizer.Tokenizer`."""
        from paphos.tokenizer import Tokenizer

        try:
            tok = Tokenizer.from_gguf(self.path, gguf_metadata=self.metadata)
        except Exception as e:
            raise LoaderError(f"{self.path}: cannot build the tokenizer: {e}") from e
        tok.set_chat_template(chat_template)  # a bad override is the user's ValueError, not ours
        return tok

    def eos_token_ids(self, tokenizer: Any | None) -> tuple[int, ...]:
        """End-of-generation ids as llama.cpp derives them: the file's eos (first), eot, eom ids,
        then the vocabulary's tokens with a known end-of-turn text (e.g. `<|endoftext|>` next to
        `<|im_end|>` in ChatML models)."""
        ids: list[int] = []
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            value = self.metadata.get(f"tokenizer.ggml.{key}")
            if value is not None and int(value) not in ids:
                ids.append(int(value))
        if tokenizer is not None:
            vocab = tokenizer.get_vocab()
            for text in _EOG_TEXTS:
                token_id = vocab.get(text)
                if token_id is not None and token_id not in ids:
                    ids.append(token_id)
        return tuple(ids)

    def generation_defaults(self) -> dict[str, Any]:
        """Sampling defaults the file recommends (`general.sampling.*`, written by recent
        converters from generation_config.json), under Paphos' SamplingParams names."""
        return {
            ours: self.metadata[f"general.sampling.{theirs}"]
            for theirs, ours in _SAMPLING_KEYS.items()
            if f"general.sampling.{theirs}" in self.metadata
        }

    def quant_summary(self) -> str:
        """e.g. `Q4_1 x210, F32 x61, Q8_0 x1` (tensor types and counts), for the startup log."""
        counts = Counter(t.tensor_type.name for t in self.tensors)
        return ", ".join(f"{name} x{n}" for name, n in counts.most_common())

    # ---- weights ------------------------------------------------------------------------------

    def iter_weights(self, *, show_progress: bool = True) -> WeightsIterator:
        """Yield `(hf_name, float32 tensor)` for every tensor of the file, dequantized."""
        from gguf.quants import dequantize

        config = self.hf_config
        heads = {
            "q_proj": config.num_attention_heads,
            "k_proj": config.num_key_value_heads,
        }
        tensors = self.tensors
        for t in progress(
            tensors, total=len(tensors), desc=f"Loading {self.path.name}", enabled=show_progress
        ):
            hf_name = gguf_to_hf_name(t.name)
            if hf_name is None:
                if t.name in _SKIPPED:
                    logger.warning(
                        "%s: ignoring %s (Llama 3.1-style RoPE scaling); contexts beyond the "
                        "original training length may degrade",
                        self.path, t.name,
                    )  # fmt: skip
                    continue
                raise LoaderError(f"{self.path}: tensor {t.name!r} has no known HF counterpart")
            try:
                array = dequantize(t.data, t.tensor_type).reshape(t.shape)
            except Exception as e:
                raise LoaderError(
                    f"{self.path}: cannot dequantize tensor {t.name!r} "
                    f"({t.tensor_type.name}, shape {list(t.shape)}): {e}"
                ) from e
            if array.dtype != np.float32 or not array.flags.writeable:
                # F32 tensors are views of the read-only file mapping; torch wants owned memory.
                array = array.astype(np.float32)
            tensor = torch.from_numpy(array)
            proj = hf_name.split(".")[-2]
            if self._spec.permute_qk and proj in heads:
                n_head = heads[proj]
                if tensor.shape[0] % (2 * n_head):
                    raise LoaderError(
                        f"{self.path}: tensor {t.name!r} has {tensor.shape[0]} rows, not a "
                        f"multiple of 2 x {n_head} heads"
                    )
                tensor = unpermute_qk(tensor, n_head)
            yield hf_name, tensor
