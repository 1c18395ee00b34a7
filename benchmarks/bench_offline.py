"""Offline throughput of `paphos.LLM`: N unique prompts through one `generate` call.

Prompts are random token ids (unique per request, so no prefix-cache hits) of `--input-len` tokens;
every request produces exactly `--output-len` tokens (`ignore_eos=True`). Reported: elapsed time,
requests/s, output tok/s and total (prompt + output) tok/s, after one small warm-up call.

    python benchmarks/bench_offline.py --num-prompts 64 --input-len 128 --output-len 128 \\
        [--model PATH] [--dtype float32] [--engine-arg max_num_seqs=32 ...] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from typing import Any


def parse_engine_args(items: list[str]) -> dict[str, Any]:
    """`key=value` pairs for `LLM(...)`; values parsed as JSON when possible (ints, bools, null)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--engine-arg expects KEY=VALUE, got {item!r}")
        try:
            out[key.replace("-", "_")] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.replace("-", "_")] = raw
    return out


def make_prompts(n: int, input_len: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for k in range(n):
        head = [lo + k % (hi - lo)]
        prompts.append((head + [rng.randrange(lo, hi) for _ in range(input_len - 1)])[:input_len])
    return prompts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the bundled default GGUF)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--id-range", type=int, nargs=2, default=(1000, 40000), metavar=("LO", "HI"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--engine-arg", action="append", default=[], metavar="KEY=VALUE", help="extra LLM() kwarg"
    )
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)

    from paphos import LLM, SamplingParams

    engine_kwargs = {"dtype": args.dtype, "max_model_len": args.max_model_len}
    engine_kwargs.update(parse_engine_args(args.engine_arg))
    t_load = time.perf_counter()
    llm = LLM(model=args.model, **engine_kwargs)
    load_s = time.perf_counter() - t_load

    lo, hi = args.id_range
    warm = make_prompts(2, min(16, args.input_len), lo, hi, seed=args.seed + 1_000)
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))

    prompts = make_prompts(args.num_prompts, args.input_len, lo, hi, args.seed)
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True, seed=args.seed
    )
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start

    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(p) for p in prompts)
    result = {
        "model": args.model or "default",
        "engine_kwargs": engine_kwargs,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "temperature": args.temperature,
        "load_s": load_s,
        "elapsed_s": elapsed,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(outs) / elapsed,
        "output_throughput": out_tokens / elapsed,
        "total_token_throughput": (in_tokens + out_tokens) / elapsed,
        "short_outputs": sum(1 for o in outs if len(o.outputs[0].token_ids) != args.output_len),
        "host": {"python": platform.python_version(), "machine": platform.machine()},
    }
    rows = [
        ("Requests", f"{len(outs)}"),
        ("Input / output len", f"{args.input_len} / {args.output_len}"),
        ("Model load (s)", f"{load_s:.2f}"),
        ("Elapsed (s)", f"{elapsed:.2f}"),
        ("Total output tokens", f"{out_tokens}"),
        ("Request throughput (req/s)", f"{result['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{result['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{result['total_token_throughput']:.2f}"),
    ]
    width = max(len(r[0]) for r in rows) + 2
    print(f"{' Offline throughput (paphos.LLM) ':=^{width + 16}}")
    for name, value in rows:
        print(f"{name:<{width}}{value:>16}")
    print("=" * (width + 16))
    if result["short_outputs"]:
        print(f"warning: {result['short_outputs']} requests produced fewer than {args.output_len} tokens")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
