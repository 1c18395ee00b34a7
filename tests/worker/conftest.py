"""The tiny random HF models of the engine tests, for the runner tests that drive the engine, and
the engines the tensor-parallel tests start."""

from collections.abc import Iterator

import pytest
import torch

from paphos import LLM
from tests.engine.conftest import tiny_model  # noqa: F401


@pytest.fixture(autouse=True)
def _keep_threads() -> Iterator[None]:
    """A tensor-parallel rank 0 runs in this process and takes its share of the cores; the next
    tests get them back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def engines() -> Iterator[list[LLM]]:
    """LLMs to close after the test (their follower processes)."""
    made: list[LLM] = []
    yield made
    for llm in made:
        llm.close()
