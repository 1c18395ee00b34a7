"""The tiny random HF models of the engine tests, for the runner tests that drive the engine."""

from tests.engine.conftest import tiny_model  # noqa: F401
