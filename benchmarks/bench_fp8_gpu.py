"""FP8 weights on the GPU: `fp8_linear` (per-token activation quantization + `torch._scaled_mm`)
checked against `reference_fp8_linear` and timed against bf16 F.linear on Llama-3-8B shapes.

    python benchmarks/bench_fp8_gpu.py --out $OUT/fp8_gpu.json

Sections (each one's failure is recorded and the rest go on; the JSON is rewritten after each):
  env        torch / triton / GPU, and which output dtypes row-wise `_scaled_mm` takes here
  ceilings   copy bandwidth (bytes read + written per second), the denominator of "frac BW"
  quantize   the Triton activation kernel bit for bit against the torch reference (dynamic and
             static, bf16 / fp16 / fp32 inputs, one-block, masked and two-pass rows)
  linear     fp8_linear against reference_fp8_linear (dynamic, static, bias, fp16 output, fast
             accumulation); max |error| / max |reference|; a CUDA-graph capture and replay;
             Fp8LinearMethod on CUDA (checkpoint shards with per-tensor scales, and `-q fp8`)
             choosing torch._scaled_mm
  sweep      K x N in {4096x6144 (qkv), 4096x4096 (o), 4096x28672 (gate_up), 14336x4096 (down)},
             M in {1, 16, 64, 256, 1024, 4096}: time per call replayed from a CUDA graph (no
             launch cost, as in the engine's decode graphs), cycling through enough weight copies
             that the weight comes from memory and not L2; TFLOP/s; GB/s of weight + x + y bytes
             and its fraction of copy bandwidth; error vs reference_fp8_linear. Columns: bf16
             F.linear, fp8_linear (quantize + GEMM), its GEMM alone, the quantize kernel alone,
             fp8_linear with use_fast_accum=True.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paphos.layers.linear import Linear, QKVLinear  # noqa: E402
from paphos.quant.fp8 import SCALED_MM, Fp8Config, Fp8LinearMethod  # noqa: E402
from paphos.quant.kernels import fp8 as k8  # noqa: E402

SHAPES = (("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096))  # (K, N)
MS = (1, 16, 64, 256, 1024, 4096)
L2_BYTES = 60 << 20  # H200
DEV = "cuda"


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def graph_seconds(calls: list[Callable[[], object]], min_calls: int = 32) -> float:
    """Seconds per call of `calls` (cycled) replayed from one CUDA graph: median of 5 replays."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    n = max(min_calls, 2 * len(calls))
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for i in range(n):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / n)
    return statistics.median(times)


def fp8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A realistic fp8 weight: a random bf16 one quantized per output channel (amax / 448)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    w = (torch.randn(n, k, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
    scale = (w.float().abs().amax(dim=1) / 448.0).clamp(min=k8.MIN_SCALE)
    return (w.float() / scale[:, None]).clamp(-448, 448).to(k8.FP8_DTYPE), scale


def x_like(m: int, k: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(m, k, device=DEV, generator=gen).to(dtype)


# ----------------------------------------------------------------------------- sections


def section_env(results: dict[str, Any]) -> dict[str, Any]:
    import triton

    props = torch.cuda.get_device_properties(0)
    probes = {
        str(dt): k8.scaled_mm_unsupported(torch.device(DEV), dt, 4096, 4096) or "ok"
        for dt in (torch.bfloat16, torch.float16, torch.float32)
    }
    return {"torch": torch.__version__, "triton": triton.__version__, "gpu": props.name,
            "capability": list(torch.cuda.get_device_capability()), "sms": props.multi_processor_count,
            "scaled_mm_out_dtypes": probes}  # fmt: skip


def section_ceilings(results: dict[str, Any]) -> dict[str, Any]:
    n = 2 << 30
    buf = torch.empty(2, n, dtype=torch.uint8, device=DEV)
    for _ in range(3):
        buf[1].copy_(buf[0])
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        buf[1].copy_(buf[0])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del buf
    torch.cuda.empty_cache()
    results["copy_bw"] = 2 * n / statistics.median(times)
    return {"copy_GBps": results["copy_bw"] / 1e9}


def section_quantize(results: dict[str, Any]) -> dict[str, Any]:
    mismatches = {}
    cases = 0
    for k in (100, 4096, 14336, 20000):
        for m in (1, 7, 256):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                x = x_like(m, k, k + m, dtype) * 3
                x[0, :4] = torch.tensor([0.0, -0.0, 1e-30, 448.0], device=DEV).to(dtype)
                for scale in (None, torch.tensor([0.004], device=DEV)):
                    q, s = k8.triton_quantize(x, scale)
                    want_q, want_s = k8.reference_quantize(x, scale)
                    cases += 1
                    bad = int((q.view(torch.uint8) != want_q.view(torch.uint8)).sum())
                    if bad or not torch.equal(s, want_s):
                        mismatches[f"K{k} M{m} {dtype} {'static' if scale is not None else 'dynamic'}"] = bad
    return {"cases": cases, "mismatches": mismatches, "pass": not mismatches}


def section_linear(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    k, n = 4096, 6144
    w, ws = fp8_weight(n, k, 1)
    bias = x_like(1, n, 3)[0]
    static = torch.tensor([0.01], device=DEV)
    for m in (1, 5, 16, 300):
        x = x_like(m, k, m)
        ref = k8.reference_fp8_linear(x, w, ws, None, torch.float32)
        ref_s = k8.reference_fp8_linear(x, w, ws, static, torch.float32)
        ref_b = k8.reference_fp8_linear(x, w, ws, None, torch.float32, bias)
        checks = {
            "dynamic": lambda x=x, ref=ref: rel_err(k8.fp8_linear(x, w, ws, None, torch.bfloat16), ref),
            "fast_accum": lambda x=x, ref=ref: rel_err(
                k8.fp8_linear(x, w, ws, None, torch.bfloat16, use_fast_accum=True), ref),
            "static": lambda x=x, ref=ref_s: rel_err(k8.fp8_linear(x, w, ws, static, torch.bfloat16), ref),
            "bias": lambda x=x, ref=ref_b: rel_err(k8.fp8_linear(x, w, ws, None, torch.bfloat16, bias), ref),
            "float16 out": lambda x=x, ref=ref: rel_err(
                k8.fp8_linear(x.half(), w, ws, None, torch.float16), ref),
            "float32 out": lambda x=x, ref=ref: rel_err(k8.fp8_linear(x.float(), w, ws, None, torch.float32), ref),
        }  # fmt: skip
        for name, check in checks.items():
            try:
                out[f"{name} M{m}"] = check()
            except Exception as e:  # noqa: BLE001 (recorded: which variants _scaled_mm takes is a result)
                out[f"{name} M{m}"] = f"error: {e}"
    # 3-D input
    x3 = x_like(6, k, 9).view(2, 3, k)
    y3 = k8.fp8_linear(x3, w, ws, None, torch.bfloat16)
    out["3d input"] = rel_err(
        y3.view(6, n), k8.reference_fp8_linear(x3.view(6, k), w, ws, None, torch.float32)
    )

    # CUDA graph: capture, then replay on new input data
    x_static = x_like(4, k, 11)
    y = k8.fp8_linear(x_static, w, ws, None, torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        y = k8.fp8_linear(x_static, w, ws, None, torch.bfloat16)
    x_static.copy_(x_like(4, k, 12))
    graph.replay()
    torch.cuda.synchronize()
    eager = k8.fp8_linear(x_static, w, ws, None, torch.bfloat16)
    out["cuda_graph_replay_equals_eager"] = bool(torch.equal(y, eager))

    # The linear method on CUDA: checkpoint shards with per-tensor scales, static and dynamic
    for activation in ("dynamic", "static"):
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
        x = x_like(33, 4096, 5)
        scale = layer.input_scale if activation == "static" else None
        ref = k8.reference_fp8_linear(x, layer.weight, layer.weight_scale, scale, torch.float32)
        out[f"Fp8LinearMethod qkv {activation}"] = {"kernel": layer.quant_method.kernel,
                                                    "rel_err": rel_err(layer(x), ref)}  # fmt: skip
    config = Fp8Config.runtime()
    with torch.device(DEV):
        layer = Linear(
            4096, 4096, params_dtype=torch.bfloat16, quant_method=config.get_linear_method("x.o_proj")
        )
    layer.weight.data.copy_(x_like(4096, 4096, 6) * 0.02)
    dense = layer.weight.data.float().clone()
    layer.quant_method.process_weights_after_loading(layer)
    x = x_like(17, 4096, 7)
    out["-q fp8 o_proj"] = {
        "kernel": layer.quant_method.kernel,
        "rel_err_vs_reference": rel_err(layer(x), k8.reference_fp8_linear(x, layer.weight, layer.weight_scale,
                                                                          None, torch.float32)),
        "rel_err_vs_dense_fp32": rel_err(layer(x), x.float() @ dense.t()),
        "weight_dtype": str(layer.weight.dtype),
        "summary": config.summary(),
    }  # fmt: skip
    errors = [v for key, v in out.items() if isinstance(v, float) and not key.startswith("fast_accum")]
    failed = [key for key, v in out.items() if isinstance(v, str) and not key.startswith("float")]
    methods = [v for v in out.values() if isinstance(v, dict)]
    out["max_rel_err"] = max(errors)
    out["pass"] = (
        out["max_rel_err"] < 1e-2
        and not failed
        and out["cuda_graph_replay_equals_eager"]
        and all(v["kernel"] == SCALED_MM for v in methods)
        and all(v.get("rel_err", v.get("rel_err_vs_reference", 1)) < 1e-2 for v in methods)
    )
    return out


def time_point(
    x: torch.Tensor, fp8_ws: list[tuple[torch.Tensor, torch.Tensor]], bf16_ws: list[torch.Tensor]
) -> dict[str, float]:
    """Seconds per call of each column of the sweep for input x (weights cycled over the copies)."""
    q, s = k8.quantize_per_token(x)
    return {
        "bf16": graph_seconds([lambda b=b: F.linear(x, b) for b in bf16_ws]),
        "fp8": graph_seconds([lambda a=a: k8.fp8_linear(x, a[0], a[1], None, torch.bfloat16) for a in fp8_ws]),
        "gemm_only": graph_seconds([lambda a=a: torch._scaled_mm(
            q, a[0].t(), scale_a=s, scale_b=a[1].view(1, -1), out_dtype=torch.bfloat16) for a in fp8_ws]),
        "quant_only": graph_seconds([lambda: k8.quantize_per_token(x)]),
        "fp8_fast_accum": graph_seconds([lambda a=a: k8.fp8_linear(
            x, a[0], a[1], None, torch.bfloat16, use_fast_accum=True) for a in fp8_ws]),
    }  # fmt: skip


def section_sweep(results: dict[str, Any]) -> dict[str, Any]:
    rows = []
    copy_bw = results.get("copy_bw", 4.3e12)
    for name, k, n in SHAPES:
        w, ws = fp8_weight(n, k, 0)
        w_bf16 = (w.float() * ws[:, None]).to(torch.bfloat16)
        copies = max(1, math.ceil(3 * L2_BYTES / w.numel()))
        fp8_ws = [(w, ws)] + [(w.clone(), ws.clone()) for _ in range(copies - 1)]
        copies16 = max(1, math.ceil(3 * L2_BYTES / (2 * w.numel())))
        bf16_ws = [w_bf16] + [w_bf16.clone() for _ in range(copies16 - 1)]
        for m in MS:
            x = x_like(m, k, m)
            ref = k8.reference_fp8_linear(x, w, ws, None, torch.float32)
            t = time_point(x, fp8_ws, bf16_ws)
            flops = 2 * m * n * k
            act = m * k * 2 + m * n * 2
            row = {
                "shape": name, "K": k, "N": n, "M": m,
                "us": {key: v * 1e6 for key, v in t.items()},
                "tflops_bf16": flops / t["bf16"] / 1e12, "tflops_fp8": flops / t["fp8"] / 1e12,
                "GBps_bf16": (2 * n * k + act) / t["bf16"] / 1e9, "GBps_fp8": (n * k + act) / t["fp8"] / 1e9,
                "speedup_fp8": t["bf16"] / t["fp8"],
                "speedup_fp8_fast_accum": t["bf16"] / t["fp8_fast_accum"],
                "err_fp8": rel_err(k8.fp8_linear(x, w, ws, None, torch.bfloat16), ref),
                "err_fp8_fast_accum": rel_err(k8.fp8_linear(x, w, ws, None, torch.bfloat16, use_fast_accum=True), ref),
                "err_bf16_vs_fp8_reference": rel_err(F.linear(x, w_bf16), ref),
            }  # fmt: skip
            row["frac_bw_bf16"] = row["GBps_bf16"] * 1e9 / copy_bw
            row["frac_bw_fp8"] = row["GBps_fp8"] * 1e9 / copy_bw
            rows.append(row)
            print_row(row)
        del fp8_ws, bf16_ws, w, ws, w_bf16
        torch.cuda.empty_cache()
    return {"rows": rows}


def print_row(r: dict[str, Any]) -> None:
    us = r["us"]
    print(f"{r['shape']:8s} {r['K']:6d}x{r['N']:<6d} M={r['M']:<5d} bf16 {us['bf16']:8.1f}us  fp8 {us['fp8']:8.1f}us "
          f"(gemm {us['gemm_only']:7.1f}, quant {us['quant_only']:5.1f}, fast {us['fp8_fast_accum']:7.1f})  "
          f"x{r['speedup_fp8']:.2f}  TFLOP/s {r['tflops_bf16']:6.1f}/{r['tflops_fp8']:6.1f}  "
          f"GB/s {r['GBps_bf16']:6.0f}/{r['GBps_fp8']:6.0f} ({r['frac_bw_bf16']:.2f}/{r['frac_bw_fp8']:.2f})  "
          f"err {r['err_fp8']:.1e} fast {r['err_fp8_fast_accum']:.1e}", flush=True)  # fmt: skip


SECTIONS = {"env": section_env, "ceilings": section_ceilings, "quantize": section_quantize,
            "linear": section_linear, "sweep": section_sweep}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fp8_gpu.json")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference stays fp32
    results: dict[str, Any] = {}
    for name in args.sections.split(","):
        try:
            results[name] = SECTIONS[name](results)
        except Exception:  # noqa: BLE001 (record it, run the other sections)
            results[name] = {"error": traceback.format_exc()}
        if name != "sweep":
            print(name, json.dumps(results[name], indent=1, default=str), flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
