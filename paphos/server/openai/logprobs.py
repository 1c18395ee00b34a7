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

from paphos.core.protocol import TokenLogprobs

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


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2 byte-level BPE spells each byte as one printable character; this maps them back."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_alphabet()


def _is_byte_level(tokenizer: Any) -> bool:
    decoder = getattr(getattr(getattr(tokenizer, "hf", None), "backend_tokenizer", None), "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


class TokenDecoder:
    """Text of each token in context, for one choice; `as_ids` spells tokens `token_id:N`.

    A character split over several byte tokens is attributed to the token that completes it; the
    tokens before it add no text. So the token strings concatenate to the response text and each
    token's offset is where its text starts.
    """

    def __init__(
        self, tokenizer: Any, context: list[int], as_ids: bool, special_ids: frozenset[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._committed = list(context[-_CONTEXT:])
        self._pending: list[int] = []  # tokens of a character not yet complete
        self._pending_chars = 0  # text of those tokens already attributed (before the broken char)
        self._as_ids = as_ids
        self._special = special_ids
        self._skip_special = skip_special_tokens
        self._byte_level = _is_byte_level(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def _new_text(self, prefix: str, token_id: int) -> tuple[str, bool]:
        """Complete text the token adds after `prefix` (pending tokens included), and whether a
        character is still unfinished."""
        full = self._decode([*self._committed, *self._pending, token_id])
        new = full[len(prefix):] if full.startswith(prefix) else self._decode([token_id])
        if new.endswith("\ufffd"):
            return new.rstrip("\ufffd"), True
        return new, False

    def step(self, token_id: int, alternatives: Sequence[int] = ()) -> tuple[str, int, dict[int, str]]:
        """(display text, characters of response text, alternatives' texts) for this position."""
        prefix = self._decode(self._committed) if self._committed else ""
        stable, unfinished = self._new_text(prefix, token_id)
        text = stable[self._pending_chars:]
        alt_texts: dict[int, str] = {}
        for alt in alternatives:
            if alt == token_id:
                alt_texts[alt] = text
            elif self._as_ids:
                alt_texts[alt] = f"token_id:{alt}"
            else:
                alt_stable, _ = self._new_text(prefix, alt)
                alt_texts[alt] = alt_stable[self._pending_chars:] or self._decode([alt])
        if unfinished:
            self._pending.append(token_id)
            self._pending_chars = len(stable)
        else:
            self._committed = [*self._committed, *self._pending, token_id][-_CONTEXT:]
            self._pending, self._pending_chars = [], 0
        visible = 0 if (self._skip_special and token_id in self._special) else len(text)
        if self._as_ids:
            text = f"token_id:{token_id}"
            alt_texts[token_id] = text
        elif not text and unfinished:
            text = self.bytes_repr(token_id)
            if token_id in alt_texts:
                alt_texts[token_id] = text
        return text, visible, alt_texts

    def raw_bytes(self, token_id: int, text: str) -> list[int]:
        """The token's own bytes (a partial UTF-8 sequence for byte tokens), for chat `bytes`."""
        piece = self._tokenizer.convert_ids_to_tokens([token_id])[0]
        if isinstance(piece, str):
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return [int(piece[3:5], 16)]  # SentencePiece byte fallback
                except ValueError:
                    pass
            if self._byte_level and token_id not in self._special and all(c in _BYTE_LEVEL for c in piece):
                return [_BYTE_LEVEL[c] for c in piece]
        if text.startswith("token_id:") or text.startswith("bytes:"):
            text = self._decode([token_id])
        return list(text.encode("utf-8"))

    def bytes_repr(self, token_id: int) -> str:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in self.raw_bytes(token_id, ""))


class CompletionLogprobs:
    """Completions shape: text_offset / token_logprobs / tokens / top_logprobs, per choice."""

    def __init__(self, decoder: TokenDecoder, num_top: int, offset: int = 0) -> None:
        self._decoder = decoder
        self._num_top = num_top
        self.offset = offset

    def _entry(self, out: dict[str, list[Any]], token_id: int, entry: TokenLogprobs | None) -> None:
        if entry is None:
            text, visible, _ = self._decoder.step(token_id)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            tops = entry.top_token_ids[: self._num_top]
            text, visible, texts = self._decoder.step(token_id, tops)
            top = {texts[t]: clean_logprob(lp) for t, lp in zip(tops, entry.top_logprobs, strict=False)}
            # The sampled token is always listed, even outside the top N (≤ N+1 keys).
            top.setdefault(text, clean_logprob(entry.logprob))
            out["token_logprobs"].append(clean_logprob(entry.logprob))
            out["top_logprobs"].append(top)
        out["tokens"].append(text)
        out["text_offset"].append(self.offset)
        self.offset += visible

    def format(
        self, token_ids: list[int], entries: list[TokenLogprobs | None] | None
    ) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for i, token_id in enumerate(token_ids):
            entry = entries[i] if entries is not None and i < len(entries) else None
            self._entry(out, token_id, entry)
        return out


class ChatLogprobs:
    """Chat shape: {"content": [{"token","logprob","bytes","top_logprobs":[...]}]}, per choice."""

    def __init__(self, decoder: TokenDecoder, num_top: int) -> None:
        self._decoder = decoder
        self._num_top = num_top

    def _item(self, token_id: int, text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": clean_logprob(logprob), "bytes": self._decoder.raw_bytes(token_id, text)}

    def format(self, token_ids: list[int], entries: list[TokenLogprobs] | None) -> list[dict[str, Any]]:
        content = []
        for i, token_id in enumerate(token_ids):
            entry = entries[i] if entries is not None and i < len(entries) else None
            tops = entry.top_token_ids[: self._num_top] if entry is not None else []
            text, _, texts = self._decoder.step(token_id, tops)
            item = self._item(token_id, text, entry.logprob if entry is not None else float("nan"))
            lps = entry.top_logprobs if entry is not None else []
            item["top_logprobs"] = [self._item(t, texts[t], lp) for t, lp in zip(tops, lps, strict=False)]
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
