"""Admission-time sampler preparation: what needs the tokenizer, done once per request.

Data flow: `Frontend.validate` (in the API process, before the request reaches the engine core)
-> `SamplingPreparer.prepare(params)` -> the request's `SamplingInputs`: DRY breaker token ids,
bad-word token sequences and the compiled grammar, serialized. The params are left as the client
sent them. The core and the runner then see only token ids and a compiled grammar, so
tokenization and grammar compilation never run inside a step; xgrammar caches compiled grammars by
their text.
"""

from __future__ import annotations

from paphos.core.protocol import SamplingInputs
from paphos.sample.guided import GrammarBackend, tokenizer_info
from paphos.sampling_params import SamplingParams
from paphos.tokenizer import Tokenizer


class SamplingPreparer:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._grammar: GrammarBackend | None = None  # built on first use (tokenizer scan: ~1 s)

    def prepare(self, params: SamplingParams) -> SamplingInputs:
        """Raises ParamError for a grammar that does not compile."""
        grammar = None
        if params.guided is not None:
            if self._grammar is None:
                self._grammar = GrammarBackend(tokenizer_info(self.tokenizer.hf, self.vocab_size, self.stop_token_ids))
            grammar = self._grammar.compile(params)
        return SamplingInputs(
            dry_breaker_ids=tuple(self.breaker_ids(params.dry_sequence_breakers)) if params.dry_multiplier > 0 else (),
            bad_words_ids=tuple(tuple(ids) for ids in self.bad_words_ids(params.bad_words)) if params.bad_words else (),
            grammar=grammar,
        )

    def breaker_ids(self, breakers: list[str]) -> list[int]:
        """Contract §4.4.14: breaker b is the last id of encode("a" + b), which gives the token b
        becomes after ordinary text (SentencePiece would otherwise add a leading-space marker)."""
        ids = set()
        for breaker in breakers:
            encoded = self.tokenizer.encode("a" + breaker, add_special_tokens=False)
            if encoded:
                ids.add(encoded[-1])
        return sorted(ids)

    def bad_words_ids(self, words: list[str]) -> list[list[int]]:
        sequences = []
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences
