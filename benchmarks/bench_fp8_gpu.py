"""FP8 weights on the GPU: `fp8_linear` (the CUDA-core GEMV at one token, the Triton small-M kernel
up to SMALL_M_MAX tokens, per-token quantization + `torch._scaled_mm` above) checked against
`reference_fp8_linear` and timed against bf16 F.linear on Llama-3-8B shapes.

    python3 benchmarks/bench_fp8_gpu.py --out $OUT/fp8.json [--sections linear,small,sweep]
        [--ms 1,2,4,8,16,32,64,256] [--workers 12]

Sections (each one's failure is recorded and the rest go on; the JSON is rewritten after each):
  env        torch / triton / GPU, and which output dtypes row-wise `_scaled_mm` takes here
  ceilings   copy bandwidth (bytes read + written per second), the denominator of "frac BW"
  quantize   the Triton activation kernel bit for bit against the torch reference (dynamic and
             static, bf16 / fp16 / fp32 inputs, one-block, masked and two-pass rows), rounding
             in the store's conversion (the GPU default) and with `to_e4m3` (the interpreter's)
  quantize_sweep  that kernel timed per token at K 4096 / 14336 and M in --ms, both roundings
  linear     fp8_linear against reference_fp8_linear at M = 1, 5, 16 (Triton) and 300
             (_scaled_mm): dynamic, static, bias, fp16 / fp32 output, fast accumulation, 3-D
             input; max |error| / max |reference|; CUDA-graph capture and replay;
             Fp8LinearMethod on CUDA (checkpoint shards with per-tensor scales, and `-q fp8`)
  small      every candidate `small_m_linear` configuration (below) against the reference on the
             q|k|v shape, bf16 output (acceptance 1e-2) and float32 output (the accumulation's
             own error, beside _scaled_mm's); an odd shape (N 1000, K 1040: masked rows and a K
             tail) with bias and static scales
  blocks     block-wise scales (128 x 128 weight blocks, activations per token and 128 values:
             DeepSeek-V3 / Qwen3-FP8 / FP8_BLOCK): `triton_quantize_groups` bit for bit against
             its torch reference, then per shape and M in --ms `fp8_blocks.fp8_block_linear` against the
             dequantized float32 emulation (error) and timed beside bf16 and the per-channel
             `fp8_linear` on the same shape (CUDA-graph replays, weights from memory); printed
             last, a decoder layer's four linears summed
  blocks_sweep  the block-wise launches per shape (128 x 128 blocks): at one token the GEMV's rows
             per program and warps, at 4 / 16 tokens and at 512 / 2048 (prefill) the small-M
             kernel's tiles (`BLOCK_CANDIDATES`) and, above SMALL_M_MAX, cuBLAS's block-scaled
             `_scaled_mm`, each checked against the emulation first
  kernels    per compiled `_small_m_kernel` variant: registers, spills, shared memory, and PTX
             instruction counts (16-byte loads, cp.async, fp8 conversions, wgmma or mma.sync)
  sweep      K x N in {4096x6144 (qkv), 4096x4096 (o), 4096x28672 (gate_up), 14336x4096 (down)},
             M in --ms: time per call replayed from a CUDA graph (no launch cost, as in the
             engine's decode graphs; programmatic dependent launch on, as there), cycling
             through enough weight copies that the weight comes from memory and not L2. Columns:
             bf16 F.linear, `scaled_mm` (triton_quantize + _scaled_mm), `fp8` (fp8_linear as
             dispatched), the candidate `small_m_linear` tiles at every M <= 64 and the
             `gemv_linear` launches (rows per program, warps) at M = 1. GB/s counts
             weight + x + y bytes; frac = / copy BW. Printed last: per M, a decoder layer's four
             linears summed.

Kernels are compiled first in parallel worker processes (Triton's disk cache): a cold cache
otherwise costs a minute or more of device time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from timing import copy_bandwidth, graph_time  # noqa: E402

from paphos.layers import pdl  # noqa: E402
from paphos.layers.linear import Linear, QKVLinear  # noqa: E402
from paphos.quant.fp8 import FP8_GEMM, Fp8Config, Fp8LinearMethod  # noqa: E402
from paphos.quant.kernels import fp8 as k8  # noqa: E402
from paphos.quant.kernels import fp8_blocks as kb  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
MS = (1, 2, 4, 8, 16, 32, 64, 256)
L2_BYTES = 60 << 20  # H200
DEV = "cuda"

CANDIDATES = {  # the default first
    "split": k8.SmallMConfig(),  # K split towards 2 programs per SM
    "old": k8.SmallMConfig(split_k=1),  # no split: before issue #18's split-K
    "pps1": k8.SmallMConfig(programs_per_sm=1),
    "pps4": k8.SmallMConfig(programs_per_sm=4),
    "k128": k8.SmallMConfig(64, 128),
    "k512s3": k8.SmallMConfig(64, 512, num_stages=3),
}


# the one-token GEMV's launches (rows per program, warps), the default first
GEMV_CANDIDATES = {f"gemv:r{c.rows_per_program}w{c.num_warps}": c for c in (
    k8.DEFAULT_GEMV, *(k8.GemvConfig(r, w) for w in (4, 8) for r in (1, 2, 4, 8)))}  # fmt: skip


def candidates(m: int) -> list[str]:
    """The `small_m_linear` configurations timed at M tokens (and the GEMV's at one)."""
    return (list(CANDIDATES) if m <= 64 else []) + (list(GEMV_CANDIDATES) if m == 1 else [])


def run(name: str, x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, scale: torch.Tensor | None = None,
        out: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """One call of a sweep column (other than bf16)."""
    if name == "fp8":
        return k8.fp8_linear(x, w, ws, scale, out, bias)
    if name == "scaled_mm":
        return k8.scaled_mm_linear(x, w, ws, scale, out, bias)
    if name in GEMV_CANDIDATES:
        return k8.gemv_linear(x, w, ws, scale, out, bias, GEMV_CANDIDATES[name])
    return k8.small_m_linear(x, w, ws, scale, out, bias, CANDIDATES[name])


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def fp8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A realistic fp8 weight: a random bf16 one quantized per output channel (amax / 448)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    w = (torch.randn(n, k, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
    scale = (w.float().abs().amax(dim=1) / 448.0).clamp(min=k8.MIN_SCALE)
    return (w.float() / scale[:, None]).clamp(-448, 448).to(k8.FP8_DTYPE), scale


def x_like(m: int, k: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(m, k, device=DEV, generator=gen).to(dtype)


# ----------------------------------------------------------------------------- correctness cases


def linear_cases() -> dict[str, Callable[[], Any]]:
    """fp8_linear as layers call it: name -> a check returning its rel. error (or a record)."""
    k, n = SHAPES["qkv"]
    w, ws = fp8_weight(n, k, 1)
    bias = x_like(1, n, 3)[0]
    static = torch.tensor([0.01], device=DEV)

    def err(m: int, dtype: torch.dtype = torch.bfloat16, scale: torch.Tensor | None = None,
            b: torch.Tensor | None = None, fast: bool = False) -> float:  # fmt: skip
        x = x_like(m, k, m, dtype)
        y = k8.fp8_linear(x, w, ws, scale, dtype, b, use_fast_accum=fast)
        return rel_err(y, k8.reference_fp8_linear(x, w, ws, scale, torch.float32, b))

    cases: dict[str, Callable[[], Any]] = {}
    for m in (1, 5, 16, 300):
        cases |= {
            f"dynamic M{m}": lambda m=m: err(m),
            f"fast_accum M{m}": lambda m=m: err(m, fast=True),
            f"static M{m}": lambda m=m: err(m, scale=static),
            f"bias M{m}": lambda m=m: err(m, b=bias),
            f"float16 out M{m}": lambda m=m: err(m, torch.float16),
            f"float32 out M{m}": lambda m=m: err(m, torch.float32),
        }

    def three_d() -> float:
        x3 = x_like(6, k, 9).view(2, 3, k)
        y3 = k8.fp8_linear(x3, w, ws, None, torch.bfloat16)
        return rel_err(y3.view(6, n), k8.reference_fp8_linear(x3.view(6, k), w, ws, None, torch.float32))

    def graph_replay() -> bool:
        """Captured, then replayed on new input data: equal to eager (M = 1 and 4: the Triton kernel)."""
        same = True
        for m in (1, 4):
            x_static = x_like(m, k, 11)
            k8.fp8_linear(x_static, w, ws, None, torch.bfloat16)
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                y = k8.fp8_linear(x_static, w, ws, None, torch.bfloat16)
            x_static.copy_(x_like(m, k, 12))
            graph.replay()
            torch.cuda.synchronize()
            same &= bool(torch.equal(y, k8.fp8_linear(x_static, w, ws, None, torch.bfloat16)))
        return same

    cases["3d input"] = three_d
    cases["cuda_graph_replay_equals_eager"] = graph_replay
    for activation in ("dynamic", "static"):
        cases[f"Fp8LinearMethod qkv {activation}"] = lambda a=activation: method_qkv(a)
    cases["-q fp8 o_proj"] = method_runtime
    return cases


def method_qkv(activation: str) -> dict[str, Any]:
    """The linear method on CUDA: checkpoint shards with per-tensor scales, static or dynamic."""
    with torch.device(DEV):
        layer = QKVLinear(
            4096, 128, 32, 8, params_dtype=torch.bfloat16, quant_method=Fp8LinearMethod(activation)
        )
    for i, (shard, rows) in enumerate((("q", 4096), ("k", 1024), ("v", 1024))):
        wq, _ = fp8_weight(rows, 4096, 20 + i)
        layer.weight.weight_loader(layer.weight, wq, shard)
        layer.weight_scale.weight_loader(layer.weight_scale, torch.tensor(0.001 * (i + 1)), shard)
        if activation == "static":
            layer.input_scale.weight_loader(layer.input_scale, torch.tensor([0.01 + 0.002 * i]), shard)
    layer.quant_method.process_weights_after_loading(layer)
    scale = layer.input_scale if activation == "static" else None
    errs = {}
    for m in (1, 33):
        x = x_like(m, 4096, 5)
        ref = k8.reference_fp8_linear(x, layer.weight, layer.weight_scale, scale, torch.float32)
        errs[f"M{m}"] = rel_err(layer(x), ref)
    return {"kernel": layer.quant_method.kernel, "rel_err": max(errs.values()), "per_m": errs}


def method_runtime() -> dict[str, Any]:
    config = Fp8Config.runtime()
    with torch.device(DEV):
        layer = Linear(
            4096, 4096, params_dtype=torch.bfloat16, quant_method=config.get_linear_method("x.o_proj")
        )
    layer.weight.data.copy_(x_like(4096, 4096, 6) * 0.02)
    dense = layer.weight.data.float().clone()
    layer.quant_method.process_weights_after_loading(layer)
    x = x_like(17, 4096, 7)
    return {
        "kernel": layer.quant_method.kernel,
        "rel_err": rel_err(layer(x), k8.reference_fp8_linear(x, layer.weight, layer.weight_scale, None,
                                                             torch.float32)),
        "rel_err_vs_dense_fp32": rel_err(layer(x), x.float() @ dense.t()),
        "weight_dtype": str(layer.weight.dtype),
        "summary": config.summary(),
    }  # fmt: skip


def small_cases() -> dict[str, Callable[[], Any]]:
    """Every candidate configuration (the GEMV's at M = 1), float32 output beside _scaled_mm's, the
    odd shape, and triton_quantize bit for bit at M = 1."""
    k, n = SHAPES["qkv"]
    w, ws = fp8_weight(n, k, 4)
    cases: dict[str, Callable[[], Any]] = {}
    for m in (1, 3, 16, 64):
        x = x_like(m, k, 40 + m)
        ref = k8.reference_fp8_linear(x, w, ws, None, torch.float32)
        for name in candidates(m):
            cases[f"{name} M{m}"] = lambda name=name, x=x, ref=ref: rel_err(run(name, x, w, ws), ref)
    # float32 output: the accumulation's own error, no bf16 rounding on top
    x16 = x_like(16, k, 51)
    ref16 = k8.reference_fp8_linear(x16, w, ws, None, torch.float32)
    for name in [*CANDIDATES, "scaled_mm"]:
        cases[f"f32out {name} M16"] = lambda name=name: rel_err(
            run(name, x16, w, ws, out=torch.float32), ref16
        )
    # odd shape: rows past N masked, K not a multiple of the blocks; bias, static and dynamic
    ko, no = 1040, 1000
    wo, wso = fp8_weight(no, ko, 5)
    bias = x_like(1, no, 6)[0]
    static = torch.tensor([0.005], device=DEV)
    for m in (1, 5, 40):
        for scale in (None, static):
            x = x_like(m, ko, 60 + m)
            ref = k8.reference_fp8_linear(x, wo, wso, scale, torch.float32, bias)
            label = f"odd {no}x{ko} M{m} {'static' if scale is not None else 'dynamic'} bias"
            cases[label] = lambda x=x, scale=scale, ref=ref: rel_err(
                k8.small_m_linear(x, wo, wso, scale, torch.bfloat16, bias), ref
            )
            if m == 1:
                cases[f"{label} gemv"] = lambda x=x, scale=scale, ref=ref: rel_err(
                    k8.gemv_linear(x, wo, wso, scale, torch.bfloat16, bias), ref
                )

    def quantize_bitwise() -> bool:
        same = True
        for scale in (None, torch.tensor([0.004], device=DEV)):
            x = x_like(1, k, 70) * 3
            x[0, :4] = torch.tensor([0.0, -0.0, 1e-30, 448.0], device=DEV)
            q, s = k8.triton_quantize(x, scale)
            want_q, want_s = k8.reference_quantize(x, scale)
            same &= torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
        return bool(same)

    cases["triton_quantize == reference_quantize (bitwise)"] = quantize_bitwise
    return cases


def run_cases(cases: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, check in cases.items():
        try:
            out[name] = check()
        except Exception as e:  # noqa: BLE001 (recorded: which variants run here is a result)
            out[name] = f"error: {type(e).__name__}: {e}"[:400]
    return out


# ----------------------------------------------------------------------------- parallel compiles


def _warm_job(jobs: list[tuple[str, Any]]) -> list[str]:
    """In a worker process: run each job once so Triton's disk cache holds its kernels. A job is
    ("case", (section, name)) or ("call", (shape, m, column)). -> the failures."""
    errors = []
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    built: dict[str, dict[str, Callable[[], Any]]] = {}
    for kind, what in jobs:
        try:
            if kind == "case":
                section, name = what
                if section not in built:
                    built[section] = linear_cases() if section == "linear" else small_cases()
                built[section][name]()
            else:
                shape, m, column = what
                k, n = SHAPES[shape]
                if shape not in weights:
                    weights[shape] = fp8_weight(n, k, 0)
                run(column, x_like(m, k, m), *weights[shape])
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 (the section records it again)
            errors.append(f"{kind} {what}: {type(e).__name__}: {e}"[:300])
    return errors


def precompile(sections: list[str], ms: list[int], workers: int) -> dict[str, Any]:
    jobs: list[tuple[str, Any]] = []
    if "linear" in sections:
        jobs += [("case", ("linear", name)) for name in linear_cases()]
    if "small" in sections:
        jobs += [("case", ("small", name)) for name in small_cases()]
    if "sweep" in sections:
        for m in ms:
            for column in ["fp8", "scaled_mm", *candidates(m)]:
                jobs.append(("call", ("qkv", m, column)))
        jobs += [("call", ("down", m, "scaled_mm")) for m in (1, 2)]  # triton_quantize's K = 14336 block
    groups = [jobs[i::workers] for i in range(min(workers, len(jobs)))]
    if not groups:
        return {"seconds": 0.0, "jobs": 0, "errors": []}
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    with ProcessPoolExecutor(len(groups), mp_context=multiprocessing.get_context("spawn")) as pool:
        errors = [e for errs in pool.map(_warm_job, groups) for e in errs]
    return {"seconds": round(time.perf_counter() - t0, 1), "jobs": len(jobs), "errors": errors}


# ----------------------------------------------------------------------------- sections


def section_env(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import triton

    props = torch.cuda.get_device_properties(0)
    probes = {
        str(dt): k8.scaled_mm_unsupported(torch.device(DEV), dt, 4096, 4096) or "ok"
        for dt in (torch.bfloat16, torch.float16, torch.float32)
    }
    return {"torch": torch.__version__, "triton": triton.__version__, "gpu": props.name,
            "capability": list(torch.cuda.get_device_capability()), "sms": props.multi_processor_count,
            "scaled_mm_out_dtypes": probes, "pdl": pdl.ENABLED, "small_m_max": k8.SMALL_M_MAX,
            "default_small_m": str(k8.DEFAULT_SMALL_M)}  # fmt: skip


def section_ceilings(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    results["copy_bw"] = copy_bandwidth()
    return {"copy_GBps": results["copy_bw"] / 1e9}


def section_quantize(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    mismatches = {}
    cases = 0
    for k in (100, 4096, 14336, 20000):
        for m in (1, 7, 256):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                x = x_like(m, k, k + m, dtype) * 3
                x[0, :4] = torch.tensor([0.0, -0.0, 1e-30, 448.0], device=DEV).to(dtype)
                for scale in (None, torch.tensor([0.004], device=DEV)):
                    want_q, want_s = k8.reference_quantize(x, scale)
                    for hw_round in (True, False):
                        q, s = k8.triton_quantize(x, scale, hw_round)
                        cases += 1
                        bad = int((q.view(torch.uint8) != want_q.view(torch.uint8)).sum())
                        if bad or not torch.equal(s, want_s):
                            kind = "static" if scale is not None else "dynamic"
                            mismatches[f"K{k} M{m} {dtype} {kind} hw_round={hw_round}"] = bad
    return {"cases": cases, "mismatches": mismatches, "pass": not mismatches}


def section_quantize_sweep(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """`triton_quantize` per token at K = 4096 and 14336 and M in --ms, the rounding to e4m3 in the
    store's conversion (hw) against `to_e4m3` before it (sw): us per call (CUDA-graph replays
    over copies of x that do not fit L2), the fraction of copy bandwidth that x read + codes
    written make, and whether the codes equal the reference's."""
    rows = []
    copy_bw = results.get("copy_bw", 4.3e12)
    for k in (4096, 14336):
        for m in args.ms:
            xs = [x_like(m, k, m + i) for i in range(max(1, math.ceil(3 * L2_BYTES / (2 * m * k))))]
            want_q = k8.reference_quantize(xs[0])[0].view(torch.uint8)
            row: dict[str, Any] = {"K": k, "M": m}
            for name, hw in (("sw", False), ("hw", True)):
                row[f"{name}_equal"] = torch.equal(k8.triton_quantize(xs[0], None, hw)[0].view(torch.uint8), want_q)
                us = graph_time([lambda x=x, hw=hw: k8.triton_quantize(x, None, hw) for x in xs]) * 1e6
                row[f"{name}_us"] = us
                row[f"{name}_frac_bw"] = 3 * m * k / (us * 1e-6) / copy_bw
            print(f"quantize K {k:5d} M {m:5d}: sw {row['sw_us']:8.2f} us ({row['sw_frac_bw']:.2f} of copy BW), "
                  f"hw {row['hw_us']:8.2f} us ({row['hw_frac_bw']:.2f}), equal {row['sw_equal']} / {row['hw_equal']}",
                  flush=True)  # fmt: skip
            rows.append(row)
    return {"rows": rows, "pass": all(r["sw_equal"] and r["hw_equal"] for r in rows)}


def section_linear(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    out = run_cases(linear_cases())
    errors = [v for key, v in out.items() if isinstance(v, float) and not key.startswith("fast_accum")]
    failed = [key for key, v in out.items() if isinstance(v, str) and not key.startswith("float")]
    methods = [v for v in out.values() if isinstance(v, dict)]
    out["max_rel_err"] = max(errors)
    out["pass"] = (
        out["max_rel_err"] < 1e-2
        and not failed
        and out["cuda_graph_replay_equals_eager"] is True
        and all(v["kernel"] == FP8_GEMM and v["rel_err"] < 1e-2 for v in methods)
    )
    return out


def section_small(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    out = run_cases(small_cases())
    bf16 = [v for key, v in out.items() if isinstance(v, float) and not key.startswith("f32out")]
    out["max_rel_err_bf16_out"] = max(bf16)
    out["pass"] = (
        out["max_rel_err_bf16_out"] < 1e-2
        and not [
            key for key, v in out.items() if isinstance(v, str) and not key.startswith("f32out scaled_mm")
        ]
        and out["triton_quantize == reference_quantize (bitwise)"] is True
    )
    return out


def section_sweep(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    copy_bw = results.get("copy_bw", 4.3e12)
    for name, (k, n) in SHAPES.items():
        w, ws = fp8_weight(n, k, 0)
        w_bf16 = (w.float() * ws[:, None]).to(torch.bfloat16)
        w32 = w.float() * ws[:, None]
        copies = max(1, math.ceil(3 * L2_BYTES / w.numel()))
        fp8_ws = [(w, ws)] + [(w.clone(), ws.clone()) for _ in range(copies - 1)]
        copies16 = max(1, math.ceil(3 * L2_BYTES / (2 * w.numel())))
        bf16_ws = [w_bf16] + [w_bf16.clone() for _ in range(copies16 - 1)]
        for m in args.ms:
            x = x_like(m, k, m)
            ref = F.linear(k8.fake_quantize(x.float()), w32)
            us: dict[str, float] = {
                "bf16": graph_time([lambda b=b, x=x: F.linear(x, b) for b in bf16_ws]) * 1e6
            }
            err: dict[str, float | str] = {"bf16": rel_err(F.linear(x, w_bf16), ref)}
            columns = ["scaled_mm", *(["fp8"] if m <= k8.SMALL_M_MAX else []), *candidates(m)]
            for col in columns:
                try:
                    err[col] = rel_err(run(col, x, w, ws), ref)
                    us[col] = graph_time([lambda a=a, x=x, col=col: run(col, x, *a) for a in fp8_ws]) * 1e6
                except Exception as e:  # noqa: BLE001 (a configuration that fails is a result)
                    err[col] = f"error: {type(e).__name__}: {e}"[:300]
            act = m * k * 2 + m * n * 2
            gbps = {c: ((2 if c == "bf16" else 1) * n * k + act) / (t * 1e-6) / 1e9 for c, t in us.items()}
            timed = [c for c in us if c not in ("bf16", "scaled_mm", "fp8")]
            best = min(timed, key=us.__getitem__) if timed else None
            row = {
                "shape": name, "K": k, "N": n, "M": m, "us": us, "rel_err": err, "GBps": gbps,
                "frac_bw": {c: v * 1e9 / copy_bw for c, v in gbps.items()}, "best": best,
                "tflops_fp8": 2 * m * n * k / (us.get("fp8", us["scaled_mm"]) * 1e-6) / 1e12,
            }  # fmt: skip
            rows.append(row)
            print_row(row)
        results["sweep"] = {"rows": rows, "partial": True}  # kept if the run is cut short
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
        del fp8_ws, bf16_ws, w, ws, w_bf16, w32
        torch.cuda.empty_cache()
    return {"rows": rows, "layer": layer_sums(rows)}


def section_blocks(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    block = 128
    x = x_like(5, 4096 + 44, 1)
    q, s = kb.triton_quantize_groups(x, block)
    want_q, want_s = k8.reference_quantize_groups(x, block)
    exact = bool(torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s))
    rows = []
    copy_bw = results.get("copy_bw", 4.3e12)
    for name, (k, n) in SHAPES.items():
        gen = torch.Generator(device=DEV).manual_seed(0)
        w = torch.randn(n, k, device=DEV, generator=gen) * 0.02
        scales = F.pad(w, (0, -k % block, 0, -n % block)).view(-(-n // block), block, -(-k // block), block)
        scales = scales.abs().amax(dim=(1, 3)) / 448.0
        spread = scales.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
        wq = (w / spread).clamp(-448, 448).to(k8.FP8_DTYPE)
        w32 = wq.float() * spread
        w_bf16 = w32.to(torch.bfloat16)
        pc, pcs = fp8_weight(n, k, 0)
        copies = max(1, math.ceil(3 * L2_BYTES / wq.numel()))
        why_not = kb.cublas_blocks_unsupported(torch.device(DEV), torch.bfloat16, block, block, n, k)
        blocks = [kb.BlockScales(scales, block, block, why_not is None)] + [
            kb.BlockScales(scales.clone(), block, block, why_not is None) for _ in range(copies - 1)]  # fmt: skip
        fp8_ws = [(wq, pc, pcs)] + [(wq.clone(), pc.clone(), pcs.clone()) for _ in range(copies - 1)]
        bf16_ws = [w_bf16] + [w_bf16.clone() for _ in range(max(1, math.ceil(3 * L2_BYTES / (2 * wq.numel()))) - 1)]
        for m in args.ms:
            xm = x_like(m, k, m)
            ref = F.linear(k8.fake_quantize(xm.float(), group=block), w32)
            got = kb.fp8_block_linear(xm, wq, blocks[0], torch.bfloat16)
            us = {
                "bf16": graph_time([lambda b=b, xm=xm: F.linear(xm, b) for b in bf16_ws]) * 1e6,
                "fp8_channel": graph_time([lambda a=a, xm=xm: k8.fp8_linear(xm, a[1], a[2], None, torch.bfloat16)
                                           for a in fp8_ws]) * 1e6,  # fmt: skip
                "fp8_blocks": graph_time([lambda a=a, b=b, xm=xm: kb.fp8_block_linear(xm, a[0], b, torch.bfloat16)
                                          for a, b in zip(fp8_ws, blocks, strict=True)]) * 1e6,  # fmt: skip
            }
            gbps = {c: ((2 if c == "bf16" else 1) * n * k + m * k * 2 + m * n * 2) / (t * 1e-6) / 1e9
                    for c, t in us.items()}  # fmt: skip
            row = {"shape": name, "K": k, "N": n, "M": m, "us": us, "rel_err": rel_err(got, ref), "no_cublas": why_not,
                   "frac_bw": {c: v * 1e9 / copy_bw for c, v in gbps.items()}}  # fmt: skip
            rows.append(row)
            print(f"{name:8s} M={m:<4d} bf16 {us['bf16']:7.1f}  fp8 per-channel {us['fp8_channel']:7.1f}  "
                  f"fp8 blocks {us['fp8_blocks']:7.1f} us (x{us['bf16'] / us['fp8_blocks']:.2f} bf16, "
                  f"{row['frac_bw']['fp8_blocks']:.2f} of copy BW)  err {row['rel_err']:.1e}", flush=True)  # fmt: skip
        del blocks, fp8_ws, bf16_ws
        torch.cuda.empty_cache()
    layer = {}
    for m in args.ms:
        sums = {c: sum(r["us"][c] for r in rows if r["M"] == m) for c in ("bf16", "fp8_channel", "fp8_blocks")}
        layer[f"M{m}"] = sums
        print(f"layer M={m:<4d} bf16 {sums['bf16']:7.1f}  fp8 per-channel {sums['fp8_channel']:7.1f} "
              f"(x{sums['bf16'] / sums['fp8_channel']:.2f})  fp8 blocks {sums['fp8_blocks']:7.1f} "
              f"(x{sums['bf16'] / sums['fp8_blocks']:.2f})", flush=True)  # fmt: skip
    return {"quantize_groups_bit_exact": exact, "rows": rows, "layer": layer}


BLOCK_CANDIDATES = {  # `fp8_block_linear`'s small-M launches tried (BK 128: a block's width)
    "n64k128w4s4": k8.SmallMConfig(64, 128),
    "n64k128w4s3": k8.SmallMConfig(64, 128, num_stages=3),
    "n64k64w4s4": k8.SmallMConfig(64, 64),
    "n128k128w8s3": k8.SmallMConfig(128, 128, num_warps=8, num_stages=3),
    "n128k128w4s3": k8.SmallMConfig(128, 128, num_warps=4, num_stages=3),
    "n64k128w4s4pps4": k8.SmallMConfig(64, 128, programs_per_sm=4),
    "n128k128w8s3m128": k8.SmallMConfig(128, 128, num_warps=8, num_stages=3, block_m=128),
    "n128k128w4s4m128": k8.SmallMConfig(128, 128, num_warps=4, num_stages=4, block_m=128),
    "n256k128w8s3m64": k8.SmallMConfig(256, 128, num_warps=8, num_stages=3),
}


def section_blocks_sweep(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    block = 128
    out: dict[str, Any] = {}
    for name, (k, n) in SHAPES.items():
        gen = torch.Generator(device=DEV).manual_seed(0)
        scales = torch.rand(-(-n // block), -(-k // block), device=DEV, generator=gen) * 1e-4 + 1e-5
        wq = (torch.randn(n, k, device=DEV, generator=gen) * 100).clamp(-448, 448).to(k8.FP8_DTYPE)
        spread = scales.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
        w32 = wq.float() * spread
        copies = max(1, math.ceil(3 * L2_BYTES / wq.numel()))
        ws = [(wq, kb.BlockScales(scales, block, block))] + [
            (wq.clone(), kb.BlockScales(scales.clone(), block, block)) for _ in range(copies - 1)]  # fmt: skip
        bf16 = [w32.to(torch.bfloat16)] + [w32.to(torch.bfloat16) for _ in range(max(1, copies // 2) - 1)]
        for m in (1, 4, 16, 512, 2048):
            xm = x_like(m, k, m)
            ref = F.linear(k8.fake_quantize(xm.float(), group=block), w32)
            row: dict[str, Any] = {"bf16": graph_time([lambda b=b, xm=xm: F.linear(xm, b) for b in bf16]) * 1e6}
            if m == 1:
                for label, gemv in GEMV_CANDIDATES.items():
                    try:
                        err = rel_err(kb.fp8_block_linear(xm, wq, ws[0][1], torch.bfloat16, gemv=gemv), ref)
                        calls = [lambda a=a, xm=xm, gemv=gemv: kb.fp8_block_linear(xm, a[0], a[1], torch.bfloat16,
                                                                                     gemv=gemv) for a in ws]  # fmt: skip
                        row[label] = (graph_time(calls) * 1e6, err)
                    except Exception as e:  # noqa: BLE001
                        row[label] = f"error: {type(e).__name__}: {e}"[:200]
            if m > k8.SMALL_M_MAX:
                cublas = [(a, dataclasses.replace(b, cublas=True)) for a, b in ws]
                try:
                    err = rel_err(kb.fp8_block_linear(xm, wq, cublas[0][1], torch.bfloat16), ref)
                    row["cublas"] = (graph_time([lambda a=a, xm=xm: kb.fp8_block_linear(xm, a[0], a[1], torch.bfloat16)
                                                 for a in cublas]) * 1e6, err)  # fmt: skip
                except Exception as e:  # noqa: BLE001
                    row["cublas"] = f"error: {type(e).__name__}: {e}"[:200]
            for label, cfg in BLOCK_CANDIDATES.items() if m > 1 else ():
                try:
                    err = rel_err(kb.fp8_block_linear(xm, wq, ws[0][1], torch.bfloat16, None, cfg), ref)
                    calls = [lambda a=a, xm=xm, cfg=cfg: kb.fp8_block_linear(xm, a[0], a[1], torch.bfloat16, None, cfg)
                             for a in ws]  # fmt: skip
                    row[label] = (graph_time(calls) * 1e6, err)
                except Exception as e:  # noqa: BLE001
                    row[label] = f"error: {type(e).__name__}: {e}"[:200]
            timed = {c: v[0] for c, v in row.items() if isinstance(v, tuple)}
            best = min(timed, key=timed.__getitem__) if timed else None
            out[f"{name} M={m}"] = row | {"best": best}
            print(f"{name:8s} M={m:<5d} bf16 {row['bf16']:7.1f} us  best {best} {timed.get(best, float('nan')):7.1f}  "
                  + " ".join(f"{c}={v[0]:.1f}" if isinstance(v, tuple) else f"{c}=ERR" for c, v in row.items()
                             if c != "bf16"), flush=True)  # fmt: skip
        del ws, bf16
        torch.cuda.empty_cache()
    return out


def print_row(r: dict[str, Any]) -> None:
    us, f = r["us"], r["frac_bw"]
    fp8 = us.get("fp8", us["scaled_mm"])
    line = (f"{r['shape']:8s} {r['K']:5d}x{r['N']:<5d} M={r['M']:<3d} bf16 {us['bf16']:7.1f}  "
            f"scaled_mm {us['scaled_mm']:7.1f}  fp8 {fp8:7.1f} us  x{us['bf16'] / fp8:.2f} vs bf16 "
            f"(scaled_mm x{us['bf16'] / us['scaled_mm']:.2f})")  # fmt: skip
    if r["best"]:
        b = r["best"]
        line += f"  best {b} {us[b]:.1f} x{us['bf16'] / us[b]:.2f}"
    if r["M"] == 1:
        line += (f"  GB/s bf16 {r['GBps']['bf16']:.0f} ({f['bf16']:.2f}) fp8 {r['GBps'].get('fp8', 0):.0f} "
                 f"({f.get('fp8', 0):.2f}) scaled_mm {r['GBps']['scaled_mm']:.0f} ({f['scaled_mm']:.2f})")  # fmt: skip
    others = " ".join(f"{c}={t:.1f}" for c, t in us.items() if c not in ("bf16", "scaled_mm", "fp8"))
    errs = max(
        (e for c, e in r["rel_err"].items() if isinstance(e, float) and c != "bf16"), default=float("nan")
    )
    print(f"{line}\n    {others}  max err {errs:.1e} (bf16 weights: {r['rel_err']['bf16']:.1e})", flush=True)


def layer_sums(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per M, a decoder layer's four linears summed: bf16, scaled_mm, fp8 as dispatched, and each
    shape's best candidate."""
    out = {}
    for m in sorted({r["M"] for r in rows}):
        rs = [r for r in rows if r["M"] == m]
        bf16 = sum(r["us"]["bf16"] for r in rs)
        scaled = sum(r["us"]["scaled_mm"] for r in rs)
        fp8 = sum(r["us"].get("fp8", r["us"]["scaled_mm"]) for r in rs)
        best = sum(r["us"][r["best"]] if r["best"] else r["us"]["scaled_mm"] for r in rs)
        out[f"M{m}"] = {"bf16_us": bf16, "scaled_mm_us": scaled, "fp8_us": fp8, "best_us": best,
                        "fp8_x_bf16": bf16 / fp8, "scaled_mm_x_bf16": bf16 / scaled, "best_x_bf16": bf16 / best}  # fmt: skip
        print(f"layer M={m:<3d} bf16 {bf16:7.1f} us  scaled_mm {scaled:7.1f} (x{bf16 / scaled:.2f})  "
              f"fp8 {fp8:7.1f} (x{bf16 / fp8:.2f})  best-per-shape {best:7.1f} (x{bf16 / best:.2f})", flush=True)  # fmt: skip
    return out


PTX_MARKS = {
    "16-byte loads": "v4.b32",
    "cp.async": "cp.async",
    "fp8->fp16x2 cvt": "e4m3x2",
    "wgmma": "wgmma.mma_async",
    "mma.sync fp8": "f32.e4m3.e4m3.f32",
    "mma.sync fp16": "f32.f16.f16.f32",
}


def section_kernels(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Every `_small_m_kernel` variant this process compiled: registers, spills, shared memory and
    counts of the PTX instructions that say which path it took."""
    out = {}
    for fn in (k8._small_m_kernel,):
        for entry in fn.device_caches.values():
            for key, kern in entry[0].items():
                try:
                    kern._init_handles()
                    constants = getattr(getattr(kern, "src", None), "constants", None)
                    ptx = kern.asm.get("ptx", "")
                    out[f"{kern.name} {len(out)}"] = {
                        "constants": {str(k): str(v) for k, v in constants.items()} if constants else str(key)[-400:],
                        "num_warps": kern.metadata.num_warps, "num_stages": kern.metadata.num_stages,
                        "shared": kern.metadata.shared, "n_regs": getattr(kern, "n_regs", None),
                        "n_spills": getattr(kern, "n_spills", None),
                        "ptx": {name: ptx.count(mark) for name, mark in PTX_MARKS.items()},
                    }  # fmt: skip
                except Exception as e:  # noqa: BLE001 (introspection of triton internals: best effort)
                    out[f"{fn.__name__} {len(out)}"] = f"error: {type(e).__name__}: {e}"[:300]
    return out


SECTIONS = {"env": section_env, "ceilings": section_ceilings, "quantize": section_quantize,
            "quantize_sweep": section_quantize_sweep,
            "linear": section_linear, "small": section_small, "sweep": section_sweep,
            "blocks": section_blocks, "blocks_sweep": section_blocks_sweep, "kernels": section_kernels}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="fp8_gpu.json")
    parser.add_argument("--sections", default="env,ceilings,linear,small,kernels,sweep")
    parser.add_argument("--ms", default=",".join(map(str, MS)))
    parser.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    args = parser.parse_args()
    args.ms = [int(v) for v in args.ms.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference stays fp32
    start = time.perf_counter()
    sections = args.sections.split(",")
    results: dict[str, Any] = {}
    if args.workers > 0:
        results["precompile"] = precompile(sections, args.ms, args.workers)
        print("precompile", json.dumps(results["precompile"], indent=1), flush=True)
    for name in sections:
        t0 = time.perf_counter()
        try:
            results[name] = SECTIONS[name](results, args)
        except Exception:  # noqa: BLE001 (record it, run the other sections)
            results[name] = {"error": traceback.format_exc()}
        if name == "kernels" and "error" not in results[name]:
            for kname, rec in results[name].items():
                print(kname, json.dumps(rec, default=str), flush=True)
        elif name not in ("sweep", "blocks", "blocks_sweep", "quantize_sweep"):
            print(name, json.dumps(results[name], indent=1, default=str), flush=True)
        print(f"[{name}: {time.perf_counter() - t0:.1f} s]", flush=True)
        results["seconds"] = round(time.perf_counter() - start, 1)
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
