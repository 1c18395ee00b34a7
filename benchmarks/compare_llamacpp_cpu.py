"""Paphos vs llama.cpp serving on CPU, same GGUF, one server at a time.

For `--rounds` rounds, each server in turn (never both at once: a small CPU box would measure the
contention; the order alternates between rounds so that neither always runs on a warmer or a more
loaded machine): start it as a subprocess with `--threads` threads, wait for it to answer, run

- the serving client of `bench_serving.py` at each `--concurrency` level (unique prompts of
  `--input-len` tokens, exactly `--output-len` output tokens each),
- single-stream decode: one request at a time, `--decode-len` output tokens,
  decode tok/s = (tokens - 1) / (E2E - TTFT), median over `--repeats`,
- single-stream prefill: one request of `--prefill-len` prompt tokens and 1 output token,
  prefill tok/s = prompt tokens / TTFT, median over `--repeats`,

then stop it. Prints one comparison table, each figure the median over the rounds with the
lowest and highest round beside it, and writes every round as JSON (`--out`).

The peer is llama.cpp's own `llama-server` (`--peer llama-server`, the default when the binary is
found): it batches concurrent requests (`--parallel` slots, continuous batching), accepts token-id
prompts and `ignore_eos`, and sends usage in the stream. `--peer llama-cpp-python` runs
`python -m llama_cpp.server` from `--peer-python` instead; that server takes one request at a time
behind a lock (no batching), accepts only text prompts and has no `ignore_eos`, so it is driven
with word prompts and an EOS ban by `logit_bias`; its concurrency > 1 rows then measure queueing.

    python benchmarks/compare_llamacpp_cpu.py [--model GGUF] [--llama-server-bin PATH] \\
        [--peer-python /work/peer-venv/bin/python] [--paphos-args "--max-model-len 2048"] --out cmp.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import BenchConfig, format_table, json_safe, run_benchmark  # noqa: E402

DEFAULT_LLAMA_SERVER = os.environ.get("LLAMA_SERVER_BIN", "/tmp/llama.cpp-src/build/bin/llama-server")
DEFAULT_PEER_PYTHON = "/work/peer-venv/bin/python"


@dataclass
class Server:
    name: str
    cmd: list[str]
    port: int
    prompt_mode: str = "ids"
    ban_eos_ids: tuple[int, ...] = ()
    env: dict[str, str] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_model() -> str | None:
    try:
        from paphos.default_model import default_model_path

        return str(default_model_path())
    except Exception:  # noqa: BLE001 - any failure means "not available here"
        return None


def eos_ids_of(gguf_path: str) -> list[int]:
    """EOS-like ids of a GGUF (for servers without `ignore_eos`): metadata ids and known end tokens."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    ids: set[int] = set()
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in reader.fields:
            ids.add(int(reader.fields[key].contents()))
    ends = {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<end_of_turn>", "</s>", "<|end|>"}
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    ids.update(i for i, t in enumerate(tokens) if t in ends)
    return sorted(ids)


@dataclass
class CpuSnapshot:
    wall_s: float
    busy_s: float  # all CPUs, from /proc/stat
    server_s: float  # the server's process tree (all threads)
    self_s: float  # this client process


def _proc_tree_cpu_ticks(root: int) -> int:
    """utime + stime of `root` and all its live descendants, in clock ticks."""
    ticks: dict[int, int] = {}
    parent: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        parent[pid] = int(fields[1])
        ticks[pid] = int(fields[11]) + int(fields[12])
    total = 0
    for pid, t in ticks.items():
        p, seen = pid, 0
        while p > 1 and seen < 64 and p != root:
            p, seen = parent.get(p, 0), seen + 1
        if p == root:
            total += t
    return total


def cpu_snapshot(pid: int) -> CpuSnapshot | None:
    """CPU seconds so far: whole machine, the server's process tree, and us (Linux /proc only)."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal (guest time is already inside user)
        busy = sum(fields[:8]) - fields[3] - fields[4]
        server = _proc_tree_cpu_ticks(pid)
    except (OSError, ValueError, IndexError):
        return None
    own = os.times()
    return CpuSnapshot(time.monotonic(), busy / tick, server / tick, own.user + own.system)


def other_cpu_share(a: CpuSnapshot | None, b: CpuSnapshot | None) -> float | None:
    """Share of the machine's CPU time that neither the server nor this client used between a and b:
    other work on the box, which skews a CPU benchmark."""
    if a is None or b is None or b.wall_s <= a.wall_s:
        return None
    other = (b.busy_s - a.busy_s) - (b.server_s - a.server_s) - (b.self_s - a.self_s)
    return max(0.0, other / ((b.wall_s - a.wall_s) * (os.cpu_count() or 1)))


def wait_ready(server: Server, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with code {proc.returncode} before it was ready")
        try:
            health = httpx.get(f"{server.base_url}/health", timeout=2.0)
            if health.status_code in (200, 404):
                models = httpx.get(f"{server.base_url}/v1/models", timeout=2.0)
                if models.status_code == 200 and models.json().get("data"):
                    return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{server.name} not ready after {timeout_s:.0f}s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop the server we started (its own process group, created by us) and wait for it."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


async def single_stream(cfg: BenchConfig, repeats: int) -> list[dict[str, Any]]:
    runs = []
    for i in range(repeats):
        runs.append(
            await run_benchmark(replace(cfg, num_prompts=1, max_concurrency=1, seed=cfg.seed + 101 * i))
        )
    return runs


async def measure(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    base = BenchConfig(
        base_url=server.base_url,
        input_len=args.input_len,
        output_len=args.output_len,
        prompt_mode=server.prompt_mode,
        ban_eos_ids=list(server.ban_eos_ids),
        warmup=1,
        seed=args.seed,
    )
    result: dict[str, Any] = {"serving": {}}
    for c in args.concurrency:
        n = max(args.min_prompts, args.prompts_per_slot * c)
        cfg = replace(base, num_prompts=n, max_concurrency=c, seed=args.seed + 1000 * c)
        summary = await run_benchmark(cfg)
        print(format_table(summary, f"{server.name} concurrency {c}"), flush=True)
        result["serving"][str(c)] = summary

    dec_cfg = replace(base, input_len=16, output_len=args.decode_len, seed=args.seed + 7)
    dec = await single_stream(dec_cfg, args.repeats)
    rates = [
        (r["total_output_tokens"] - 1) / ((r["e2e_ms"]["mean"] - r["ttft_ms"]["mean"]) / 1e3)
        for r in dec
        if r["completed"] and r["total_output_tokens"] > 1
    ]
    result["decode_tok_s"] = statistics.median(rates) if rates else float("nan")
    result["decode_runs"] = dec

    pre_cfg = replace(base, input_len=args.prefill_len, output_len=1, seed=args.seed + 13)
    pre = await single_stream(pre_cfg, args.repeats)
    rates = [r["total_input_tokens"] / (r["ttft_ms"]["mean"] / 1e3) for r in pre if r["completed"]]
    result["prefill_tok_s"] = statistics.median(rates) if rates else float("nan")
    result["prefill_runs"] = pre
    print(
        f"{server.name}: decode {result['decode_tok_s']:.1f} tok/s, prefill {result['prefill_tok_s']:.1f} tok/s"
    )
    return result


def run_server(server: Server, args: argparse.Namespace, log_path: Path) -> dict[str, Any]:
    print(f"starting {server.name}: {shlex.join(server.cmd)}  (log: {log_path})", flush=True)
    with log_path.open("wb") as log:
        env = {**os.environ, **(server.env or {})}
        proc = subprocess.Popen(
            server.cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            t0 = time.monotonic()
            wait_ready(server, proc, args.startup_timeout)
            startup_s = time.monotonic() - t0
            before = cpu_snapshot(proc.pid)
            result = asyncio.run(measure(server, args))
            result["startup_s"] = startup_s
            result["other_cpu_share"] = other_cpu_share(before, cpu_snapshot(proc.pid))
            if (result["other_cpu_share"] or 0.0) > 0.05:
                print(f"warning: other processes used {result['other_cpu_share']:.0%} of the CPU meanwhile")
        finally:
            stop(proc)
    result["cmd"] = server.cmd
    result["log"] = str(log_path)
    return result


def build_servers(args: argparse.Namespace, model: str) -> list[Server]:
    servers = []
    if not args.skip_paphos:
        port = free_port()
        cmd = [args.paphos_python, "-m", "paphos", "run", model, "--port", str(port), "--threads", str(args.threads)]
        servers.append(Server("paphos", cmd + shlex.split(args.paphos_args), port))
    if args.skip_peer:
        return servers
    port = free_port()
    slots = max(args.concurrency)
    if args.peer == "llama-server":
        ctx = slots * args.ctx_per_slot
        cmd = [
            args.llama_server_bin, "-m", model, "--host", "127.0.0.1", "--port", str(port),
            "-c", str(ctx), "-np", str(slots), "--kv-unified", "-t", str(args.threads),
            "-tb", str(args.threads), "--no-webui",
        ]  # fmt: skip
        servers.append(Server("llama-server", cmd + shlex.split(args.peer_args), port))
    else:
        cmd = [
            args.peer_python, "-m", "llama_cpp.server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", str(args.ctx_per_slot), "--n_threads", str(args.threads),
            "--n_threads_batch", str(args.threads), "--interrupt_requests", "False",
        ]  # fmt: skip
        servers.append(
            Server(
                "llama-cpp-python",
                cmd + shlex.split(args.peer_args),
                port,
                prompt_mode="words",
                ban_eos_ids=tuple(eos_ids_of(model)),
            )
        )
    return servers


def _share(result: dict[str, Any]) -> str:
    share = result.get("other_cpu_share")
    return "-" if share is None else f"{share:.0%}"


def comparison_table(results: dict[str, list[dict[str, Any]]], concurrency: list[int]) -> str:
    """One row per metric, one column per server: median over the rounds (lowest-highest). With
    two servers, the rates also get the first's over the second's within each round (the two ran
    minutes apart, so the machine's drift mostly cancels), median (lowest-highest) of the rounds."""
    names = list(results)

    def cell(values: list[Any], digits: int = 1) -> str:
        values = [v for v in values if v is not None and not (isinstance(v, float) and v != v)]
        if not values:
            return "-"
        if len(values) == 1:
            return f"{values[0]:.{digits}f}"
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

    # (label, per server its value in each round, whether the row is a rate)
    metrics: list[tuple[str, list[list[Any]], bool]] = []
    for c in concurrency:
        for label, get, rate in (
            ("output tok/s", lambda s: s["output_throughput"], True),
            ("req/s", lambda s: s["request_throughput"], True),
            ("mean TTFT ms", lambda s: s["ttft_ms"]["mean"], False),
            ("mean TPOT ms", lambda s: s["tpot_ms"]["mean"], False),
            ("p99 ITL ms", lambda s: s["itl_ms"]["p99"], False),
            ("mean E2E ms", lambda s: s["e2e_ms"]["mean"], False),
        ):
            metrics.append((f"c={c:<3d} {label}", [[get(r["serving"][str(c)]) for r in results[n]] for n in names], rate))
    for label, key, rate in (("single-stream decode tok/s", "decode_tok_s", True),
                             ("single-stream prefill tok/s", "prefill_tok_s", True), ("startup s", "startup_s", False)):  # fmt: skip
        metrics.append((label, [[r.get(key) for r in results[n]] for n in names], rate))
    rows = [(label, [cell(v) for v in values], rate, values) for label, values, rate in metrics]
    rows.append(("CPU used by other processes", [
        cell([100 * r["other_cpu_share"] for r in results[n] if r.get("other_cpu_share") is not None]) + " %"
        for n in names
    ], False, []))  # fmt: skip
    header = list(names)
    if len(names) == 2:
        header.append(f"{names[0]} / {names[1]}")
        rows = [
            (label, [*cells, cell([a / b for a, b in zip(*values, strict=False) if a and b], 2) + " x" if rate else "-"],
             rate, values)
            for label, cells, rate, values in rows
        ]  # fmt: skip
    width = max(len(r[0]) for r in rows) + 2
    col = max(24, *(len(n) + 2 for n in header))
    lines = [f"{'metric':<{width}}" + "".join(f"{n:>{col}}" for n in header)]
    lines.append("-" * (width + col * len(header)))
    lines += [f"{label:<{width}}" + "".join(f"{v:>{col}}" for v in cells) for label, cells, _, _ in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF path (default: the bundled default model)")
    ap.add_argument("--paphos-python", default=sys.executable, help="python that runs `-m paphos run`")
    ap.add_argument("--paphos-args", default="--max-model-len 2048", help="extra flags for `paphos run`")
    ap.add_argument("--peer", choices=("llama-server", "llama-cpp-python"), default=None)
    ap.add_argument("--llama-server-bin", default=DEFAULT_LLAMA_SERVER)
    ap.add_argument("--peer-python", default=DEFAULT_PEER_PYTHON, help="python with llama-cpp-python[server]")
    ap.add_argument("--peer-args", default="", help="extra flags for the peer server")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--ctx-per-slot", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    # 4 waves at 16 streams: with 2, one level lasted ~3.5 s and its figure moved by a quarter between rounds
    ap.add_argument("--prompts-per-slot", type=int, default=4, help="requests per level = this x concurrency")
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--decode-len", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3, help="single-stream requests per round")
    ap.add_argument("--rounds", type=int, default=3, help="start-measure-stop cycles of each server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--skip-paphos", action="store_true")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--log-dir", default="/tmp/paphos-compare-logs", help="server logs go here")
    ap.add_argument("--out", default=None, help="write all results as JSON here")
    args = ap.parse_args(argv)

    model = args.model or default_model()
    if not model:
        raise SystemExit("no --model given and paphos.default_model is not importable")
    if args.peer is None:
        args.peer = "llama-server" if Path(args.llama_server_bin).exists() else "llama-cpp-python"
    if args.ctx_per_slot < args.prefill_len + 8 or args.ctx_per_slot < args.input_len + args.output_len:
        raise SystemExit("--ctx-per-slot is too small for the prompt and output lengths")
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)

    results: dict[str, list[dict[str, Any]]] = {}
    servers = build_servers(args, model)
    for round_id in range(args.rounds):
        for server in servers if round_id % 2 == 0 else servers[::-1]:
            log_path = log_dir / f"{server.name}-{round_id}.log"
            try:
                results.setdefault(server.name, []).append(run_server(server, args, log_path))
            except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
                print(f"{server.name} failed: {exc} (see {log_path})", file=sys.stderr)
    if not results:
        return 1
    print()
    print(
        f"model {Path(model).name}, {args.input_len} prompt / {args.output_len} output tokens, {args.threads} threads, "
        f"median (lowest-highest) of {args.rounds} rounds"
    )
    print(comparison_table(results, args.concurrency))
    if args.out:
        payload = {"model": model, "args": vars(args), "results": results}
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(json_safe(payload), f, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
