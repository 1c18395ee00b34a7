"""Order resolution (contract §4.2 and paphos/sample/order.py): defaults, temperature_last,
partial sampler_priority by names and ids, KoboldCpp sampler_order, mirostat, errors."""

from __future__ import annotations

import pytest

from paphos.sample import order as st
from paphos.sampling_params import ParamError, SamplingParams


def test_default_and_temperature_last() -> None:
    assert SamplingParams().order == st.DEFAULT_ORDER
    assert st.DEFAULT_ORDER[:4] == ("dry", "penalties", "no_repeat_ngram", "temperature")
    assert SamplingParams(temperature_last=True).order[-1] == "temperature"


def test_partial_priority_lists_first_then_default_relative_order() -> None:
    order = SamplingParams(sampler_priority=["min_p", "Temperature", 13]).order
    assert order[:3] == ("min_p", "temperature", "xtc")
    rest = [s for s in st.DEFAULT_ORDER if s not in ("min_p", "temperature", "xtc")]
    assert list(order[3:]) == rest
    # Synonyms and string ids; top_p_top_k expands to top-k then top-p; beats temperature_last.
    order = SamplingParams(sampler_priority=["top_p", "5"], temperature_last=True).order
    assert order[:3] == ("top_k", "top_p", "temperature")


def test_full_aphrodite_id_list() -> None:
    ids = [5, 0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13]
    assert SamplingParams(sampler_priority=ids).order[0] == "temperature"


def test_kobold_sampler_order_skips_absent_blocks() -> None:
    order = SamplingParams(sampler_order=[6, 0, 1, 3, 4, 2, 5]).order
    assert order == ("dry", "no_repeat_ngram", "penalties", "top_k", "top_a", "tfs", "typical_p", "top_p", "min_p",
                     "temperature", "quadratic", "top_nsigma", "eta_cutoff", "epsilon_cutoff", "xtc")
    assert "temperature" not in SamplingParams(sampler_order=[0, 2]).order
    # Not a KoboldCpp list (names, or an id above 6): read as sampler_priority.
    assert SamplingParams(sampler_order=[9, 5]).order[:2] == ("top_nsigma", "temperature")
    assert SamplingParams(sampler_order=[0], sampler_priority=["xtc"]).order[0] == "xtc"


def test_mirostat_runs_its_own_chain() -> None:
    assert SamplingParams(mirostat_mode=2, sampler_priority=["xtc"]).order == st.MIROSTAT_ORDER


@pytest.mark.parametrize(("kwargs", "param"), [
    (dict(sampler_priority=["temperature", "temp"]), "sampler_priority"),
    (dict(sampler_priority=["nope"]), "sampler_priority"),
    (dict(sampler_priority=[14]), "sampler_priority"),
    (dict(sampler_order=[0, 0]), "sampler_order"),
])
def test_invalid_orders_name_the_field(kwargs: dict, param: str) -> None:
    with pytest.raises(ParamError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_client_forms() -> None:
    p = SamplingParams(seed=-1, custom_token_bans="1, 2,3", dry_sequence_breakers='["\\n", "*"]',
                       guided_json="{}", response_format={"type": "text"}, banned_strings=[])
    assert p.seed is None and p.custom_token_bans == [1, 2, 3] and p.dry_sequence_breakers == ["\n", "*"]
    assert p.guided is None and p.banned_strings is None
