"""Fixtures of the server tests: the fake engine of `fakes.py` behind the app, and one real server.

The fake engine and tokenizer are deterministic (no model, no torch work).

Tokenizer: one token per ASCII character (id = code point); 0 <pad>, 1 <s> (BOS), 2 </s> (EOS);
vocabulary 128. Engine: choice i generates chr(ord('a') + (step + i) % 26) each step until
max_tokens. Markers in the prompt text change behaviour: SLOW (20 ms per token), RAISE (the
iterator raises at step 2), ERRFIELD (an output with `error` at step 1), KVFULL (ParamError on the
first iteration, as the engine's own validation would).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from unittest import mock

import pytest
from starlette.testclient import TestClient

from tests.server.fakes import FakeEngine, make_app


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine: FakeEngine):
    with TestClient(make_app(engine), raise_server_exceptions=False) as c:
        for _ in range(400):
            if engine.is_ready:
                break
            time.sleep(0.005)
        yield c


@pytest.fixture(scope="session")
def spawned_server_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared real server's log directory: server.log, and step_trace.jsonl (its engine core's
    PAPHOS_STEP_TRACE)."""
    return tmp_path_factory.mktemp("server")


@pytest.fixture(scope="session")
def spawned_server(spawned_server_dir: Path):
    """One real server (default model) shared by every test that needs HTTP end to end."""
    from tests.server.spawn import spawn_server

    with contextlib.ExitStack() as stack:
        with mock.patch.dict(os.environ, {"PAPHOS_STEP_TRACE": str(spawned_server_dir / "step_trace.jsonl")}):
            base = stack.enter_context(spawn_server(spawned_server_dir))
        yield base
