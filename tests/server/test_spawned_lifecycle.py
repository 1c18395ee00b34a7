"""The two-process server's lifecycle, as an operator sees it: the engine core dying mid-stream
ends the streams with an error event, turns /health to 503 and makes the server exit non-zero
(so a supervisor restarts it); SIGTERM during streaming stops both processes in the grace
period, with no orphan engine core left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx

from tests.server.spawn import NAME, spawn_server_process

LONG = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0,
        "ignore_eos": True, "stream": True}


def core_pid(server: subprocess.Popen[bytes]) -> int:
    """The engine core: the server's child process running Python (Linux /proc)."""
    children = Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()
    for pid in children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"multiprocessing" in cmdline and b"spawn_main" in cmdline:
            return int(pid)
    raise AssertionError(f"no engine core among the server's children {children}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.split(") ", 1)[1][0] != "Z"


class StreamReader(threading.Thread):
    """Reads one SSE stream in the background, keeping every `data:` payload and when it came."""

    def __init__(self, base: str, body: dict | None = None) -> None:
        super().__init__(daemon=True)
        self.base = base
        self.body = LONG if body is None else body
        self.events: list[tuple[float, str]] = []
        self.started = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.base}/v1/completions", json=self.body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append((time.monotonic(), line[6:]))
                        self.started.set()
        except httpx.HTTPError as exc:
            self.error = exc
        finally:
            self.started.set()


def test_core_death_mid_stream_gives_error_event_health_503_and_nonzero_exit(tmp_path: Path) -> None:
    with spawn_server_process(tmp_path) as (server, base):
        reader = StreamReader(base)
        reader.start()
        assert reader.started.wait(60) and reader.events, reader.error
        core = core_pid(server)
        os.kill(core, signal.SIGKILL)
        killed = time.monotonic()

        saw_503 = None
        while time.monotonic() - killed < 2.0 and saw_503 is None:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 503:
                    saw_503 = time.monotonic() - killed
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        assert saw_503 is not None, "/health did not answer 503 within 2 s of the core's death"

        reader.join(10)
        assert not reader.is_alive(), "the stream hung after the engine core died"
        error_events = [(t, e) for t, e in reader.events if e != "[DONE]" and "error" in json.loads(e)]
        assert error_events, reader.events[-3:]
        assert error_events[0][0] - killed < 2.0
        assert json.loads(error_events[0][1])["error"]["code"] == 503

        assert server.wait(30) != 0


def test_sigterm_during_16_streams_stops_both_processes_in_the_grace_period(tmp_path: Path) -> None:
    with spawn_server_process(tmp_path) as (server, base):
        readers = [StreamReader(base) for _ in range(16)]
        for reader in readers:
            reader.start()
        for reader in readers:
            assert reader.started.wait(60) and reader.events, reader.error
        core = core_pid(server)
        server.send_signal(signal.SIGTERM)
        started = time.monotonic()
        # uvicorn's graceful shutdown (5 s for open streams) then the core's stop (SIGTERM, at
        # most 10 s before SIGKILL): 15 s plus start-up slack is the grace period.
        assert server.wait(20) == 0
        assert time.monotonic() - started < 20
        deadline = time.monotonic() + 5
        while alive(core) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(core), "the engine core outlived the server"
        for reader in readers:
            reader.join(10)
            assert not reader.is_alive()


def test_sigterm_lets_in_flight_streams_finish_within_the_shutdown_timeout(tmp_path: Path) -> None:
    """--shutdown-timeout: after SIGTERM new connections are refused, a stream already running
    ends normally (every token, [DONE]) when it fits in the deadline, and the server exits 0."""
    with spawn_server_process(tmp_path, "--shutdown-timeout", "60") as (server, base):
        reader = StreamReader(base, {**LONG, "max_tokens": 48})
        reader.start()
        assert reader.started.wait(60) and reader.events, reader.error
        server.send_signal(signal.SIGTERM)
        refused = False
        deadline = time.monotonic() + 5
        while not refused and time.monotonic() < deadline:
            try:
                httpx.get(f"{base}/health", timeout=1)
                time.sleep(0.05)
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                # A connection the kernel accepted just before the listener closed is dropped
                # without a response (closed, or reset while the request is read): not served either.
                refused = True
        assert refused, "the server still accepted connections after SIGTERM"
        reader.join(60)
        assert not reader.is_alive() and reader.error is None, reader.error
        chunks = [json.loads(e) for _, e in reader.events if e != "[DONE]"]
        assert reader.events[-1][1] == "[DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"]) >= 40
        assert server.wait(30) == 0
