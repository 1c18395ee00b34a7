"""Errors of adapter registration and loading; the server maps them to 400 / 404 (contract §3.6)."""

from __future__ import annotations


class LoRAError(ValueError):
    """The adapter cannot be used: LoRA disabled, a bad config, an unsupported feature, a rank over
    --max-lora-rank, tensors that do not fit the model, a name already taken. The message names
    the file, field or tensor at fault (HTTP 400)."""


class LoRANotFoundError(LoRAError):
    """No adapter at that path or Hugging Face repo, or no adapter of that name (HTTP 404)."""
