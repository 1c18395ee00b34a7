"""A GGUF checkpoint (llama.cpp format; one file, or the files of a split model) as HF config,
tokenizer and HF-named weights.

Data flow: `load_model_source` -> `GGUFCheckpoint(path)` -> `hf_config` (built from the file's
metadata), `tokenizer()` (transformers' GGUF tokenizer conversion) and `iter_weights()` ->
`(hf_name, tensor)` pairs -> the model's `load_weights`, exactly as for a safetensors checkpoint.
Tensors a quant method keeps quantized (`raw_names`, e.g. GGUF linear weights, see
paphos/quant/gguf/linear.py) are yielded as their raw blocks, uint8 [rows, bytes per row]; the
others are dequantized to float32 with `gguf.quants.dequantize` (the reference numpy dequantizers
of the format's own package), one tensor at a time, from the memory-mapped file.

Split models (`<name>-00001-of-0000N.gguf`, llama.cpp's gguf-split) load from the first file: it
has the metadata and names the file count; the tensors of all files are read as one table.

Layout differences between llama.cpp and HF undone here:
- llama.cpp's converter permutes the rows of Q and K (and their biases) of llama-architecture models
  so that each head's rotary pairs are interleaved (GPT-J style RoPE); HF models rotate halves
  (NeoX style). `unpermute_qk` is the exact inverse of that permutation (rows are whole blocks, so
  it applies to raw blocks too). Qwen2, Qwen3 and Gemma 3 are converted without it (llama.cpp runs
  them with NeoX RoPE), so their weights are taken as they are.
- Gemma's RMSNorm weights are stored as 1 + w (HF computes x * (1 + w)); 1 is subtracted.
- A model with tied embeddings has no `output.weight`; then `tie_word_embeddings` is set and no
  `lm_head.weight` is yielded, as in an HF checkpoint of such a model.

The header comes from `gguf_reader.py` (fast; see why there). The config is built from the
metadata here rather than by `AutoConfig.from_pretrained(gguf_file=...)`, whose legacy path for
these architectures re-parses every vocabulary string of the file (seconds) to read the same dozen
keys, and which knows nothing of llama.cpp's fixed Gemma 3 hyperparameters. The tests check
config, names and values against transformers' own GGUF conversion.

Adding an architecture: an `_ArchSpec` entry, its extra tensor names, and any value transform
llama.cpp's converter applied.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paphos.loader.base import LoaderError, WeightsIterator, progress
from paphos.loader.gguf_reader import GGUFFile, GGUFFormatError, GGUFTensor, read_gguf

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _ArchSpec:
    model_type: str  # HF `model_type`
    hf_architecture: str  # HF `architectures[0]`, what the model registry resolves
    permute_qk: bool  # llama.cpp permuted Q/K rows for interleaved RoPE
    # llama.cpp stored RMSNorm weights as 1 + w (Gemma: HF computes x * (1 + w))
    norm_plus_one: bool = False
    layer_names: dict[str, str] | None = None  # overrides of _LAYER_NAMES


_GEMMA3_LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

_ARCHS: dict[str, _ArchSpec] = {
    "llama": _ArchSpec("llama", "LlamaForCausalLM", permute_qk=True),
    "qwen2": _ArchSpec("qwen2", "Qwen2ForCausalLM", permute_qk=False),
    "qwen3": _ArchSpec("qwen3", "Qwen3ForCausalLM", permute_qk=False),
    "gemma3": _ArchSpec(
        "gemma3_text",
        "Gemma3ForCausalLM",
        permute_qk=False,
        norm_plus_one=True,
        layer_names=_GEMMA3_LAYER_NAMES,
    ),  # fmt: skip
}
# llama.cpp's fixed Gemma 3 hyperparameters (llama-model.cpp, LLM_ARCH_GEMMA3): every 6th layer
# attends globally, the others over the sliding window with RoPE base 10000; attention scale
# 1/sqrt(head_dim), except the 62-layer 27B model which uses 1/sqrt(hidden / heads).
_GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0

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
    # per-head q/k norms (Qwen3, Gemma 3)
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp's gguf-split names: <name>-00001-of-00003.gguf
_SPLIT_RE = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.gguf")
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


def gguf_to_hf_name(name: str, architecture: str = "llama") -> str | None:
    """The HF parameter name of GGUF tensor `name` of a model of `architecture`, or None if it
    has no HF counterpart."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if m is None:
        return None
    spec = _ARCHS.get(architecture)
    hf = ((spec and spec.layer_names) or {}).get(m.group(2)) or _LAYER_NAMES.get(m.group(2))
    return f"model.layers.{m.group(1)}.{hf}.{m.group(3)}" if hf else None


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


def _read(path: Path) -> GGUFFile:
    try:
        return read_gguf(path)
    except (GGUFFormatError, OSError) as e:
        raise LoaderError(f"{path}: not a readable GGUF file: {e}") from e


class GGUFCheckpoint:
    """One `.gguf` file, memory-mapped. Cheap to keep; tensors are read when iterated."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise LoaderError(f"{self.path}: GGUF file not found")
        first = _read(self.path)
        # Key/values; arrays longer than 256 items (vocabulary, merges) appear as their length.
        self.metadata: dict[str, Any] = first.metadata
        self.tensors: list[GGUFTensor] = [t for f in [first, *self._other_splits(first)] for t in f.tensors]
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

    def _other_splits(self, first: GGUFFile) -> list[GGUFFile]:
        """Files 2..N of a split model (`<name>-00001-of-0000N.gguf`, llama.cpp's gguf-split:
        metadata in the first file, each file with its `split.no` and a share of the tensors)."""
        count = int(self.metadata.get("split.count", 1))
        if count <= 1:
            return []
        m = _SPLIT_RE.fullmatch(self.path.name)
        if m is None or int(m.group(2)) != 1 or int(m.group(3)) != count:
            raise LoaderError(
                f"{self.path}: part of a {count}-file split GGUF; pass the first file "
                f"(<name>-00001-of-{count:05d}.gguf)"
            )
        files = []
        for no in range(2, count + 1):
            path = self.path.with_name(f"{m.group(1)}-{no:05d}-of-{m.group(3)}.gguf")
            if not path.is_file():
                raise LoaderError(f"{self.path}: split file {path.name} ({no} of {count}) not found")
            part = _read(path)
            if int(part.metadata.get("split.no", -1)) != no - 1:
                raise LoaderError(f"{path}: split.no is {part.metadata.get('split.no')}, expected {no - 1}")
            files.append(part)
        expected = self.metadata.get("split.tensors.count")
        found = len(first.tensors) + sum(len(f.tensors) for f in files)
        if expected is not None and found != int(expected):
            raise LoaderError(
                f"{self.path}: the {count} split files hold {found} tensors, expected {expected}"
            )
        return files

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
        if self._spec.model_type in ("llama", "qwen3"):
            kwargs["attention_bias"] = "blk.0.attn_q.bias" in names
        if self._spec.model_type == "gemma3_text":
            kwargs.update(self._gemma3_kwargs(kwargs))
        rope_scaling = self._rope_scaling()
        if rope_scaling is not None:
            kwargs["rope_scaling"] = rope_scaling
        if kwargs["vocab_size"] is None:
            raise LoaderError(f"{self.path}: no vocabulary size in the metadata")
        return AutoConfig.for_model(self._spec.model_type, **kwargs)

    def _gemma3_kwargs(self, base: dict[str, Any]) -> dict[str, Any]:
        layers, heads, hidden = base["num_hidden_layers"], base["num_attention_heads"], base["hidden_size"]
        kwargs: dict[str, Any] = {
            "sliding_window": int(self._require("attention.sliding_window")),
            "sliding_window_pattern": _GEMMA3_SLIDING_PATTERN,
            "rope_local_base_freq": _GEMMA3_LOCAL_ROPE_BASE,
            "query_pre_attn_scalar": hidden // heads if layers == 62 else base["head_dim"],
            "hidden_activation": "gelu_pytorch_tanh",
        }
        softcap = self._key("final_logit_softcapping")
        if softcap is not None:
            kwargs["final_logit_softcapping"] = float(softcap)
        return kwargs

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

    def tensors_by_hf_name(self) -> dict[str, GGUFTensor]:
        """The file's tensors that have an HF counterpart, by HF name."""
        named = ((gguf_to_hf_name(t.name, self.architecture), t) for t in self.tensors)
        return {name: t for name, t in named if name is not None}

    def iter_weights(self, *, show_progress: bool = True, raw_names: Container[str] = ()) -> WeightsIterator:
        """Yield `(hf_name, tensor)` for every tensor of the file: float32 dequantized, or for the
        names in `raw_names` the stored blocks as uint8 [rows, bytes per row] (what a quantized
        linear method keeps; rows in HF order)."""
        from gguf.quants import dequantize

        tensors = self.tensors
        for t in progress(
            tensors, total=len(tensors), desc=f"Loading {self.path.name}", enabled=show_progress
        ):
            hf_name = gguf_to_hf_name(t.name, self.architecture)
            if hf_name is None:
                if t.name in _SKIPPED:
                    logger.warning(
                        "%s: ignoring %s (Llama 3.1-style RoPE scaling); contexts beyond the "
                        "original training length may degrade",
                        self.path, t.name,
                    )  # fmt: skip
                    continue
                raise LoaderError(f"{self.path}: tensor {t.name!r} has no known HF counterpart")
            if hf_name in raw_names:
                tensor = torch.from_numpy(np.array(t.data).reshape(t.shape[0], -1))
                yield hf_name, self._unpermute(t, hf_name, tensor)
                continue
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
            if self._spec.norm_plus_one and hf_name.endswith("norm.weight"):
                tensor = tensor - 1.0
            yield hf_name, self._unpermute(t, hf_name, tensor)

    def _unpermute(self, t: GGUFTensor, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Q/K rows (weights: rows of values or of raw blocks; biases) back in HF order."""
        config = self.hf_config
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
        proj = hf_name.split(".")[-2]
        if not self._spec.permute_qk or proj not in heads:
            return tensor
        n_head = heads[proj]
        if tensor.shape[0] % (2 * n_head):
            raise LoaderError(
                f"{self.path}: tensor {t.name!r} has {tensor.shape[0]} rows, not a multiple of "
                f"2 x {n_head} heads"
            )
        return unpermute_qk(tensor, n_head)
