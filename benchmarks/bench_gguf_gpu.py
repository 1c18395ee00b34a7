"""GGUF on the GPU in one process: the Triton GGUF kernels checked and tuned on Llama-3-8B shapes,
then the engine on a random Llama-3-8B-shaped Q4_K_M-style file and a Q8_0 file against bf16 dummy
weights of the same shape, against llama.cpp: its `llama-batched-bench` on the same files in the
same run (section llamacpp), or else the H200 figures of an earlier lease (issues 7 and 18).

    PYTHONPATH=<carried wheels> python benchmarks/bench_gguf_gpu.py --out results/gguf_gpu.json \\
        [--sections ceilings,kernels,sweep,crossover,q4_k_m,q8_0,bf16,llamacpp] [--q4km F.gguf] [--q8 F.gguf] \\
        [--llamacpp-bin /tmp/llbuild/bin/llama-batched-bench]

Sections (in this order; each one's failure is recorded and the rest go on; the JSON is rewritten
after every section so a timeout keeps what finished):
  ceilings   copy bandwidth (read + write bytes / s), the denominator of "fraction of copy BW"
  kernels    every Triton format on real shapes against the torch reference (dequantize in fp32,
             matmul in fp32): max relative error for M = 1, 16, 64 (fused) and 512 (dequantize +
             cuBLAS); acceptance < 1e-2
  gemv       the batch-1 GEMV (triton_gemv) per (type, shape): rows per program and warps swept,
             the best installed in GEMV_CONFIGS; GB/s of the planes read and fraction of copy
             BW, next to cuBLAS on the same shape in bf16 (2 bytes per weight); an integer-dot
             call includes its launch quantizing x
  i8         the int8 tensor-core kernel (triton_gguf_i8: Q4_K, Q5_K, Q8_0) per shape at --i8-ms tokens: its
             default launch and a sweep of tiles / warps / stages / K split targets (the best installed in triton_gguf_i8.TUNED_CONFIGS for the engine
             sections after it), beside the fused kernel and cuBLAS bf16 on the same shape
             (CUDA-graph replays cycling through copies larger than L2; times include x's
             quantizing launch); relative error against the float32 reference
  batched    batched decode as the engine dispatches it (the int8 GEMM for Q4_K / Q5_K / Q8_0, the fused
             kernel for the others) on every GEMV_SHAPES segment at --i8-ms tokens, beside cuBLAS
             bf16: run on two checkouts on one machine to compare kernel versions
  sweep      block sizes / split-K / warps / stages / token tiles of the fused kernel per (type,
             shape) at --sweep-ms tokens (16), the best one installed in TUNED_CONFIGS (the engine
             sections use them)
  crossover  fused kernel vs dequantize + cuBLAS at M = 16..256 on the gate_up shape; sets
             FUSED_MAX_TOKENS to the largest M where fused wins
  q4_k_m_no_pdl  the Q4_K_M engine's batch-1 decode with programmatic dependent launch off
  q4_k_m, q8_0, bf16   the engine (paphos.LLM, CUDA graphs): batch-1 decode tok/s (and GB/s of
             the weight bytes read per token, fraction of copy BW), batch-16 / 32 / 64 decode tok/s,
             pp512 tok/s, weight memory on the GPU (every parameter and buffer, embedding and head
             included, each also on its own) vs the file's tensor bytes, kernels chosen
  llamacpp   llama.cpp's `llama-batched-bench` (`--llamacpp-bin`, built with CUDA) on the same two
             files, after the engine sections have freed the GPU: `-ngl 99 -fa on -b 2048 -ub 512
             -npp 128 -ntg 128 -npl 1,16,64 -c 16384` (S_TG: decode tok/s at batch 1, 16, 64; S_PP)
             and `-npp 512 -ntg 128 -npl 1 -c 1024` (pp512); each command, its parsed table, its log's
             header lines (-lv 4: device, buffers, flash attention) and the llama.cpp commit are
             recorded. When it ran, the table's llama.cpp figures and ratios
             are these (same run); otherwise the hard-coded H200 ones.
The GGUF files are generated into a temp dir (scripts/make_random_gguf.py) unless given, with a
synthetic vocabulary so that llama.cpp loads them; Paphos ignores it and takes a synthetic
tokenizer passed as an override (as bench_gpu.py does for dummy weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(Path(__file__).parent))

from bench_gpu import (  # noqa: E402
    cuda_time,
    engine_steps,
    print_profile,
    profile_decode,
    profile_prefill,
    random_prompts,
    run_sections,
    write_synthetic_tokenizer,
)
from make_random_gguf import random_blocks as gguf_random_blocks  # noqa: E402
from make_random_gguf import write as write_gguf  # noqa: E402
from timing import graph_time  # noqa: E402

from paphos import LLM  # noqa: E402
from paphos.layers import pdl  # noqa: E402
from paphos.quant.gguf import launch, planes  # noqa: E402
from paphos.quant.gguf import triton_gguf as tg  # noqa: E402
from paphos.quant.gguf import triton_gguf_i8 as ti8  # noqa: E402
from paphos.quant.gguf.dequant import dequantize  # noqa: E402
from paphos.sampling_params import SamplingParams  # noqa: E402

SECTIONS = ("ceilings", "kernels", "q6_k_tile", "gemv", "i8", "batched", "sweep", "crossover", "q4_k_m", "q4_k_m_no_pdl",
            "q8_0", "bf16", "llamacpp")
DEFAULT_CONFIG = Path(__file__).parent / "configs" / "llama-3-8b.json"
# llama.cpp built with CUDA on an H200 of an earlier lease, random Llama-3-8B-shaped files (issue 7):
# tg128, pp512; batch-16 decode from `llama-batched-bench -npl 1,16,64` (issue 18). The fallback
# reference when section llamacpp did not run in the same process.
LLAMACPP_REFERENCE_DEVICE = "NVIDIA H200 (earlier lease)"
LLAMACPP = {"q4_k_m": {"tg128": 278, "pp512": 9500, "b16": 2057}, "q8_0": {"tg128": 255, "pp512": 11100, "b16": 1958},
            "bf16": {"tg128": 208, "pp512": None, "b16": None}}  # F16 for the float row  # fmt: skip
# (name, N, K) of the Llama-3-8B linears (qkv: q|k of one type + v, tested by parts)
SHAPES = (("attn_q/o", 4096, 4096), ("attn_k/v", 1024, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336), ("head", 128256, 4096))  # fmt: skip
MAIN_TYPES = ("Q4_K", "Q6_K", "Q8_0")
# The batch-1 GEMV's shapes: each segment of the engine's layers in the Q4_K_M and Q8_0 files
# (q|k Q4_K + v Q6_K; qkv Q8_0; ffn_down Q4_K or Q6_K), and two more types for scale.
GEMV_SHAPES = (
    ("Q4_K", "attn_q|k", 5120, 4096), ("Q4_K", "attn_o", 4096, 4096), ("Q4_K", "gate_up", 28672, 4096),
    ("Q4_K", "down", 4096, 14336), ("Q6_K", "attn_v", 1024, 4096), ("Q6_K", "down", 4096, 14336),
    ("Q6_K", "head", 128256, 4096), ("Q8_0", "attn_qkv", 6144, 4096), ("Q8_0", "attn_o", 4096, 4096),
    ("Q8_0", "gate_up", 28672, 4096), ("Q8_0", "down", 4096, 14336), ("Q8_0", "head", 128256, 4096),
    ("Q5_K", "gate_up", 28672, 4096), ("Q4_0", "gate_up", 28672, 4096),
)  # fmt: skip


def _raw_gpu(type_name: str, n: int, k: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    if type_name in ("Q4_K", "Q6_K", "Q8_0"):
        raw = gguf_random_blocks(type_name, n, k, rng)
    else:
        sys.path.insert(0, str(ROOT))
        from tests.quant.gguf_blocks import random_blocks, weight_scale

        raw = random_blocks(type_name, n, k, rng, weight_scale(type_name))
    return torch.from_numpy(raw).cuda()


def _segment(type_name: str, n: int, k: int, seed: int = 0) -> tuple[tg.Segment, torch.Tensor]:
    raw = _raw_gpu(type_name, n, k, seed)
    return tg.Segment(type_name, 0, n, k, planes.repack(raw, type_name)), raw


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.results: dict[str, Any] = {
            "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "triton": getattr(tg.triton, "__version__", None), "llamacpp_reference": LLAMACPP,
            "llamacpp_reference_device": LLAMACPP_REFERENCE_DEVICE,
        }  # fmt: skip
        self.tmp = Path(args.tmp or tempfile.mkdtemp(prefix="paphos-gguf-bench-"))
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.config = json.loads(Path(args.config).read_text())
        self.tokenizer_dir = self.tmp / "tokenizer"
        write_synthetic_tokenizer(self.tokenizer_dir, self.config["vocab_size"], self.config["eos_token_id"])

    def save(self) -> None:
        Path(self.args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(self.args.out).write_text(json.dumps(self.results, indent=1, default=str))


# ----------------------------------------------------------------------------- sections


def section_ceilings(bench: Bench) -> dict[str, Any]:
    n = 2 << 30
    buffers = torch.empty(2, n, dtype=torch.uint8, device="cuda")
    t = cuda_time(lambda: buffers[1].copy_(buffers[0]), iters=20)
    buffers.resize_(0)
    torch.cuda.empty_cache()
    bench.results["copy_bw"] = 2 * n / t
    return {"copy_GBps": 2 * n / t / 1e9}


def section_kernels(bench: Bench) -> dict[str, Any]:
    out: dict[str, Any] = {}
    worst = 0.0
    cases = [(t, name, n, k) for t in MAIN_TYPES for name, n, k in SHAPES if name != "head"]
    cases += [(t, "attn_q/o", 4096, 4096) for t in planes.FORMATS if t not in MAIN_TYPES]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for type_name, shape, n, k in cases:
        seg, raw = _segment(type_name, n, k)
        w = dequantize(raw, type_name)  # fp32 reference weights
        errs = {}
        for m in (1, 16, 64, 512):
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            ref = x.float() @ w.t()
            got = tg.matmul(x, [seg], n)  # M = 1: the GEMV; 16, 64: fused; 512: dequantize + cuBLAS
            errs[f"M{m}"] = _rel(got, ref)
        worst = max(worst, *errs.values())
        out[f"{type_name} {shape} {n}x{k}"] = errs
        del seg, raw, w
    torch.cuda.empty_cache()
    out["max_rel_err"] = worst
    out["pass"] = worst < 1e-2
    return out


def section_q6_k_tile(bench: Bench) -> dict[str, Any]:
    """The fused kernel's Q6_K weights on the GPU (paphos/quant/gguf/q6_k_tile.py, its inline PTX), read
    back by one-hot tokens: bit for bit the interpreter path's arithmetic (code x (hi + lo), each
    of its two roundings to the model dtype), as torch computes it here, and the fraction equal to
    the exact weights correctly rounded."""
    out: dict[str, Any] = {}
    n, k = 1024, 4096
    seg, raw = _segment("Q6_K", n, k)
    fields = planes._codes_and_scales(raw.reshape(-1, planes.type_size("Q6_K")), "Q6_K")
    codes = (fields["q"].reshape(n, k) - 32).float()
    scale = fields["sc"].float().reshape(n, k // 16) * fields["sd"].float().reshape(n, k // 256).repeat_interleave(16, 1)
    exact = dequantize(raw, "Q6_K")
    for dtype in (torch.bfloat16, torch.float16):
        hi = scale.to(dtype).float()
        lo = (scale - hi).to(dtype).float()
        part = (codes * lo.repeat_interleave(16, 1)).to(dtype).float()
        expected = (codes * hi.repeat_interleave(16, 1) + part).to(dtype)
        engine = launch.default_config("Q6_K", n, k, 16)  # its 16-token tile, one K slice (no float32 sums)
        for cfg in (tg.KernelConfig(engine.block_n, engine.block_k, 1, 4, 3, 16), tg.KernelConfig(32, 128, 1, 4, 2, 16)):
            got = tg.fused_matmul(torch.eye(k, dtype=dtype, device="cuda"), [seg], n, [cfg]).t()
            name = f"{str(dtype).removeprefix('torch.')} {cfg.block_n}x{cfg.block_k}"
            out[name] = {"bit_exact": bool(torch.equal(got, expected)),
                         "correctly_rounded": (got == exact.to(dtype)).float().mean().item()}  # fmt: skip
            print(f"q6_k_tile {name}: as the interpreter path {out[name]['bit_exact']}, correctly rounded "
                  f"{out[name]['correctly_rounded']:.5f}", flush=True)  # fmt: skip
    out["pass"] = all(v["bit_exact"] and v["correctly_rounded"] >= 0.99 for v in out.values())
    return out


GEMV_CANDIDATES = [tg.GemvConfig(bn, w, int8_x=False) for bn, w in (
    (1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (1, 4), (2, 4), (4, 4), (8, 4), (1, 8), (2, 8), (4, 8))]  # fmt: skip
# integer dots (Q4_0, Q4_K, Q8_0): rows per step, warps, rows per program
GEMV_INT8_CANDIDATES = [tg.GemvConfig(bn, w, int8_x=True, rows_per_program=rpp) for bn, w, rpp in (
    (1, 4, 4), (2, 2, 8), (2, 4, 8), (1, 8, 8), (1, 4, 16), (2, 4, 16), (4, 4, 16), (2, 8, 16), (2, 16, 32),
    (1, 8, 4), (1, 16, 8), (1, 16, 16))]  # fmt: skip
# where integer dots apply, the float kernel's configurations that ever won there
GEMV_FLOAT_FALLBACK = [tg.GemvConfig(bn, w, int8_x=False) for bn, w in ((1, 4), (4, 2))]


L2_BYTES = 60 << 20  # H200 (H100: 50 MiB)


def _copies(seg: tg.Segment) -> list[tg.Segment]:
    """Enough copies of a segment's planes that cycling through them reads from memory, not L2."""
    count = max(1, math.ceil(3 * L2_BYTES / seg.n_bytes()))
    return [seg] + [tg.Segment(seg.type_name, 0, seg.rows, seg.k, {n: t.clone() for n, t in seg.planes.items()})
                    for _ in range(count - 1)]  # fmt: skip


def _timed_segment(type_name: str, n: int, k: int) -> tuple[tg.Segment, torch.Tensor, list[tg.Segment], list[torch.Tensor]]:
    """A random segment for timing: (segment, its float32 weights, copies of its planes and bf16
    copies of its weights, each set larger than L2 so that cycling through it reads memory)."""
    seg, raw = _segment(type_name, n, k)
    w = dequantize(raw, type_name)
    w16 = w.to(torch.bfloat16)
    w16s = [w16] + [w16.clone() for _ in range(math.ceil(3 * L2_BYTES / (w16.numel() * 2)) - 1)]
    return seg, w, _copies(seg), w16s


def section_gemv(bench: Bench) -> dict[str, Any]:
    out: dict[str, Any] = {}
    bw = bench.results.get("copy_bw")
    types = bench.args.gemv_types.split(",") if bench.args.gemv_types else None
    shapes = bench.args.gemv_shapes.split(",") if bench.args.gemv_shapes else None
    for type_name, name, n, k in GEMV_SHAPES:
        if (types and type_name not in types) or (shapes and name not in shapes):
            continue
        seg, raw = _segment(type_name, n, k)
        ref_w = dequantize(raw, type_name)
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        ref = x.float() @ ref_w.t()
        nbytes = seg.n_bytes()
        copies = _copies(seg)
        results = []
        int8 = tg.triton_gemv.integer_dots(seg.fmt)
        for cfg in GEMV_FLOAT_FALLBACK + GEMV_INT8_CANDIDATES if int8 else GEMV_CANDIDATES:
            dst = torch.empty(n, dtype=torch.bfloat16, device="cuda")
            fns = [partial(tg.triton_gemv.gemv, x[0], c_seg, dst, cfg.block_n, cfg.num_warps, cfg.chunk, cfg.int8_x,
                           cfg.rows_per_program) for c_seg in copies]  # fmt: skip
            try:
                fns[0]()
                err = _rel(dst[None], ref)
                t = graph_time(fns)
            except Exception as e:  # noqa: BLE001 (a config that does not compile is recorded)
                results.append({"cfg": cfg.__dict__, "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            results.append({"cfg": cfg.__dict__, "us": t * 1e6, "GBps": nbytes / t / 1e9, "rel_err": err})
        ok = [r for r in results if "us" in r]
        best = min(ok, key=lambda r: r["us"])
        tg.GEMV_CONFIGS[(type_name, n, k)] = cfg = tg.GemvConfig(**best["cfg"])
        pdl.ENABLED = False  # the same launches, each starting after the previous one finished
        try:
            best["us_no_pdl"] = 1e6 * graph_time([
                partial(tg.triton_gemv.gemv, x[0], c_seg, dst, cfg.block_n, cfg.num_warps, cfg.chunk, cfg.int8_x,
                        cfg.rows_per_program) for c_seg in copies])  # fmt: skip
        finally:
            pdl.ENABLED = True
        w16 = ref_w.to(torch.bfloat16)
        w16s = [w16] + [w16.clone() for _ in range(math.ceil(3 * L2_BYTES / (w16.numel() * 2)) - 1)]
        t16 = graph_time([lambda w=w, v=x: torch.nn.functional.linear(v, w) for w in w16s])
        out[f"{type_name} {name} {n}x{k}"] = {
            "best_us": best["us"], "best": best["cfg"], "GBps": best["GBps"],
            "frac_copy_bw": best["GBps"] * 1e9 / bw if bw else None, "max_rel_err": max(r["rel_err"] for r in ok),
            "cublas_bf16_us": t16 * 1e6, "cublas_bf16_GBps": w16.numel() * 2 / t16 / 1e9,
            "all": results,
        }  # fmt: skip
        print(f"gemv {type_name} {name} {n}x{k}: {best['us']:.1f} us ({best['us_no_pdl']:.1f} without PDL) "
              f"{best['GBps']:.0f} GB/s best {best['cfg']} "
              f"(cuBLAS bf16 {t16 * 1e6:.1f} us); " + ", ".join(
                  f"{'i' if r['cfg']['int8_x'] else 'f'}{r['cfg']['block_n']}/{r['cfg']['num_warps']}"
                  f"/{r['cfg']['rows_per_program'] or ''}:{r.get('us', float('nan')):.1f}" for r in results),
              flush=True)  # fmt: skip
        del seg, ref_w, w16s, copies
    torch.cuda.empty_cache()
    out["max_rel_err"] = max(v["max_rel_err"] for v in out.values() if isinstance(v, dict))
    return out


# (type, shape name, N, K) of the int8 path: the Q4_K segments of a Q4_K_M layer, a Q5_K gate|up
I8_SHAPES = tuple(s for s in GEMV_SHAPES if ti8.supports(s[0], s[3]))


def _i8_candidates(type_name: str, n: int, k: int, m: int) -> list[ti8.I8Config]:
    """Stream-K over the rule's tile (2-4 programs per SM), the split rule's tile with other K
    splits, steps and stages, 128-row tiles (4 or 8 warps), then mma.sync tiles (32 or 16 rows)."""
    split = partial(ti8.i8_config, type_name, n, k, m, stream=False)
    out = [] if type_name == "Q8_0" else [dataclasses.replace(split(), stream_per_sm=per_sm) for per_sm in (2, 3, 4)]
    for bn, warps in ((64, 4), (128, 4), (128, 8), (64, 2), (32, 2), (16, 1)):
        for per_sm in (2, 4, 8):
            base = dataclasses.replace(split(per_sm), block_n=bn, num_warps=warps)
            if bn != 64:  # the same programs per SM with other tiles
                base = dataclasses.replace(base, split_k=max(1, base.split_k * bn // 64))
            out += [dataclasses.replace(base, num_stages=stages) for stages in (3, 4)]
    return list(dict.fromkeys(out))


def section_i8(bench: Bench) -> dict[str, Any]:
    out: dict[str, Any] = {}
    bw = bench.results.get("copy_bw")
    ms = [int(v) for v in bench.args.i8_ms.split(",")]
    types = bench.args.gemv_types.split(",") if bench.args.gemv_types else None
    shapes = [s for s in I8_SHAPES if not types or s[0] in types]
    per_case = bench.args.sweep_seconds / (len(shapes) * len(ms))
    for type_name, name, n, k in shapes:
        seg, ref_w, copies, w16s = _timed_segment(type_name, n, k)
        for m in ms:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            ref = x.float() @ ref_w.t()
            row: dict[str, Any] = {"GB": seg.n_bytes() / 1e9}
            row["cublas_bf16_us"] = 1e6 * graph_time([lambda w=w, v=x: torch.nn.functional.linear(v, w) for w in w16s])
            row["fused_us"] = 1e6 * graph_time([lambda s=c, v=x, n=n: tg.fused_matmul(v, [s], n) for c in copies])
            dst = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

            def run(cfg: ti8.I8Config | None, s: tg.Segment, v: torch.Tensor = x, d: torch.Tensor = dst,
                    t: str = type_name) -> None:  # fmt: skip
                ti8.matmul_into(d, ti8.quantize_x(v, t), s, cfg)

            ti8.TUNED_CONFIGS.pop((type_name, n, k, 16), None)
            default = ti8.i8_config(type_name, n, k, m)
            results = []
            deadline = time.perf_counter() + per_case
            for cfg in [default, *_i8_candidates(type_name, n, k, m)]:
                if time.perf_counter() > deadline and cfg is not default:
                    break
                try:
                    run(cfg, seg)
                    err = _rel(dst, ref)
                    t = graph_time([partial(run, cfg, c) for c in copies])
                except Exception as e:  # noqa: BLE001 (a config that does not compile is recorded)
                    results.append({"cfg": cfg.__dict__, "error": f"{type(e).__name__}: {e}"[:200]})
                    continue
                results.append({"cfg": cfg.__dict__, "us": t * 1e6, "rel_err": err})
            ok = [r for r in results if "us" in r]
            best = min(ok, key=lambda r: r["us"])
            ti8.TUNED_CONFIGS[(type_name, n, k, default.block_m)] = ti8.I8Config(**best["cfg"])
            row |= {
                "default_us": ok[0]["us"] if results[0] is ok[0] else None, "best_us": best["us"], "best": best["cfg"],
                "GBps": seg.n_bytes() / best["us"] / 1e3, "frac_copy_bw": seg.n_bytes() / best["us"] / 1e-6 / bw if bw else None,
                "max_rel_err": max(r["rel_err"] for r in ok), "all": results,
            }  # fmt: skip
            out[f"{type_name} {name} {n}x{k} M{m}"] = row
            print(f"i8 {type_name} {name} {n}x{k} M{m}: default {row['default_us'] or float('nan'):.1f} best "
                  f"{best['us']:.1f} us {best['cfg']} ({row['GBps']:.0f} GB/s), fused {row['fused_us']:.1f}, "
                  f"cuBLAS bf16 {row['cublas_bf16_us']:.1f}; err {row['max_rel_err']:.1e}", flush=True)  # fmt: skip
        del seg, ref_w, w16s, copies
    torch.cuda.empty_cache()
    for m, (type_name, what) in itertools.product(ms, (("Q4_K", "Q4_K linears of a Q4_K_M layer"), ("Q8_0", "Q8_0 layer"))):
        rows = [v for key, v in out.items()
                if key.startswith(f"{type_name} ") and key.endswith(f" M{m}") and " head " not in key]  # fmt: skip
        if not rows:
            continue
        tot = {c: sum(r[c] for r in rows) for c in ("cublas_bf16_us", "fused_us", "best_us")}
        tot["default_us"] = sum(r["default_us"] or math.nan for r in rows)
        out[f"{what} M{m}"] = tot
        print(f"i8 {what} ({len(rows)}) M{m}: int8 {tot['default_us']:.1f} us (best launches "
              f"{tot['best_us']:.1f}), fused {tot['fused_us']:.1f}, bf16 {tot['cublas_bf16_us']:.1f} (x bf16: "
              f"{tot['cublas_bf16_us'] / tot['default_us']:.2f})", flush=True)  # fmt: skip
    return out


def _candidates(m: int) -> list[tg.KernelConfig]:
    if m == 1:
        tiles = [
            (8, 256, 4),
            (16, 256, 4),
            (16, 512, 4),
            (32, 256, 4),
            (16, 256, 8),
            (32, 512, 8),
            (8, 512, 2),
        ]
        return [tg.KernelConfig(bn, bk, s, w, 2, 1) for bn, bk, w in tiles for s in (1, 2, 4, 8)]
    tiles = [(32, 128, 4), (64, 128, 4), (32, 256, 4), (64, 64, 4)]
    bm = max(16, launch.m_bucket(m))
    out = [tg.KernelConfig(bn, bk, s, w, 2, bm) for bn, bk, w in tiles for s in (1, 2, 4)]
    # Q6_K's 16-bit decode (q6_k_tile.py) won with 64 x 64 tiles on 3 stages at 16 and 32 tokens
    out += [tg.KernelConfig(64, 64, s, 4, 3, bm) for s in (1, 2, 4, 8)]
    if bm > 16:  # token tiles of half the step, the second reading the weights from L2
        out += [tg.KernelConfig(64, 64, s, 4, 3, bm // 2) for s in (2, 4, 8)]
    return out


def section_batched(bench: Bench) -> dict[str, Any]:
    """Batched decode as the engine dispatches it (`tg.matmul`: the int8 GEMM for Q4_K / Q5_K, the
    fused kernel for the other types) on every `GEMV_SHAPES` segment at the --i8-ms token counts,
    against cuBLAS bf16 on the dequantized weight; weights cycled from memory. Run on two
    checkouts on one machine to compare kernel versions."""
    out: dict[str, Any] = {}
    types = bench.args.gemv_types.split(",") if bench.args.gemv_types else None
    for type_name, name, n, k in GEMV_SHAPES:
        if types and type_name not in types:
            continue
        seg, w, copies, w16s = _timed_segment(type_name, n, k)
        for m in (int(v) for v in bench.args.i8_ms.split(",")):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            err = _rel(tg.matmul(x, [seg], n), x.float() @ w.t())
            t = graph_time([lambda s=c, v=x, n=n: tg.matmul(v, [s], n) for c in copies])
            tb = graph_time([lambda ww=ww, v=x: torch.nn.functional.linear(v, ww) for ww in w16s])
            out[f"{type_name} {name} {n}x{k} M{m}"] = {"us": t * 1e6, "cublas_bf16_us": tb * 1e6, "rel_err": err,
                                                       "GBps": seg.n_bytes() / t / 1e9}  # fmt: skip
            print(f"batched {type_name} {name} {n}x{k} M{m}: {t * 1e6:.1f} us ({seg.n_bytes() / t / 1e9:.0f} GB/s), "
                  f"cuBLAS bf16 {tb * 1e6:.1f}; err {err:.1e}", flush=True)  # fmt: skip
        del seg, w, copies, w16s
        torch.cuda.empty_cache()
    return out


def section_sweep(bench: Bench) -> dict[str, Any]:
    out: dict[str, Any] = {}
    deadline = time.perf_counter() + bench.args.sweep_seconds
    for type_name in bench.args.sweep_types.split(","):
        for name, n, k in SHAPES:
            if name == "head" and type_name == "Q4_K":
                continue  # the Q4_K_M head is Q6_K
            if bench.args.sweep_shapes and name not in bench.args.sweep_shapes.split(","):
                continue
            seg, _ = _segment(type_name, n, k)
            bytes_read = seg.n_bytes()
            for m in (int(v) for v in bench.args.sweep_ms.split(",")):  # one token: the GEMV, swept in `gemv`
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                default = tg.config_for(type_name, n, k, m)
                results = []
                for cfg in [default, *_candidates(m)]:
                    if time.perf_counter() > deadline and cfg is not default:
                        break
                    try:
                        t = cuda_time(
                            lambda c=cfg, x=x, s=seg, n=n: tg.fused_matmul(x, [s], n, [c]), warmup=2, iters=10
                        )
                    except Exception as e:  # noqa: BLE001 (a config that does not compile is skipped)
                        results.append((math.inf, cfg, f"{type(e).__name__}"))
                        continue
                    results.append((t, cfg, None))
                best_t, best, _ = min(results, key=lambda r: r[0])
                launch.TUNED_CONFIGS[(type_name, n, k, launch.m_bucket(m))] = best
                default_t = results[0][0]
                out[f"{type_name} {name} {n}x{k} M{m}"] = {
                    "best_us": best_t * 1e6, "best": best.__dict__, "default_us": default_t * 1e6,
                    "GBps": bytes_read / best_t / 1e9, "tried": len(results),
                    "failed": sum(1 for r in results if r[2]),
                }  # fmt: skip
                print(f"sweep {type_name} {name} {n}x{k} M{m}: default {default_t * 1e6:.1f} us, best {best_t * 1e6:.1f} "
                      f"{best}", flush=True)  # fmt: skip
    torch.cuda.empty_cache()
    return out


def section_crossover(bench: Bench) -> dict[str, Any]:
    out: dict[str, Any] = {}
    n, k = 28672, 4096
    segs = [_segment("Q4_K", n, k)[0]]
    fused_wins = []
    for m in (16, 32, 64, 128, 256):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        t_fused = cuda_time(lambda x=x: tg.fused_matmul(x, segs, n), warmup=2, iters=10)
        t_deq = cuda_time(lambda x=x: tg.dequant_matmul(x, segs, n), warmup=2, iters=10)
        out[f"M{m}"] = {"fused_us": t_fused * 1e6, "dequant_cublas_us": t_deq * 1e6}
        if t_fused < t_deq:
            fused_wins.append(m)
    # The largest bucket up to which fused is faster at every tested M (64 at most: its tile).
    limit = 16
    for m in (16, 32, 64):
        if m in fused_wins:
            limit = m
        else:
            break
    tg.FUSED_MAX_TOKENS = limit
    out["FUSED_MAX_TOKENS"] = limit
    segs.clear()
    torch.cuda.empty_cache()
    return out


def _model(llm: LLM) -> torch.nn.Module:
    return llm.engine.runner.model


def _module_bytes(module: torch.nn.Module) -> int:
    """GPU bytes of a module's parameters and buffers (blocks, repacked planes or float tables)."""
    tensors = {t.data_ptr(): t for t in [*module.parameters(), *module.buffers()] if t.is_cuda and t.numel()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _weight_report(llm: LLM, gguf_path: Path | None) -> dict[str, Any]:
    """Weight memory on the GPU: every parameter and buffer of the model, the embedding and the head
    included (kept in GGUF blocks, or float tables where the file or a fallback has them so), and
    the bytes one decode step reads (all but the embedding, of which it reads a few rows; a head
    tied to the embedding reads the shared table whole)."""
    model = _model(llm)
    total = _module_bytes(model)
    embed_module, head_module = model.model.embed_tokens, model.lm_head
    embed_bytes = _module_bytes(embed_module)
    tied = getattr(model, "tie_word_embeddings", False)
    head_bytes = embed_bytes if tied else _module_bytes(head_module)
    read_per_token = total - (0 if tied else embed_bytes)
    kinds = Counter()
    dequantized = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "kernel", None)
        if kernel is not None:
            name = kernel.name if getattr(kernel, "fallback", None) is None else f"{kernel.name}->dequantized"
            kinds[name] += 1
        if hasattr(module, "gguf_dequantized"):
            dequantized += 1

    def kind(module: torch.nn.Module) -> str:
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "kernel", None)
        if kernel is None:
            return f"float {module.weight.dtype}"
        layout = "dequantized" if hasattr(module, "gguf_dequantized") else "GGUF blocks"
        types = "+".join(sorted({s.type_name for s in method.shards}))
        return f"{types} {layout} ({kernel.name})"

    report = {
        "weights_GB": total / 1e9, "embedding_GB": embed_bytes / 1e9, "embedding": kind(embed_module),
        "head_GB": head_bytes / 1e9, "head": "tied to the embedding" if tied else kind(head_module),
        "read_per_token_GB": read_per_token / 1e9, "kernels": dict(kinds),
        "layers_dequantized_at_load": dequantized,
        "scratch_GB": sum(b.numel() * b.element_size() for b in tg._SCRATCH.values()) / 1e9,
        "torch_allocated_GB": torch.cuda.memory_allocated() / 1e9,
    }  # fmt: skip
    if gguf_path is not None:
        from paphos.loader.gguf_loader import GGUFCheckpoint

        ckpt = GGUFCheckpoint(gguf_path)
        file_bytes = sum(t.n_bytes for t in ckpt.tensors)
        report["file_tensor_GB"] = file_bytes / 1e9
        report["weights_over_file"] = total / file_bytes
        by_name = {t.name: t.n_bytes for t in ckpt.tensors}
        report["file_embedding_GB"] = by_name.get("token_embd.weight", 0) / 1e9
        report["file_head_GB"] = by_name.get("output.weight", by_name.get("token_embd.weight", 0)) / 1e9
    report["_read_bytes"] = read_per_token
    return report


def _run_engine(bench: Bench, kind: str, path: Path | None, batch1_only: bool = False) -> dict[str, Any]:
    args = bench.args
    vocab = bench.config["vocab_size"]
    kwargs: dict[str, Any] = dict(
        tokenizer=str(bench.tokenizer_dir), dtype="bfloat16", max_model_len=4096, max_num_seqs=64,
        max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=args.gmu,
        enable_prefix_caching=False,
    )  # fmt: skip
    t0 = time.perf_counter()
    if path is None:
        llm = LLM(str(args.config), load_format="dummy", **kwargs)
    else:
        llm = LLM(str(path), **kwargs)
    out: dict[str, Any] = {"startup_s": time.perf_counter() - t0}
    try:
        mem = _weight_report(llm, path)
        read_bytes = mem.pop("_read_bytes")
        out["memory"] = mem
        bw = bench.results.get("copy_bw")
        engine_steps(llm, random_prompts(1, 32, vocab, 1), 8)  # warm-up
        # batch 1: 128-token prompt, 128 tokens decoded (tg128 of llama-bench, at context 128-256)
        steps = engine_steps(llm, random_prompts(1, 128, vocab, 2), 128)
        tpot = statistics.median(t for t, rows in steps[1:] if rows == 1)
        out["batch1"] = {
            "tok_s": 1 / tpot, "step_ms": tpot * 1e3, "GBps": read_bytes / tpot / 1e9,
            "frac_copy_bw": read_bytes / tpot / bw if bw else None,
        }  # fmt: skip
        # Greedy tokens of a fixed prompt (graph-replayed decode): equal with and without
        # programmatic dependent launch (section q4_k_m_no_pdl compares), or a kernel reads early.
        # (96 tokens: a prefill past FUSED_MAX_TOKENS, whose GEMMs have no split-K atomics.)
        done = llm.generate([random_prompts(1, 96, vocab, 7)[0]],
                            SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))  # fmt: skip
        out["greedy_tokens"] = done[0].outputs[0].token_ids
        if args.profile:
            out["profile_batch1"] = profile_decode(llm, vocab)
            print_profile(f"{kind} batch-1 decode step", out["profile_batch1"])
        for batch in () if batch1_only else (16, 32, 64):  # 32: two token tiles of Q4_K's int8 path
            steps = engine_steps(llm, random_prompts(batch, 128, vocab, 10 + batch), 64)
            decode = [t for t, rows in steps[1:] if rows == batch]
            out[f"batch{batch}"] = (
                {"tok_s": batch / statistics.median(decode)} if decode else {"error": "no pure decode steps"}
            )
        times = []
        for seed in range(0 if batch1_only else 4):  # pp512: one 512-token prompt per step (chunk >= 512), best of the last 3
            steps = engine_steps(llm, random_prompts(1, 512, vocab, 100 + seed), 1)
            times.append(steps[0][0])
        if times:
            out["pp512"] = {"tok_s": 512 / min(times[1:]), "ms": min(times[1:]) * 1e3, "all_ms": [t * 1e3 for t in times]}
        if args.profile and times:
            out["profile_pp512"] = profile_prefill(llm, vocab)
            print_profile(f"{kind} pp512 step", out["profile_pp512"])
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    ref = LLAMACPP[kind]
    out["vs_llamacpp"] = {  # the H200 figures; same-run ratios: results["vs_llamacpp_same_run"]
        "reference": LLAMACPP_REFERENCE_DEVICE,
        "tg128_ratio": out["batch1"]["tok_s"] / ref["tg128"] if "batch1" in out else None,
        "pp512_ratio": out["pp512"]["tok_s"] / ref["pp512"] if ref["pp512"] and "pp512" in out else None,
    }
    return out


def _gguf_path(bench: Bench, mix: str) -> Path:
    given = bench.args.q4km if mix == "q4_k_m" else bench.args.q8
    if given:
        return Path(given)
    path = bench.tmp / f"random-llama3-8b-{mix}-vocab.gguf"  # with a vocabulary, for llama.cpp
    if not path.exists():
        t0 = time.perf_counter()
        write_gguf(path, mix, vocab=True)
        bench.results.setdefault("generate_s", {})[mix] = round(time.perf_counter() - t0, 1)
    return path


def section_q4_k_m(bench: Bench) -> dict[str, Any]:
    return _run_engine(bench, "q4_k_m", _gguf_path(bench, "q4_k_m"))


def section_q8_0(bench: Bench) -> dict[str, Any]:
    return _run_engine(bench, "q8_0", _gguf_path(bench, "q8_0"))


def section_q4_k_m_no_pdl(bench: Bench) -> dict[str, Any]:
    """The Q4_K_M engine's batch-1 decode with programmatic dependent launch off (paphos/layers/pdl.py)."""
    pdl.ENABLED = False
    try:
        out = _run_engine(bench, "q4_k_m", _gguf_path(bench, "q4_k_m"), batch1_only=True)
    finally:
        pdl.ENABLED = True
    with_pdl = bench.results.get("q4_k_m", {}).get("greedy_tokens")
    out["same_greedy_tokens_as_pdl"] = None if with_pdl is None else with_pdl == out["greedy_tokens"]
    print(f"q4_k_m without PDL: same greedy tokens as with PDL: {out['same_greedy_tokens_as_pdl']}")
    return out


def section_bf16(bench: Bench) -> dict[str, Any]:
    return _run_engine(bench, "bf16", None)


# llama-batched-bench's table: PP, TG, B, N_KV, T_PP s, S_PP t/s, T_TG s, S_TG t/s, T s, S t/s
BATCHED_BENCH_COLUMNS = ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed")
_NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


def parse_batched_bench(text: str) -> list[dict[str, float]]:
    """The rows of llama-batched-bench's output: its markdown table (the default) or its JSONL lines
    (`--output-format jsonl`), each as a dict keyed by BATCHED_BENCH_COLUMNS."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows.append({k: row[k] for k in BATCHED_BENCH_COLUMNS if k in row})
        elif line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) == len(BATCHED_BENCH_COLUMNS) and all(_NUMBER.match(c) for c in cells):
                rows.append({k: (int(c) if k in ("pp", "tg", "pl", "n_kv") else float(c))
                             for k, c in zip(BATCHED_BENCH_COLUMNS, cells, strict=True)})  # fmt: skip
    return rows


# the header lines worth keeping from llama-batched-bench's log (-lv 4: info)
_INFO = re.compile(r"build:|Device \d+:|n_kv_max =|Flash Attention|kv_unified|n_ctx_seq  |file type|vocab type|"
                   r"model buffer size|KV buffer size|compute buffer size|offloaded \d+/\d+ layers")


def _tail(text: str | bytes | None, n: int = 3000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-n:]


def run_batched_bench(binary: str, model: Path, extra: list[str], timeout: float) -> dict[str, Any]:
    """One llama-batched-bench run: the command, its wall time and parsed rows (with its header
    lines: build, device, n_kv_max / flash_attn), or the error and the output's tail."""
    cmd = [binary, "-m", str(model), *extra]
    out: dict[str, Any] = {"command": shlex.join(cmd)}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        out.update(error=f"timed out after {timeout:.0f} s", stdout_tail=_tail(e.stdout), stderr_tail=_tail(e.stderr))
        return out
    except OSError as e:
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    out["rc"] = proc.returncode
    text = proc.stdout + "\n" + proc.stderr
    out["info"] = [line.strip() for line in text.splitlines() if _INFO.search(line)][:24]
    out["rows"] = parse_batched_bench(proc.stdout) or parse_batched_bench(text)
    if proc.returncode != 0 or not out["rows"]:
        out["error"] = f"exit code {proc.returncode}" if proc.returncode else "no result rows in the output"
        out["stdout_tail"], out["stderr_tail"] = _tail(proc.stdout), _tail(proc.stderr)
    return out


def _llamacpp_commit(args: argparse.Namespace) -> str | None:
    if args.llamacpp_commit:
        return args.llamacpp_commit
    commit_file = Path(args.llamacpp_src) / "COMMIT" if args.llamacpp_src else None
    return commit_file.read_text().strip() if commit_file and commit_file.is_file() else None


def section_llamacpp(bench: Bench) -> dict[str, Any]:
    """llama.cpp's llama-batched-bench on the engine sections' two files, in this process's run."""
    args = bench.args
    binary = args.llamacpp_bin
    if not binary or not Path(binary).is_file():
        raise FileNotFoundError(f"no llama-batched-bench at {binary!r} (--llamacpp-bin; benchmarks/README.md says how "
                                "to build it)")  # fmt: skip
    gc.collect()
    free = total = 0
    if torch.cuda.is_available():  # what the engine sections left to llama.cpp
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
    npl = [int(b) for b in args.llamacpp_npl.split(",")]
    ctx = max(npl) * (128 + 128)  # prompts not shared: each sequence holds its 128 + 128 tokens
    common = ["-ngl", "99", "-fa", args.llamacpp_fa, "-b", "2048", "-ub", "512", "-lv", "4",
              *shlex.split(getattr(args, "llamacpp_extra", None) or "")]
    out: dict[str, Any] = {
        "binary": str(Path(binary).resolve()), "commit": _llamacpp_commit(args),
        "gpu_free_GB_before": free / 1e9, "gpu_total_GB": total / 1e9,
        "torch_reserved_GB_before": torch.cuda.memory_reserved() / 1e9 if torch.cuda.is_available() else 0,
    }  # fmt: skip
    for mix in ("q4_k_m", "q8_0"):
        path = _gguf_path(bench, mix)
        decode = run_batched_bench(binary, path, [*common, "-npp", "128", "-ntg", "128", "-npl", args.llamacpp_npl,
                                                  "-c", str(ctx)], args.llamacpp_timeout)  # fmt: skip
        prefill = run_batched_bench(binary, path, [*common, "-npp", "512", "-ntg", "128", "-npl", "1", "-c", "1024"],
                                    args.llamacpp_timeout)  # fmt: skip
        r: dict[str, Any] = {"file": str(path), "decode": decode, "pp512_run": prefill}
        by_pl = {row["pl"]: row for row in decode.get("rows", []) if row.get("pp") == 128}
        r["tg_tok_s"] = {str(pl): row["speed_tg"] for pl, row in sorted(by_pl.items())}
        r["pp128_tok_s"] = {str(pl): row["speed_pp"] for pl, row in sorted(by_pl.items())}
        pp512 = [row for row in prefill.get("rows", []) if row.get("pp") == 512 and row.get("pl") == 1]
        r["pp512_tok_s"] = pp512[0]["speed_pp"] if pp512 else None
        r["tg128_at_pp512_tok_s"] = pp512[0]["speed_tg"] if pp512 else None
        if "error" in decode:
            r["error"] = f"decode run: {decode['error']}"
        out[mix] = r
        print(f"llama.cpp {mix}: S_TG {r['tg_tok_s']} tok/s, pp512 {r['pp512_tok_s']} tok/s"
              + (f" ({r['error']})" if "error" in r else ""), flush=True)  # fmt: skip
    return out


def llamacpp_reference(results: dict[str, Any], kind: str) -> tuple[dict[str, Any], bool]:
    """(tg128, pp512, b16 of llama.cpp for `kind`, measured in this run?): section llamacpp's
    batch-1 and batch-16 S_TG and pp512 where it ran on that file, else the H200 figures."""
    measured = ((results.get("llamacpp") or {}).get(kind) or {})
    tg = measured.get("tg_tok_s") or {}
    if "1" in tg and "16" in tg:
        return {"tg128": tg["1"], "pp512": measured.get("pp512_tok_s"), "b16": tg["16"], "b64": tg.get("64")}, True
    return LLAMACPP[kind], False


def same_run_ratios(results: dict[str, Any]) -> dict[str, Any]:
    """Paphos / llama.cpp of this run, per file: batch 1, 16, 64 decode and pp512."""
    out = {}
    for kind in ("q4_k_m", "q8_0"):
        ref, same = llamacpp_reference(results, kind)
        r = results.get(kind) or {}
        if not same or "batch1" not in r:
            continue
        ratio = {"batch1": r["batch1"]["tok_s"] / ref["tg128"]}
        for b, key in ((16, "b16"), (64, "b64")):
            tok_s = r.get(f"batch{b}", {}).get("tok_s")
            if tok_s and ref.get(key):
                ratio[f"batch{b}"] = tok_s / ref[key]
        if ref.get("pp512") and "pp512" in r:
            ratio["pp512"] = r["pp512"]["tok_s"] / ref["pp512"]
        out[kind] = ratio
    return out


def print_table(results: dict[str, Any]) -> None:
    rows = [
        (
            "",
            "b1 tok/s",
            "GB/s",
            "%copy",
            "b16 tok/s",
            "b16 x bf16 / x llama.cpp",
            "b32 tok/s",
            "b64 tok/s",
            "pp512",
            "llama.cpp tg/pp",
            "weights GB",
            "file GB",
        )
    ]
    for kind in ("q4_k_m", "q8_0", "bf16"):
        r = results.get(kind) or {}
        if "batch1" not in r:
            rows.append((kind, r.get("error", "-")[:60], "", "", "", "", "", "", "", "", "", ""))
            continue
        b1, mem = r["batch1"], r.get("memory", {})
        frac = b1.get("frac_copy_bw")
        ref, same = llamacpp_reference(results, kind)
        source = " (same run)" if same else " (H200)"
        b16 = r.get("batch16", {}).get("tok_s", 0)
        bf16_b16 = (results.get("bf16") or {}).get("batch16", {}).get("tok_s")
        b16_ratios = (f"{b16 / bf16_b16:.2f}" if bf16_b16 else "-") + (
            f" / {b16 / ref['b16']:.2f}{source}" if ref["b16"] else "")
        rows.append((
            kind, f"{b1['tok_s']:.0f}", f"{b1['GBps']:.0f}", f"{100 * frac:.0f}" if frac else "-", f"{b16:.0f}",
            b16_ratios, f"{r.get('batch32', {}).get('tok_s', 0):.0f}", f"{r.get('batch64', {}).get('tok_s', 0):.0f}",
            f"{r.get('pp512', {}).get('tok_s', 0):.0f}",
            f"{ref['tg128']:.0f} / " + (f"{ref['pp512']:.0f}" if ref["pp512"] else "-") + source,
            f"{mem.get('weights_GB', 0):.2f}", f"{mem.get('file_tensor_GB', 0):.2f}" if "file_tensor_GB" in mem else "-",
        ))  # fmt: skip
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths, strict=True)))
    for kind in ("q4_k_m", "q8_0", "bf16"):
        mem = (results.get(kind) or {}).get("memory")
        if mem:
            ratio = f" = {mem['weights_over_file']:.3f} x file" if "weights_over_file" in mem else ""
            print(f"{kind} weights {mem['weights_GB']:.3f} GB{ratio}: embedding {mem['embedding_GB']:.3f} GB "
                  f"({mem['embedding']}), head {mem['head_GB']:.3f} GB ({mem['head']})")  # fmt: skip
    measured = results.get("llamacpp") or {}
    if "error" in measured:
        print(f"llama.cpp section: {measured['error']}")
    elif measured:
        for kind in ("q4_k_m", "q8_0"):
            m = measured.get(kind) or {}
            tg = ", ".join(f"b{pl} {v:.0f}" for pl, v in (m.get("tg_tok_s") or {}).items())
            print(f"llama.cpp (same run, {results.get('device')}, commit {measured.get('commit')}) {kind}: "
                  f"S_TG {tg or '-'} tok/s, pp512 " + (f"{m['pp512_tok_s']:.0f}" if m.get("pp512_tok_s") else "-")
                  + (f"; {m['error']}" if "error" in m else ""))  # fmt: skip
    if not all(llamacpp_reference(results, kind)[1] for kind in ("q4_k_m", "q8_0")):
        print(f"(H200): llama.cpp figures of {LLAMACPP_REFERENCE_DEVICE}, not of this machine")
    k = results.get("kernels", {})
    if "max_rel_err" in k:
        print(f"kernels: max rel err {k['max_rel_err']:.2e} ({'pass' if k['pass'] else 'FAIL'} < 1e-2)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--q4km", help="a Q4_K_M GGUF to use instead of generating one")
    parser.add_argument("--q8", help="a Q8_0 GGUF to use instead of generating one")
    parser.add_argument("--tmp", help="directory for the generated files (default: a new temp dir)")
    parser.add_argument("--gmu", type=float, default=0.85)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--gemv-types", help="gemv, i8 and batched sections: only these types (comma-separated)")
    parser.add_argument("--sweep-types", default=",".join(MAIN_TYPES), help="sweep section: these types")
    parser.add_argument("--sweep-ms", default="16", help="sweep section: token counts (each above 1)")
    parser.add_argument("--sweep-shapes", help="sweep section: only these shape names (e.g. down,head)")
    parser.add_argument("--gemv-shapes", help="gemv section: only these shape names (e.g. down,head)")
    parser.add_argument("--profile", action="store_true",
                        help="engine sections: also profile a batch-1 decode step and a pp512 step")
    parser.add_argument("--sweep-seconds", type=float, default=100.0, help="time cap of each config sweep")
    parser.add_argument("--i8-ms", default="8,16", help="i8 and batched sections: token counts")
    parser.add_argument("--llamacpp-bin", default=os.environ.get("LLAMA_BATCHED_BENCH_BIN",
                        "/tmp/llbuild/bin/llama-batched-bench"), help="llamacpp section: llama-batched-bench")  # fmt: skip
    parser.add_argument("--llamacpp-src", default=str(ROOT / ".srv" / "llama.cpp"),
                        help="llamacpp section: the llama.cpp source it was built from (its COMMIT file is recorded)")
    parser.add_argument("--llamacpp-commit", help="llamacpp section: the llama.cpp commit to record")
    parser.add_argument("--llamacpp-npl", default="1,16,64", help="llamacpp section: batch sizes (-npl)")
    parser.add_argument("--llamacpp-fa", default="on", choices=("on", "off", "auto"),
                        help="llamacpp section: flash attention (-fa)")
    parser.add_argument("--llamacpp-extra", help="llamacpp section: more llama-batched-bench arguments (one string)")
    parser.add_argument("--llamacpp-timeout", type=float, default=240.0, help="llamacpp section: seconds per run")
    args = parser.parse_args()
    bench = Bench(args)
    run_sections(bench, args.sections.split(","), globals())
    if "llamacpp" in bench.results:
        bench.results["vs_llamacpp_same_run"] = same_run_ratios(bench.results)
    bench.results["tuned_configs"] = {str(k): v.__dict__ for k, v in launch.TUNED_CONFIGS.items()}
    bench.results["gemv_configs"] = {str(k): v.__dict__ for k, v in tg.GEMV_CONFIGS.items()}
    bench.results["i8_configs"] = {str(k): v.__dict__ for k, v in ti8.TUNED_CONFIGS.items()}
    bench.save()
    print_table(bench.results)


if __name__ == "__main__":
    main()
