"""Split GGUF files (llama.cpp's gguf-split, `<name>-00001-of-0000N.gguf`) load from the first file,
as the same model written as one file; written here with the `gguf` package's own splitting."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paphos.loader import GGUFCheckpoint, LoaderError, find_gguf_file
from tests.quant.gguf_blocks import write_tiny_llama

LAYERS = [{"attn_q": "Q4_K", "ffn_down": "Q6_K"}, {"attn_v": "Q5_0"}]


@pytest.fixture
def split_dir(tmp_path: Path) -> Path:
    (tmp_path / "split").mkdir()
    write_tiny_llama(tmp_path / "split" / "tiny.gguf", LAYERS, split_max_tensors=7)
    return tmp_path / "split"


def test_split_loads_like_one_file(tmp_path: Path, split_dir: Path) -> None:
    files = sorted(p.name for p in split_dir.iterdir())
    assert files == [f"tiny-0000{i}-of-00003.gguf" for i in range(1, 4)]
    single = GGUFCheckpoint(write_tiny_llama(tmp_path / "one.gguf", LAYERS))
    split = GGUFCheckpoint(find_gguf_file(split_dir))
    assert split.path.name == "tiny-00001-of-00003.gguf"
    assert split.hf_config.to_dict() == single.hf_config.to_dict()
    assert split.quant_summary() == single.quant_summary()
    ours, want = dict(split.iter_weights(show_progress=False)), dict(single.iter_weights(show_progress=False))
    assert ours.keys() == want.keys() and all(torch.equal(ours[k], want[k]) for k in want)
    raw = {"model.layers.0.self_attn.q_proj.weight"}
    assert torch.equal(
        dict(split.iter_weights(show_progress=False, raw_names=raw))[next(iter(raw))],
        dict(single.iter_weights(show_progress=False, raw_names=raw))[next(iter(raw))],
    )


def test_split_errors_name_the_file(split_dir: Path) -> None:
    with pytest.raises(
        LoaderError, match=r"tiny-00002-of-00003\.gguf: part of a 3-file split GGUF; pass the first"
    ):
        GGUFCheckpoint(split_dir / "tiny-00002-of-00003.gguf")
    (split_dir / "tiny-00003-of-00003.gguf").unlink()
    with pytest.raises(LoaderError, match=r"split file tiny-00003-of-00003\.gguf \(3 of 3\) not found"):
        GGUFCheckpoint(split_dir / "tiny-00001-of-00003.gguf")
