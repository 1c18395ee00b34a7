"""Check and time the Triton paged-attention backend against the torch reference on a GPU.

Where it sits: benchmarks/ drives paphos/attention directly (metadata built by the testing
helper, standing in for scheduler + model runner). For each realistic shape (Llama-3-8B layer:
Hq 32, Hkv 8, D 128, block 16; decode and prefill; sliding window, soft-cap, fp8 KV, D 256) it
  * runs TorchReferenceBackend and TritonAttentionBackend on identical caches and records the max
    abs error of the outputs and of the written cache entries;
  * times both with CUDA events (warmup, median of several runs), and the decode path also
    replayed from a captured CUDA graph (what the model runner will do);
and prints a table and writes JSON to --out. A failing variant records its error and the script
goes on.

    python benchmarks/gpu_attention_check.py --out /tmp/attn.json [--only decode] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paphos.attention.backend import write_kv_cache  # noqa: E402
from paphos.attention.testing import allocate_block_tables, build_metadata  # noqa: E402
from paphos.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from paphos.attention.triton_backend import TritonAttentionBackend  # noqa: E402

BLOCK = 16


@dataclass
class Case:
    name: str
    query_lens: list[int]
    seq_lens: list[int]
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    window: int | None = None
    soft_cap: float | None = None
    kv_dtype: str = "bf16"  # bf16 | fp16 | fp8

    @property
    def kind(self) -> str:
        if max(self.query_lens) == 1:
            return "decode"
        return "mixed" if min(self.query_lens) == 1 else "prefill"


def cases() -> list[Case]:
    out: list[Case] = []
    for batch in (1, 64, 256):
        for ctx in (128, 4096):
            out.append(Case(f"decode b{batch} ctx{ctx}", [1] * batch, [ctx] * batch))
    out += [
        Case("prefill 1x1024", [1024], [1024]),
        Case("prefill 4x4096", [4096] * 4, [4096] * 4),
        Case("chunk 512 after 3584 cached", [512], [4096]),
        Case("mixed 64 decode@4096 + 512 chunk", [1] * 64 + [512], [4096] * 64 + [1024]),
        Case("decode b64 ctx4096 window1024", [1] * 64, [4096] * 64, window=1024),
        Case("prefill 1x4096 window1024", [4096], [4096], window=1024),
        Case("decode b64 ctx4096 fp8", [1] * 64, [4096] * 64, kv_dtype="fp8"),
        Case("decode b1 ctx4096 fp8", [1], [4096], kv_dtype="fp8"),
        Case("prefill 4x4096 fp8", [4096] * 4, [4096] * 4, kv_dtype="fp8"),
        Case("decode b64 ctx4096 fp16", [1] * 64, [4096] * 64, kv_dtype="fp16"),
        Case("decode b64 ctx4096 softcap50", [1] * 64, [4096] * 64, soft_cap=50.0),
        # Gemma-2-9B-like layer: D 256, window and soft-cap together.
        Case(
            "gemma2 decode b32 ctx4096 D256",
            [1] * 32,
            [4096] * 32,
            num_heads=16,
            head_dim=256,
            window=4096,
            soft_cap=50.0,
        ),
        Case(
            "gemma2 prefill 2x2048 D256",
            [2048] * 2,
            [2048] * 2,
            num_heads=16,
            head_dim=256,
            window=1024,
            soft_cap=50.0,
        ),
    ]
    return out


def time_cuda(fn, warmup: int, iters: int) -> float:
    """Median milliseconds of `fn` over `iters` runs, each bracketed by its own CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_case(case: Case, args: argparse.Namespace) -> dict:
    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(1234)
    cache_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}[case.kv_dtype]
    act_dtype = torch.float16 if case.kv_dtype == "fp16" else torch.bfloat16
    k_scale, v_scale = (0.05, 0.04) if case.kv_dtype == "fp8" else (1.0, 1.0)
    num_blocks = sum(math.ceil(s / BLOCK) for s in case.seq_lens) + 1
    tables = allocate_block_tables(case.seq_lens, BLOCK, num_blocks, gen)
    md = build_metadata(case.query_lens, case.seq_lens, tables, BLOCK, device=dev)
    num_tokens = md.num_tokens

    # The earlier context of each sequence (all but this step's tokens) is already cached.
    cache = torch.empty(num_blocks, 2, BLOCK, case.num_kv_heads, case.head_dim, dtype=cache_dtype, device=dev)
    if cache_dtype == torch.float8_e4m3fn:
        cache.copy_((torch.randn(cache.shape, device=dev) * 3).clamp(-448, 448).to(cache_dtype))
    else:
        cache.normal_()
    q = torch.randn(num_tokens, case.num_heads, case.head_dim, device=dev, dtype=act_dtype)
    k = torch.randn(num_tokens, case.num_kv_heads, case.head_dim, device=dev, dtype=act_dtype) * 0.2
    v = torch.randn(num_tokens, case.num_kv_heads, case.head_dim, device=dev, dtype=act_dtype) * 0.2
    scale = case.head_dim**-0.5
    ref = TorchReferenceBackend(k_scale=k_scale, v_scale=v_scale)
    tri = TritonAttentionBackend(k_scale=k_scale, v_scale=v_scale)
    kw = dict(sliding_window=case.window, logits_soft_cap=case.soft_cap)

    row: dict = {"kind": case.kind, "tokens": num_tokens, "seqs": len(case.seq_lens)}
    # ---- correctness: same inputs, separate caches.
    cache_ref, cache_tri = cache.clone(), cache.clone()
    out_ref = ref.forward(q, k, v, cache_ref, md, scale, **kw)
    out_tri = tri.forward(q, k, v, cache_tri, md, scale, **kw)
    torch.cuda.synchronize()
    row["max_abs_err"] = (out_tri.float() - out_ref.float()).abs().max().item()
    row["mean_abs_err"] = (out_tri.float() - out_ref.float()).abs().mean().item()
    row["out_absmax"] = out_ref.float().abs().max().item()
    row["cache_max_abs_err"] = (cache_tri.float() - cache_ref.float()).abs().max().item()
    row["nan"] = bool(torch.isnan(out_tri.float()).any().item())
    del cache_ref, out_ref, out_tri
    # An independent check of the write kernel: the reference's write of the same rows.
    if cache_dtype != torch.float8_e4m3fn:
        probe = cache_tri.clone()
        write_kv_cache(k, v, probe, md.slot_mapping)
        row["write_exact"] = bool(torch.equal(probe, cache_tri))
        del probe

    # ---- timing (both include the K/V write, as a layer's call does).
    row["triton_ms"] = time_cuda(
        lambda: tri.forward(q, k, v, cache_tri, md, scale, **kw), args.warmup, args.iters
    )
    if not args.skip_ref:
        row["ref_ms"] = time_cuda(
            lambda: ref.forward(q, k, v, cache_tri, md, scale, **kw), 1, max(1, args.iters // 4)
        )
    if case.kind == "decode":
        row["num_splits"] = tri.num_splits(len(case.seq_lens), case.num_kv_heads, dev)
        md.decode_only = True
        try:
            static_out = tri.forward_decode(q, k, v, cache_tri, md, scale, **kw)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    tri.forward_decode(q, k, v, cache_tri, md, scale, **kw)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = tri.forward_decode(q, k, v, cache_tri, md, scale, **kw)
            graph.replay()
            eager = tri.forward_decode(q, k, v, cache_tri, md, scale, **kw)
            torch.cuda.synchronize()
            row["graph_matches_eager"] = bool(torch.equal(static_out, eager))
            # Growing contexts without re-capture: seq_lens is read on the device at replay.
            row["graph_ms"] = time_cuda(graph.replay, args.warmup, args.iters)
        except Exception as exc:  # noqa: BLE001 - a failed capture is a result to report
            row["graph_error"] = f"{type(exc).__name__}: {exc}"

    # ---- throughput figures.
    ctx_tokens = sum(case.seq_lens)
    kv_bytes = ctx_tokens * case.num_kv_heads * case.head_dim * 2 * cache.element_size()
    row["kv_read_gb_s"] = kv_bytes / (row["triton_ms"] * 1e-3) / 1e9
    flops = 0.0
    for ql, sl in zip(case.query_lens, case.seq_lens, strict=True):
        visible = sum(min(p + 1, case.window or sl) for p in range(sl - ql, sl))
        flops += 4 * case.num_heads * case.head_dim * visible  # QK^T and PV, 2 flops a MAC
    row["triton_tflops"] = flops / (row["triton_ms"] * 1e-3) / 1e12
    return row


def graph_ms(fn, iters: int = 20) -> float:
    """Median milliseconds of `fn` replayed from a CUDA graph: kernel time without launch cost."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_cuda(graph.replay, 3, iters)


def sweep(args: argparse.Namespace) -> list[dict]:
    """Time tile configs of the decode and prefill kernels alone (graph replay) on a few shapes."""
    import functools
    import itertools

    from paphos.attention import triton_attention as ta
    from paphos.attention import triton_prefill as tp

    dev = torch.device("cuda")
    rows = []
    shapes = [
        ("decode", Case("b64 ctx4096", [1] * 64, [4096] * 64)),
        ("decode", Case("b64 ctx4096 fp8", [1] * 64, [4096] * 64, kv_dtype="fp8")),
        ("decode", Case("b1 ctx4096", [1], [4096])),
        ("decode", Case("b256 ctx4096", [1] * 256, [4096] * 256)),
        # The offline 1000 x 1000 workload's decode steps: 256 sequences, ~1500 tokens each.
        ("decode", Case("b256 ctx1536", [1] * 256, [1536] * 256)),
        ("decode", Case("b256 ctx1536 fp8", [1] * 256, [1536] * 256, kv_dtype="fp8")),
        ("prefill", Case("4x4096", [4096] * 4, [4096] * 4)),
        ("prefill", Case("chunk 512 after 3584", [512], [4096])),
        ("prefill", Case("D256 2x2048", [2048] * 2, [2048] * 2, num_heads=16, head_dim=256)),
    ]
    for kind, case in shapes:
        if args.only and args.only not in case.name:
            continue
        cache_dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[case.kv_dtype]
        num_blocks = sum(math.ceil(x / BLOCK) for x in case.seq_lens) + 1
        gen = torch.Generator().manual_seed(0)
        tables = allocate_block_tables(case.seq_lens, BLOCK, num_blocks, gen)
        md = build_metadata(case.query_lens, case.seq_lens, tables, BLOCK, device=dev)
        cache = torch.randn(num_blocks, 2, BLOCK, case.num_kv_heads, case.head_dim, device=dev).to(
            cache_dtype
        )
        q = torch.randn(md.num_tokens, case.num_heads, case.head_dim, device=dev, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        if kind == "decode":
            splits = TritonAttentionBackend().num_splits(len(case.seq_lens), case.num_kv_heads, dev)
            fp8 = case.kv_dtype == "fp8"  # half the bytes a token: longer tiles and deeper pipelines
            grid = itertools.product([64, 128, 256] if fp8 else [32, 64, 128], [4, 8], [2, 3, 4] if fp8 else [2, 3],
                                     sorted({splits, max(1, splits // 2)}))  # fmt: skip
        else:
            small = case.head_dim > 128  # D 256: register and shared-memory pressure
            grid = itertools.product(
                [32, 64] if small else [64, 128], [32, 64], [4, 8], [1, 2] if small else [2, 3]
            )
        for params in grid:
            try:
                if kind == "decode":
                    block_n, warps, stages, num_splits = params
                    fn = functools.partial(
                        ta.paged_attention_decode, q, cache, md.block_tables, md.seq_lens, out, scale=0.1,
                        num_splits=num_splits, config=ta.DecodeConfig(block_n, warps, stages),
                    )  # fmt: skip
                else:
                    fn = functools.partial(
                        tp.paged_attention_prefill, q, cache, md.block_tables, md.seq_lens, md.query_start_loc,
                        out, scale=0.1, config=tp.PrefillConfig(*params),
                    )  # fmt: skip
                row = {"kind": kind, "shape": case.name, "params": list(params), "ms": graph_ms(fn)}
                if kind == "decode":  # K and V of every context token, read once
                    kv_bytes = 2 * sum(case.seq_lens) * case.num_kv_heads * case.head_dim * cache.element_size()
                    row["GBps"] = kv_bytes / row["ms"] / 1e6
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: skip the config
                row = {"kind": kind, "shape": case.name, "params": list(params), "error": str(exc)[:200]}
            rows.append(row)
        best = sorted((r for r in rows if r["shape"] == case.name and "ms" in r), key=lambda r: r["ms"])[:4]
        print(f"{kind} {case.name}: " + "; ".join(
            f"{r['params']} {r['ms']:.4f}ms" + (f" {r['GBps']:.0f} GB/s" if "GBps" in r else "") for r in best))
        if kind == "decode":
            default = ta.default_decode_config(case.head_dim, dev, cache_dtype)
            now = [r for r in rows if r["shape"] == case.name and "ms" in r
                   and r["params"][:3] == [default.block_n, default.num_warps, default.num_stages]]
            print("   default " + "; ".join(f"{r['params']} {r['ms']:.4f}ms {r['GBps']:.0f} GB/s" for r in now))
        sys.stdout.flush()
        torch.cuda.empty_cache()
    return rows


def _fmt(row: dict, key: str) -> str:
    val = row.get(key)
    return f"{val:9.3f}" if isinstance(val, float) else f"{'-':>9s}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="JSON output path")
    parser.add_argument("--only", default="", help="run only cases whose name contains this")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--skip-ref", action="store_true", help="do not time the torch reference")
    parser.add_argument("--sweep", action="store_true", help="time kernel tile configs instead")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")

    import triton

    env = {
        "gpu": torch.cuda.get_device_name(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    print(json.dumps(env))
    if args.sweep:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"env": env, "sweep": sweep(args)}, indent=1))
        return
    results = []
    header = (
        f"{'case':40s} {'err':>9s} {'cache_err':>9s} {'triton_ms':>9s} {'graph_ms':>9s} {'ref_ms':>9s} "
        f"{'GB/s':>7s} {'TFLOP/s':>7s} {'splits':>6s}"
    )
    print(header)
    for case in cases():
        if args.only and args.only not in case.name:
            continue
        t0 = time.time()
        try:
            row = run_case(case, args)
            row["ok"] = row["max_abs_err"] <= 2e-2 and not row["nan"]
        except Exception as exc:  # noqa: BLE001 - record and go on to the next variant
            row = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        row["wall_s"] = round(time.time() - t0, 2)
        row["case"] = asdict(case) | {"name": case.name}
        # Keep the JSON small: the per-sequence lists are summarised by their lengths.
        row["case"]["query_lens"] = f"{len(case.query_lens)} seqs, max {max(case.query_lens)}"
        row["case"]["seq_lens"] = f"max {max(case.seq_lens)}"
        results.append(row)
        if "error" in row:
            print(f"{case.name:40s} ERROR {row['error'][:200]}")
        else:
            print(
                f"{case.name:40s} {row['max_abs_err']:9.2e} {row['cache_max_abs_err']:9.2e} {_fmt(row, 'triton_ms')} "
                f"{_fmt(row, 'graph_ms')} {_fmt(row, 'ref_ms')} {row['kv_read_gb_s']:7.0f} {row['triton_tflops']:7.1f} "
                f"{row.get('num_splits', '-')!s:>6s}"
                + ("" if row["ok"] else "  FAIL")
                + (f"  graph_error={row['graph_error']}" if "graph_error" in row else "")
            )
        sys.stdout.flush()
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"env": env, "results": results}, indent=1))
    failed = [r["case"]["name"] for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)}/{len(results)} ok" + (f"; failed: {failed}" if failed else ""))


if __name__ == "__main__":
    main()
