"""Shape-checked copies of checkpoint tensors into parameters.

Data flow: loader (safetensors / GGUF) -> model.load_weights -> a parameter's `weight_loader` ->
here. Layers raise `ShapeMismatchError`; the model turns it into a `WeightLoadError` that names
the checkpoint tensor, because only the model knows the checkpoint name.
"""

from __future__ import annotations

import torch


class ShapeMismatchError(ValueError):
    def __init__(self, expected: tuple[int, ...], got: tuple[int, ...]) -> None:
        self.expected = tuple(expected)
        self.got = tuple(got)
        super().__init__(f"expected shape {list(self.expected)}, got {list(self.got)}")


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy src into dst (converting dtype/device); shapes must match exactly."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ShapeMismatchError(tuple(dst.shape), tuple(src.shape))
    with torch.no_grad():
        dst.copy_(src)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
    if shard_id is not None:
        raise ValueError(f"parameter takes no shards, got shard {shard_id!r}")
    copy_checked(param.data, loaded)
