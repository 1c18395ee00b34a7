"""The integer-weight kernel family (paphos/quant/kernels/triton_int.py: W4A16 / W8A16 for GPTQ,
AWQ and compressed-tensors) on the GPU, in one process: every kernel path checked against the
torch reference (`int_layout.reference_matmul`) and timed on Llama-3-8B shapes, beside bf16
cuBLAS (`F.linear`) at the same number of tokens.

    python3 benchmarks/bench_int_gpu.py --out results/int.json [--budget-s 400] [--no-sweep]
        [--specs w4_g128,...] [--shapes qkv,...] [--ms 1,16,...] [--workers 16]

Specs: 4-bit groups of 128 symmetric, asymmetric and act-order (symmetric), 8-bit per-channel
(symmetric). Shapes (N x K): q|k|v 6144 x 4096, o 4096 x 4096, gate|up 28672 x 4096, down
4096 x 14336. Tokens M: 1 to 2048.

For each (spec, shape, M): `matmul` as the engine calls it (the default path), then, unless
--no-sweep, the other candidates: integer-dot GEMV launch configurations up to 16 tokens (at
M = 1 with the launch that quantizes x, and "fed": x's int8 parts already written by its
producer), the fused dequant x tl.dot kernel's tiles and K splits (from 16 tokens; packed 16-bit
or float32 dequantization), the int8 tensor-core GEMM (with its quantizing launch, and "i8_fed":
the block parts attached, as the norm / SiLU / attention merge kernels write them), and
dequantize + cuBLAS (from 64). Each candidate's output is checked first: max
|out - ref| / max |ref| against the float32 reference, acceptance < 1e-2 (bf16 weights and
output against exact float32). Times: CUDA-graph replays of back-to-back calls (as the engine's
decode steps replay them; programmatic dependent launch on), cycling through copies of the planes
larger than three times the L2 so every call reads its weights from memory; GB/s over the
planes' bytes (codes, scales, zeros, perm) and that over the copy bandwidth measured in the same
run. Kernels are compiled first in parallel worker processes (Triton's disk cache).

Printed last: per spec and M the summed time of a layer's four linears against bf16, the issue's
bars (4-bit batch 1 >= 2.2 x bf16, stretch 3 x; act-order >= 0.9 x of no act-order; 4-bit at
M = 16 >= 1.8 x bf16; large M within ~10 % of cuBLAS), and the best candidate per shape. The JSON
(--out) has every candidate's figures, rewritten after each spec.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from timing import copy_bandwidth, graph_time  # noqa: E402

from paphos.layers import pdl, x_int8  # noqa: E402
from paphos.quant.kernels import int_layout  # noqa: E402
from paphos.quant.kernels import triton_int as ti  # noqa: E402
from paphos.quant.kernels import triton_int_i8 as ti8  # noqa: E402
from paphos.quant.kernels.int_layout import IntSpec  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# name -> (bits, group size (None: per-channel), zero points, act-order)
SPECS = {
    "w4_g128": (4, 128, False, False), "w4_g128_asym": (4, 128, True, False),
    "w4_g128_act": (4, 128, False, True), "w8_channel": (8, None, False, False),
}  # fmt: skip
MS = (1, 2, 4, 8, 16, 32, 64, 128, 512, 2048)
L2_BYTES = 60 << 20  # H200 (H100: 50 MiB)
SMS = 132

# several tokens: (rows per program, warps)
MULTI_GEMV = [(2, 4), (4, 4), (2, 8), (4, 8), (8, 8)]
GEMV_CANDIDATES = [ti.GemvConfig(1, 4, 4), ti.GemvConfig(1, 8, 8), ti.GemvConfig(2, 4, 8), ti.GemvConfig(1, 4, 8),
                   ti.GemvConfig(1, 2, 4)]  # fmt: skip
# fused kernel tiles (BN, BK, warps, stages) at each token tile BM, and K-split targets (programs
# per SM; 0: no split); the tiles are swept at the token counts of --sweep-ms
GEMM_TILES = [(64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4),
              (64, 256, 4, 3)]  # fmt: skip
SPLIT_TARGETS = (1, 2, 4, 0)
SWEEP_MS = (4, 16, 64)
# int8 tensor-core kernel (triton_int_i8.py): (rows, warps, stages) per program, and programs per
# SM its K split aims at
I8_TILES = [(64, 4, 3), (64, 4, 2), (128, 4, 4), (128, 4, 2), (128, 8, 3), (256, 8, 3)]
I8_TARGETS = (1, 2, 4)


@dataclass(frozen=True)
class Candidate:
    """One way to compute a (spec, shape, M) product: `path` in matmul (what the engine calls),
    gemv, gemv_fed (x's parts given), gemm, i8, i8_fed (x's block parts given), dequant."""

    path: str
    gemv: ti.GemvConfig | None = None
    gemm: ti.GemmConfig | None = None
    i8: ti8.I8Config | None = None

    @property
    def label(self) -> str:
        if self.i8:
            c = self.i8
            return f"{self.path}:m{c.block_m}n{c.block_n}s{c.split_k}w{c.num_warps}st{c.num_stages}"
        if self.gemv:
            c = self.gemv
            return f"{self.path}:{c.block_n}/{c.num_warps}/{c.rows_per_program}"
        if self.gemm:
            c = self.gemm
            kind = ("" if c.bytes_unpack else "nib") + ("" if c.scale_after else "S") + ("" if c.packed_math else "f32")
            return f"{self.path}:m{c.block_m}n{c.block_n}k{c.block_k}s{c.split_k}w{c.num_warps}st{c.num_stages}{kind}"
        return self.path


def make_spec(name: str, shape: str) -> IntSpec:
    bits, group, zeros, perm = SPECS[name]
    n, k = SHAPES[shape]
    return IntSpec(bits, group or k, k, n, zeros, perm)


def make_planes(spec: IntSpec, seed: int) -> dict[str, torch.Tensor]:
    """Random codes, bf16 scales, integer zero points, a random perm: packed on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n, k, g = spec.out_features, spec.in_features, spec.groups
    codes = torch.randint(0, 1 << spec.bits, (n, k), generator=gen, device="cuda", dtype=torch.int32)
    scales = (torch.rand(n, g, generator=gen, device="cuda") + 0.5) * (0.02 if spec.bits == 4 else 0.002)
    zeros = torch.randint(0, 1 << spec.bits, (n, g), generator=gen, device="cuda").to(torch.bfloat16)
    perm = torch.randperm(k, generator=gen, device="cuda") if spec.has_perm else None
    return int_layout.pack(codes, scales.to(torch.bfloat16), zeros if spec.has_zeros else None, spec, perm)


def split_for(spec: IntSpec, m: int, bm: int, bn: int, bk: int, target: int) -> int:
    """K slices so the grid has about `target` programs per SM (each slice >= 2 steps of BK)."""
    tiles = math.ceil(spec.out_features / bn) * math.ceil(m / bm)
    n_iters = spec.in_features // ti.fit_block_k(bk, spec)
    split = 1
    while target and tiles * split < target * SMS and n_iters // (split * 2) >= 2:
        split *= 2
    return split


def old_gemm(spec: IntSpec, m: int) -> ti.GemmConfig:
    """The fused kernel as it was before the byte unpacking (`_nibbles`, scales before the dot),
    with its launch rule: the baseline of every comparison."""
    return dataclasses.replace(ti.gemm_config(spec, m), bytes_unpack=False, scale_after=False)


def candidates(spec: IntSpec, m: int, sweep: bool) -> list[Candidate]:
    out = [Candidate("matmul")]
    if not sweep:
        return out
    if m == 1:
        out += [Candidate("gemv", gemv=c) for c in GEMV_CANDIDATES]
        out += [Candidate("gemv_fed", gemv=c) for c in GEMV_CANDIDATES[:2]]
    elif m <= 16:
        out += [Candidate("gemv", gemv=ti.GemvConfig(bn, warps, bn)) for bn, warps in MULTI_GEMV]
    bm = min(128, max(16, 1 << (m - 1).bit_length()))
    if 2 < m <= 128:
        out.append(Candidate("gemm", gemm=old_gemm(spec, m)))
        out.append(Candidate("gemm", gemm=ti.gemm_config(spec, m)))
        if ti8.supports(spec):
            out.append(Candidate("i8", i8=ti8.i8_config(spec, m)))
            if not spec.has_perm:  # the GEMM alone, as where x's producer wrote its parts
                out.append(Candidate("i8_fed", i8=ti8.i8_config(spec, m)))
    if m in SWEEP_MS and m <= 128 and ti8.supports(spec):
        base = ti8.i8_config(spec, m)
        for (bn, warps, stages), target in itertools.product(I8_TILES, I8_TARGETS):
            cfg = dataclasses.replace(ti8.i8_config(spec, m, target, bn), num_warps=warps, num_stages=stages)
            if cfg != base and not any(c.i8 == cfg for c in out):
                out.append(Candidate("i8", i8=cfg))
        if m > 16:  # 16-token tiles over several token tiles (the later ones may find the weights in L2)
            for bn, target in itertools.product((64, 128), I8_TARGETS):
                cfg = dataclasses.replace(ti8.i8_config(spec, 16, target, bn), block_m=16)
                out.append(Candidate("i8", i8=cfg))
    if m in SWEEP_MS and m <= 128 and not ti8.supports(spec):  # the int8 kernel's layers: its sweep above
        for bn, bk, warps, stages in GEMM_TILES:
            if bm * bn > 64 * 128:  # the accumulator alone would fill the registers
                continue
            for target in SPLIT_TARGETS:
                split = split_for(spec, m, bm, bn, bk, target)
                cfg = ti.GemmConfig(bn, bm, bk, split, warps, stages)
                if target and split == 1 or any(c.gemm == cfg for c in out):
                    continue
                out.append(Candidate("gemm", gemm=cfg))
        if spec.bits == 4:  # bytes unpacked, but the scales applied before the dot
            out.append(Candidate("gemm", gemm=dataclasses.replace(ti.gemm_config(spec, m), scale_after=False)))
    if m >= 64:
        out.append(Candidate("dequant"))
    return out


def runner(
    c: Candidate, spec: IntSpec, planes: dict[str, torch.Tensor], x: torch.Tensor
) -> Callable[[], torch.Tensor]:
    """A closure computing the product through candidate `c`."""
    if c.path == "matmul":
        return lambda: ti.matmul(x, planes, spec)
    if c.path == "gemv":
        return lambda: ti.gemv(x, planes, spec, c.gemv)
    if c.path == "gemv_fed":
        xq = ti.quantize_x(x, planes, spec)
        return lambda: ti.gemv(x, planes, spec, c.gemv, xq)
    if c.path == "gemm":
        return lambda: ti.gemm(x, planes, spec, c.gemm)
    if c.path == "i8":
        return lambda: ti8.matmul(x, planes, spec, c.i8)
    if c.path == "i8_fed":
        fed = x_int8.attach(x.view(x.shape), ti8.x_layout(spec.bits), ti8.quantize_x(x, spec.bits))
        return lambda: ti8.matmul(fed, planes, spec, c.i8)
    if c.path == "dequant":
        return lambda: ti.dequant_matmul(x, planes, spec)
    raise ValueError(c.path)


def copies_of(planes: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Enough copies that cycling through them reads from memory, not L2."""
    count = max(1, math.ceil(3 * L2_BYTES / int_layout.planes_nbytes(planes)))
    return [planes] + [{k: v.clone() for k, v in planes.items()} for _ in range(count - 1)]


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


# ---------------------------------------------------------------------------- parallel compiles


def _compile_job(spec_name: str, jobs: list[tuple[str, int, Candidate]]) -> list[str]:
    """In a worker process: run each (shape, M, candidate) once on random data, so Triton's disk
    cache holds every kernel the timing loop launches. -> the failures."""
    errors, planes = [], {}
    for shape, m, c in jobs:
        try:
            spec = make_spec(spec_name, shape)
            if shape not in planes:
                planes[shape] = make_planes(spec, 0)
            x = torch.randn(m, spec.in_features, device="cuda").to(torch.bfloat16)
            runner(c, spec, planes[shape], x)()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 (reported; the timing loop records it per candidate)
            errors.append(f"{spec_name} {shape} M{m} {c.label}: {type(e).__name__}: {e}"[:300])
    return errors


def precompile(work: list[tuple[str, str, int, Candidate]], workers: int) -> dict[str, Any]:
    """Every candidate's kernels compiled in parallel processes, one per (spec, candidate with
    any K split: the split count is a launch argument, not a compile)."""
    groups: dict[tuple[str, object], list[tuple[str, int, Candidate]]] = {}
    for spec_name, shape, m, c in work:
        cfg = (dataclasses.replace(c.gemm, split_k=min(c.gemm.split_k, 2)) if c.gemm
               else dataclasses.replace(c.i8, split_k=min(c.i8.split_k, 2)) if c.i8 else c.gemv)  # fmt: skip
        groups.setdefault((spec_name, c.path, cfg), []).append((shape, m, c))
    t0 = time.perf_counter()
    with ProcessPoolExecutor(
        min(workers, len(groups)), mp_context=multiprocessing.get_context("spawn")
    ) as pool:
        errors = [
            e for errs in pool.map(_compile_job, [k[0] for k in groups], list(groups.values())) for e in errs
        ]
    return {"seconds": round(time.perf_counter() - t0, 1), "jobs": len(groups), "errors": errors}


# ---------------------------------------------------------------------------- measurements


def measure_shape(
    spec_name: str, shape: str, ms: list[int], sweep: bool, bw: float, deadline: float
) -> dict[str, Any]:
    spec = make_spec(spec_name, shape)
    planes = make_planes(spec, 1)
    nbytes = int_layout.planes_nbytes(planes)
    copies = copies_of(planes)
    w_ref = int_layout.dequantize(planes, spec)
    w16 = w_ref.to(torch.bfloat16)
    w16s = [w16] + [w16.clone() for _ in range(math.ceil(3 * L2_BYTES / (w16.numel() * 2)) - 1)]
    out: dict[str, Any] = {
        "bytes": nbytes,
        "bytes_per_weight": nbytes / (spec.out_features * spec.in_features),
    }
    gen = torch.Generator(device="cuda").manual_seed(2)
    for m in ms:
        x = torch.randn(m, spec.in_features, device="cuda", generator=gen).to(torch.bfloat16)
        ref = x.float() @ w_ref.t()
        calls = 64 if m <= 128 else 12
        t16 = graph_time([lambda w=w, v=x: F.linear(v, w) for w in w16s], calls)
        row: dict[str, Any] = {"bf16_us": t16 * 1e6, "candidates": []}
        for c in candidates(spec, m, sweep and time.perf_counter() < deadline):
            rec: dict[str, Any] = {"label": c.label}
            try:
                got = runner(c, spec, planes, x)()
                torch.cuda.synchronize()
                rec["rel_err"] = _rel(got, ref)
                if not rec["rel_err"] < 1e-2:
                    rec["error"] = "wrong result"
                else:
                    t = graph_time([runner(c, spec, p, x) for p in copies], calls)
                    rec |= {"us": t * 1e6, "GBps": nbytes / t / 1e9, "frac_copy_bw": nbytes / t / bw,
                            "x_bf16": t16 / t}  # fmt: skip
            except Exception as e:  # noqa: BLE001 (a candidate that fails is recorded, the rest go on)
                rec["error"] = f"{type(e).__name__}: {e}"[:300]
            row["candidates"].append(rec)
        ok = [r for r in row["candidates"] if "us" in r]
        row["best"] = min(ok, key=lambda r: r["us"]) if ok else None
        row["default"] = row["candidates"][0]
        row["max_rel_err"] = max((r["rel_err"] for r in row["candidates"] if "rel_err" in r), default=None)
        out[f"M{m}"] = row
        b, d = row["best"], row["default"]
        print(f"{spec_name} {shape} M={m}: bf16 {t16 * 1e6:.1f} us; matmul {d.get('us', float('nan')):.1f} us; "
              f"best {b['label'] if b else '-'} {b['us'] if b else float('nan'):.1f} us "
              f"({b['frac_copy_bw'] if b else 0:.0%} copy BW); err {row['max_rel_err']}", flush=True)  # fmt: skip
    del copies, w_ref, w16, w16s
    torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------- report


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Per spec and M: the four linears summed (best candidate and `matmul`), against bf16."""
    summary: dict[str, Any] = {}
    for spec_name, shapes in results["specs"].items():
        per_m = {}
        for key in (f"M{m}" for m in MS):
            rows = [shapes.get(s, {}).get(key) for s in SHAPES]
            if any(r is None or r["best"] is None or "us" not in r["default"] for r in rows):
                continue
            bf16 = sum(r["bf16_us"] for r in rows)
            best = sum(r["best"]["us"] for r in rows)
            default = sum(r["default"]["us"] for r in rows)
            per_m[key] = {"bf16_us": bf16, "best_us": best, "matmul_us": default, "x_bf16_best": bf16 / best,
                          "x_bf16_matmul": bf16 / default,
                          "max_rel_err": max(r["max_rel_err"] for r in rows)}  # fmt: skip
        summary[spec_name] = per_m
    bars = {}
    w4, act = summary.get("w4_g128", {}), summary.get("w4_g128_act", {})
    if "M1" in w4:
        bars["w4 batch-1 x bf16 (>= 2.2, stretch 3)"] = w4["M1"]["x_bf16_best"]
    if "M16" in w4:
        bars["w4 M=16 x bf16 (>= 1.8)"] = w4["M16"]["x_bf16_best"]
    for key in ("M1", "M16"):
        if key in w4 and key in act:
            bars[f"act-order / plain at {key} (>= 0.9)"] = w4[key]["best_us"] / act[key]["best_us"]
    for key in ("M512", "M2048"):
        if key in w4:
            bars[f"w4 {key} time / bf16 (<= ~1.1)"] = 1 / w4[key]["x_bf16_best"]
    return {"layer": summary, "bars": bars}


def print_report(results: dict[str, Any]) -> None:
    print(f"\ncopy bandwidth {results['copy_GBps']:.0f} GB/s; compile {results.get('precompile')}")
    print("layer = qkv + o + gate_up + down; us summed; x = bf16 time / ours")
    print(f"{'spec':14} {'M':>5} {'bf16':>9} {'best':>9} {'x':>6} {'matmul':>9} {'x':>6} {'err':>8}")
    for spec_name, per_m in results["summary"]["layer"].items():
        for key, r in per_m.items():
            print(f"{spec_name:14} {key[1:]:>5} {r['bf16_us']:9.1f} {r['best_us']:9.1f} {r['x_bf16_best']:6.2f} "
                  f"{r['matmul_us']:9.1f} {r['x_bf16_matmul']:6.2f} {r['max_rel_err']:8.1e}")  # fmt: skip
    print("best per shape (us, % copy BW):")
    for spec_name, shapes in results["specs"].items():
        for shape, rows in shapes.items():
            cells = [f"{k[1:]}:{r['best']['label']}={r['best']['us']:.1f}/{r['best']['frac_copy_bw']:.0%}"
                     for k, r in rows.items() if k.startswith("M") and r["best"]]  # fmt: skip
            if "error" in rows:
                cells = [rows["error"]]
            print(f"  {spec_name} {shape}: " + " ".join(cells))
    for bar, value in results["summary"]["bars"].items():
        print(f"BAR {bar}: {value:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--specs", default=",".join(SPECS))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--ms", default=",".join(map(str, MS)))
    parser.add_argument("--no-sweep", action="store_true", help="time `matmul` alone (the default paths)")
    parser.add_argument("--sweep-ms", default=",".join(map(str, SWEEP_MS)), help="token counts of the tile sweep")
    parser.add_argument("--budget-s", type=float, default=400.0, help="after this, only `matmul` is timed")
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    args = parser.parse_args()
    start = time.perf_counter()
    deadline = start + args.budget_s
    specs, shapes = args.specs.split(","), args.shapes.split(",")
    ms = [int(v) for v in args.ms.split(",")]
    globals()["SWEEP_MS"] = tuple(int(v) for v in args.sweep_ms.split(","))
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": ti.triton.__version__,
        "pdl": pdl.ENABLED, "args": vars(args), "specs": {},
    }  # fmt: skip

    def save() -> None:
        results["summary"] = summarize(results)
        results["seconds"] = round(time.perf_counter() - start, 1)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))

    results["copy_GBps"] = copy_bandwidth() / 1e9
    work = [(s, sh, m, c) for s in specs for sh in shapes for m in ms
            for c in candidates(make_spec(s, sh), m, not args.no_sweep)]  # fmt: skip
    results["precompile"] = precompile(work, args.workers)
    print(f"precompiled: {results['precompile']}", flush=True)
    for spec_name in specs:
        results["specs"][spec_name] = {}
        for shape in shapes:
            try:
                results["specs"][spec_name][shape] = measure_shape(spec_name, shape, ms, not args.no_sweep,
                                                                   results["copy_GBps"] * 1e9, deadline)  # fmt: skip
            except Exception as e:  # noqa: BLE001 (one broken shape must not lose the others)
                traceback.print_exc()
                results["specs"][spec_name][shape] = {"error": f"{type(e).__name__}: {e}"[:300]}
            save()
    save()
    print_report(results)


if __name__ == "__main__":
    main()
