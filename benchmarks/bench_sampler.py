"""Sampler time per step: batch x vocabulary x sampler mix, on CPU or CUDA.

Cases (issue 5): (a) greedy, (b) temperature + top-p + min-p, (c) every sampler of the chain on
every row (penalties, DRY and no-repeat-ngram over a `--history`-token history, all truncations,
dynatemp, smoothing, XTC, skew, bias and bans), (d) every row a different `sampler_priority`
(a seeded permutation of the 14 stages) with the (b) samplers plus top-k, top-a and XTC. The
baseline is a bare `argmax` of the same logits; (a) and (b) are also reported as overhead over it.

Reported per cell: `sampler_ms`, the Sampler call (device time: synchronised before and after), and
`build_ms`, `SamplingMetadata.build` (host work done every step by the runner). Median of
`--repeats` after `--warmup` runs. Before timing, every cell checks the fast sampler against the
reference form (`Sampler(fast=False)`: the whole chain on [R, V] with torch ops) on the same device:
`token_mismatches` (rows whose sampled token differs; float32 sums in another order may move a
boundary token, so a rare 1 is rounding, many is a bug), `max_logprob_diff`, and `reference_ms`
(one call of the reference form). `--no-check` skips it.

    python benchmarks/bench_sampler.py --device cuda --out sampler.json
    python benchmarks/bench_sampler.py --device cpu --batch 1 64 --vocab 49152 --repeats 3 --out cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout, installed or not
from paphos.sample.metadata import SamplingMetadata  # noqa: E402
from paphos.sample.sampler import Sampler  # noqa: E402
from paphos.sampling_params import SamplingParams  # noqa: E402

CASES = ("a", "b", "c", "d")
EVERY = dict(
    temperature=0.9, top_k=50, top_p=0.95, min_p=0.02, top_a=0.05, tfs=0.98, typical_p=0.97, eta_cutoff=2.0,
    epsilon_cutoff=2.0, nsigma=3.0, smoothing_factor=0.2, smoothing_curve=1.5, repetition_penalty=1.1,
    repetition_penalty_range=256, rep_pen_slope=0.7, frequency_penalty=0.1, presence_penalty=0.1,
    no_repeat_ngram_size=4, dry_multiplier=0.8, dry_allowed_length=2, xtc_probability=0.5, xtc_threshold=0.1,
    skew=0.1, dynatemp_min=0.5, dynatemp_max=1.2, min_tokens=1, custom_token_bans=[5, 6], logit_bias={7: 2.0},
)


def case_params(case: str, batch: int) -> list[SamplingParams]:
    if case == "a":
        return [SamplingParams(temperature=0) for _ in range(batch)]
    if case == "b":
        return [SamplingParams(temperature=0.8, top_p=0.95, min_p=0.05) for _ in range(batch)]
    if case == "c":
        params = [SamplingParams(**EVERY) for _ in range(batch)]
        for p in params:
            p.dry_breaker_ids = [10, 11, 12, 13]
        return params
    rng = random.Random(0)
    params = []
    for _ in range(batch):
        order = list(range(14))
        rng.shuffle(order)
        params.append(SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05, top_a=0.05,
                                     xtc_probability=0.5, sampler_priority=order))
    return params


def timed(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run_cell(case: str, batch: int, vocab: int, history: int, device: torch.device, warmup: int,
             repeats: int, check: bool = True) -> dict:
    gen = torch.Generator().manual_seed(batch * 7 + vocab)
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(device)
    params = case_params(case, batch)
    rng = random.Random(1)
    tokens = [[rng.randrange(vocab) for _ in range(history)] for _ in range(batch)]
    num_prompt = [history // 2] * batch

    def build() -> SamplingMetadata:
        return SamplingMetadata.build(params, list(range(batch)), tokens, num_prompt, 0, vocab, device)

    metadata = build()
    sampler = Sampler()
    row: dict = {"case": case, "batch": batch, "vocab": vocab}
    with torch.inference_mode():
        if check:
            fast = sampler(logits, metadata)
            reference = Sampler(fast=False)
            ref_ms = timed(lambda: reference(logits, metadata), device, 0, 1)
            ref = reference(logits, metadata)
            row["token_mismatches"] = int((fast.sampled_token_ids != ref.sampled_token_ids).sum())
            row["max_logprob_diff"] = float((fast.sampled_logprobs - ref.sampled_logprobs).abs().max())
            row["reference_ms"] = ref_ms
        sampler_ms = timed(lambda: sampler(logits, metadata), device, warmup, repeats)
        argmax_ms = timed(lambda: logits.argmax(dim=-1), device, warmup, repeats)
    build_ms = timed(build, device, warmup, repeats)
    row.update({"sampler_ms": sampler_ms, "build_ms": build_ms, "argmax_ms": argmax_ms,
                "over_argmax_ms": sampler_ms - argmax_ms, "groups": len(metadata.groups)})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 128256, 262144])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--history", type=int, default=512, help="prompt + output tokens per row")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--no-check", action="store_true", help="skip the fast-vs-reference check")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    header = (f"{'case':>4} {'batch':>6} {'vocab':>7} {'sampler ms':>11} {'over argmax':>12} {'build ms':>9} "
              f"{'groups':>6} {'ref ms':>9} {'mismatch':>8}")
    print(header)
    for vocab in args.vocab:
        for batch in args.batch:
            for case in args.cases:
                row = run_cell(case, batch, vocab, args.history, device, args.warmup, args.repeats,
                               not args.no_check)
                rows.append(row)
                print(f"{case:>4} {batch:>6} {vocab:>7} {row['sampler_ms']:>11.3f} {row['over_argmax_ms']:>12.3f} "
                      f"{row['build_ms']:>9.3f} {row['groups']:>6} {row.get('reference_ms', float('nan')):>9.3f} "
                      f"{row.get('token_mismatches', '-'):>8}", flush=True)
    if args.out:
        meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                "torch": torch.__version__, "threads": torch.get_num_threads(), "history": args.history,
                "warmup": args.warmup, "repeats": args.repeats}
        with open(args.out, "w") as f:
            mismatches = sum(r.get("token_mismatches", 0) for r in rows)
            json.dump({"meta": meta, "token_mismatches": mismatches, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
