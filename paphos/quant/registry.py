"""Which weight format a checkpoint is in, and the QuantConfig that runs it.

Data flow: worker setup -> `select_quant_config(source, quantization, gguf_numerics)` -> the
checkpoint's own word (a GGUF file; `quantization_config.quant_method` in config.json, or the
`quantize_config.json` / `quant_config.json` older AutoGPTQ / AutoAWQ repos carry instead) and the
user's `--quantization` are reconciled -> the format's module builds its QuantConfig -> the model
asks it for each linear layer's method. One module per format (gguf/, gptq.py, awq.py,
compressed_tensors.py, fp8.py); adding one is one entry in `_BUILDERS`.

`--quantization` either names the checkpoint's own method (Aphrodite's `gptq_marlin` /
`awq_marlin` / `marlin` are the same checkpoints as `gptq` / `awq`: the fast kernel is chosen
automatically), or asks for `fp8` on an unquantized checkpoint (weights quantized at load); any
other contradiction is a start-up error naming the file, field and value.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paphos.config import ConfigError
from paphos.quant.errors import QuantConfigError

logger = logging.getLogger(__name__)

# --quantization names that mean the same checkpoint format as another.
ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq", "marlin": "gptq"}
# Files older repos carry instead of config.json's quantization_config, and the method they imply.
_SIDE_FILES = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"))


def _gptq(qc: dict[str, Any], source: Any, numerics: str) -> Any:
    from paphos.quant.gptq import GPTQConfig

    return GPTQConfig.from_quant_config(qc)


def _awq(qc: dict[str, Any], source: Any, numerics: str) -> Any:
    from paphos.quant.awq import AWQConfig

    return AWQConfig.from_quant_config(qc)


def _compressed_tensors(qc: dict[str, Any], source: Any, numerics: str) -> Any:
    from paphos.quant.compressed_tensors import from_quant_config

    return from_quant_config(qc, bool(getattr(source.hf_config, "tie_word_embeddings", False)))


def _fp8(qc: dict[str, Any], source: Any, numerics: str) -> Any:
    from paphos.quant.fp8 import Fp8Config

    return Fp8Config.from_hf_quant_config(qc)


def _exl2(qc: dict[str, Any], source: Any, numerics: str) -> Any:
    from paphos.quant.exl2 import EXL2Config

    return EXL2Config.from_quant_config(qc)


def _gguf(qc: dict[str, Any], source: Any, numerics: str) -> Any:
    from paphos.quant.gguf import quant_config_for_source

    return quant_config_for_source(source, numerics)


_BUILDERS: dict[str, Callable[[dict[str, Any], Any, str], Any]] = {
    "gguf": _gguf,
    "gptq": _gptq,
    "awq": _awq,
    "compressed-tensors": _compressed_tensors,
    "fp8": _fp8,
    "exl2": _exl2,
}

def checkpoint_quantization(source: Any) -> tuple[str | None, dict[str, Any], str]:
    """(quant_method or None, its quantization_config, where it was read) of a model source."""
    if source.load_format == "gguf":
        return "gguf", {}, str(source.path)
    qc = getattr(source.hf_config, "quantization_config", None)
    where = str(Path(source.path) / "config.json")
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    if qc is None and Path(source.path).is_dir():
        for name, method in _SIDE_FILES:
            side = Path(source.path) / name
            if side.is_file():
                try:
                    qc = {"quant_method": method} | json.loads(side.read_text(encoding="utf-8"))
                except (OSError, ValueError) as e:
                    raise ConfigError(f"{side}: cannot read ({e})") from e
                where = str(side)
                break
    if not qc:
        return None, {}, where
    return str(qc.get("quant_method", "")).lower() or None, qc, where


def select_quant_config(source: Any, quantization: str | None, gguf_numerics: str = "float") -> Any:
    """The QuantConfig for `source` (None: unquantized), or ConfigError naming what is at fault."""
    method, qc, where = checkpoint_quantization(source)
    requested = ALIASES.get(quantization, quantization) if quantization else None
    if requested == "fp8" and method is None:
        from paphos.quant.fp8 import Fp8Config

        logger.info("--quantization fp8: weights of %s are quantized to FP8 at load", source.path)
        return Fp8Config.runtime()
    if requested is not None and requested != method:
        has = f"quantization_config.quant_method = {method!r}" if method else "no quantization_config"
        raise ConfigError(f"--quantization {quantization} given, but {where} has {has}")
    if method is None:
        return None
    builder = _BUILDERS.get(method)
    if builder is None:
        raise ConfigError(
            f"{where}: quantization_config.quant_method = {method!r} is not supported "
            f"(supported: {', '.join(_BUILDERS)})"
        )
    try:
        return builder(qc, source, gguf_numerics)
    except QuantConfigError as e:
        raise QuantConfigError(f"{where}: {e}") from None
