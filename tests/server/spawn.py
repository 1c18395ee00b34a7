"""Starts `python -m paphos run` with the bundled default model as a subprocess, for the tests
that talk to a real server over HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def spawn_server_process(log_dir: Path, *extra_args: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """The server's process and base URL, once /health answers 200."""
    port = free_port()
    log_path = log_dir / "server.log"
    cmd = [sys.executable, "-m", "paphos", "run", "--port", str(port), "--served-model-name", NAME, "other-name",
           "--max-model-len", "2048", "--cpu-kv-cache-gb", "1", "--disable-log-requests", *extra_args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready after 600 s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield proc, base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
