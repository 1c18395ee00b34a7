"""Banned phrases (`banned_strings`, Kobold `banned_tokens`) on the detokenized output: the
output-processor half of KoboldCpp-style anti-slop (contract §4.4.12).

Data flow: `OutputProcessor` keeps one `PhraseBan` per sequence that has banned strings. After each
step's tokens are detokenized:
- `find` reports the earliest banned phrase that now appears in the uncommitted text, as the index
  of the output token containing its first character; the output processor then truncates the
  sequence there and asks the scheduler (`Scheduler.rollback_request`) to drop those tokens and
  ban that token id at that position only; the model runner regenerates from there;
- `committed` says how much text and how many tokens are safe to stream: whole tokens (a rollback
  removes whole tokens) up to the last point where the text does not end with the beginning of a
  phrase, so a client never receives text that is later retracted, and committed text can never
  become the start of a phrase after a rollback.
Matching is case-insensitive unless `banned_strings_case_sensitive`; folding is per character so
offsets in the folded text are offsets in the real text.
"""

from __future__ import annotations

import bisect

from paphos.engine.stop import held_back_length

MAX_ROLLBACKS = 128
RETRY_LIMIT_REASON = "banned_strings_retry_limit"


def _fold(text: str) -> str:
    return "".join(c if len(low := c.lower()) != 1 else low for c in text)


class PhraseBan:
    def __init__(self, phrases: list[str], case_sensitive: bool) -> None:
        self.case_sensitive = case_sensitive
        self.phrases = list(phrases) if case_sensitive else [_fold(p) for p in phrases]
        # Character offset in the sequence's text where each output token's text begins.
        self.token_starts: list[int] = []
        # Each output token's logprob under the raw distribution (to undo cumulative_logprob).
        self.sampled_logprobs: list[float] = []
        self.num_rollbacks = 0

    def record(self, text_len_before: int, token_texts: list[str], logprobs: list[float]) -> None:
        offset = text_len_before
        for piece in token_texts:
            self.token_starts.append(offset)
            offset += len(piece)
        self.sampled_logprobs.extend(logprobs)

    def _tail(self, text: str, start: int) -> str:
        tail = text[start:]
        return tail if self.case_sensitive else _fold(tail)

    def token_at(self, char: int) -> int:
        """Index of the token whose text contains `char`; tokens that produced no text yet (the
        first bytes of a multi-byte character) belong to the character they started."""
        k = max(0, bisect.bisect_right(self.token_starts, char) - 1)
        while k > 0 and self.token_starts[k - 1] == self.token_starts[k]:
            k -= 1
        return k

    def find(self, text: str, committed_chars: int) -> int | None:
        """Token index where the earliest complete banned phrase in the uncommitted text starts."""
        tail = self._tail(text, committed_chars)
        starts = [i for i in (tail.find(p) for p in self.phrases) if i != -1]
        if not starts:
            return None
        return self.token_at(committed_chars + min(starts))

    def committed(self, text: str, num_tokens: int, committed_chars: int) -> tuple[int, int]:
        """(characters, tokens) that may be streamed now: the longest run of whole tokens whose
        text does not end with the beginning of a phrase. Text that ends with a phrase's beginning
        is unsafe even when later text does not continue it: a rollback may cut that later text off
        and the regenerated continuation may complete the phrase."""
        tail = self._tail(text, committed_chars)
        for k in range(num_tokens, -1, -1):
            end = len(text) if k == num_tokens else self.token_starts[k]
            if end <= committed_chars:
                break
            if held_back_length(tail[: end - committed_chars], self.phrases) == 0:
                while 0 < k < num_tokens and self.token_starts[k - 1] == end:
                    k -= 1  # a token that produced no text yet belongs with the one after it
                return end, k
        return committed_chars, self.token_at(committed_chars) if committed_chars < len(text) else num_tokens

    def truncate(self, num_tokens: int) -> float:
        """Forget tokens from `num_tokens` on; returns the sum of their logprobs."""
        removed = sum(self.sampled_logprobs[num_tokens:])
        del self.token_starts[num_tokens:]
        del self.sampled_logprobs[num_tokens:]
        return removed
