"""The front door against the engine: the same loads over HTTP (`paphos run` + bench_serving.py) and
in-process (`paphos.LLM`, bench_gpu.py's step timing), on one machine in one run, and the ratios
the front-door work is judged by.

What it measures (full sizes; `--quick` shrinks every load for a CPU dry run):

  in-process (one worker process that imports bench_gpu.py and exits before the server starts,
  so the GPU is free again; it builds one `paphos.LLM` with the server's engine settings)
    decode       batch-1 decode, 128-token prompt, 128 generated: median engine step (ms)
    concurrent   64 sequences, 128 in / 128 out: median step at batch 64, decode tok/s and overall
                 output tok/s (bench_gpu's section_concurrent; one untimed warm-up of the same shape)
    ttft         a lone 1024-token prompt, 6 runs (first dropped): time to the first token
    offline      LLM.generate, 1000 prompts x 1000 in / 1000 out (ignore_eos): output tok/s
  server (`python -m paphos run MODEL --load-format dummy --tokenizer TOK --port 2242
  --disable-log-requests` + the engine flags + `--server-arg` extras; ready when /health is 200)
    http1        1 stream, 128 in / 128 out, 8 prompts: TPOT
    http_ttft    a lone 1024-token prompt, 5 prompts, 16 out, concurrency 1: TTFT median
    http64       64 requests of 128 / 128 at once (in-process `concurrent`'s shape), three runs,
                 the median by output tok/s: output tok/s, TPOT
    http64_sustained  64 streams, 128 / 128, 256 prompts (a client sends its next request when
                 one ends): reported beside http64; between its waves sits the clients' turnaround
    http256      256 streams, 512 / 256, 512 prompts: output tok/s, TTFT and TPOT p50 / p99
    http1000     1000 x 1000 / 1000, concurrency 1000: output tok/s
  every bench_serving run uses `--id-range 1000 40000` and a seed of its own (no prefix-cache hits
  between runs). With `--profile-server S`, http64_sustained runs a second time under `py-spy
  record` (--subprocesses --threads --nonblocking, raw collapsed stacks, at most S seconds) with one
  `py-spy dump` of every server process 2 s in; the measured run is the clean first one. Set
  PAPHOS_STEP_TRACE=FILE to have the server's engine core write its per-step trace there.
  Each HTTP run also records the busy cores of every server process (from /proc: "api" = the
  process `paphos run` started as, the others by pid) and of the client, so a saturated front door,
  engine core or bench_serving shows as a value near 1.0.

On a machine without CUDA (the `--quick` dry run) the worker makes torch.cuda.synchronize a no-op
so bench_gpu.engine_steps runs there; its figures are then CPU figures of the model given.

Acceptance ratios (printed last, also in the JSON under "acceptance"):
    http64 output tok/s / in-process concurrent overall tok/s       >= 0.9
    http64 median TPOT / in-process batch-64 step                   <= 1.15
    http1000 output tok/s / offline output tok/s                    >= 0.9
    http1 median TPOT / in-process batch-1 step                     <= 1.05
    http_ttft median TTFT                                           <= 40 ms

Engine settings: both sides get the same ones, bench_gpu.py's (bf16 on a GPU, max-model-len 8192,
max-num-seqs 256, max-num-batched-tokens 8192, gpu-memory-utilization 0.75), so the ratios measure
the front door alone; `--no-match-engine` leaves the server on its own defaults (2048 batched
tokens, 0.92), as the commands of ../shared/bench/README.md ran it.

Time on the H200 (estimates from benchmarks/README.md and the front-door issue; the whole run is
held to `--deadline`, 530 s by default, and every part has its own timeout, clipped to what is left):
    in-process worker   ~150-200 s (timeout 270): start, dummy 8B weights, CUDA graphs and the
                        first Triton compiles ~40-70 s; decode + concurrent + ttft ~5 s;
                        offline 1000 x 1000 ~85-117 s (117 s in the issue, 110 s in the README)
    server start        ~30-60 s (timeout 300; the Triton cache is warm from the worker)
    http1 ~6 s, http_ttft ~2 s, http64 3 x ~2 s, http64_sustained ~5 s (+ ~5 s profiled), http256 ~15 s (timeouts 90,
                        60, 120, 180 s)
    http1000            ~85-208 s (208 s in the issue before the front-door work; timeout 330 s,
                        run last so a slow one is the only thing the deadline cuts)
    total               ~330-500 s

Outputs in `--out-dir` (at most 7 files, the device tool brings back 8): front_door.json (all
figures, rewritten after every part), front_door.log (what this prints), inproc.log, server.log,
serving.log (bench_serving's tables), pyspy-record.txt and pyspy-dump.txt (with --profile-server).

    # H200 (wheels installed on PYTHONPATH first, .srv made as ../shared/bench/README.md says)
    python3 benchmarks/front_door_gpu.py --out-dir $OUT --profile-server 20
    # CPU dry run with the bundled SmolLM2 GGUF (or --model DIR with a small config.json + vocab.gguf)
    .venv/bin/python benchmarks/front_door_gpu.py --quick --model default --out-dir /tmp/fd --port 23542 \
        [--profile-server 15 --py-spy PATH/bin/py-spy]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent

INPROC_SECTIONS = ("decode", "concurrent", "ttft", "offline")
SERVER_SECTIONS = ("http1", "http_ttft", "http64", "http64_sustained", "http256", "http1000")
ALIASES = {"inprocess": INPROC_SECTIONS, "server": SERVER_SECTIONS, "all": INPROC_SECTIONS + SERVER_SECTIONS}


@dataclass(frozen=True)
class Load:
    """One load: `n` prompts (in-process: sequences, or runs for ttft) of `input_len` tokens, each
    generating `output_len`; `concurrency` and `seed` for bench_serving; `timeout_s` per run;
    `repeats` runs with seeds of their own, of which the median by output tok/s is reported (all are
    kept in the JSON)."""

    n: int
    input_len: int
    output_len: int
    concurrency: int = 1
    seed: int = 0
    timeout_s: float = 120.0
    repeats: int = 1


FULL: dict[str, Load] = {
    "decode": Load(1, 128, 128),
    "concurrent": Load(64, 128, 128, repeats=3),
    "ttft": Load(6, 1024, 1),
    "offline": Load(1000, 1000, 1000),
    "http1": Load(8, 128, 128, 1, seed=1, timeout_s=90),
    "http_ttft": Load(5, 1024, 16, 1, seed=2, timeout_s=60),
    # The figure: the same 64 requests as `concurrent`, at once; then the same shape as a
    # sustained load (each client sends its next request when one ends), reported beside it.
    "http64": Load(64, 128, 128, 64, seed=3, timeout_s=60, repeats=3),
    "http64_sustained": Load(256, 128, 128, 64, seed=7, timeout_s=120),
    "http256": Load(512, 512, 256, 256, seed=5, timeout_s=180),
    "http1000": Load(1000, 1000, 1000, 1000, seed=6, timeout_s=330),
}
QUICK: dict[str, Load] = {
    "decode": Load(1, 32, 32),
    "concurrent": Load(8, 32, 16),
    "ttft": Load(3, 128, 1),
    "offline": Load(8, 64, 32),
    "http1": Load(3, 32, 16, 1, seed=1, timeout_s=300),
    "http_ttft": Load(3, 128, 16, 1, seed=2, timeout_s=300),
    "http64": Load(8, 32, 16, 8, seed=3, timeout_s=300, repeats=3),
    "http64_sustained": Load(16, 32, 16, 8, seed=7, timeout_s=300),
    "http256": Load(16, 64, 16, 8, seed=5, timeout_s=300),
    "http1000": Load(8, 64, 32, 8, seed=6, timeout_s=300),
}
PROFILE_SEED = 4

# (key, description, HTTP figure, in-process figure, is the value their ratio (else the HTTP figure), op, bar)
CHECKS: tuple[tuple[str, str, tuple[str, ...], tuple[str, ...], bool, str, float], ...] = (
    ("http64_tok_s_over_inproc", "{http64} output tok/s / in-process {concurrent} overall",
     ("http64", "output_throughput"), ("concurrent", "overall_output_tok_s"), True, ">=", 0.9),
    ("http64_tpot_over_step", "{http64} median TPOT / in-process batch-{bc} step",
     ("http64", "tpot_ms", "median"), ("concurrent", "step_ms"), True, "<=", 1.15),
    ("http1000_over_offline", "{http1000} output tok/s / offline {offline}",
     ("http1000", "output_throughput"), ("offline", "output_tok_s"), True, ">=", 0.9),
    ("http1_tpot_over_step", "{http1} median TPOT / in-process batch-1 step",
     ("http1", "tpot_ms", "median"), ("decode", "step_ms"), True, "<=", 1.05),
    ("http_ttft_ms", "lone {ttft_len}-token prompt: HTTP TTFT median (ms)",
     ("http_ttft", "ttft_ms", "median"), ("ttft", "ttft_ms_median"), False, "<=", 40.0),
)  # fmt: skip


# ----------------------------------------------------------------------------- small helpers


class Reporter:
    """Prints to stdout and to front_door.log; keeps the results and rewrites the JSON."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.log_file: TextIO = open(out_dir / "front_door.log", "a", encoding="utf-8")  # noqa: SIM115
        self.results: dict[str, Any] = {}

    def log(self, *parts: object) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def save(self) -> None:
        (self.out_dir / "front_door.json").write_text(json.dumps(_json_safe(self.results), indent=1, default=str))


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and obj != obj:  # NaN: strict JSON has none
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    return obj


class Clock:
    """The run's deadline: each part's timeout is what it asks for, clipped to what is left."""

    def __init__(self, deadline_s: float) -> None:
        self.t0 = time.monotonic()
        self.deadline_s = deadline_s

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def budget(self, want: float, reserve: float) -> float:
        return max(0.0, min(want, self.deadline_s - self.elapsed() - reserve))


def _dig(d: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def _fmt(value: Any, digits: int = 2) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return "-" if value is None else str(value)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def _stop_group(proc: subprocess.Popen[Any], grace_s: float = 20.0) -> int | None:
    """SIGTERM to the process group `proc` leads (started with process_group=0), SIGKILL after
    `grace_s`; then SIGKILL to what is left of the group (children the leader left behind);
    returns the leader's exit status."""
    if proc.poll() is None:
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return proc.poll()


def _raise_nofile() -> tuple[int, int]:
    """1000 streams need more than the usual 1024 descriptors, in the server and in the client."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    want = min(want, 1 << 20)
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _gpu_memory_used() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _has_gpu() -> bool:
    if not shutil.which("nvidia-smi"):
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def _default_model_path() -> str:
    code = "from paphos.default_model import default_model_path; print(default_model_path())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=_child_env(),
                         check=True, timeout=600)  # fmt: skip
    return out.stdout.strip().splitlines()[-1]


def _port_answers(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


# ----------------------------------------------------------------------------- in-process worker
# Runs in its own process (`--worker SPEC.json`): imports torch, paphos and bench_gpu, writes its
# results JSON after every section, and frees the GPU by exiting.


def _id_prompts(n: int, length: int, id_range: tuple[int, int], seed: int) -> list[list[int]]:
    """Random token ids from bench_serving's range (away from special tokens), as the server gets."""
    rng = random.Random(seed)
    lo, hi = id_range
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


def _median_step_ms(steps: list[tuple[float, int]], batch: int) -> float | None:
    """bench_gpu's _decode_stats definition: the median of the steps after the first that decoded
    exactly `batch` rows."""
    rows = [t for t, n in steps[1:] if n == batch]
    return statistics.median(rows) * 1e3 if rows else None


def _median_run(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The run whose `key` is the median (the lower middle of an even count), with every run's
    `key` beside it, so that a lucky or unlucky repetition neither passes nor fails a bar alone."""
    ranked = sorted(runs, key=lambda r: r.get(key) or 0.0)
    chosen = dict(ranked[(len(ranked) - 1) // 2])
    if len(runs) > 1:
        chosen["repeats"] = [r.get(key) for r in runs]
    return chosen


def run_worker(spec_path: Path) -> int:
    spec = json.loads(spec_path.read_text())
    out_path = Path(spec["out"])
    results: dict[str, Any] = {}

    def save() -> None:
        out_path.write_text(json.dumps(_json_safe(results), indent=1, default=str))

    sys.path.insert(0, str(BENCH_DIR))
    sys.path.insert(0, str(REPO))
    import bench_gpu  # the engine_steps timing loop of the in-process GPU figures
    import torch

    from paphos import LLM
    from paphos.sampling_params import SamplingParams

    cuda = torch.cuda.is_available()
    env: dict[str, Any] = {"torch": torch.__version__, "cuda": cuda,
                           "device": torch.cuda.get_device_name(0) if cuda else "cpu"}  # fmt: skip
    if not cuda:
        # bench_gpu.engine_steps synchronizes CUDA around its timings; on a CPU dry run that is a
        # no-op, and the figures are CPU figures of whatever model was given.
        torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
        env["note"] = "CPU: torch.cuda.synchronize made a no-op for bench_gpu.engine_steps"
    results["env"] = env
    save()
    id_range = tuple(spec["id_range"])
    loads = {k: Load(**v) for k, v in spec["loads"].items()}
    kwargs = dict(spec["engine"])
    if spec.get("tokenizer"):
        kwargs["tokenizer"] = spec["tokenizer"]
    t0 = time.perf_counter()
    llm = LLM(spec["model"], **kwargs)
    env["build_s"] = round(time.perf_counter() - t0, 1)
    print(f"LLM built in {env['build_s']} s: {spec['model']} {kwargs}", flush=True)
    save()

    def steps(prompts: list[list[int]], max_tokens: int) -> list[tuple[float, int]]:
        return bench_gpu.engine_steps(llm, prompts, max_tokens)

    def decode(load: Load) -> dict[str, Any]:
        step = _median_step_ms(steps(_id_prompts(1, load.input_len, id_range, 11), load.output_len), 1)
        return {"batch": 1, "input_len": load.input_len, "output_len": load.output_len, "step_ms": step,
                "tok_s": 1e3 / step if step else None}  # fmt: skip

    def concurrent(load: Load) -> dict[str, Any]:
        steps(_id_prompts(load.n, load.input_len, id_range, 12), 2)  # same shapes, untimed
        runs = []
        for k in range(load.repeats):
            t = time.perf_counter()
            got = steps(_id_prompts(load.n, load.input_len, id_range, 13 + 100 * k), load.output_len)
            elapsed = time.perf_counter() - t
            step = _median_step_ms(got, load.n)
            runs.append({"batch": load.n, "input_len": load.input_len, "output_len": load.output_len,
                         "step_ms": step, "decode_tok_s": load.n * 1e3 / step if step else None,
                         "seconds": elapsed, "overall_output_tok_s": load.n * load.output_len / elapsed})  # fmt: skip
        return _median_run(runs, "overall_output_tok_s")

    def ttft(load: Load) -> dict[str, Any]:
        times = []
        for run in range(load.n):
            got = steps(_id_prompts(1, load.input_len, id_range, 100 + run), 1)
            times.append(sum(t for t, _ in got))
        kept = times[1:] or times
        return {"input_len": load.input_len, "ttft_ms_median": statistics.median(kept) * 1e3,
                "ttft_ms_all": [t * 1e3 for t in times]}  # fmt: skip

    def offline(load: Load) -> dict[str, Any]:
        prompts = _id_prompts(load.n, load.input_len, id_range, 14)
        params = SamplingParams(temperature=0.0, max_tokens=load.output_len, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"prompts": load.n, "input_len": load.input_len, "output_len": load.output_len, "seconds": elapsed,
                "output_tokens": produced, "output_tok_s": produced / elapsed,
                "total_tok_s": (produced + load.n * load.input_len) / elapsed}  # fmt: skip

    sections: dict[str, Callable[[Load], dict[str, Any]]] = {
        "decode": decode, "concurrent": concurrent, "ttft": ttft, "offline": offline,
    }
    for name in spec["sections"]:
        t = time.perf_counter()
        try:
            results[name] = sections[name](loads[name])
        except Exception as exc:  # one broken section must not lose the others' figures
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        results[name]["section_s"] = round(time.perf_counter() - t, 1)
        print(f"--- {name}: {json.dumps(_json_safe(results[name]), default=str)[:600]}", flush=True)
        save()
    return 0


# ----------------------------------------------------------------------------- parts run by the parent


def run_inprocess(args: argparse.Namespace, rep: Reporter, clock: Clock, scratch: Path,
                  sections: list[str], spec_base: dict[str, Any], reserve: float) -> None:  # fmt: skip
    budget = clock.budget(args.inproc_timeout, reserve)
    if budget < 10:
        rep.results["inprocess"] = {"skipped": f"deadline: {budget:.0f} s left for it"}
        rep.log(f"in-process: skipped, only {budget:.0f} s left")
        return
    out = scratch / "inproc.json"
    spec = {**spec_base, "sections": sections, "out": str(out)}
    spec_path = scratch / "inproc_spec.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path)]
    rep.log(f"\n=== in-process worker (timeout {budget:.0f} s): {' '.join(sections)}")
    t0 = time.monotonic()
    with open(rep.out_dir / "inproc.log", "ab") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=_child_env(), stdout=log, stderr=subprocess.STDOUT,
                                process_group=0)  # fmt: skip
        try:
            rc: int | None = proc.wait(budget)
            status = f"exit {rc}"
        except subprocess.TimeoutExpired:
            rc = _stop_group(proc, grace_s=5)
            status = f"timed out after {budget:.0f} s (killed, exit {rc})"
        finally:
            _stop_group(proc, grace_s=5)
    got: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    got["worker"] = {"status": status, "seconds": round(time.monotonic() - t0, 1), "timeout_s": round(budget)}
    rep.results["inprocess"] = got
    rep.results.setdefault("part_seconds", {})["inprocess"] = got["worker"]["seconds"]
    rep.log(f"in-process worker: {status} in {got['worker']['seconds']} s; GPU memory after: {_gpu_memory_used()}")
    for name in sections:
        rep.log(f"  {name}: {json.dumps(_json_safe(got.get(name, 'missing')), default=str)[:400]}")
    rep.save()


class Server:
    def __init__(self, cmd: list[str], port: int, log_path: Path) -> None:
        self.cmd, self.port, self.log_path = cmd, port, log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.base_url = f"http://127.0.0.1:{port}"

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the server writes it until stop()
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=_child_env(), stdout=log, stderr=subprocess.STDOUT,
                                     process_group=0)  # fmt: skip
        log.close()  # the child holds its own descriptor

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until /health answered 200; raises if the server exits or the time runs out."""
        assert self.proc is not None
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with status {self.proc.returncode} before /health was 200")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"/health not 200 after {timeout_s:.0f} s")

    def stop(self) -> int | None:
        return _stop_group(self.proc) if self.proc is not None else None


def _tree_cpu(root_pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of `root_pid` and its descendants, from /proc: {pid: (name, s)}."""
    tick = os.sysconf("SC_CLK_TCK")
    info: dict[int, tuple[int, str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        info[int(entry.name)] = (int(fields[1]), name, (int(fields[11]) + int(fields[12])) / tick)
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _, _) in info.items():
            if ppid == parent and pid not in tree:
                tree.add(pid)
                frontier.append(pid)
    return {pid: (info[pid][1], info[pid][2]) for pid in tree if pid in info}


def _cpu_fractions(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], root: int,
                   wall: float) -> dict[str, float]:  # fmt: skip
    """Busy fraction of one core per server process over a run ("api" = the process `paphos run`
    started as, the others by pid and name)."""
    out = {}
    for pid, (name, cpu) in after.items():
        label = "api" if pid == root else f"{pid}:{name}"
        out[label] = round((cpu - before.get(pid, (name, 0.0))[1]) / wall, 3) if wall > 0 else 0.0
    return out


def _child_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _serving_cmd(base_url: str, load: Load, out: Path, id_range: tuple[int, int], timeout_s: float,
                 seed: int | None = None) -> list[str]:  # fmt: skip
    return [sys.executable, str(BENCH_DIR / "bench_serving.py"), "--base-url", base_url,
            "--id-range", str(id_range[0]), str(id_range[1]), "--num-prompts", str(load.n),
            "--input-len", str(load.input_len), "--output-len", str(load.output_len),
            "--max-concurrency", str(load.concurrency), "--seed", str(load.seed if seed is None else seed),
            "--timeout", str(max(30, int(timeout_s))), "--out", str(out)]  # fmt: skip


def run_serving(name: str, load: Load, server: Server, rep: Reporter, clock: Clock, scratch: Path,
                id_range: tuple[int, int], seed: int | None = None,
                during: Callable[[], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """One bench_serving run as a subprocess under its own timeout; its table goes to serving.log,
    its summary into the results. `during` runs in a thread while it runs (the profiler's dump)."""
    budget = clock.budget(load.timeout_s, reserve=15)
    if budget < 5:
        return {"skipped": f"deadline: {budget:.0f} s left"}
    out = scratch / f"{name}.json"
    out.unlink(missing_ok=True)
    cmd = _serving_cmd(server.base_url, load, out, id_range, budget, seed)
    rep.log(f"\n=== {name}: {load.n} prompts, {load.input_len} in / {load.output_len} out, "
            f"concurrency {load.concurrency} (timeout {budget:.0f} s)")  # fmt: skip
    root = server.proc.pid if server.proc is not None else 0
    cpu_before, client_before = _tree_cpu(root), _child_cpu_s()
    t0 = time.monotonic()
    with open(rep.out_dir / "serving.log", "a", encoding="utf-8") as log:
        log.write(f"\n##### {name}: {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=_child_env(), stdout=log, stderr=subprocess.STDOUT,
                                process_group=0)  # fmt: skip
        helper = threading.Thread(target=during, daemon=True) if during else None
        if helper:
            helper.start()
        try:
            rc = proc.wait(budget)
            status = f"exit {rc}"
        except subprocess.TimeoutExpired:
            _stop_group(proc, grace_s=3)
            status = f"timed out after {budget:.0f} s"
        finally:
            _stop_group(proc, grace_s=3)
        if helper:
            helper.join(30)
    wall = time.monotonic() - t0
    seconds = round(wall, 1)
    result: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"error": status}
    result["status"], result["wall_s"] = status, seconds
    # A process near 1.0 is saturated: the API process (front door), the engine core, or the
    # client itself (then the HTTP figure measures bench_serving, not the server).
    result["server_cpu_frac"] = _cpu_fractions(cpu_before, _tree_cpu(root), root, wall)
    result["client_cpu_frac"] = round((_child_cpu_s() - client_before) / wall, 3) if wall > 0 else None
    if "duration_s" not in result and "timed out" in status:
        total = load.n * load.output_len
        result["note"] = f"did not finish: output tok/s below {total / budget:.0f} ({total} tokens in {budget:.0f} s)"
    rep.log(f"{name}: {status} in {seconds} s; out tok/s {_fmt(result.get('output_throughput'))}, "
            f"TTFT p50/p99 {_fmt(_dig(result, ('ttft_ms', 'median')))}/{_fmt(_dig(result, ('ttft_ms', 'p99')))} ms, "
            f"TPOT p50/p99 {_fmt(_dig(result, ('tpot_ms', 'median')))}/{_fmt(_dig(result, ('tpot_ms', 'p99')))} ms, "
            f"failed {result.get('failed', '-')}; CPU (cores busy) server {result['server_cpu_frac']}, "
            f"client {result['client_cpu_frac']}")  # fmt: skip
    return result


# ----------------------------------------------------------------------------- py-spy


def find_py_spy(explicit: str | None) -> str | None:
    """--py-spy, else PATH, else a `bin/py-spy` beside any PYTHONPATH or sys.path entry (a wheel
    installed with `pip install --target DIR` puts it in DIR/bin)."""
    if explicit:
        return explicit if Path(explicit).is_file() else None
    found = shutil.which("py-spy")
    if found:
        return found
    roots = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + sys.path
    roots.append(str(Path(sys.executable).parent.parent))
    for root in roots:
        candidate = Path(root) / "bin" / "py-spy"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


_PROCESS_FRAME = re.compile(r'process (\d+):"(.*?)";')


def summarize_raw_profile(path: Path, top: int = 12) -> dict[str, Any]:
    """py-spy raw (collapsed) stacks -> per process and thread: samples, the top functions by self
    samples (the innermost frame) and by inclusive samples. With --subprocesses a stack starts with
    `process PID:"cmdline";` for the process and each parent (a cmdline may hold ';'), then with
    --threads `thread (TID): name;`."""
    groups: dict[str, dict[str, Any]] = {}
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        process = thread = ""
        while match := _PROCESS_FRAME.match(stack):
            process = f"pid {match[1]} ({match[2][:60]})"
            stack = stack[match.end():]
        if stack.startswith("thread "):
            thread, _, stack = stack.partition(";")
        key = " | ".join(p for p in (process, thread) if p) or "all"
        frames = [f for f in stack.split(";") if f]
        group = groups.setdefault(key, {"samples": 0, "self": Counter(), "inclusive": Counter()})
        group["samples"] += int(count_text)
        if frames:
            group["self"][frames[-1]] += int(count_text)
            for frame in set(frames):
                group["inclusive"][frame] += int(count_text)
    out = {}
    for key, group in sorted(groups.items(), key=lambda kv: -kv[1]["samples"]):
        out[key] = {"samples": group["samples"], "self_top": group["self"].most_common(top),
                    "inclusive_top": group["inclusive"].most_common(top)}  # fmt: skip
    return out


def run_profiled(args: argparse.Namespace, name: str, load: Load, server: Server, rep: Reporter, clock: Clock,
                        scratch: Path, id_range: tuple[int, int]) -> None:  # fmt: skip
    spy = find_py_spy(args.py_spy)
    if spy is None:
        reason = "py-spy not found (PATH, PYTHONPATH/bin, --py-spy): profile skipped"
        rep.log(reason)
        rep.results["profile"] = {"skipped": reason}
        return
    assert server.proc is not None
    pid = server.proc.pid
    record_path = rep.out_dir / "pyspy-record.txt"
    dump_path = rep.out_dir / "pyspy-dump.txt"
    rec_cmd = [spy, "record", "--pid", str(pid), "--subprocesses", "--threads", "--nonblocking", "--format", "raw",
               "--rate", str(args.profile_rate), "--duration", str(int(args.profile_server)), "-o", str(record_path)]
    rep.log(f"\n=== profile: {shlex.join(rec_cmd)}")  # fmt: skip
    with open(rep.out_dir / "front_door.log", "a", encoding="utf-8") as log:
        rec = subprocess.Popen(rec_cmd, stdout=log, stderr=subprocess.STDOUT, process_group=0)
    time.sleep(1.0)  # let it attach before the load starts

    def dump() -> None:
        time.sleep(2.0)
        with open(dump_path, "a", encoding="utf-8") as f:
            f.write(f"##### py-spy dump --subprocesses --pid {pid} at +2 s of the profiled {load.concurrency}-stream run\n")
            f.flush()
            try:
                subprocess.run([spy, "dump", "--pid", str(pid), "--subprocesses"], stdout=f, stderr=subprocess.STDOUT,
                               timeout=60)  # fmt: skip
            except subprocess.TimeoutExpired:
                f.write("py-spy dump timed out\n")

    result = run_serving(f"{name}_profiled", load, server, rep, clock, scratch, id_range, seed=PROFILE_SEED,
                         during=dump)  # fmt: skip
    if rec.poll() is None:
        rec.send_signal(signal.SIGINT)  # py-spy writes what it has on Ctrl-C
    try:
        rec.wait(30)
    except subprocess.TimeoutExpired:
        _stop_group(rec, grace_s=5)
    profile: dict[str, Any] = {"command": rec_cmd, "exit": rec.returncode, "run": result}
    if record_path.exists():
        profile["summary"] = summarize_raw_profile(record_path)
        for key, group in profile["summary"].items():
            rep.log(f"[py-spy] {key}: {group['samples']} samples; self top: "
                    + "; ".join(f"{f} {n}" for f, n in group["self_top"][:6]))  # fmt: skip
    else:
        profile["error"] = "py-spy wrote no record (see front_door.log for its message)"
        rep.log(profile["error"])
    rep.results["profile"] = profile
    rep.save()


# ----------------------------------------------------------------------------- tables


def print_tables(rep: Reporter, loads: dict[str, Load]) -> None:
    inproc = rep.results.get("inprocess", {})
    server_runs = rep.results.get("server", {}).get("runs", {})
    rep.log("\n=== in-process (paphos.LLM, engine_steps / generate)")
    rep.log(f"{'section':<12}{'shape':>22}{'step ms':>10}{'tok/s':>12}{'overall tok/s':>15}{'TTFT ms':>10}{'s':>8}")
    for name in INPROC_SECTIONS:
        r = inproc.get(name)
        if not isinstance(r, dict):
            continue
        ld = loads[name]
        shape = f"{ld.n} x {ld.input_len}/{ld.output_len}"
        tok_s = r.get("tok_s") or r.get("decode_tok_s") or r.get("output_tok_s")
        rep.log(f"{name:<12}{shape:>22}{_fmt(r.get('step_ms')):>10}{_fmt(tok_s, 1):>12}"
                f"{_fmt(r.get('overall_output_tok_s'), 1):>15}{_fmt(r.get('ttft_ms_median')):>10}"
                f"{_fmt(r.get('seconds', r.get('section_s')), 1):>8}" + (f"  {r['error']}" if "error" in r else ""))
    rep.log("\n=== HTTP (bench_serving.py against paphos run)")
    rep.log(f"{'run':<16}{'shape':>24}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}"
            f"{'TPOT p99':>10}{'failed':>8}{'dur s':>8}")
    for name, r in server_runs.items():
        ld = loads.get(name.removesuffix("_profiled"))
        shape = f"{ld.n} x {ld.input_len}/{ld.output_len} c{ld.concurrency}" if ld else ""
        rep.log(f"{name:<16}{shape:>24}{_fmt(r.get('output_throughput'), 1):>11}"
                f"{_fmt(_dig(r, ('ttft_ms', 'median'))):>10}{_fmt(_dig(r, ('ttft_ms', 'p99'))):>10}"
                f"{_fmt(_dig(r, ('tpot_ms', 'median'))):>10}{_fmt(_dig(r, ('tpot_ms', 'p99'))):>10}"
                f"{_fmt(r.get('failed')):>8}{_fmt(r.get('duration_s'), 1):>8}"
                + ("" if "duration_s" in r else f"  {r.get('skipped') or r.get('note') or r.get('error', '')}"))
    # fmt: skip


def acceptance(rep: Reporter, loads: dict[str, Load]) -> list[dict[str, Any]]:
    sources = {**rep.results.get("inprocess", {}), **rep.results.get("server", {}).get("runs", {})}
    names = {k: f"{v.n}x{v.input_len}/{v.output_len} c{v.concurrency}" for k, v in loads.items() if k.startswith("http")}
    names |= {"concurrent": f"{loads['concurrent'].n}x{loads['concurrent'].input_len}/{loads['concurrent'].output_len}",
              "offline": f"{loads['offline'].n}x{loads['offline'].input_len}/{loads['offline'].output_len}",
              "bc": str(loads["concurrent"].n), "ttft_len": str(loads["http_ttft"].input_len)}  # fmt: skip
    rows = []
    for key, text, http_path, inproc_path, is_ratio, op, bar in CHECKS:
        http = _dig(sources, http_path)
        base = _dig(sources, inproc_path)
        value = (http / base if http is not None and base else None) if is_ratio else http
        failed = _dig(sources, (http_path[0], "failed"))
        ok = None if value is None else (value >= bar if op == ">=" else value <= bar)
        if ok and failed:
            ok = False  # failed requests make the figure worthless
        rows.append({"check": key, "description": text.format(**names), "http": http, "in_process": base,
                     "value": value, "op": op, "bar": bar, "pass": ok, "failed_requests": failed})  # fmt: skip
    rep.log("\n=== acceptance")
    rep.log(f"{'check':<62}{'HTTP':>10}{'in-proc':>10}{'value':>9}{'bar':>9}  pass")
    for r in rows:
        verdict = {True: "yes", False: "NO", None: "n/a"}[r["pass"]]
        rep.log(f"{r['description']:<62}{_fmt(r['http']):>10}{_fmt(r['in_process']):>10}{_fmt(r['value'], 3):>9}"
                f"{r['op'] + ' ' + str(r['bar']):>9}  {verdict}")  # fmt: skip
    return rows


# ----------------------------------------------------------------------------- main


def parse_sections(text: str) -> list[str]:
    names: list[str] = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        for name in ALIASES.get(item, (item,)):
            if name not in INPROC_SECTIONS + SERVER_SECTIONS:
                raise argparse.ArgumentTypeError(f"unknown section {name!r}")
            if name not in names:
                names.append(name)
    return names


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="front_door_out", help="JSON and logs (on the device: $OUT)")
    ap.add_argument("--sections", type=parse_sections, default=list(ALIASES["all"]),
                    help=f"comma list of {', '.join(INPROC_SECTIONS + SERVER_SECTIONS)} or inprocess, server, all")
    ap.add_argument("--quick", action="store_true", help="small loads everywhere (CPU dry run)")
    ap.add_argument("--model", default=".srv", help="model for both sides: a config.json directory (dummy "
                    "weights), a .gguf, or `default` for the bundled SmolLM2 GGUF (default .srv)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer for both sides (default: MODEL/vocab.gguf when "
                    "MODEL is a directory holding one, else the model's own; '' for the model's own)")
    ap.add_argument("--load-format", default=None, help="default: dummy for a directory, auto for a file")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="picks the engine defaults (bf16 and --gmu on cuda); auto: cuda when nvidia-smi sees a GPU")
    ap.add_argument("--gmu", type=float, default=0.75, help="gpu-memory-utilization of both sides on a GPU")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--match-engine", action=argparse.BooleanOptionalAction, default=True,
                    help="give the server the in-process engine settings (default on)")
    ap.add_argument("--server-arg", action="append", default=[], metavar="'FLAGS'",
                    help="extra `paphos run` flags, shell-split; repeatable: --server-arg='--kv-cache-dtype fp8'")
    ap.add_argument("--port", type=int, default=2242)
    ap.add_argument("--id-range", type=int, nargs=2, default=(1000, 40000), metavar=("LO", "HI"))
    ap.add_argument("--deadline", type=float, default=None, help="seconds for the whole run (default 530, quick 1800)")
    ap.add_argument("--inproc-timeout", type=float, default=None, help="in-process worker (default 270, quick 900)")
    ap.add_argument("--server-start-timeout", type=float, default=300.0)
    ap.add_argument("--profile-server", type=float, default=0.0, metavar="S",
                    help="rerun http64_sustained under py-spy record (at most S seconds) and dump the server processes")
    ap.add_argument("--profile-rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument("--py-spy", default=None, help="py-spy binary (default: PATH, then PYTHONPATH entries' bin/)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        rc = run_worker(Path(args.worker))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)  # no waiting on engine threads at exit: the parent only needs the JSON and a free GPU
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    rep = Reporter(out_dir)
    clock = Clock(args.deadline if args.deadline is not None else (1800.0 if args.quick else 530.0))
    loads = QUICK if args.quick else FULL
    inproc_timeout = args.inproc_timeout if args.inproc_timeout is not None else (900.0 if args.quick else 270.0)
    args.inproc_timeout = inproc_timeout
    device = args.device if args.device != "auto" else ("cuda" if _has_gpu() else "cpu")

    model = _default_model_path() if args.model == "default" else str(Path(args.model).resolve())
    tokenizer = args.tokenizer
    if tokenizer is None:
        guess = Path(model) / "vocab.gguf"
        tokenizer = str(guess) if Path(model).is_dir() and guess.is_file() else ""
    elif tokenizer:
        tokenizer = str(Path(tokenizer).resolve())
    load_format = args.load_format or ("dummy" if Path(model).is_dir() else "auto")
    engine: dict[str, Any] = {"load_format": load_format, "max_model_len": args.max_model_len,
                              "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    if device == "cuda":
        engine |= {"dtype": "bfloat16", "gpu_memory_utilization": args.gmu}
    id_range = (args.id_range[0], args.id_range[1])
    nofile = _raise_nofile()

    stop_now = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop_now.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    rep.results["meta"] = {
        "argv": sys.argv, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "python": sys.version.split()[0],
        "device": device, "model": model, "tokenizer": tokenizer or None, "engine": engine, "quick": args.quick,
        "sections": args.sections, "loads": {k: asdict(v) for k, v in loads.items()}, "nofile": nofile,
        "deadline_s": clock.deadline_s, "gpu_memory_at_start": _gpu_memory_used(),
    }  # fmt: skip
    rep.log(f"front_door_gpu: device {device}, model {model}, tokenizer {tokenizer or '(model)'}, engine {engine}, "
            f"sections {','.join(args.sections)}, deadline {clock.deadline_s:.0f} s, nofile {nofile}")  # fmt: skip
    rep.save()

    inproc_sections = [s for s in args.sections if s in INPROC_SECTIONS]
    server_sections = [s for s in args.sections if s in SERVER_SECTIONS]
    spec_base = {"model": model, "tokenizer": tokenizer, "engine": engine, "id_range": list(id_range),
                 "loads": {k: asdict(v) for k, v in loads.items()}}  # fmt: skip
    server: Server | None = None
    with tempfile.TemporaryDirectory(prefix="front-door-") as tmp:
        scratch = Path(tmp)
        try:
            if inproc_sections:
                # A stuck worker must leave the server part its start and the short runs.
                reserve = (150.0 if not args.quick else 300.0) if server_sections else 10.0
                run_inprocess(args, rep, clock, scratch, inproc_sections, spec_base, reserve)
            if server_sections:
                server = run_server_part(args, rep, clock, scratch, server_sections, loads, model, tokenizer,
                                         engine, id_range)  # fmt: skip
        except KeyboardInterrupt:
            rep.log("interrupted: stopping what runs and writing what finished")
        finally:
            if server is not None:
                t = time.monotonic()
                rc = server.stop()
                rep.log(f"server stopped (exit {rc}) in {time.monotonic() - t:.1f} s")
            if not stop_now.is_set():
                print_tables(rep, loads)
                rep.results["acceptance"] = acceptance(rep, loads)
            rep.results["total_s"] = round(clock.elapsed(), 1)
            rep.save()
            rep.log(f"\ntotal {clock.elapsed():.0f} s; wrote {out_dir / 'front_door.json'}")
    return 0


def run_server_part(args: argparse.Namespace, rep: Reporter, clock: Clock, scratch: Path, sections: list[str],
                    loads: dict[str, Load], model: str, tokenizer: str, engine: dict[str, Any],
                    id_range: tuple[int, int]) -> Server | None:  # fmt: skip
    server_info: dict[str, Any] = {"runs": {}}
    rep.results["server"] = server_info
    if _port_answers(args.port):
        server_info["error"] = f"port {args.port} already answers: another server? (use --port)"
        rep.log(server_info["error"])
        return None
    cmd = [sys.executable, "-m", "paphos", "run", model, "--port", str(args.port), "--disable-log-requests",
           "--load-format", engine["load_format"]]  # fmt: skip
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    if args.match_engine:
        cmd += ["--max-model-len", str(engine["max_model_len"]), "--max-num-seqs", str(engine["max_num_seqs"]),
                "--max-num-batched-tokens", str(engine["max_num_batched_tokens"])]  # fmt: skip
        if "dtype" in engine:
            cmd += ["--dtype", engine["dtype"], "--gpu-memory-utilization", str(engine["gpu_memory_utilization"])]
    for extra in args.server_arg:
        cmd += shlex.split(extra)
    server_info["command"] = cmd
    budget = clock.budget(args.server_start_timeout, reserve=15)
    rep.log(f"\n=== server (ready timeout {budget:.0f} s; GPU memory before: {_gpu_memory_used()}): {shlex.join(cmd)}")
    server = Server(cmd, args.port, rep.out_dir / "server.log")
    server.start()
    try:
        server_info["startup_s"] = round(server.wait_ready(budget), 1)
    except (RuntimeError, TimeoutError) as exc:
        server_info["error"] = str(exc)
        tail = (rep.out_dir / "server.log").read_text(errors="replace").splitlines()[-25:]
        rep.log(f"server not ready: {exc}\n" + "\n".join(tail))
        rep.save()
        return server
    processes = {}
    for pid in _tree_cpu(server.proc.pid) if server.proc is not None else ():
        try:
            processes[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
        except OSError:
            continue
    server_info["processes"] = processes
    rep.log(f"server ready in {server_info['startup_s']} s; GPU memory: {_gpu_memory_used()}; processes: {processes}")
    rep.save()
    for name in sections:
        load = loads[name]
        runs = [run_serving(name, load, server, rep, clock, scratch, id_range, seed=load.seed + 100 * k)
                for k in range(load.repeats)]  # fmt: skip
        server_info["runs"][name] = _median_run(runs, "output_throughput")
        rep.results.setdefault("part_seconds", {})[name] = server_info["runs"][name].get("wall_s")
        rep.save()
        if name == "http64_sustained" and args.profile_server > 0:
            run_profiled(args, name, load, server, rep, clock, scratch, id_range)
            if "run" in rep.results["profile"]:
                server_info["runs"][f"{name}_profiled"] = rep.results["profile"].pop("run")
            rep.save()
        if server.proc is not None and server.proc.poll() is not None:
            server_info["error"] = f"server exited with status {server.proc.returncode} during {name}"
            rep.log(server_info["error"])
            break
    return server


if __name__ == "__main__":
    sys.exit(main())
