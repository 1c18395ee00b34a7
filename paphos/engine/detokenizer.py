"""Incremental detokenization of one sequence, on top of `tokenizers`' DecodeStream.

DecodeStream holds back bytes of an unfinished UTF-8 character (byte-fallback tokens) and is
primed with the prompt's last tokens so that the first generated token gets the spacing it has in
context (SentencePiece's leading-space marker, for example). The priming steps the tokens through
the stream, whose text is dropped: DecodeStream's own `ids=` priming, given a prompt that ends
inside a UTF-8 character, re-emits the whole primed context with the first completed character.
"""

from __future__ import annotations

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.decoders import DecodeStream

# Enough prompt context for any merge a decoder looks back on.
PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self, backend: BackendTokenizer, prompt_token_ids: list[int], skip_special_tokens: bool
    ) -> None:
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]:
            self._stream.step(backend, token_id)  # context only: this text is the prompt's
        self.text = ""

    def add_tokens(self, token_ids: list[int]) -> str:
        """Appends tokens; returns the text they completed (possibly empty)."""
        pieces = [self._stream.step(self._backend, token_id) for token_id in token_ids]
        new_text = "".join(p for p in pieces if p)
        self.text += new_text
        return new_text
