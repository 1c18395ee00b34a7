"""The launch rule of programmatic dependent launch (paphos/layers/pdl.py): which steps' kernels
launch with PDL, decided from their input's token count."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from paphos.layers import pdl


@pytest.fixture
def hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """A PDL-capable GPU as far as the rule can tell: sm_90, PDL not disabled, triton present (a
    stand-in where it is not installed: the rule only asks whether it is)."""
    if pdl.triton is None:
        monkeypatch.setattr(pdl, "triton", object())
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(pdl, "_supported", lambda index: True)


def _tokens(n: int) -> SimpleNamespace:
    return SimpleNamespace(is_cuda=True, shape=(n, 4096), device=SimpleNamespace(index=0))


def test_small_steps_launch_with_pdl_larger_ones_without(hopper: None) -> None:  # noqa: ARG001
    assert pdl.options(_tokens(1)) == {"PDL": True, "launch_pdl": True}
    assert pdl.options(_tokens(pdl.MAX_TOKENS)) == {"PDL": True, "launch_pdl": True}
    assert pdl.options(_tokens(pdl.MAX_TOKENS + 1)) == {"PDL": False}
    assert pdl.options(_tokens(512)) == {"PDL": False}


def test_the_bound_and_the_switch_are_honoured(hopper: None, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ARG001
    monkeypatch.setattr(pdl, "MAX_TOKENS", 64)
    assert pdl.options(_tokens(64))["PDL"] and not pdl.options(_tokens(65))["PDL"]
    monkeypatch.setattr(pdl, "ENABLED", False)  # PAPHOS_DISABLE_PDL=1
    assert pdl.options(_tokens(1)) == {"PDL": False}


def test_cpu_tensors_never_ask_for_pdl(hopper: None) -> None:  # noqa: ARG001
    cpu = SimpleNamespace(is_cuda=False, shape=(1, 4096), device=SimpleNamespace(index=None))
    assert pdl.options(cpu) == {"PDL": False}
