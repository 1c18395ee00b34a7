"""Suite-wide setup: Triton kernels run in the Triton interpreter on CPU-only machines (CI).

The variable must be set before any kernel module is imported: `triton.jit` decides at decoration
time whether a kernel is interpreted or compiled.

Also the one real server (the bundled default model) that the HTTP end-to-end tests of every
directory share, started at its first use.
"""

import contextlib
import os
from pathlib import Path
from unittest import mock

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Engines run their decode steps eagerly here: compiling each test's tiny model would cost more
# than the test (the compiled step has its own tests, which turn it back on).
os.environ.setdefault("PAPHOS_CPU_COMPILE", "0")


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
