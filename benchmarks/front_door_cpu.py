"""The front door on the CPU: the same loads over HTTP (`paphos run`) and in-process (`paphos.LLM`).

Measures, with the bundled default model (or `--model`), in one run:
  single stream  decode tok/s of one greedy request (`ignore_eos`, `--output-len` tokens, a
                 32-token id prompt): 1 / TPOT over HTTP (TPOT = (E2E - TTFT) / (tokens - 1) from
                 the streamed chunks, bench_serving.py), (tokens - 1) / (last token - first
                 token) in-process (stamped per engine step)
  N streams      output tok/s of `--concurrency` such requests at once: all output tokens / wall
                 time of the batch, over HTTP (streaming) and offline (`LLM.generate` of the same
                 prompts)
The server and the in-process engine are both loaded for the whole run but never busy at the same
time (2 cores: neither measures the other's load). Each round measures both, alternating which
goes first; rounds report median and spread (max - min) / median, the machine drifts by +-20 %.
Acceptance (issue: the server delivers the engine's speed): single stream >= 0.9x, N streams >=
0.85x.

    .venv/bin/python benchmarks/front_door_cpu.py --rounds 5 --out front_door_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import BenchConfig, run_benchmark  # noqa: E402
from front_door_gpu import Server  # noqa: E402

from paphos import LLM, SamplingParams  # noqa: E402

PROMPT_LEN = 32
ID_RANGE = (1000, 40000)


def prompts(count: int, seed: int) -> list[list[int]]:
    base = ID_RANGE[0] + seed * 7919
    span = ID_RANGE[1] - ID_RANGE[0]
    return [[ID_RANGE[0] + (base + 31 * i + 97 * j) % span for j in range(PROMPT_LEN)] for i in range(count)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_run(base: str, count: int, output_len: int, seed: int) -> dict[str, Any]:
    cfg = BenchConfig(base_url=base, num_prompts=count, input_len=PROMPT_LEN, output_len=output_len,
                      max_concurrency=count, id_range=ID_RANGE, warmup=0, seed=seed)
    return asyncio.run(run_benchmark(cfg))


def http_single(base: str, output_len: int, seed: int) -> float:
    summary = http_run(base, 1, output_len, seed)
    return 1000.0 / summary["tpot_ms"]["median"]


def http_batch(base: str, count: int, output_len: int, seed: int) -> float:
    return http_run(base, count, output_len, seed)["output_throughput"]


def inproc_single(llm: LLM, output_len: int, seed: int) -> float:
    engine = llm.engine
    request_id = f"single-{seed}"
    engine.add_request(request_id, prompts(1, seed)[0], SamplingParams(temperature=0, max_tokens=output_len,
                                                                      ignore_eos=True))
    stamps: list[float] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.outputs and output.outputs[0].token_ids:
                stamps.append(time.perf_counter())
    return (output_len - 1) / (stamps[-1] - stamps[0])


def inproc_batch(llm: LLM, count: int, output_len: int, seed: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts(count, seed), params)
    elapsed = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def spread(values: list[float]) -> dict[str, float]:
    median = statistics.median(values)
    return {"median": median, "min": min(values), "max": max(values),
            "spread": (max(values) - min(values)) / median if median else 0.0, "all": values}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the bundled default model)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--server-arg", action="append", default=[], help="extra flag for paphos run (repeatable)")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)

    log = Path(tempfile.mkdtemp(prefix="front-door-cpu-")) / "server.log"
    port = args.port or free_port()
    server = Server([sys.executable, "-m", "paphos", "run", *([args.model] if args.model else []), "--port", str(port),
                     "--max-model-len", "2048", "--disable-log-requests", *args.server_arg], port, log)
    server.start()
    try:
        server.wait_ready(600)
        llm = LLM(args.model, max_model_len=2048)
        # Warm both sides once (first-call allocations, tokenizer caches) outside the figures.
        inproc_batch(llm, 2, 8, seed=0)
        http_batch(server.base_url, 2, 8, seed=0)
        figures: dict[str, list[float]] = {k: [] for k in ("http_single", "inproc_single", "http_batch",
                                                           "inproc_batch")}
        for r in range(args.rounds):
            seed = 1 + r
            sides = [("http", server.base_url), ("inproc", llm)]
            for side, target in sides if r % 2 == 0 else sides[::-1]:
                if side == "http":
                    figures["http_single"].append(http_single(target, args.output_len, seed))
                    figures["http_batch"].append(http_batch(target, args.concurrency, args.output_len, seed))
                else:
                    figures["inproc_single"].append(inproc_single(target, args.output_len, seed))
                    figures["inproc_batch"].append(inproc_batch(target, args.concurrency, args.output_len, seed))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in figures.items()),
                  flush=True)
    finally:
        server.stop()

    result: dict[str, Any] = {
        "model": args.model or "default", "output_len": args.output_len, "concurrency": args.concurrency,
        "rounds": args.rounds, "cpus": os.cpu_count(), **{k: spread(v) for k, v in figures.items()},
    }
    single = result["http_single"]["median"] / result["inproc_single"]["median"]
    batch = result["http_batch"]["median"] / result["inproc_batch"]["median"]
    result["acceptance"] = {"single_stream_ratio": single, "single_stream_pass": single >= 0.9,
                            "batch_ratio": batch, "batch_pass": batch >= 0.85}
    rows = [
        ("single-stream decode tok/s", "http_single", "inproc_single", single, ">= 0.9"),
        (f"{args.concurrency} streams output tok/s", "http_batch", "inproc_batch", batch, ">= 0.85"),
    ]
    print(f"\n{'metric':<30}{'HTTP':>16}{'in-process':>16}{'ratio':>8}  bar")
    for name, http_key, inproc_key, ratio, bar in rows:
        h, i = result[http_key], result[inproc_key]
        print(f"{name:<30}{h['median']:>9.1f} ±{h['spread']:>4.0%}{i['median']:>9.1f} ±{i['spread']:>4.0%}"
              f"{ratio:>8.2f}  {bar} {'yes' if ratio >= float(bar.split()[1]) else 'NO'}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
