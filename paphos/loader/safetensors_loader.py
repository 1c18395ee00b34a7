"""Weights of an HF model directory stored as one or several `*.safetensors` files.

Data flow: `ModelSource.iter_weights()` -> here -> `(hf_name, tensor)` pairs -> the model's
`load_weights`. Files are opened with `safetensors.safe_open`, which memory-maps them, so a tensor is
read from disk only when it is asked for and the whole checkpoint is never held twice in memory.
Tensors keep the dtype of the file; the model casts while copying into its parameters.
"""

from __future__ import annotations

import json
from pathlib import Path

from paphos.loader.base import LoaderError, WeightsIterator, progress

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint files of `model_dir`, in load order.

    With an index json (sharded checkpoints) exactly the files it names; otherwise every
    `*.safetensors` file. Mistral-style repos that carry both HF shards and a
    `consolidated.safetensors` duplicate get only the HF shards.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise LoaderError(f"{model_dir}: not a directory")
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise LoaderError(f"{index}: not a valid safetensors index ({e})") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise LoaderError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    hf_files = [f for f in files if not f.name.startswith("consolidated")]
    files = hf_files or files
    if not files:
        present = ", ".join(sorted(p.name for p in model_dir.iterdir())[:20]) or "(empty)"
        raise LoaderError(
            f"{model_dir}: no *.safetensors files (found: {present}). PyTorch .bin checkpoints "
            "are not supported; convert them to safetensors."
        )
    return files


def count_safetensors_tensors(files: list[Path]) -> int:
    """Number of tensors in `files` (headers only; cheap), for the progress bar."""
    from safetensors import safe_open

    total = 0
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                total += len(f.keys())
        except Exception as e:  # safetensors raises its own SafetensorError / OSError
            raise LoaderError(f"{file}: cannot read safetensors file: {e}") from e
    return total


def iter_safetensors(model_dir: str | Path, *, show_progress: bool = True) -> WeightsIterator:
    """Yield `(name, tensor)` for every tensor of the checkpoint in `model_dir`."""
    from safetensors import safe_open

    files = safetensors_files(model_dir)
    total = count_safetensors_tensors(files) if show_progress else None

    def tensors() -> WeightsIterator:
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as e:
                raise LoaderError(f"{file}: cannot read safetensors file: {e}") from e
            with handle as f:
                for name in f.keys():
                    try:
                        tensor = f.get_tensor(name)
                    except Exception as e:  # truncated file, bad offsets, unknown dtype
                        raise LoaderError(f"{file}: cannot read tensor {name!r}: {e}") from e
                    yield name, tensor

    yield from progress(tensors(), total=total, desc=f"Loading {Path(model_dir).name}", enabled=show_progress)
