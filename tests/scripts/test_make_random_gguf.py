"""scripts/make_random_gguf.py: the synthetic vocabulary (`--vocab`) that lets llama.cpp load the
random files, on the toy shape (`--small`): its size, its special and byte tokens, and that it changes
neither the tensors nor how Paphos loads the file with a tokenizer override."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, TokenType

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "make_random_gguf.py"
sys.path.insert(0, str(ROOT / "scripts"))

from make_random_gguf import SMALL, synthetic_vocab, write  # noqa: E402


def _tensor_bytes(reader: GGUFReader) -> dict[str, bytes]:
    return {t.name: np.asarray(t.data).tobytes() for t in reader.tensors}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], Path]:
    out = {}
    tmp = tmp_path_factory.mktemp("random-gguf")
    for mix in ("q4_k_m", "q8_0"):
        for vocab in (False, True):
            out[mix, vocab] = tmp / f"{mix}-{vocab}.gguf"
            write(out[mix, vocab], mix, n_layers=2, seed=3, verbose=False, vocab=vocab, small=True)
    return out


@pytest.mark.parametrize("mix", ["q4_k_m", "q8_0"])
def test_vocabulary_matches_the_embedding_rows(files: dict, mix: str) -> None:
    reader = GGUFReader(files[mix, True])
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert reader.fields["tokenizer.ggml.model"].contents() == "llama"
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    n_vocab = SMALL["vocab"]
    assert len(tokens.data) == n_vocab == int(embd.shape[-1]) == reader.fields["llama.vocab_size"].contents()
    assert len(reader.fields["tokenizer.ggml.scores"].data) == n_vocab
    assert len(reader.fields["tokenizer.ggml.token_type"].data) == n_vocab
    pieces = tokens.contents()
    assert pieces[:3] == ["<unk>", "<s>", "</s>"]
    assert pieces[3 + 0x0A] == "<0x0A>" and pieces[3 + 255] == "<0xFF>"
    assert len(set(pieces)) == n_vocab
    assert reader.fields["tokenizer.ggml.bos_token_id"].contents() == SMALL["bos"]
    assert reader.fields["tokenizer.ggml.eos_token_id"].contents() == SMALL["eos"]
    assert "tokenizer.ggml.tokens" not in GGUFReader(files[mix, False]).fields


@pytest.mark.parametrize("mix", ["q4_k_m", "q8_0"])
def test_vocabulary_leaves_the_tensors_alone(files: dict, mix: str) -> None:
    assert _tensor_bytes(GGUFReader(files[mix, True])) == _tensor_bytes(GGUFReader(files[mix, False]))


def test_llama3_sized_vocabulary_marks_bos_and_eos_as_control() -> None:
    pieces, scores, types = synthetic_vocab(128256, 128000, 128001)
    assert len(pieces) == len(scores) == len(types) == 128256 == len(set(pieces))
    assert types[128000] == types[128001] == int(TokenType.CONTROL)
    assert pieces[128000] == "<|begin_of_text|>" and pieces[128001] == "<|end_of_text|>"
    assert types[3:259] == [int(TokenType.BYTE)] * 256 and types[259] == int(TokenType.NORMAL)
    assert scores[259] > scores[1000] > scores[-1]


def test_paphos_loads_both_files_alike_with_a_tokenizer_override(files: dict, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from paphos.loader.source import load_model_source

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(SMALL["vocab"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": f"t{SMALL['eos']}",
    }))  # fmt: skip
    plain = load_model_source(files["q4_k_m", False], tokenizer=tmp_path)
    with_vocab = load_model_source(files["q4_k_m", True], tokenizer=tmp_path)
    assert with_vocab.hf_config.to_dict() == plain.hf_config.to_dict()
    assert with_vocab.eos_token_ids == plain.eos_token_ids
    assert with_vocab.tokenizer.encode("t5 t7", add_special_tokens=False) == [5, 7]


def test_command_line_writes_the_vocabulary(tmp_path: Path) -> None:
    out = tmp_path / "cli.gguf"
    subprocess.run([sys.executable, str(SCRIPT), str(out), "--mix", "q8_0", "--layers", "1", "--small", "--vocab"],
                   check=True, capture_output=True, timeout=120)  # fmt: skip
    assert len(GGUFReader(out).fields["tokenizer.ggml.tokens"].data) == SMALL["vocab"]
