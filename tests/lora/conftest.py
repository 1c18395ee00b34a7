"""The tiny Llama the PEFT tests put adapters on, written once per session."""

from __future__ import annotations

import pytest

from tests.lora.peft_fixtures import TinyLlama, write_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> TinyLlama:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
