"""TokenLogprobs (engine records) -> the two OpenAI logprob shapes: completions and chat.

Runs in the HTTP layer after each RequestOutput. A token's string is the text it adds in context
(decoded with a few tokens to its left), so leading spaces and multi-byte characters read as in
the generated text and `text_offset` lines up with `text`. One formatter per choice keeps that
context and the running offset across streamed chunks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from paphos.core.scheduler_output import TokenLogprobs

# Tokens of left context used to decode one token; enough for SentencePiece spaces and for UTF-8
# sequences split over up to four byte tokens.
_CONTEXT = 4
NEG_INF_LOGPROB = -9999.0


def clean_logprob(value: float) -> float:
    """JSON has no -inf: the contract writes it (and NaN) as -9999.0."""
    return value if math.isfinite(value) else NEG_INF_LOGPROB


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    ids = getattr(getattr(tokenizer, "hf", None), "all_special_ids", None)
    if ids is None:
        ids = [getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    return frozenset(i for i in ids if i is not None)


class TokenDecoder:
    """Decodes token ids one at a time with left context; `as_ids` spells tokens `token_id:N`."""

    def __init__(self, tokenizer: Any, context: list[int], as_ids: bool, special_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._window = list(context[-_CONTEXT:])
        self._as_ids = as_ids
        self._special = special_ids

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def _in_context(self, prefix: str, token_id: int) -> str:
        full = self._decode([*self._window, token_id])
        if full.startswith(prefix):
            return full[len(prefix):]
        return self._decode([token_id])

    def step(self, token_id: int, alternatives: Sequence[int] = ()) -> tuple[str, dict[int, str]]:
        """Text of `token_id` and of each alternative at this position; then advances past it."""
        if self._as_ids:
            texts = {t: f"token_id:{t}" for t in alternatives}
            text = f"token_id:{token_id}"
        else:
            prefix = self._decode(self._window) if self._window else ""
            text = self._in_context(prefix, token_id)
            texts = {t: (text if t == token_id else self._in_context(prefix, t)) for t in alternatives}
        self._window = [*self._window, token_id][-_CONTEXT:]
        return text, texts

    def visible_length(self, token_id: int, text: str, skip_special_tokens: bool) -> int:
        """How many characters of the response text this token accounts for."""
        if skip_special_tokens and token_id in self._special:
            return 0
        if self._as_ids:
            return len(self._decode([token_id]))
        return len(text)


class CompletionLogprobs:
    """Completions shape: text_offset / token_logprobs / tokens / top_logprobs, per choice."""

    def __init__(self, decoder: TokenDecoder, num_top: int, skip_special_tokens: bool, offset: int = 0) -> None:
        self._decoder = decoder
        self._num_top = num_top
        self._skip_special = skip_special_tokens
        self.offset = offset

    def _entry(self, out: dict[str, list[Any]], token_id: int, entry: TokenLogprobs | None) -> None:
        if entry is None:
            text, _ = self._decoder.step(token_id)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            tops = entry.top_token_ids[: self._num_top]
            text, texts = self._decoder.step(token_id, tops)
            top = {texts[t]: clean_logprob(lp) for t, lp in zip(tops, entry.top_logprobs, strict=False)}
            # The sampled token is always listed, even outside the top N (≤ N+1 keys).
            top.setdefault(text, clean_logprob(entry.logprob))
            out["token_logprobs"].append(clean_logprob(entry.logprob))
            out["top_logprobs"].append(top)
        out["tokens"].append(text)
        out["text_offset"].append(self.offset)
        self.offset += self._decoder.visible_length(token_id, text, self._skip_special)

    def format(
        self, token_ids: list[int], entries: list[TokenLogprobs | None] | None
    ) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for i, token_id in enumerate(token_ids):
            entry = entries[i] if entries is not None and i < len(entries) else None
            self._entry(out, token_id, entry)
        return out


def merge_completion_logprobs(parts: list[dict[str, list[Any]]]) -> dict[str, list[Any]]:
    merged: dict[str, list[Any]] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for part in parts:
        for key, values in part.items():
            merged[key].extend(values)
    return merged


class ChatLogprobs:
    """Chat shape: {"content": [{"token","logprob","bytes","top_logprobs":[...]}]}, per choice."""

    def __init__(self, decoder: TokenDecoder, num_top: int) -> None:
        self._decoder = decoder
        self._num_top = num_top

    @staticmethod
    def _item(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": clean_logprob(logprob), "bytes": list(text.encode("utf-8"))}

    def format(self, token_ids: list[int], entries: list[TokenLogprobs] | None) -> list[dict[str, Any]]:
        content = []
        for i, token_id in enumerate(token_ids):
            entry = entries[i] if entries is not None and i < len(entries) else None
            tops = entry.top_token_ids[: self._num_top] if entry is not None else []
            text, texts = self._decoder.step(token_id, tops)
            item = self._item(text, entry.logprob if entry is not None else float("nan"))
            lps = entry.top_logprobs if entry is not None else []
            item["top_logprobs"] = [self._item(texts[t], lp) for t, lp in zip(tops, lps, strict=False)]
            content.append(item)
        return content


def prompt_logprobs_json(
    tokenizer: Any, prompt_ids: list[int], entries: list[TokenLogprobs | None] | None, as_ids: bool
) -> list[dict[str, dict[str, Any]] | None] | None:
    """`prompt_logprobs` of a completions choice: per position {token_id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    result: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries[: len(prompt_ids)]:
        if entry is None:
            result.append(None)
            continue
        position: dict[str, dict[str, Any]] = {}
        ids = [(entry.token_id, entry.logprob, entry.rank)]
        ids += [(t, lp, r + 1) for r, (t, lp) in enumerate(zip(entry.top_token_ids, entry.top_logprobs, strict=False))]
        for tid, lp, rank in ids:
            if str(tid) in position:
                continue
            text = f"token_id:{tid}" if as_ids else tokenizer.decode([tid], skip_special_tokens=False)
            position[str(tid)] = {"logprob": clean_logprob(lp), "rank": rank, "decoded_token": text}
        result.append(position)
    return result
