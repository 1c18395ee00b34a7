"""Stop strings on the detokenized text, and how much text is safe to stream.

Text that could still become a stop string (a suffix that is a prefix of some stop string) is held
back, so a client never receives characters that are later cut off.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopMatch:
    stop_string: str
    # Length of the text to keep: the stop string excluded or included as asked.
    truncate_to: int


def find_stop_string(
    text: str, new_text_len: int, stops: list[str], include_stop_str: bool
) -> StopMatch | None:
    """Earliest stop string that ends within the new text (it may start in older text)."""
    best: StopMatch | None = None
    best_start = len(text)
    for stop in stops:
        search_from = max(0, len(text) - new_text_len - len(stop) + 1)
        start = text.find(stop, search_from)
        if start != -1 and start < best_start:
            best_start = start
            best = StopMatch(stop, start + len(stop) if include_stop_str else start)
    return best


def held_back_length(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest
