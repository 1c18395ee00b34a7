"""From a model path to everything the engine needs before it builds the model: `ModelSource`.

Data flow (engine start-up):

    load_model_source(model_path, load_format, tokenizer, chat_template)
      -> ModelSource{hf_config, tokenizer, eos_token_ids, max_model_len, generation_defaults, ...}
    model_cls = resolve_model_class(source.hf_config)      # paphos.models.registry
    model = model_cls(source.hf_config, ...)
    source.load_into(model, seed)   # streams (hf_name, tensor) into model.load_weights, or dummy

GGUF tensors that a layer's quant method keeps quantized (its `raw_tensor_names`, e.g.
`paphos.quant.gguf.GGUFLinearMethod`) are streamed as their raw blocks; the rest dequantized.

Format detection (`detect_format`): a `.gguf` file (or a directory holding exactly one model:
one file, or the files of one split model) is GGUF;
a directory with `*.safetensors` is safetensors; "dummy" is only ever chosen explicitly.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from paphos.loader.base import LoaderError, WeightsIterator
from paphos.loader.dummy_loader import fill_dummy_weights, load_dummy_config
from paphos.loader.gguf_loader import GGUFCheckpoint
from paphos.loader.safetensors_loader import iter_safetensors, safetensors_files
from paphos.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

FORMATS = ("safetensors", "gguf", "dummy")
_SPLIT_FIRST = re.compile(r".+-00001-of-\d{5}\.gguf")
GGUF_MAGIC = b"GGUF"
# generation_config.json keys that are sampling defaults (Aphrodite/vLLM apply them when a request
# leaves the field unset).
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# Config attributes that bound the context length, most specific first.
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")
DEFAULT_MAX_MODEL_LEN = 2048


def _is_gguf_file(path: Path) -> bool:
    if path.suffix == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def find_gguf_file(path: str | Path) -> Path:
    """`path` itself if it is a GGUF file, or the only `.gguf` file of directory `path`."""
    path = Path(path)
    if path.is_file():
        return path
    files = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(files) == 1:
        return files[0]
    firsts = [f for f in files if _SPLIT_FIRST.fullmatch(f.name)]
    if len(firsts) == 1 and all(
        f.name.startswith(firsts[0].name[: -len("00001-of-00000.gguf")]) for f in files
    ):
        return firsts[0]  # the files of one split model: loading starts from the first
    if not files:
        raise LoaderError(f"{path}: no .gguf file found")
    names = ", ".join(f.name for f in files)
    raise LoaderError(f"{path}: several .gguf files ({names}); pass the path of the one to load")


def detect_format(model_path: str | Path, load_format: str = "auto") -> str:
    """The format of `model_path`: "safetensors", "gguf" or "dummy"; LoaderError names the path."""
    path = Path(model_path).expanduser()
    if load_format not in ("auto", *FORMATS):
        raise LoaderError(f"--load-format must be auto or one of {', '.join(FORMATS)}, got {load_format!r}")
    if not path.exists():
        raise LoaderError(f"{path}: no such file or directory")
    if load_format == "dummy":
        return "dummy"
    if path.is_file():
        if _is_gguf_file(path):
            fmt = "gguf"
        else:
            raise LoaderError(
                f"{path}: a model file must be a .gguf file; for safetensors pass the model directory"
            )
    elif any(path.glob("*.safetensors")):
        fmt = "safetensors"
    elif any(path.glob("*.gguf")):
        fmt = "gguf"
    else:
        raise LoaderError(f"{path}: no *.safetensors or *.gguf files in the directory")
    if load_format != "auto" and load_format != fmt:
        raise LoaderError(f"{path}: --load-format {load_format} given, but this looks like {fmt}")
    return fmt


def derive_max_model_len(hf_config: Any) -> int:
    """The model's context length from its config (text config for multimodal configs)."""
    config = getattr(hf_config, "text_config", None) or hf_config
    for key in _MAX_LEN_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    logger.warning("No context length in the model config; assuming %d", DEFAULT_MAX_MODEL_LEN)
    return DEFAULT_MAX_MODEL_LEN


@dataclass(frozen=True)
class ModelSource:
    """What the engine needs from a model path, before and while building the model."""

    path: Path  # the file or directory actually loaded
    load_format: str  # "safetensors" | "gguf" | "dummy"
    hf_config: Any  # a transformers PretrainedConfig; `architectures[0]` picks the model class
    tokenizer: Tokenizer | None  # None only for dummy models without tokenizer files
    eos_token_ids: tuple[int, ...]  # every end-of-generation id, the primary EOS first
    max_model_len: int  # the model's context length (cap for --max-model-len)
    generation_defaults: Mapping[str, Any] = field(default_factory=dict)  # sampling defaults
    # dtype of the checkpoint's float weights, the hint for `--dtype auto`; None for GGUF (pick by
    # device) and for configs that do not say.
    checkpoint_dtype: torch.dtype | None = None
    description: str = ""  # one line for the start-up log (format, quant types)
    gguf: GGUFCheckpoint | None = field(default=None, repr=False)  # the parsed header of a GGUF model
    # (show_progress, names to stream raw) -> weights
    _weights: Callable[[bool, Container[str]], WeightsIterator] | None = field(default=None, repr=False)

    def iter_weights(self, *, show_progress: bool = True, raw_names: Container[str] = ()) -> WeightsIterator:
        """`(hf_name, tensor)` pairs for `model.load_weights`; not available for dummy models.
        `raw_names`: GGUF tensors to stream as stored (quantized blocks) instead of dequantized."""
        if self._weights is None:
            raise LoaderError(f"{self.path}: dummy models have no weights; use fill_dummy_weights")
        return self._weights(show_progress, raw_names)

    def load_into(self, model: torch.nn.Module, *, seed: int = 0, show_progress: bool = True) -> None:
        """Fill `model`'s parameters: `model.load_weights(...)`, or random values for dummy."""
        if self.load_format == "dummy":
            fill_dummy_weights(model, seed)
            finish = getattr(model, "process_weights_after_loading", None)
            if finish is not None:  # quant methods that quantize at load (-q fp8) do it now
                finish()
        else:
            model.load_weights(
                self.iter_weights(show_progress=show_progress, raw_names=raw_tensor_names(model))
            )


def raw_tensor_names(model: torch.nn.Module) -> frozenset[str]:
    """Checkpoint tensors that the model's quant methods keep in their stored form."""
    return frozenset(
        name
        for module in model.modules()
        for name in getattr(getattr(module, "quant_method", None), "raw_tensor_names", ())
    )


def load_model_source(
    model: str | Path,
    *,
    load_format: str = "auto",
    tokenizer: str | Path | None = None,
    chat_template: str | None = None,
) -> ModelSource:
    """Read the config, tokenizer and generation defaults of `model` (weights stay on disk).

    `tokenizer`: another HF directory or GGUF file to take the tokenizer from (`--tokenizer`).
    `chat_template`: a file path or Jinja string overriding the model's template (`--chat-template`).
    """
    path = Path(model).expanduser()
    fmt = detect_format(path, load_format)
    if fmt == "gguf" or (fmt == "dummy" and _is_gguf_only(path)):
        checkpoint = GGUFCheckpoint(find_gguf_file(path))
        tok = (
            _load_tokenizer(tokenizer, chat_template)
            if tokenizer is not None
            else checkpoint.tokenizer(chat_template)
        )
        quant = checkpoint.quant_summary()
        logger.info("Loaded GGUF metadata of %s (%s; %s)", checkpoint.path, checkpoint.architecture, quant)
        return ModelSource(
            path=checkpoint.path,
            load_format=fmt,
            hf_config=checkpoint.hf_config,
            tokenizer=tok,
            eos_token_ids=checkpoint.eos_token_ids(tok),
            max_model_len=derive_max_model_len(checkpoint.hf_config),
            generation_defaults=checkpoint.generation_defaults(),
            description=f"{fmt} {checkpoint.path.name} ({checkpoint.architecture}; {quant})",
            gguf=checkpoint,
            _weights=None
            if fmt == "dummy"
            else (lambda show, raw: checkpoint.iter_weights(show_progress=show, raw_names=raw)),
        )

    if fmt == "dummy":
        hf_config = load_dummy_config(path)
        model_dir = path if path.is_dir() else path.parent
        tok = _load_tokenizer(tokenizer or model_dir, chat_template, required=tokenizer is not None)
        weights = None
    else:
        from transformers import AutoConfig

        safetensors_files(path)  # fail early, naming the directory, if there is nothing to load
        try:
            hf_config = AutoConfig.from_pretrained(str(path))
        except Exception as e:
            raise LoaderError(f"{path}: cannot read config.json: {e}") from e
        model_dir = path
        tok = _load_tokenizer(tokenizer or path, chat_template, required=True)

        def weights(show: bool, raw_names: Container[str]) -> WeightsIterator:
            return iter_safetensors(path, show_progress=show)

    generation = _read_generation_config(model_dir)
    logger.info("Loaded %s config of %s (%s)", fmt, path, getattr(hf_config, "model_type", "?"))
    return ModelSource(
        path=path,
        load_format=fmt,
        hf_config=hf_config,
        tokenizer=tok,
        eos_token_ids=_hf_eos_ids(hf_config, generation, tok),
        max_model_len=derive_max_model_len(hf_config),
        generation_defaults={k: generation[k] for k in _SAMPLING_KEYS if k in generation},
        checkpoint_dtype=_config_dtype(hf_config),
        description=f"{fmt} {path.name} ({getattr(hf_config, 'model_type', '?')})",
        _weights=weights,
    )


def _is_gguf_only(path: Path) -> bool:
    """A GGUF file, or a directory with a .gguf file but no config.json (dummy weights for it)."""
    if path.is_file():
        return _is_gguf_file(path)
    return not (path / "config.json").is_file() and any(path.glob("*.gguf"))


def _config_dtype(hf_config: Any) -> torch.dtype | None:
    # transformers 5 calls it `dtype`, 4.x `torch_dtype`; either a torch.dtype or its name.
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None


def _load_tokenizer(
    source: str | Path, chat_template: str | None, *, required: bool = True
) -> Tokenizer | None:
    source = Path(source).expanduser()
    try:
        if source.is_file() and _is_gguf_file(source):
            tok = Tokenizer.from_gguf(source)
        else:
            tok = Tokenizer.from_pretrained(source)
    except Exception as e:  # missing files, unsupported tokenizer class, ...
        if not required:
            logger.warning("%s: no usable tokenizer (%s); running without one", source, e)
            return None
        raise LoaderError(f"{source}: cannot load the tokenizer ({e}); pass --tokenizer") from e
    tok.set_chat_template(chat_template)  # a bad override is the user's ValueError, not ours
    return tok


def _read_generation_config(model_dir: Path) -> dict[str, Any]:
    file = model_dir / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        logger.warning("%s: ignored, not valid json (%s)", file, e)
        return {}


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _hf_eos_ids(hf_config: Any, generation: Mapping[str, Any], tok: Tokenizer | None) -> tuple[int, ...]:
    """The tokenizer's EOS first, then generation_config.json's and config.json's eos ids."""
    text_config = getattr(hf_config, "text_config", None) or hf_config
    ids: list[int] = []
    for value in (
        tok.eos_token_id if tok is not None else None,
        generation.get("eos_token_id"),
        getattr(text_config, "eos_token_id", None),
    ):
        ids.extend(i for i in _as_ids(value) if i not in ids)
    return tuple(ids)
