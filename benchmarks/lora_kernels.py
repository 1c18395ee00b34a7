"""The batched multi-LoRA kernels (paphos/lora/kernels/triton_sgmv.py: shrink h = x A^T, expand
y += h B^T, per token its adapter slot) on the GPU against the torch reference, on Llama-3-8B
shapes; on the CPU (`--device cpu --small`) the reference alone on small shapes, as a smoke test.

    python3 benchmarks/lora_kernels.py [--out results/lora.json] [--sweep] [--projections qkv,o]
        [--ranks 16/16,64/64,64/16] [--tokens 1x1,16x4,512x1]
    python3 benchmarks/lora_kernels.py --device cpu --small

Projections (K -> output slices): q|k|v 4096 -> 4096/1024/1024, o 4096 -> 4096, gate|up 4096 ->
14336/14336, down 14336 -> 4096; bf16 x, A, B and y; 16 slots, each holding an adapter of rank
`rank` zero-padded to R (R/rank: 16/16, 64/64, and 64/16 to show the padded rank skipped).
Tokens x slots used: 1x1, 16x1, 16x4, 16x16, 64x1, 64x4, 64x16 (decode-like: the tokens in
batch order take the used slots in turn) and 512x1, 512x4 (a prefill chunk); the mapping's
capacity is the token count, as for a graph of that batch size.

Per case:
  - check: Triton shrink then expand against the reference on the same inputs: max |h - h_ref|
    (float32 sums of the same bf16 products: only the order differs) and max |y - y_ref| (one bf16
    rounding of float32 sums; expand multiplies in tf32); "ok" where h is within 1e-4 of max |h|
    and y within one bf16 unit in the last place of max |y|;
  - times (us per call; A and B cycled through copies larger than three times the L2 so every
    call reads its weights from memory, as a model's 32 layers do; x, h and y stay, as the base
    matmul has just touched them): shrink, expand and both replayed from one CUDA graph
    (timing.graph_time), both eagerly (CUDA events over many back-to-back calls after a
    warm-up, host launch cost included), and the torch reference eagerly;
  - the bytes the pair must move: A's and B's rows of the used slots' rank (not the padding),
    x, h written and read back (float32, the used rank), y read and written; their rate over the
    graph-replayed time, and that as a fraction of the copy bandwidth measured in the same run
    (the H200's is about 4.0 TB/s).
`--sweep` also times (graph-replayed) other shrink tiles / K splits and expand tiles on the
decode cases and reports the best against the default rule (`shrink_config`, `expand_config`):
about 20 launches per case, so narrow it (e.g. --ranks 64/64 --tokens 1x1,16x4,64x16).

`--with-base` also times, graph-replayed, each projection's base matmul (bf16 cuBLAS, x W^T)
alone, then with the adapters as the engine runs them (`LoRALinear.begin` / `finish`: the shrink
on a side stream beside the base matmul, then the expand) and with shrink, matmul and expand in
one stream: what LoRA adds to a layer is the difference.

Printed: one row per case, then per R/rank, tokens and slots the sum over a layer's four
projections (graph-replayed shrink + expand) and that times 32 layers. JSON (--out, default
$OUT/lora_kernels.json when OUT is set): every figure, rewritten after each case.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from timing import copy_bandwidth, graph_time  # noqa: E402

from paphos.lora.kernels import LoRAMapping, build_mapping, expand_ref, shrink_ref  # noqa: E402
from paphos.lora.layers import LoRABatch, LoRALinear  # noqa: E402

# name -> (K, output slice offsets)
PROJECTIONS = {
    "qkv": (4096, (0, 4096, 5120, 6144)), "o": (4096, (0, 4096)),
    "gate_up": (4096, (0, 14336, 28672)), "down": (14336, (0, 4096)),
}  # fmt: skip
SMALL_PROJECTIONS = {
    "qkv": (256, (0, 256, 320, 384)), "o": (256, (0, 256)), "gate_up": (256, (0, 512, 1024)), "down": (512, (0, 256)),
}  # fmt: skip
RANKS = ((16, 16), (64, 64), (64, 16))  # (padded R, the adapters' rank)
TOKENS = ((1, 1), (16, 1), (16, 4), (16, 16), (64, 1), (64, 4), (64, 16), (512, 1), (512, 4))  # (tokens, slots used)
SMALL_TOKENS = ((1, 1), (16, 4), (64, 16), (128, 4))
NUM_SLOTS = 16
LAYERS = 32
L2_BYTES = 60 << 20  # H200 (H100: 50 MiB)
MAX_COPY_BYTES = 8 << 30
DTYPE = torch.bfloat16


def eager_time(fns: list[Callable[[], object]], device: torch.device, min_calls: int = 50) -> float:
    """Seconds per call of `fns` cycled back to back: CUDA events around the calls after a warm-up
    (host launch cost included where it exceeds the kernels'), or on the CPU the median of each
    call's wall time (robust to other processes on a shared machine)."""
    calls = max(min_calls, len(fns))
    for i in range(min(calls, 2 * len(fns), 20)):
        fns[i % len(fns)]()
    if device.type != "cuda":
        times = []
        for i in range(calls):
            start = time.perf_counter()
            fns[i % len(fns)]()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(calls):
        fns[i % len(fns)]()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


class Case:
    """One projection's stacked slot weights (and copies of them), inputs and mapping."""

    def __init__(self, k: int, slices: tuple[int, ...], r: int, rank: int, tokens: int, used: int,
                 device: torch.device, copies: int) -> None:  # fmt: skip
        gen = torch.Generator(device=device).manual_seed(tokens * 131 + used * 7 + r + rank + k)
        self.k, self.slices, self.r, self.rank, self.tokens, self.used = k, slices, r, rank, tokens, used
        self.ns, o = len(slices) - 1, slices[-1]
        self.a, self.b = [], []
        for _ in range(copies):
            a = torch.randn(NUM_SLOTS, self.ns, r, k, generator=gen, device=device) / k**0.5
            a[:, :, rank:] = 0
            b = torch.randn(NUM_SLOTS, o, r, generator=gen, device=device) / rank**0.5
            b[:, :, rank:] = 0
            self.a.append(a.reshape(NUM_SLOTS, self.ns * r, k).to(DTYPE))
            self.b.append(b.to(DTYPE))
        self.x = torch.randn(tokens, k, generator=gen, device=device).to(DTYPE)
        self.y0 = torch.randn(tokens, o, generator=gen, device=device).to(DTYPE)
        self.y = self.y0.clone()
        self.h = torch.zeros(tokens, self.ns * r, dtype=torch.float32, device=device)
        host = build_mapping(np.arange(tokens) % used, [rank] * NUM_SLOTS, NUM_SLOTS, tokens)
        self.mapping = LoRAMapping.from_host(host, device)

    def bytes_moved(self) -> int:
        """What the pair must read and write: the used slots' A and B over the rank, x, h (float32,
        written then read), y (read and written)."""
        e, o, rows = DTYPE.itemsize, self.slices[-1], self.ns * self.rank
        weights = self.used * (rows * self.k + o * self.rank) * e
        return weights + self.tokens * (self.k * e + 2 * rows * 4 + 2 * o * e)


def weight_copies(k: int, slices: tuple[int, ...], r: int, rank: int, used: int) -> int:
    """Copies of A and B so that cycling through them reads more than three L2s of weights."""
    ns, o = len(slices) - 1, slices[-1]
    read = used * (ns * rank * k + o * rank) * DTYPE.itemsize
    stored = NUM_SLOTS * (ns * r * k + o * r) * DTYPE.itemsize
    return max(1, min(256, math.ceil(3 * L2_BYTES / read), MAX_COPY_BYTES // stored))


def check(case: Case, ts: Any) -> dict[str, Any]:
    """Triton shrink + expand against the reference on copy 0."""
    h_ref = torch.zeros_like(case.h)
    shrink_ref(case.x, case.a[0], case.mapping, h_ref)
    y_ref = case.y0.clone()
    expand_ref(h_ref, case.b[0], case.slices, case.mapping, y_ref)
    h = torch.full_like(case.h, float("nan"))
    ts.lora_shrink(case.x, case.a[0], case.mapping, h, n_slices=case.ns)
    y = case.y0.clone()
    ts.lora_expand(h, case.b[0], case.slices, case.mapping, y)
    h_err = (h - h_ref).abs().max().item()
    y_err = (y.float() - y_ref.float()).abs().max().item()
    ok = h_err <= 1e-4 * h_ref.abs().max().item() and y_err <= 2**-7 * y_ref.float().abs().max().item()
    return {"h_max_abs_err": h_err, "y_max_abs_err": y_err, "ok": bool(ok)}


def sweep(case: Case, ts: Any) -> dict[str, Any]:
    """Graph-replayed times of other shrink and expand launches (decode cases)."""
    n, o = case.ns * case.r, case.slices[-1]
    default_s = ts.shrink_config(case.tokens, NUM_SLOTS, n, case.k)
    default_e = ts.expand_config(case.tokens, o, case.r)
    shrinks = {default_s} | {ts.ShrinkConfig(bn, bk, split) for bn in (16, 32) for bk in (64, 128)
                             for split in (1, 4, 16)}  # fmt: skip
    expands = {default_e} | {ts.ExpandConfig(bn, bk, 8 if bn == 128 else 4, col_blocks=cb) for bn in (32, 64, 128)
                             for bk in (16, 32) if case.r % bk == 0 for cb in (1, 2, 4)}  # fmt: skip
    out: dict[str, Any] = {"shrink": {}, "expand": {}}
    for cfg in sorted(shrinks, key=str):
        fns = [lambda a=a, cfg=cfg: ts.lora_shrink(case.x, a, case.mapping, case.h, n_slices=case.ns, cfg=cfg)
               for a in case.a]  # fmt: skip
        out["shrink"][str(cfg)] = graph_time(fns) * 1e6
    for cfg in sorted(expands, key=str):
        fns = [lambda b=b, cfg=cfg: ts.lora_expand(case.h, b, case.slices, case.mapping, case.y, cfg=cfg)
               for b in case.b]  # fmt: skip
        out["expand"][str(cfg)] = graph_time(fns) * 1e6
    for kind, default in (("shrink", default_s), ("expand", default_e)):
        best = min(out[kind], key=out[kind].get)
        out[f"{kind}_best"] = {"config": best, "us": out[kind][best], "default_us": out[kind][str(default)]}
    return out


def with_base(case: Case, ts: Any) -> dict[str, float]:
    """Graph-replayed us of the projection's base matmul alone, with LoRA as the engine applies
    it (shrink on the side stream) and with all three in one stream."""
    o = case.slices[-1]
    weight = torch.randn(o, case.k, device=case.x.device).to(DTYPE) / case.k**0.5
    batch = LoRABatch(NUM_SLOTS, case.x.device, use_triton=True)
    batch.set(np.arange(case.tokens) % case.used, [case.rank] * NUM_SLOTS)
    lora = LoRALinear(list(np.diff(case.slices)), case.k, case.r, batch, DTYPE)
    lora.a.copy_(case.a[0])
    lora.b.copy_(case.b[0])

    def engine() -> None:
        pending = lora.begin(case.x)
        lora.finish(pending, torch.nn.functional.linear(case.x, weight))

    def one_stream() -> None:
        y = torch.nn.functional.linear(case.x, weight)
        ts.lora_shrink(case.x, case.a[0], case.mapping, case.h, n_slices=case.ns)
        ts.lora_expand(case.h, case.b[0], case.slices, case.mapping, y)

    return {"base_us": graph_time([lambda: torch.nn.functional.linear(case.x, weight)]) * 1e6,
            "base_lora_us": graph_time([engine]) * 1e6,
            "base_lora_one_stream_us": graph_time([one_stream]) * 1e6}  # fmt: skip


def measure(name: str, r: int, rank: int, tokens: int, used: int, device: torch.device, small: bool,
            bw: float | None, ts: Any, do_sweep: bool, do_base: bool = False) -> dict[str, Any]:  # fmt: skip
    k, slices = (SMALL_PROJECTIONS if small else PROJECTIONS)[name]
    copies = weight_copies(k, slices, r, rank, used) if device.type == "cuda" else 1
    case = Case(k, slices, r, rank, tokens, used, device, copies)
    row: dict[str, Any] = {"projection": name, "R": r, "rank": rank, "tokens": tokens, "slots_used": used,
                           "num_slots": NUM_SLOTS, "weight_copies": copies, "bytes": case.bytes_moved()}  # fmt: skip

    def ref(i: int) -> None:
        shrink_ref(case.x, case.a[i], case.mapping, case.h)
        expand_ref(case.h, case.b[i], case.slices, case.mapping, case.y)

    row["ref_eager_us"] = eager_time([lambda i=i: ref(i) for i in range(copies)], device, 20) * 1e6
    if ts is None:
        return row
    n, o = case.ns * r, slices[-1]
    row["shrink_config"] = str(ts.shrink_config(tokens, NUM_SLOTS, n, k))
    row["expand_config"] = str(ts.expand_config(tokens, o, r))
    row |= check(case, ts)

    def shrink(i: int) -> None:
        ts.lora_shrink(case.x, case.a[i], case.mapping, case.h, n_slices=case.ns)

    def expand(i: int) -> None:
        ts.lora_expand(case.h, case.b[i], case.slices, case.mapping, case.y)

    def both(i: int) -> None:
        shrink(i)
        expand(i)

    row["shrink_us"] = graph_time([lambda i=i: shrink(i) for i in range(copies)]) * 1e6
    row["expand_us"] = graph_time([lambda i=i: expand(i) for i in range(copies)]) * 1e6
    row["graph_us"] = graph_time([lambda i=i: both(i) for i in range(copies)]) * 1e6
    row["eager_us"] = eager_time([lambda i=i: both(i) for i in range(copies)], device) * 1e6
    row["GBps"] = row["bytes"] / row["graph_us"] / 1e3
    row["frac_copy_bw"] = row["GBps"] * 1e9 / bw if bw else None
    if do_sweep and tokens <= 64:
        row["sweep"] = sweep(case, ts)
    if do_base:
        row |= with_base(case, ts)
    return row


def print_row(row: dict[str, Any]) -> None:
    head = (f"{row['projection']:8} {row['R']:>3}/{row['rank']:<3} {row['tokens']:>4} {row['slots_used']:>3} "
            f"{row['bytes'] / 1e6:8.2f}")  # fmt: skip
    if "graph_us" not in row:
        print(f"{head} {'':>8} {'':>8} {'':>8} {'':>8} {row['ref_eager_us']:8.1f}", flush=True)
        return
    frac = f"{row['frac_copy_bw']:6.1%}" if row["frac_copy_bw"] is not None else ""
    print(f"{head} {row['shrink_us']:8.1f} {row['expand_us']:8.1f} {row['graph_us']:8.1f} {row['eager_us']:8.1f} "
          f"{row['ref_eager_us']:8.1f} {row['GBps']:8.0f} {frac:>6} {row['h_max_abs_err']:8.1e} "
          f"{row['y_max_abs_err']:8.1e} {'ok' if row['ok'] else 'FAIL'}", flush=True)  # fmt: skip


def layer_sums(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per R/rank, tokens and slots used: the four projections summed (graph-replayed pair, or
    the reference where there is no Triton)."""
    key = "graph_us" if rows and "graph_us" in rows[0] else "ref_eager_us"
    sums: dict[str, dict[str, float]] = {}
    for row in rows:
        label = f"R{row['R']}/rank{row['rank']} T{row['tokens']} slots{row['slots_used']}"
        entry = sums.setdefault(label, {"us": 0.0, "projections": 0})
        entry["us"] += row[key]
        entry["projections"] += 1
        if "base_us" in row:  # what LoRA adds beside the base matmuls, as the engine runs it
            for what in ("base_lora_us", "base_lora_one_stream_us"):
                entry[f"added_{what}"] = entry.get(f"added_{what}", 0.0) + row[what] - row["base_us"]
    for entry in sums.values():
        entry[f"us_x{LAYERS}_layers"] = entry["us"] * LAYERS
    return sums


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--small", action="store_true", help="small shapes (the CPU smoke test)")
    default_out = os.path.join(os.environ["OUT"], "lora_kernels.json") if os.environ.get("OUT") else None
    parser.add_argument("--out", default=default_out)
    parser.add_argument("--sweep", action="store_true", help="also time other launch configurations (decode)")
    parser.add_argument("--with-base", action="store_true",
                        help="also time each projection's base matmul alone and with LoRA beside it")  # fmt: skip
    parser.add_argument("--projections", default=",".join(PROJECTIONS))
    parser.add_argument("--ranks", default=None, help="R/rank pairs, e.g. 16/16,64/16")
    parser.add_argument("--tokens", default=None, help="tokens x slots used, e.g. 1x1,64x16")
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --device cpu --small")
    ts = None
    if device.type == "cuda":
        from paphos.lora.kernels import triton_sgmv as ts

        if not ts.supports(device):
            sys.exit("the Triton LoRA kernels do not support this device")
    ranks = [tuple(int(v) for v in p.split("/")) for p in args.ranks.split(",")] if args.ranks else list(RANKS)
    if args.tokens:
        tokens = [tuple(int(v) for v in p.split("x")) for p in args.tokens.split(",")]
    else:
        tokens = list(SMALL_TOKENS if args.small else TOKENS)
    bw = copy_bandwidth() if device.type == "cuda" else None
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "small": args.small, "copy_GBps": bw / 1e9 if bw else None,
        "num_slots": NUM_SLOTS, "rows": [],
    }  # fmt: skip
    if ts is not None:
        import triton

        results["triton"] = triton.__version__
    print(f"device {results['device']}; copy bandwidth "
          f"{f'{bw / 1e9:.0f} GB/s' if bw else '-'} (H200 about 4000); {NUM_SLOTS} slots; us per call")  # fmt: skip
    print(f"{'proj':8} {'R/rank':>7} {'T':>4} {'used':>3} {'MB':>8} {'shrink':>8} {'expand':>8} {'graph':>8} "
          f"{'eager':>8} {'ref':>8} {'GB/s':>8} {'%copy':>6} {'h err':>8} {'y err':>8}")  # fmt: skip
    for name in args.projections.split(","):
        for r, rank in ranks:
            for t, used in tokens:
                row = measure(name, r, rank, t, used, device, args.small, bw, ts, args.sweep,
                              args.with_base and ts is not None)  # fmt: skip
                print_row(row)
                results["rows"].append(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                results["layer"] = layer_sums(results["rows"])
                if args.out:
                    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\nlayer = {' + '.join(args.projections.split(','))}, shrink + expand "
          f"({'graph-replayed' if ts else 'reference, eager'}); us, and x {LAYERS} layers")  # fmt: skip
    for label, entry in results["layer"].items():
        added = ""
        if "added_base_lora_us" in entry:
            added = (f"   added to the base matmuls: {entry['added_base_lora_us']:7.1f} (side stream), "
                     f"{entry['added_base_lora_one_stream_us']:7.1f} (one stream)")  # fmt: skip
        print(f"{label:36} {entry['us']:9.1f} {entry[f'us_x{LAYERS}_layers']:10.1f}{added}")
    if args.sweep:
        print("\nsweep (decode): best against the default rule, us")
        for row in results["rows"]:
            if "sweep" in row:
                sw = row["sweep"]
                print(f"{row['projection']:8} {row['R']:>3}/{row['rank']:<3} {row['tokens']:>4} {row['slots_used']:>3}  "
                      + "  ".join(f"{kind} {sw[f'{kind}_best']['default_us']:.1f} -> {sw[f'{kind}_best']['us']:.1f} "
                                  f"{sw[f'{kind}_best']['config']}" for kind in ("shrink", "expand")))  # fmt: skip
    failed = [r for r in results["rows"] if r.get("ok") is False]
    if failed:
        sys.exit(f"{len(failed)} cases outside the tolerance")


if __name__ == "__main__":
    main()
