"""Tensor parallelism on the GPUs of one machine: the same Llama-3-8B-shaped model (dummy bf16
weights) at `-tp N` for each N, measured through the engine like bench_gpu.py measures `-tp 1`.

    python benchmarks/bench_tp_gpu.py --out results/tp.json [--tp 1,2,4]
        [--config benchmarks/configs/llama-3-8b.json]   # or configs/llama-3-70b.json with --tp 2,4,8

Per N (each in a fresh engine; the script is rank 0, the engine starts ranks 1..N-1 itself):
  decode_b1    one sequence, 128-token prompt, 128 generated: median step ms, tok/s, and GB/s per
               GPU (each GPU reads 1/N of the weights but the input embedding, and its KV heads)
  decode_b64   64 sequences of 128-token prompts, 128 generated: median step of the 64-row
               decode steps, tok/s
  ttft_4k      a lone 4096-token prompt: time to its first token (median of 4 after one warm-up)
  allreduce    share of rank 0's CUDA kernel time spent in NCCL kernels (the all-reduces after
               attention and MLP, the embedding's, the logits' gather) over a batch-1 and a
               64-row decode step and over the 4k prefill step; rank 0's NCCL kernels include
               waiting for the slowest rank
Then a table (N, tok/s at batch 1 and 64, speed-ups over N=1, TTFT, all-reduce shares) and the
JSON (rewritten after every N, so a failure keeps what finished). Decode steps replay CUDA graphs;
the decode lookahead is off with N > 1 (docs/tensor-parallel.md), so `-tp 1` is run both ways:
`tp1` as the engine runs it by default and `tp1_no_lookahead`, the like-for-like baseline.

Dummy weights differ between N (each rank draws its own shards), so the outputs are not compared
here; parity is tests/worker/test_tensor_parallel.py's.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))

from bench_gpu import engine_steps, random_prompts, write_synthetic_tokenizer  # noqa: E402

from paphos import LLM  # noqa: E402

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "llama-3-8b.json"


def nccl_share(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float | None:
    """NCCL kernels' share of rank 0's CUDA kernel time over these requests' steps (None when
    the profiler saw no kernel, e.g. a CUPTI that hides the kernels of graph replays)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine_steps(llm, prompts, max_tokens)
        torch.cuda.synchronize()
    total = nccl = 0.0
    for event in prof.key_averages():
        total += event.device_time_total
        if "nccl" in event.key.lower():
            nccl += event.device_time_total
    return nccl / total if total else None


class Run:
    """One engine at -tp N and its measurements."""

    def __init__(self, args: argparse.Namespace, tokenizer: Path, config: dict[str, Any], tp: int,
                 lookahead: bool | None) -> None:
        self.config = config
        self.tp = tp
        self.llm = LLM(
            args.config, load_format="dummy", tokenizer=str(tokenizer), dtype="bfloat16", max_model_len=8192,
            max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=args.gmu,
            tensor_parallel_size=tp, decode_lookahead=lookahead,
        )

    def weight_bytes_per_gpu(self) -> int:
        """Rank 0's weights but its embedding rows (a lookup reads a few rows, not the table);
        every rank holds as many."""
        model = self.llm.engine.runner.model
        embed = model.model.embed_tokens.weight
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        return total - (0 if model.tie_word_embeddings else embed.numel() * embed.element_size())

    def kv_bytes_per_token_per_gpu(self) -> int:
        return sum(c[0, :, 0].numel() * c.element_size() for c in self.llm.engine.runner.kv_caches)

    def decode(self, batch: int, seed: int) -> dict[str, Any]:
        vocab = self.config["vocab_size"]
        steps = engine_steps(self.llm, random_prompts(batch, 128, vocab, seed), 128)
        tpot = statistics.median(t for t, rows in steps[1:] if rows == batch)
        step_bytes = self.weight_bytes_per_gpu() + batch * (128 + 64) * self.kv_bytes_per_token_per_gpu()
        return {"step_ms": tpot * 1e3, "tok_s": batch / tpot, "GBps_per_gpu": step_bytes / tpot / 1e9}

    def ttft(self) -> dict[str, Any]:
        vocab = self.config["vocab_size"]
        times = [sum(t for t, _ in engine_steps(self.llm, random_prompts(1, 4096, vocab, 500 + s), 1))
                 for s in range(5)]  # fmt: skip
        return {"ttft_ms": statistics.median(times[1:]) * 1e3, "ttft_ms_all": [t * 1e3 for t in times]}

    def allreduce(self) -> dict[str, Any]:
        vocab = self.config["vocab_size"]
        return {
            "decode_b1": nccl_share(self.llm, random_prompts(1, 128, vocab, 7), 32),
            "decode_b64": nccl_share(self.llm, random_prompts(64, 128, vocab, 8), 16),
            "prefill_4k": nccl_share(self.llm, random_prompts(1, 4096, vocab, 9), 1),
        }

    def close(self) -> None:
        self.llm.close()
        del self.llm
        gc.collect()
        torch.cuda.empty_cache()


def measure(args: argparse.Namespace, tokenizer: Path, config: dict[str, Any], tp: int,
            lookahead: bool | None) -> dict[str, Any]:
    out: dict[str, Any] = {"tp": tp}
    started = time.perf_counter()
    run = Run(args, tokenizer, config, tp, lookahead)
    out["start_s"] = time.perf_counter() - started
    try:
        for name, fn in (("decode_b1", lambda: run.decode(1, 1)), ("decode_b64", lambda: run.decode(64, 2)),
                         ("ttft_4k", run.ttft), ("allreduce", run.allreduce)):
            try:
                out[name] = fn()
            except Exception as exc:  # noqa: BLE001 - recorded; the other measurements go on
                out[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    finally:
        run.close()
    return out


def print_table(results: dict[str, Any]) -> None:
    def get(row: dict[str, Any], *keys: str) -> Any:
        for key in keys:
            row = row.get(key) if isinstance(row, dict) else None  # type: ignore[assignment]
        return row

    base = results["runs"].get("tp1_no_lookahead") or results["runs"].get("tp1") or {}
    b1_base, b64_base = get(base, "decode_b1", "tok_s"), get(base, "decode_b64", "tok_s")
    print(f"\n=== bench_tp_gpu ({results['device']}, {results['config']}) ===")
    print(f"{'run':<18}{'b1 tok/s':>10}{'x':>6}{'GB/s/GPU':>10}{'b64 tok/s':>11}{'x':>6}{'TTFT 4k ms':>12}"
          f"{'AR b1':>8}{'AR b64':>8}{'AR 4k':>8}")

    def fmt(value: Any, spec: str) -> str:
        width = int(spec.split(".")[0])
        return format(value, spec) if isinstance(value, (int, float)) else "-".rjust(width)

    for name, row in results["runs"].items():
        b1, b64 = get(row, "decode_b1", "tok_s"), get(row, "decode_b64", "tok_s")
        print(f"{name:<18}{fmt(b1, '10.1f')}{fmt(b1 / b1_base if b1 and b1_base else None, '6.2f')}"
              f"{fmt(get(row, 'decode_b1', 'GBps_per_gpu'), '10.0f')}{fmt(b64, '11.1f')}"
              f"{fmt(b64 / b64_base if b64 and b64_base else None, '6.2f')}{fmt(get(row, 'ttft_4k', 'ttft_ms'), '12.1f')}"
              f"{fmt(get(row, 'allreduce', 'decode_b1'), '8.1%')}{fmt(get(row, 'allreduce', 'decode_b64'), '8.1%')}"
              f"{fmt(get(row, 'allreduce', 'prefill_4k'), '8.1%')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--tp", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4],
                        help="tensor-parallel sizes, comma-separated (default 1,2,4)")
    parser.add_argument("--gmu", type=float, default=0.9)
    args = parser.parse_args()
    available = torch.cuda.device_count()
    config = json.loads(Path(args.config).read_text())
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0), "gpus": available, "torch": torch.__version__,
        "config": Path(args.config).name, "runs": {},
    }
    tokenizer = Path(tempfile.mkdtemp(prefix="paphos-bench-tp-")) / "tokenizer"
    write_synthetic_tokenizer(tokenizer, config["vocab_size"], config["eos_token_id"])
    plan: list[tuple[str, int, bool | None]] = []
    for tp in args.tp:
        if tp == 1:
            plan += [("tp1", 1, None), ("tp1_no_lookahead", 1, False)]
        else:
            plan.append((f"tp{tp}", tp, None))
    for name, tp, lookahead in plan:
        if tp > available:
            results["runs"][name] = {"tp": tp, "skipped": f"{available} GPU(s) visible"}
            continue
        print(f"--- {name}", flush=True)
        try:
            results["runs"][name] = measure(args, tokenizer, config, tp, lookahead)
        except Exception as exc:  # noqa: BLE001 - recorded; the next N still runs
            results["runs"][name] = {"tp": tp, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    print_table(results)


if __name__ == "__main__":
    main()
