"""Schema-driven fuzzing of every route, from the server's own OpenAPI document (schemathesis).

Each operation of /openapi.json gets a handful of generated requests, valid and invalid ones
alike, against the in-process app with the fake engine of fakes.py (no model, no network), then a
few against a real spawned server (its real tokenizer, chat template and sampler). The property
checked is the one every input must keep: no 5xx and no hang. Generation is derandomized, so a
failure reproduces on every run.
"""

from __future__ import annotations

import faulthandler
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.server.fakes import FakeEngine, make_app

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Examples per operation; about 40 operations, so the in-process run takes some 30 s on 2 cores.
MAX_EXAMPLES = int(os.environ.get("PAPHOS_FUZZ_EXAMPLES", "8"))
SPAWNED_EXAMPLES = int(os.environ.get("PAPHOS_FUZZ_SPAWNED_EXAMPLES", "2"))
# A request to the fake engine ends in milliseconds, a capped one to the real model in about a
# second: anything near this is a hang.
SLOW_S = 15.0
FUZZ_SETTINGS = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


def _configure(schema: Any, max_examples: int) -> Any:
    schema.config.generation.update(
        modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=max_examples, deterministic=True,
    )
    return schema


def _fake_app() -> Any:
    engine = FakeEngine()
    # Schemathesis's ASGI transport does not run the lifespan: mark the engine ready by hand.
    engine.is_ready = True
    return make_app(engine, api_keys=(KEY,))


schema = _configure(schemathesis.openapi.from_asgi("/openapi.json", _fake_app()), MAX_EXAMPLES)


@pytest.fixture(autouse=True)
def _watchdog() -> Iterator[None]:
    # The in-process transport has no timeout: a request that never returns would block forever.
    # Dump every stack and exit instead, so a hang is a visible failure.
    faulthandler.dump_traceback_later(300, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _call(case: Any) -> None:
    started = time.monotonic()
    case.call_and_validate(checks=[not_a_server_error], headers=AUTH)
    elapsed = time.monotonic() - started
    assert elapsed < SLOW_S, f"{case.method} {case.path} took {elapsed:.1f} s"


@schema.parametrize()
@settings(FUZZ_SETTINGS, max_examples=MAX_EXAMPLES)
def test_fake_engine(case):
    _call(case)


# Lengths the real model would spend seconds or minutes on; the cap keeps every generation short.
_LENGTHS = {"max_tokens": 4, "max_completion_tokens": 4, "max_length": 4, "n": 2, "best_of": 2}


def _cap_lengths(body: Any) -> None:
    if not isinstance(body, dict):
        return
    for name, cap in _LENGTHS.items():
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[name] = cap
    if "messages" in body or "prompt" in body:
        # Chat's default max_tokens is the rest of the context, Kobold's max_length 200.
        body.setdefault("max_tokens", 4)
        body.setdefault("max_length", 4)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_spawned_server(spawned_server, mode):
    # One hypothesis run per operation (schemathesis's lazy fixture loader does not run under this
    # pytest); the operations come from the live server's document.
    live = schemathesis.openapi.from_url(f"{spawned_server}/openapi.json")
    operations = [result.ok() for result in live.get_all_operations()]
    assert len(operations) > 30
    for operation in operations:
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(FUZZ_SETTINGS, max_examples=SPAWNED_EXAMPLES)
        def run(case):
            _cap_lengths(case.body)
            _call(case)

        try:
            run()
        except Unsatisfiable:
            # An operation with no parameters and no body has no invalid form to generate.
            assert mode is GenerationMode.NEGATIVE, operation.label
