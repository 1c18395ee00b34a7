"""Sampler time per step: batch x vocabulary x sampler mix, on CPU or CUDA.

Cases (issue 5): (a) greedy, (b) temperature + top-p + min-p, (c) every sampler of the chain on
every row (penalties, DRY and no-repeat-ngram over a `--history`-token history, all truncations,
dynatemp, smoothing, XTC, skew, bias and bans), (d) every row a different `sampler_priority`
(a seeded permutation of the 14 stages) with the (b) samplers plus top-k, top-a and XTC. The
baseline is a bare `argmax` of the same logits; (a) and (b) are also reported as overhead over it.

Reported per cell: `sampler_ms`, the Sampler call per step, and `build_ms`,
`SamplingMetadata.build` (host work done every step by the runner). On CUDA a timing is `--iters`
calls back to back between two CUDA events (launch overhead included, as in a serving loop),
divided by `--iters`; the median of `--repeats` such timings after `--warmup` calls (which also
compile the Triton kernels). On CPU, the median of `--repeats` single calls.

Before timing, every cell checks the fast sampler against the reference form
(`Sampler(fast=False)`: the whole chain on [R, V] with torch ops, one chain per group of rows) on
the same device, at `--check-steps` output positions (different draws): `token_mismatches` (row
draws whose token differs; float32 sums in another order may move a boundary token, so a rare 1 is
rounding, many is a bug) out of `checked_draws`, `max_logprob_diff`, and `reference_ms` (one call
of the reference form). Case (b) on CUDA also checks the fused kernel's top-p + min-p survivor set
against the torch ops, row by row (`tail_set_mismatch_rows`). `--no-check` skips all that.

    python benchmarks/bench_sampler.py --device cuda --quick --out sampler.json   # < 2 min on an H200
    python benchmarks/bench_sampler.py --device cuda --out sampler.json           # the full grid
    python benchmarks/bench_sampler.py --device cpu --batch 1 64 --vocab 49152 --repeats 3 --out cpu.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout, installed or not
from bench_gpu import kernel_profile, print_profile  # noqa: E402

from paphos.core.protocol import SamplingInputs  # noqa: E402
from paphos.sample import order as st  # noqa: E402
from paphos.sample.fast import dense_tail, tail_kernels  # noqa: E402
from paphos.sample.metadata import SamplingMetadata, sampler_row  # noqa: E402
from paphos.sample.ops.min_p import apply_min_p  # noqa: E402
from paphos.sample.ops.top_k_top_p import apply_top_k_top_p  # noqa: E402
from paphos.sample.sampler import NUM_DRAWS, Sampler  # noqa: E402
from paphos.sampling_params import SamplingParams  # noqa: E402

CASES = ("a", "b", "c", "d")
EVERY = dict(
    temperature=0.9, top_k=50, top_p=0.95, min_p=0.02, top_a=0.05, tfs=0.98, typical_p=0.97, eta_cutoff=2.0,
    epsilon_cutoff=2.0, nsigma=3.0, smoothing_factor=0.2, smoothing_curve=1.5, repetition_penalty=1.1,
    repetition_penalty_range=256, rep_pen_slope=0.7, frequency_penalty=0.1, presence_penalty=0.1,
    no_repeat_ngram_size=4, dry_multiplier=0.8, dry_allowed_length=2, xtc_probability=0.5, xtc_threshold=0.1,
    skew=0.1, dynatemp_min=0.5, dynatemp_max=1.2, min_tokens=1, custom_token_bans=[5, 6], logit_bias={7: 2.0},
)


EVERY_INPUTS = SamplingInputs(dry_breaker_ids=(10, 11, 12, 13))  # case (c)'s DRY sequence breakers


def case_params(case: str, batch: int) -> tuple[list[SamplingParams], list[SamplingInputs]]:
    """The case's params and sampling inputs, one of each per row."""
    inputs = [EVERY_INPUTS if case == "c" else SamplingInputs()] * batch
    if case == "a":
        return [SamplingParams(temperature=0) for _ in range(batch)], inputs
    if case == "b":
        return [SamplingParams(temperature=0.8, top_p=0.95, min_p=0.05) for _ in range(batch)], inputs
    if case == "c":
        return [SamplingParams(**EVERY) for _ in range(batch)], inputs
    rng = random.Random(0)
    params = []
    for _ in range(batch):
        order = list(range(14))
        rng.shuffle(order)
        params.append(SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05, top_a=0.05,
                                     xtc_probability=0.5, sampler_priority=order))
    return params, inputs


def timed(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int, iters: int) -> float:
    """Milliseconds per call (see the module docstring)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / iters)
    else:
        for _ in range(repeats):
            start_s = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start_s) * 1e3)
    return statistics.median(times)


def host_timed(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def check(sampler: Sampler, logits: torch.Tensor, metadata: SamplingMetadata, steps: int) -> dict:
    """The fast sampler against the reference form at `steps` output positions (module docstring)."""
    reference = Sampler(fast=False)
    positions = metadata.positions
    mismatches, logprob_diff = 0, 0.0
    for k in range(steps):
        metadata.positions = positions + k
        fast, ref = sampler(logits, metadata), reference(logits, metadata)
        mismatches += int((fast.sampled_token_ids != ref.sampled_token_ids).sum())
        logprob_diff = max(logprob_diff, float((fast.sampled_logprobs - ref.sampled_logprobs).abs().max()))
    metadata.positions = positions
    out = {"token_mismatches": mismatches, "checked_draws": steps * logits.shape[0],
           "max_logprob_diff": logprob_diff}
    if dense_tail.applicable(metadata, logits):
        out["tail_set_mismatch_rows"] = tail_set_mismatches(logits, metadata)
    return out


def tail_set_mismatches(logits: torch.Tensor, md: SamplingMetadata) -> int:
    """Rows whose survivors of the one-kernel (temperature, top-p, min-p) path differ from the ops'."""
    temp, top_p, min_p = md.col("temperature"), md.col("top_p"), md.col("min_p")
    tail = dense_tail.sample(logits, logits, md, NUM_DRAWS)
    xs = logits.float() / temp.unsqueeze(1)
    ref = xs.clone()
    if st.TOP_P in md.groups[0].stages:
        ref = apply_top_k_top_p(ref, None, top_p)
    ref = apply_min_p(ref, min_p)
    ids = torch.arange(xs.shape[1], device=xs.device)
    last_v, last_id = tail.last_value[:, None], tail.last_id[:, None]
    kept = (xs > last_v) | ((xs == last_v) & (ids <= last_id))
    kept &= (xs >= xs.amax(-1, keepdim=True) + torch.log(min_p)[:, None]) & torch.isfinite(xs)
    return int((kept != torch.isfinite(ref)).any(dim=-1).sum())


def tail_sweep(logits: torch.Tensor, md: SamplingMetadata, configs: list[tail_kernels.TailLaunch],
               device: torch.device, warmup: int, repeats: int, iters: int) -> dict[str, dict]:
    """The dense tail kernel alone at each launch shape (lanes per quarter chunk, warps, chunks in
    flight): ms per call, and whether its tokens are the default launch's."""
    want = dense_tail.sample(logits, logits, md, NUM_DRAWS).token
    out = {}
    for launch in configs:
        def call(launch: tail_kernels.TailLaunch = launch) -> tail_kernels.TailResult:
            return dense_tail.sample(logits, logits, md, NUM_DRAWS, launch=launch)

        out["x".join(map(str, launch))] = {"ms": timed(call, device, warmup, repeats, iters),
                                   "same_tokens": bool(torch.equal(call().token, want))}  # fmt: skip
    return out


def _compile_tail(launch: tail_kernels.TailLaunch, batch: int, vocab: int) -> None:
    """In a worker process: the dense tail kernel at one launch shape for case (b) at this batch,
    compiled into Triton's disk cache (rows 1 and rows > 1 compile apart)."""
    device = torch.device("cuda")
    logits = torch.randn(batch, vocab, device=device)
    params, inputs = case_params("b", batch)
    md = SamplingMetadata.build(params, list(range(batch)), [[] for _ in range(batch)], [0] * batch, 0, vocab, device,
                                sampling_inputs=inputs)  # fmt: skip
    dense_tail.sample(logits, logits, md, NUM_DRAWS, launch=launch)
    torch.cuda.synchronize()


def precompile_tail(configs: list[tail_kernels.TailLaunch], batches: list[int], vocabs: list[int]) -> float:
    """Compile every dense tail launch shape a sweep times (and the default ones) in parallel
    processes: one compile of the kernel takes tens of seconds. -> seconds spent."""
    start = time.perf_counter()
    jobs = {(launch, batch, vocab) for vocab in vocabs for batch in batches
            for launch in [*configs, tail_kernels.TAIL_LAUNCH_FEW, tail_kernels.TAIL_LAUNCH_MANY]}  # fmt: skip
    workers = min(len(jobs), os.cpu_count() or 1)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for done in [pool.submit(_compile_tail, *job) for job in jobs]:
            done.result()
    return time.perf_counter() - start


def run_cell(case: str, batch: int, vocab: int, history: int, device: torch.device, warmup: int,
             repeats: int, iters: int, check_steps: int, profile: bool = False,
             tail_configs: list[tail_kernels.TailLaunch] | None = None) -> dict:
    gen = torch.Generator().manual_seed(batch * 7 + vocab)
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(device)
    params, inputs = case_params(case, batch)
    rows = [sampler_row(p) for p in params]  # kept per request by the runner, not rebuilt each step
    rng = random.Random(1)
    tokens = [[rng.randrange(vocab) for _ in range(history)] for _ in range(batch)]
    num_prompt = [history // 2] * batch

    def build() -> SamplingMetadata:
        return SamplingMetadata.build(params, list(range(batch)), tokens, num_prompt, 0, vocab, device,
                                      sampler_rows=rows, sampling_inputs=inputs)

    metadata = build()
    sampler = Sampler()
    row: dict = {"case": case, "batch": batch, "vocab": vocab}
    with torch.inference_mode():
        sampler(logits, metadata)  # compiles the kernels this cell uses
        if check_steps:
            row.update(check(sampler, logits, metadata, check_steps))
            row["reference_ms"] = timed(lambda: Sampler(fast=False)(logits, metadata), device, 1, 1, 1)
        sampler_ms = timed(lambda: sampler(logits, metadata), device, warmup, repeats, iters)
        argmax_ms = timed(lambda: logits.argmax(dim=-1), device, warmup, repeats, iters)
        if profile:
            row["profile"] = kernel_profile(lambda: sampler(logits, metadata), iters)
        if tail_configs and dense_tail.applicable(metadata, logits):
            row["tail_configs"] = tail_sweep(logits, metadata, tail_configs, device, warmup, repeats, iters)
    build_ms = host_timed(build, repeats)
    row.update({"sampler_ms": sampler_ms, "build_ms": build_ms, "argmax_ms": argmax_ms,
                "over_argmax_ms": sampler_ms - argmax_ms, "groups": len(metadata.groups),
                "slot_applications": sum(len(s) for s in metadata.slots) if metadata.slots else None})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 128256, 262144])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--history", type=int, default=512, help="prompt + output tokens per row")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="timings per cell (median)")
    parser.add_argument("--iters", type=int, default=20, help="CUDA: calls per timing")
    parser.add_argument("--check-steps", type=int, default=4, help="output positions checked per cell")
    parser.add_argument("--quick", action="store_true", help="vocab 128256, batch 1 64 256, cases a-d only")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--profile", action="store_true",
                        help="CUDA: per cell, the kernels, GPU busy time and host ops of a call (torch.profiler)")
    parser.add_argument("--no-check", action="store_true", help="skip the fast-vs-reference check")
    parser.add_argument("--tail-configs", nargs="+", default=[], metavar="LANESxWARPSxDEPTH",
                        help="CUDA, case (b): also time the dense tail kernel alone at each launch shape "
                             "(lanes per quarter chunk, warps, chunks in flight), e.g. 512x16x4")
    args = parser.parse_args()
    if args.quick:
        args.vocab, args.batch, args.cases = [128256], [1, 64, 256], list(CASES)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    tail_configs = [tail_kernels.TailLaunch(*map(int, c.split("x"))) for c in args.tail_configs]
    if tail_configs and device.type == "cuda" and "b" in args.cases:
        print(f"compiled the dense tail launch shapes in {precompile_tail(tail_configs, args.batch, args.vocab):.0f} s")
    rows = []
    header = (f"{'case':>4} {'batch':>6} {'vocab':>7} {'sampler ms':>11} {'over argmax':>12} {'build ms':>9} "
              f"{'groups':>6} {'ref ms':>9} {'mismatch':>8} {'tail set':>8}")
    print(header)
    for vocab in args.vocab:
        for batch in args.batch:
            for case in args.cases:
                row = run_cell(case, batch, vocab, args.history, device, args.warmup, args.repeats,
                               args.iters, 0 if args.no_check else args.check_steps, args.profile,
                               tail_configs)
                rows.append(row)
                print(f"{case:>4} {batch:>6} {vocab:>7} {row['sampler_ms']:>11.3f} {row['over_argmax_ms']:>12.3f} "
                      f"{row['build_ms']:>9.3f} {row['groups']:>6} {row.get('reference_ms', float('nan')):>9.3f} "
                      f"{row.get('token_mismatches', '-'):>8} {row.get('tail_set_mismatch_rows', '-'):>8}", flush=True)
                if "profile" in row:
                    print_profile(f"  case {case} batch {batch}", row["profile"])
                for name, cfg in row.get("tail_configs", {}).items():
                    print(f"  dense tail {name:>7}: {cfg['ms']:.4f} ms  same tokens {cfg['same_tokens']}")
    if args.out:
        meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                "torch": torch.__version__, "threads": torch.get_num_threads(), "history": args.history,
                "warmup": args.warmup, "repeats": args.repeats, "iters": args.iters,
                "check_steps": 0 if args.no_check else args.check_steps}
        with open(args.out, "w") as f:
            mismatches = sum(r.get("token_mismatches", 0) for r in rows)
            set_mismatches = sum(r.get("tail_set_mismatch_rows", 0) for r in rows)
            json.dump({"meta": meta, "token_mismatches": mismatches, "tail_set_mismatch_rows": set_mismatches,
                       "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
