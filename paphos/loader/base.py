"""Shared pieces of the weight loaders: the error type and the progress bar.

Every format loader (safetensors, gguf, dummy) yields `(hf_name, tensor)` pairs, HF safetensors
names such as `model.layers.0.self_attn.q_proj.weight`; the model's `load_weights` consumes them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch

T = TypeVar("T")

# What every loader yields and every model's `load_weights` accepts.
WeightsIterator = Iterator[tuple[str, torch.Tensor]]


class LoaderError(RuntimeError):
    """A checkpoint cannot be loaded; the message names the file (and tensor) at fault."""


def progress(items: Iterable[T], *, total: int | None, desc: str, enabled: bool = True) -> Iterator[T]:
    """Wrap `items` in a tqdm bar on stderr (the engine's stdout may carry data)."""
    if not enabled:
        yield from items
        return
    from tqdm import tqdm

    with tqdm(items, total=total, desc=desc, unit="tensor", file=sys.stderr, leave=False) as bar:
        yield from bar
