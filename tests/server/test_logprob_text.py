"""TokenDecoder on a real byte-level BPE tokenizer (built in the test): characters split over byte
tokens are attributed to the token that completes them, offsets follow the text, `bytes` are raw."""

from __future__ import annotations

import pytest

from paphos.server.openai.logprobs import CompletionLogprobs, TokenDecoder


@pytest.fixture(scope="module")
def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from paphos.tokenizer import Tokenizer as PaphosTokenizer

    # No merges: every byte is its own token, the worst case for multi-byte characters.
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PaphosTokenizer(PreTrainedTokenizerFast(tokenizer_object=backend), add_bos=False)


def test_multibyte_characters(byte_tokenizer):
    text = "a 匠 👌."
    ids = byte_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode("utf-8"))
    decoder = TokenDecoder(byte_tokenizer, [], False, frozenset())
    steps = [decoder.step(t) for t in ids]
    visible = "".join(s[0] for s in steps if not s[0].startswith("bytes:"))
    assert visible == text
    assert sum(s[1] for s in steps) == len(text)
    assert [decoder.raw_bytes(t, "") for t in ids] == [[b] for b in text.encode("utf-8")]


def test_offsets_point_into_text(byte_tokenizer):
    text = "é!"
    ids = byte_tokenizer.encode(text, add_special_tokens=False)
    decoder = TokenDecoder(byte_tokenizer, [], False, frozenset())
    out = CompletionLogprobs(decoder, 0).format(ids, None)
    assert out["tokens"][-2:] == ["é", "!"] and out["tokens"][0].startswith("bytes:")
    assert out["text_offset"] == [0, 0, 1]
    assert text[out["text_offset"][-1]] == "!"
