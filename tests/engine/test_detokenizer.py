"""Incremental detokenization on the default model's byte-level vocabulary: a completion's text is
what its own tokens add to the prompt, also when the prompt ends inside a UTF-8 character."""

from __future__ import annotations

import pytest

from paphos.default_model import default_model_path
from paphos.engine.detokenizer import IncrementalDetokenizer
from paphos.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path(), gguf_metadata={"tokenizer.ggml.pre": "smollm"})


def _stream(tok: Tokenizer, prompt: list[int], completion: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok.hf.backend_tokenizer, prompt, skip_special_tokens=True)
    return [detok.add_tokens([t]) for t in completion]


@pytest.mark.parametrize("prompt_text, completion_text", [
    ("The capital of France is", " Paris, a city of light."),
    ("Numbers: 1, 2,", " 3, 4 and 5"),
    ("unicode: café,", " naïve, 日本語 and 🎉 too"),
])
def test_pieces_join_to_the_completion_text(tok: Tokenizer, prompt_text: str, completion_text: str) -> None:
    prompt = tok.hf.encode(prompt_text, add_special_tokens=False)
    completion = tok.hf.encode(prompt_text + completion_text, add_special_tokens=False)[len(prompt):]
    assert "".join(_stream(tok, prompt, completion)) == completion_text


def test_a_prompt_ending_inside_a_character_does_not_leak_into_the_completion(tok: Tokenizer) -> None:
    # " jeopard" then " 고" as bytes: the prompt stops after the space and the character's first byte.
    prompt = tok.hf.encode(" extended introducing jeopard", add_special_tokens=False)
    char = tok.hf.encode(" 고.", add_special_tokens=False)
    assert len(char) > 2
    pieces = _stream(tok, prompt + char[:1], char[1:])
    assert "".join(pieces) in (" 고.", "고.")
    assert "jeopard" not in "".join(pieces)
