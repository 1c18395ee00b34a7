"""Scale-out behind a real nginx: two Paphos instances (default model, CPU) behind
`deploy/nginx/paphos.conf`, rendered with this test's ports and nothing else changed. Streaming
OpenAI completions and Kobold generations run through nginx while one instance is killed (SIGKILL
of its whole process group, as an OOM kill or a crash would): the streams it was serving end
promptly with a visible failure, never a hang, and every request made after its death succeeds on
the survivor, nginx retrying the generation POSTs that could not connect."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.server.spawn import NAME, free_port, spawn_server_processes, wait_healthy

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "deploy" / "nginx" / "paphos.conf"
# Debian puts it in /usr/sbin, which is not on every user's PATH.
NGINX = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/sbin")
pytestmark = pytest.mark.skipif(
    NGINX is None, reason="the nginx binary is not installed (`make install` adds Debian's nginx-light when root)")

# How long a failure may take to reach the client once the instance is dead. Death is seen by
# nginx as a closed socket within milliseconds; the slack is for two loaded CPU cores.
PROMPT_FAILURE_S = 5.0
CLIENT_TIMEOUT = httpx.Timeout(30.0, connect=5.0)
# Longer than the test lets the streams run: the client hangs up on the survivor's streams once
# they have shown they go on after the kill, so the CPU's speed does not set the test's length.
STREAM = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0,
          "ignore_eos": True, "stream": True}
KOBOLD = {"prompt": "The weather today is", "max_length": 8, "temperature": 0.0}


def render_config(ports: list[int], listen_port: int) -> str:
    """deploy/nginx/paphos.conf with every upstream listing `ports` (each with the parameters of
    the file's first `server` line) and nginx listening on loopback at `listen_port`."""
    text = CONFIG.read_text()

    def upstream(match: re.Match[str]) -> str:
        body = match.group(2)
        servers = list(re.finditer(r"^(\s*)server\s+\S+?:\d+([^;\n]*);\n", body, re.M))
        assert servers, f"upstream {match.group(1)!r} lists no server"
        indent, params = servers[0].group(1), servers[0].group(2)
        lines = "".join(f"{indent}server 127.0.0.1:{port}{params};\n" for port in ports)
        body = body[:servers[0].start()] + lines + body[servers[-1].end():]
        assert not re.search(r"^\s*server\s", body[servers[0].start() + len(lines):], re.M), \
            "the upstream's server lines are not contiguous"
        return f"upstream {match.group(1)} {{{body}}}"

    text, upstreams = re.subn(r"upstream\s+(\w+)\s*\{(.*?)^\}", upstream, text, flags=re.S | re.M)
    assert upstreams == 2, f"expected two upstream blocks in {CONFIG}, found {upstreams}"
    text, listens = re.subn(r"^(\s*)listen\s+[^;]+;", rf"\g<1>listen 127.0.0.1:{listen_port};", text, flags=re.M)
    assert listens == 1, f"expected one listen directive in {CONFIG}, found {listens}"
    return text


def main_config(prefix: Path, site: Path) -> str:
    """The top-level file a distribution's nginx.conf would be, every path inside `prefix`.
    The access log records where each request went, for the failure messages."""
    # A root master hands requests to `nobody` workers, who could not enter pytest's private
    # temporary directories to spool request bodies; the test's nginx stays root instead.
    user = "user root;\n" if os.geteuid() == 0 else ""
    return f"""{user}daemon off;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log info;
events {{ worker_connections 256; }}
http {{
    log_format upstreams '$request_uri status=$status upstream=[$upstream_addr] '
                         'upstream_status=[$upstream_status] time=$request_time end=$msec';
    access_log {prefix}/access.log upstreams;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    include {site};
}}
"""


@contextmanager
def run_nginx(workdir: Path, ports: list[int]) -> Iterator[str]:
    """nginx in the foreground with the rendered configuration; its base URL once it proxies."""
    assert NGINX is not None
    prefix = workdir / "nginx"
    prefix.mkdir()
    listen = free_port()
    site = prefix / "paphos.conf"
    site.write_text(render_config(ports, listen))
    conf = prefix / "nginx.conf"
    conf.write_text(main_config(prefix, site))
    with open(prefix / "stderr.log", "w") as log:
        # `-e`: errors met before the configuration is read go to the prefix too, not /var/log.
        proc = subprocess.Popen([NGINX, "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log")],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{listen}"
    try:
        wait_healthy(proc, base, "nginx (proxying /health)", lambda: nginx_logs(prefix), timeout_s=15, poll_s=0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            # Workers outlive a killed master; the session holds them all.
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def nginx_logs(prefix: Path) -> str:
    parts = []
    for name in ("stderr.log", "error.log", "access.log"):
        path = prefix / name
        if path.exists():
            parts.append(f"--- {name}\n{path.read_text()[-6000:]}")
    return "\n".join(parts)


@dataclass
class Call:
    """One request through nginx, as its client saw it."""

    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    status: int | None = None
    token_times: list[float] = field(default_factory=list)
    complete: bool = False
    error: str | None = None
    hung_up: bool = False

    @property
    def tokens(self) -> int:
        return len(self.token_times)

    def tokens_since(self, moment: float) -> int:
        return sum(1 for t in self.token_times if t > moment)

    def __repr__(self) -> str:
        took = (self.ended or time.monotonic()) - self.started
        return (f"Call(status={self.status}, tokens={self.tokens}, complete={self.complete}, "
                f"hung_up={self.hung_up}, error={self.error!r}, took={took:.2f}s)")


def stream_completion(base: str, call: Call, body: dict, hang_up: threading.Event | None = None) -> None:
    """An SSE completion; complete means `data: [DONE]` arrived after only token events. Setting
    `hang_up` closes the connection at the next event, as a client that has seen enough does."""
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=CLIENT_TIMEOUT) as response:
            call.status = response.status_code
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    call.complete = call.status == 200 and call.error is None
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        call.error = f"error event: {event['error']}"
                    else:
                        call.token_times.append(time.monotonic())
                if hang_up is not None and hang_up.is_set():
                    call.hung_up = True
                    break
    except httpx.HTTPError as exc:
        call.error = f"{type(exc).__name__}: {exc}"
    finally:
        call.ended = time.monotonic()


def kobold_generate(base: str, call: Call) -> None:
    try:
        response = httpx.post(f"{base}/api/v1/generate", json=KOBOLD, timeout=CLIENT_TIMEOUT)
        call.status = response.status_code
        if response.status_code == 200:
            call.complete = isinstance(response.json()["results"][0]["text"], str)
        else:
            call.error = response.text[:300]
    except httpx.HTTPError as exc:
        call.error = f"{type(exc).__name__}: {exc}"
    finally:
        call.ended = time.monotonic()


def wait_for(condition: Callable[[], bool], timeout: float, message: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message()
        time.sleep(0.05)


def start(target: Callable[..., None], *args: object) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def test_instance_killed_under_load_fails_its_streams_fast_and_the_survivor_takes_new_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One compute thread per instance: two instances on two cores, as one per GPU would be,
    # rather than each oversubscribing the machine with a thread per core.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    log_dirs = [tmp_path / "a", tmp_path / "b"]
    for log_dir in log_dirs:
        log_dir.mkdir()
    with spawn_server_processes(log_dirs, new_session=True) as instances:
        (victim, victim_base), (_, survivor_base) = instances
        ports = [int(base.rsplit(":", 1)[1]) for _, base in instances]
        with run_nginx(tmp_path, ports) as front:

            def logs() -> str:
                return nginx_logs(tmp_path / "nginx")

            # Streams one after another, each once it has a token: least_conn then puts two on
            # each instance, so the kill below is sure to cut some and spare others.
            streams: list[Call] = []
            stream_threads = []
            hang_up = threading.Event()
            for _ in range(4):
                streams.append(call := Call())
                stream_threads.append(start(stream_completion, front, call, STREAM, hang_up))
                wait_for(lambda c=call: c.tokens >= 1, 60, lambda c=call: f"no token through nginx: {c}\n{logs()}")

            # Kobold generations back to back, from before the kill until after it.
            kobold: list[Call] = []
            stop_kobold = threading.Event()

            def kobold_loop() -> None:
                while not stop_kobold.is_set():
                    kobold.append(call := Call())
                    kobold_generate(front, call)

            kobold_thread = start(kobold_loop)
            wait_for(lambda: any(c.complete for c in kobold), 60,
                     lambda: f"no Kobold generation through nginx: {kobold}\n{logs()}")
            assert all(c.ended is None for c in streams), f"streams ended before the kill: {streams}"

            os.killpg(victim.pid, signal.SIGKILL)
            killed = time.monotonic()
            victim.wait(10)
            # The listening socket died with the server process: from now on a connection to the
            # victim is refused, so every new request must end up on the survivor.
            dead, dead_wall = time.monotonic(), time.time()
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"{victim_base}/health", timeout=2)

            # The victim's two streams end, the survivor's two go on.
            wait_for(lambda: sum(1 for c in streams if c.ended is not None) >= 2, 2 * PROMPT_FAILURE_S,
                     lambda: f"the victim's streams did not end: {streams}\n{logs()}")
            wait_for(lambda: sum(1 for c in streams if c.tokens_since(dead) >= 2) >= 2, 60,
                     lambda: f"the survivor's streams stalled: {streams}\n{logs()}")
            hang_up.set()
            for thread in stream_threads:
                thread.join(30)
                assert not thread.is_alive(), f"a stream hung after the kill: {streams}\n{logs()}"
            cut = [c for c in streams if not c.hung_up]
            assert len(cut) == 2, f"expected least_conn to have put 2 of the 4 streams on each instance: {streams}"
            for c in cut:
                # Cut after it had started, told to the client as an incomplete chunked body
                # (never a clean end that only lacks [DONE]), and promptly.
                assert c.tokens >= 1 and not c.complete, c
                assert c.error is not None and "incomplete chunked read" in c.error, c
                assert c.ended - killed < PROMPT_FAILURE_S, f"{c} ended {c.ended - killed:.2f}s after the kill"

            # Let the Kobold loop make requests after the death too.
            wait_for(lambda: sum(1 for c in kobold if c.started > dead and c.ended is not None) >= 2, 60,
                     lambda: f"the Kobold loop stalled: {kobold}\n{logs()}")
            stop_kobold.set()
            kobold_thread.join(40)
            assert not kobold_thread.is_alive(), f"a Kobold generation hung: {kobold}\n{logs()}"
            for c in kobold:
                assert c.ended is not None
                if c.started > dead:
                    assert c.complete, f"a Kobold generation after the death failed: {c}\n{logs()}"
                elif not c.complete:
                    # In flight on the victim: nginx's 502 (never retried: the POST had been sent).
                    assert c.status == 502 and "BadGatewayError" in (c.error or ""), c
                    assert c.ended - max(c.started, killed) < PROMPT_FAILURE_S, c

            # A fresh burst after the death: everything lands on the survivor.
            after = [Call() for _ in range(5)]
            short = {**STREAM, "max_tokens": 6}
            threads = [start(stream_completion, front, c, short) for c in after[:3]]
            threads += [start(kobold_generate, front, c) for c in after[3:]]
            for thread in threads:
                thread.join(40)
            assert all(c.complete for c in after), f"requests after the death failed: {after}\n{logs()}"
            assert all(c.tokens == 6 for c in after[:3]), after

            # nginx's view of the same: no request that reached an instance was replayed on
            # another, every request begun after the death was answered by the survivor, and
            # a generation POST that nginx first sent towards the victim could not connect there
            # and was retried on the survivor.
            victim_addr, survivor_addr = victim_base.removeprefix("http://"), survivor_base.removeprefix("http://")
            entries = access_log(tmp_path / "nginx" / "access.log")
            for entry in entries:
                if entry.status == 502:
                    assert len(entry.upstreams) == 1, f"a sent request was retried: {entry}"
            # (The log's times are in milliseconds: a margin keeps a request that raced the death
            # out of the set.)
            after_death = [e for e in entries if e.started > dead_wall + 0.05]
            assert after_death and all(e.status == 200 and e.upstreams[-1] == survivor_addr for e in after_death), \
                "\n".join(map(str, after_death))
            assert any(e.uri == "/v1/completions" and e.upstreams == [victim_addr, survivor_addr]
                       and e.upstream_statuses == ["502", "200"] for e in after_death), \
                "no generation POST was retried after failing to connect:\n" + "\n".join(map(str, after_death))


@dataclass
class Entry:
    """One line of the test's access log."""

    uri: str
    status: int
    upstreams: list[str]
    upstream_statuses: list[str]
    started: float


def access_log(path: Path) -> list[Entry]:
    entries = []
    pattern = re.compile(r"(\S+) status=(\d+) upstream=\[(.*)\] upstream_status=\[(.*)\] time=([\d.]+) end=([\d.]+)")
    for line in path.read_text().splitlines():
        match = pattern.fullmatch(line)
        assert match, line
        uri, status, upstreams, statuses, took, end = match.groups()
        entries.append(Entry(uri, int(status), upstreams.split(", "), statuses.split(", "), float(end) - float(took)))
    return entries
