"""Stop-string matching and the hold-back rule: a partial stop string is never streamed."""

from paphos.engine.stop import find_stop_string, held_back_length


def test_stop_string_spanning_old_and_new_text_is_found() -> None:
    match = find_stop_string("hello wor", new_text_len=3, stops=["o wo"], include_stop_str=False)
    assert match is not None and match.stop_string == "o wo" and match.truncate_to == 4


def test_earliest_stop_string_wins_and_inclusion_keeps_it() -> None:
    text = "a STOP b END"
    match = find_stop_string(text, len(text), ["END", "STOP"], include_stop_str=True)
    assert match is not None and match.stop_string == "STOP" and text[: match.truncate_to] == "a STOP"


def test_stop_string_entirely_in_old_text_is_not_rematched() -> None:
    assert find_stop_string("xxSTOPyy", new_text_len=2, stops=["STOP"], include_stop_str=False) is None


def test_hold_back_is_longest_suffix_that_starts_a_stop_string() -> None:
    assert held_back_length("the end is ne", ["near", "x"]) == 2
    assert held_back_length("the end is n", ["near"]) == 1
    assert held_back_length("nothing", ["near"]) == 0
    # A complete stop string is matched, not held back.
    assert held_back_length("abc", ["abc"]) == 0
