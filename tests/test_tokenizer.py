"""Tokenizer: GGUF vocabularies encode like transformers' GGUF tokenizer, BOS rules (llama.cpp's for
GGUF, never doubled), chat templates and their overrides.

SmolLM2's GGUF says `tokenizer.ggml.add_bos_token = false`, so llama.cpp adds no BOS to its prompts,
and neither do we (its HF tokenizer adds none either; the ChatML template starts with
`<|im_start|>`, which is also the BOS token)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from paphos.default_model import default_model_path
from paphos.tokenizer import Tokenizer, resolve_chat_template

TEXTS = [
    "Hello world",
    "  leading spaces and trailing  ",
    "numbers 1234567 and 3.14159, year 2024",
    "unicode: café, naïve, 日本語, emoji 🎉",
    "<|im_start|>user\nhi<|im_end|>\n",
    "code:\n\tdef f(x):\n\t\treturn x**2\n",
    "",
]


@pytest.fixture(scope="module")
def smol_gguf() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def tok(smol_gguf: Path) -> Tokenizer:
    # As the GGUF loader builds it (with the file's pre-tokenizer type).
    return Tokenizer.from_gguf(smol_gguf, gguf_metadata={"tokenizer.ggml.pre": "smollm"})


@pytest.fixture(scope="module")
def reference(smol_gguf: Path):
    """transformers' GGUF tokenizer, untouched. `AutoTokenizer.from_pretrained(dir, gguf_file=...)`
    resolves to this same class for a llama-architecture file but first re-parses the whole file
    for a config (~8 s of CPU), so the class is used directly to keep the suite fast."""
    from transformers import TokenizersBackend

    return TokenizersBackend.from_pretrained(str(smol_gguf.parent), gguf_file=smol_gguf.name)


def test_encodes_like_transformers_gguf_tokenizer(tok: Tokenizer, reference) -> None:
    for text in TEXTS:
        assert tok.encode(text) == reference.encode(text), text
        assert tok.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)
    assert tok.vocab_size == len(reference) == 49152
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_smollm2_special_tokens_and_no_bos(tok: Tokenizer) -> None:
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert {0, 1, 2} <= set(tok.all_special_ids)
    assert tok.add_bos is False  # GGUF add_bos_token = false, as llama.cpp reads it
    assert tok.encode("Hello world") == [19556, 905]
    assert tok.encode("<|im_start|>Hello") == [1, 19556]  # special strings become their ids
    assert tok.decode([1, 19556, 2]) == "Hello"
    assert tok.decode([1, 19556, 2], skip_special_tokens=False) == "<|im_start|>Hello<|im_end|>"


def test_digits_split_like_llama_cpp(tok: Tokenizer) -> None:
    # llama.cpp's "smollm" pre-tokenizer splits every digit (as SmolLM2's tokenizer.json does).
    assert type(tok.hf.backend_tokenizer.pre_tokenizer).__name__ == "Sequence"
    assert tok.convert_ids_to_tokens(tok.encode("x 2024")) == ["x", "Ġ", "2", "0", "2", "4"]


def test_bos_added_once_when_the_model_asks(tok: Tokenizer) -> None:
    with_bos = Tokenizer(tok.hf, add_bos=True)
    assert with_bos.encode("Hello world") == [1, 19556, 905]
    assert with_bos.encode("<|im_start|>Hello world") == [1, 19556, 905]  # not doubled
    assert with_bos.encode("Hello world", add_special_tokens=False) == [19556, 905]


def test_hf_directory_and_no_double_bos(tok: Tokenizer, tmp_path: Path) -> None:
    tok.hf.save_pretrained(tmp_path)
    plain = Tokenizer.from_pretrained(tmp_path)
    assert plain.add_bos is False and plain.encode("Hello world") == [19556, 905]
    assert plain.chat_template == tok.chat_template
    # An HF tokenizer whose post-processor adds BOS (like Llama 3's tokenizer.json).
    with_bos = copy.deepcopy(tok.hf)
    with_bos.add_bos_token = True
    with_bos.save_pretrained(tmp_path / "bos")
    bos = Tokenizer.from_pretrained(tmp_path / "bos")
    assert bos.add_bos is True
    assert bos.encode("Hello world") == [1, 19556, 905]
    assert bos.encode("<|im_start|>Hello world") == [1, 19556, 905]


CHATML = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
)


def test_chat_template_from_gguf(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == CHATML
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == CHATML.removesuffix(
        "<|im_start|>assistant\n"
    )
    cont = tok.apply_chat_template(
        [*messages, {"role": "assistant", "content": "Hel"}], continue_final_message=True
    )
    assert cont.endswith("<|im_start|>assistant\nHel")


def test_chat_template_overrides(tok: Tokenizer, tmp_path: Path) -> None:
    literal = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
    file = tmp_path / "t.jinja"
    file.write_text(literal)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, chat_template=literal) == "[user] hi"
    assert tok.apply_chat_template(messages, chat_template=str(file)) == "[user] hi"
    overridden = Tokenizer(tok.hf, add_bos=False, chat_template=resolve_chat_template(str(file)))
    assert overridden.apply_chat_template(messages) == "[user] hi"
    assert overridden.apply_chat_template(messages, chat_template="{{ 'arg wins' }}") == "arg wins"
    with pytest.raises(ValueError, match="--chat-template"):
        resolve_chat_template(str(tmp_path / "missing.jinja"))


def test_missing_chat_template_names_the_fix(tok: Tokenizer, tmp_path: Path) -> None:
    tok.hf.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    bare = Tokenizer.from_pretrained(tmp_path)
    assert bare.chat_template is None
    with pytest.raises(ValueError, match="--chat-template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
