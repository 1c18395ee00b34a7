"""Fixtures of the server tests: the fake engine of `fakes.py` behind the app, and one real server.

The fake engine and tokenizer are deterministic (no model, no torch work).

Tokenizer: one token per ASCII character (id = code point); 0 <pad>, 1 <s> (BOS), 2 </s> (EOS);
vocabulary 128. Engine: choice i generates chr(ord('a') + (step + i) % 26) each step until
max_tokens. Markers in the prompt text change behaviour: SLOW (20 ms per token), RAISE (the
iterator raises at step 2), ERRFIELD (an output with `error` at step 1), KVFULL (ParamError on the
first iteration, as the engine's own validation would).
"""

from __future__ import annotations

import time

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
