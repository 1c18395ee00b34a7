"""The start-up error of a quantized checkpoint whose `quantization_config` we cannot run: it
names the config file's field and value at fault."""

from __future__ import annotations

from typing import Any

from paphos.config import ConfigError


class QuantConfigError(ConfigError):
    """A quantization_config field has a value no format module supports."""


def field_value(field: str, value: Any, why: str) -> str:
    return f"quantization_config.{field} = {value!r} is not supported: {why}"
