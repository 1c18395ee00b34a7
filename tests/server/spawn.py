"""Starts `python -m paphos run` with the bundled default model as a subprocess, for the tests
that talk to a real server over HTTP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

NAME = "smol"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def spawn_server(log_dir: Path, *extra_args: str) -> Iterator[str]:
    with spawn_server_process(log_dir, *extra_args) as (_, base):
        yield base


def _launch(log_dir: Path, extra_args: Sequence[str], new_session: bool) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "paphos", "run", "--port", str(port), "--served-model-name", NAME, "other-name",
           "--max-model-len", "2048", "--cpu-kv-cache-gb", "1", "--disable-log-requests", *extra_args]
    with open(log_dir / "server.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=new_session,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen[bytes], base: str, what: str, logs: Callable[[], str],
                 timeout_s: float = 600, poll_s: float = 0.5) -> None:
    """Until `base`/health answers 200; a process that exits or a timeout raises with `logs()`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{logs()}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not healthy after {timeout_s:g} s:\n{logs()}")
        time.sleep(poll_s)


def _server_log(log_dir: Path) -> Callable[[], str]:
    return lambda: (log_dir / "server.log").read_text()[-4000:]


def _stop(proc: subprocess.Popen[bytes], new_session: bool) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if new_session:
        # The server may have been killed before it could stop its engine core (a test's SIGKILL
        # of one process, say); the session is the whole instance, so nothing of it outlives us.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@contextmanager
def spawn_server_process(
    log_dir: Path, *extra_args: str, new_session: bool = False,
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """The server's process and base URL, once /health answers 200.

    `new_session` starts it in its own session (and process group, whose id is the server's
    pid), so a test can kill the whole instance, engine core included, with `os.killpg`.
    """
    proc, base = _launch(log_dir, extra_args, new_session)
    try:
        wait_healthy(proc, base, "server", _server_log(log_dir))
        yield proc, base
    finally:
        _stop(proc, new_session)


@contextmanager
def spawn_server_processes(
    log_dirs: Sequence[Path], *extra_args: str, new_session: bool = False,
) -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    """Several servers (one per log directory), started together so their model loads overlap,
    yielded once every one answers /health with 200."""
    with ExitStack() as stack:
        started = []
        for log_dir in log_dirs:
            proc, base = _launch(log_dir, extra_args, new_session)
            stack.callback(_stop, proc, new_session)
            started.append((proc, base))
        for (proc, base), log_dir in zip(started, log_dirs, strict=True):
            wait_healthy(proc, base, "server", _server_log(log_dir))
        yield started
