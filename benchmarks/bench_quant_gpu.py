"""GPTQ / AWQ / compressed-tensors / FP8 / EXL2 on the GPU: the engine on random Llama-3-8B-shaped
checkpoints of each format against bf16 dummy weights of the same shape, in one process.

    PYTHONPATH=<carried wheels> python benchmarks/bench_quant_gpu.py --out results/quant_gpu.json \\
        [--sections ceilings,bf16,gptq,gptq_actorder,awq,ct_w4a16,fp8,fp8_offline,bf16_offline] \\
        [--fixtures 'exl2*']

Sections (each one's failure is recorded and the rest go on; the JSON is rewritten after each):
  fixtures       the real-tool fixtures of tests/quant/data/checkpoints (`--fixtures`: a glob of
                 their names) on the GPU in bf16 (EXL2: fp16 and bf16) with the formats' kernels
                 (the Triton int kernels, the FP8 GEMM, the EXL2 kernels) and the Triton attention
                 (whose decode merge writes o_proj's int8 parts) against the tools' fp32
                 references: max |dlogit| with one token per step (batch-1 GEMV), 8 prompts one
                 token each (M = 8) and 8 prompts of 16 tokens in one step (M = 128), and the
                 kernel summary lines
  exl2_kernels   the EXL2 kernels (paphos/quant/kernels/triton_exl2.py) on Llama-3-8B shapes with
                 random code streams (q|k|v, o, gate|up, down at 4.0 bpw; o and down at 2.5 and
                 6.0 bpw; the 6-bit head): the dequantize kernel bit-exact against exl2.dequantize
                 in bf16 and fp16, the GEMV (1-8 tokens) and dequantize + cuBLAS (16 tokens)
                 against float32 products of the same weights; CUDA-graph times of the batch-1
                 GEMV (GB/s of the layer's bytes, and bf16 cuBLAS on the same shape), on o and
                 gate|up a sweep of its tile / warps / K slices, and the GEMV against dequantize
                 + cuBLAS at 1-16 tokens on gate|up (the crossover, GEMV_MAX_TOKENS)
  ceilings       copy bandwidth (read + write bytes / s), the denominator of "fraction of copy BW"
  bf16           dummy bf16 weights (the baseline of every ratio)
  gptq, gptq_actorder, gptq_actorder_sym, awq, ct_w4a16
                 a checkpoint written by scripts/make_random_quant.py (4-bit, group 128; GPTQ v1
                 symmetric, GPTQ asymmetric with act-order, GPTQ symmetric with act-order,
                 AutoAWQ GEMM, pack-quantized W4A16)
  exl2, exl2_mix EXL2 checkpoints written by scripts/make_random_quant.py: 4.0 bpw (5/4/3-bit
                 groups of 32/64/128 rows), and 2.5 bpw (3/2-bit) layers alternating with 6.0 bpw
                 (8/6/4-bit) ones; 6-bit heads
  fp8            dummy bf16 weights quantized at load (`quantization="fp8"`: per-channel weight
                 scales, dynamic per-token activations; the same kernels as an FP8 checkpoint)
  fp8_block      a block-wise FP8 checkpoint written by scripts/make_random_quant.py (the `fp8`
                 format with 128 x 128 `weight_block_size`, as DeepSeek-V3 and Qwen3-FP8 ship)
  fp8_offline, bf16_offline   1000 prompts x 1000 tokens in, 1000 out (`LLM.generate`'s loop),
                 with where the time went (bench_gpu.offline_run: decode-only steps by batch,
                 steps with prefill, preemptions, the KV cache's fill; with --profile, the
                 kernels of a decode step at full batch and of a full prefill step)
  fp8_offline_kv8, bf16_offline_kv8   the same with an fp8 KV cache (at this batch the KV cache's
                 reads outweigh the weights')
Each engine section (paphos.LLM, CUDA graphs): batch-1 decode tok/s with the GB/s of the weight
bytes one token reads and its fraction of copy BW, batch-16 / 32 / 64 (and `--batches`) decode tok/s, pp512 tok/s,
weight bytes on the GPU against the checkpoint's tensor bytes, the kernel summary lines the
engine logged, and the greedy tokens of a fixed prompt.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(Path(__file__).parent))

from bench_gpu import (  # noqa: E402
    engine_steps,
    offline_run,
    print_offline,
    print_profile,
    profile_decode,
    profile_prefill,
    random_prompts,
    run_sections,
    section_ceilings,  # noqa: F401 - a section here too (run_sections finds it by name)
    write_synthetic_tokenizer,
)
from make_random_quant import write as write_random_quant  # noqa: E402

from paphos import LLM  # noqa: E402
from paphos.sampling_params import SamplingParams  # noqa: E402

SECTIONS = ("fixtures", "exl2_kernels", "ceilings", "bf16", "gptq", "gptq_actorder", "gptq_actorder_sym", "awq",
            "ct_w4a16", "exl2", "exl2_mix", "fp8", "fp8_block", "fp8_offline", "bf16_offline", "fp8_offline_kv8", "bf16_offline_kv8")
DEFAULT_CONFIG = Path(__file__).parent / "configs" / "llama-3-8b.json"
FORMATS = {"gptq": "gptq", "gptq_actorder": "gptq-actorder", "gptq_actorder_sym": "gptq-actorder-sym", "awq": "awq",
           "ct_w4a16": "ct-w4a16", "fp8_block": "fp8-block", "exl2": "exl2", "exl2_mix": "exl2-mix"}


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.results: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
        self.tmp = Path(args.tmp or tempfile.mkdtemp(prefix="paphos-quant-bench-"))
        self.config = json.loads(Path(args.config).read_text())
        self.tokenizer_dir = self.tmp / "tokenizer"
        write_synthetic_tokenizer(self.tokenizer_dir, self.config["vocab_size"], self.config["eos_token_id"])

    def save(self) -> None:
        Path(self.args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(self.args.out).write_text(json.dumps(self.results, indent=1, default=str))

    def llm(self, path: Path | None, **extra: Any) -> LLM:
        kwargs: dict[str, Any] = dict(
            tokenizer=str(self.tokenizer_dir), dtype="bfloat16", max_model_len=4096, max_num_seqs=self.args.max_num_seqs,
            max_num_batched_tokens=self.args.max_num_batched_tokens, gpu_memory_utilization=self.args.gmu,
            enable_prefix_caching=False,
        )  # fmt: skip
        if path is None:
            return LLM(str(self.args.config), load_format="dummy", **kwargs, **extra)
        return LLM(str(path), **kwargs, **extra)


class _Summary(logging.Handler):
    """Collects the engine's kernel summary lines ("Using Marlin-class kernels for N layers")."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "paphos.worker.setup" and ("kernels" in record.getMessage() or "layers" in record.getMessage()):
            self.lines.append(record.getMessage())


def _gpu_bytes(module: torch.nn.Module) -> int:
    tensors = {t.data_ptr(): t for t in [*module.parameters(), *module.buffers()] if t.is_cuda and t.numel()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


_ITEMSIZE = {"F32": 4, "I32": 4, "I64": 8, "F16": 2, "BF16": 2, "I16": 2, "F8_E4M3": 1, "I8": 1, "U8": 1}


def _file_bytes(path: Path | None) -> int | None:
    """Tensor bytes of a checkpoint directory (from the safetensors headers)."""
    if path is None:
        return None
    from safetensors import safe_open

    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                total += math.prod(tensor.get_shape()) * _ITEMSIZE[tensor.get_dtype()]
    return total


def run_engine(bench: Bench, path: Path | None, **extra: Any) -> dict[str, Any]:
    vocab = bench.config["vocab_size"]
    summary = _Summary()
    logging.getLogger("paphos.worker.setup").addHandler(summary)
    t0 = time.perf_counter()
    llm = bench.llm(path, **extra)
    logging.getLogger("paphos.worker.setup").removeHandler(summary)
    out: dict[str, Any] = {"startup_s": time.perf_counter() - t0, "kernels": summary.lines}
    try:
        model = llm.engine.runner.model
        total = _gpu_bytes(model)
        read = total - _gpu_bytes(model.model.embed_tokens)  # a step reads a few embedding rows
        file_bytes = _file_bytes(path)
        out["memory"] = {"weights_GB": total / 1e9, "read_per_token_GB": read / 1e9,
                         "file_tensor_GB": file_bytes / 1e9 if file_bytes else None,
                         "weights_over_file": total / file_bytes if file_bytes else None}  # fmt: skip
        bw = bench.results.get("copy_bw")
        engine_steps(llm, random_prompts(1, 32, vocab, 1), 8)  # warm-up
        steps = engine_steps(llm, random_prompts(1, 128, vocab, 2), 128)
        tpot = statistics.median(t for t, rows in steps[1:] if rows == 1)
        out["batch1"] = {"tok_s": 1 / tpot, "step_ms": tpot * 1e3, "GBps": read / tpot / 1e9,
                         "frac_copy_bw": read / tpot / bw if bw else None}  # fmt: skip
        done = llm.generate([random_prompts(1, 96, vocab, 7)[0]], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
        out["greedy_tokens"] = done[0].outputs[0].token_ids
        for batch in sorted({16, 32, 64, *bench.args.batches} - {1}):  # batch 1 has its own row above
            steps = engine_steps(llm, random_prompts(batch, 128, vocab, 10 + batch), 64)
            decode = [t for t, rows in steps[1:] if rows == batch]
            out[f"batch{batch}"] = {"tok_s": batch / statistics.median(decode)} if decode else {"error": "no pure decode steps"}
        times = [engine_steps(llm, random_prompts(1, 512, vocab, 100 + s), 1)[0][0] for s in range(4)]
        out["pp512"] = {"tok_s": 512 / min(times[1:]), "ms": min(times[1:]) * 1e3}
        if bench.args.profile:
            for batch in (1, 16):
                out[f"profile_batch{batch}"] = profile_decode(llm, vocab, batch)
                print_profile(f"batch-{batch} decode step", out[f"profile_batch{batch}"])
            out["profile_pp512"] = profile_prefill(llm, vocab)
            print_profile("pp512 step", out["profile_pp512"])
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return out


def offline(bench: Bench, **extra: Any) -> dict[str, Any]:
    vocab = bench.config["vocab_size"]
    llm = bench.llm(None, **extra)
    try:
        prompts = random_prompts(bench.args.offline_prompts, 1000, vocab, 99)
        params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
        run = offline_run(llm, prompts, params, profile_at=300 if bench.args.profile else None)
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    print_offline(f"offline {len(prompts)} x 1000 in, 1000 out", run)
    return run


def _checkpoint(bench: Bench, fmt: str) -> Path:
    path = bench.tmp / fmt
    if not (path / "config.json").exists():
        t0 = time.perf_counter()
        write_random_quant(path, bench.config, fmt, 128, seed=0)
        print(f"wrote {path} in {time.perf_counter() - t0:.1f} s", flush=True)
    return path


def section_fixtures(bench: Bench) -> dict[str, Any]:
    from safetensors.torch import load_file

    import tests.models.paged as paged
    from paphos.attention.triton_backend import TritonAttentionBackend
    from paphos.loader import load_model_source
    from paphos.models.registry import resolve_model_class
    from paphos.quant.registry import select_quant_config

    data = ROOT / "tests" / "quant" / "data"
    out: dict[str, Any] = {}
    for path in sorted((data / "checkpoints").glob(bench.args.fixtures)):
        ref = load_file(str(data / "references" / f"{path.name}.safetensors"))
        source = load_model_source(str(path))
        # EXL2 in both 16-bit types: its GEMV multiplies fp16 weights by x in float32 either way,
        # its dense path converts them to the model dtype
        for dtype in (torch.float16, torch.bfloat16) if path.name.startswith("exl2") else (torch.bfloat16,):
            config = select_quant_config(source, None)
            with torch.device("cuda"):
                model = resolve_model_class(source.hf_config)(source.hf_config, dtype, TritonAttentionBackend(), config)
            source.load_into(model, show_progress=False)
            ids = ref["input_ids"].cuda()
            blocks = len(ids) * 4 + 1
            paged.NUM_BLOCKS = blocks
            want = ref["dequant_logits"].cuda()
            errors = {}
            for label, seqs, steps in (
                ("M=1", [ids[0]], [[1]] * 16), ("M=8", list(ids), [[1] * 8] * 16), ("M=128", list(ids), [[16] * 8]),
            ):
                caches = [torch.zeros(model.kv_cache_shape_per_layer(blocks, paged.BLOCK), dtype=dtype, device="cuda")
                          for _ in range(model.num_layers)]  # fmt: skip
                got = torch.stack(paged.run_schedule(model, caches, seqs, steps))
                errors[label] = (got - want[: len(seqs)]).abs().max().item()
            tool = (ref["dequant_logits"] - ref["tool_logits"]).abs().max().item()
            name = path.name if dtype == torch.bfloat16 and not path.name.startswith("exl2") else f"{path.name}-{str(dtype)[6:]}"
            out[name] = {"max_abs_dlogit": errors, "tool_bf16_or_fp16_vs_reference": tool, "kernels": config.summary()}
            print(f"{name:30} {errors}  (the tool's own kernels: {tool:.3f})  {config.summary()}", flush=True)
            del model
    worst = max(max(r["max_abs_dlogit"].values()) - max(r["tool_bf16_or_fp16_vs_reference"], 0.1) for r in out.values())
    out["pass"] = worst <= 0.15
    return out


def _exl2_layer(shapes: list[tuple[int, int]], mix: Any, gen: torch.Generator, block_n: int | None = None) -> tuple[Any, torch.Tensor]:
    """Planes of one random EXL2 layer (its shards' [n, k]) on the GPU, and its float32 weight
    [N, K] by exl2.dequantize."""
    from make_random_quant import exl2_tensors

    from paphos.quant.exl2 import CHECKPOINT_TENSORS, _group_tuples, check_tensors, dequantize
    from paphos.quant.kernels import exl2_layout

    shards, weights = [], []
    for n, k in shapes:
        t = {name.rsplit(".", 1)[1]: v.cuda() for name, v in exl2_tensors("w", n, k, mix, gen).items()}
        groups = _group_tuples(check_tensors(*(t[name] for name in CHECKPOINT_TENSORS)))
        shards.append(exl2_layout.Shard(t["q_weight"], t["q_scale"], t["q_scale_max"], t["q_invperm"], groups, n))
        weights.append(dequantize(*(t[name] for name in CHECKPOINT_TENSORS))[:n])
    return exl2_layout.pack(shards, block_n), torch.cat(weights)


def _copies(planes: Any, count: int) -> list[Any]:
    """Copies of a layer's planes, cycled through so a timed loop reads memory, not L2."""
    import dataclasses

    return [planes] + [dataclasses.replace(planes, **{n: t.clone() for n, t in planes.tensors().items()}, launches={})
                       for _ in range(count - 1)]  # fmt: skip


def _exl2_timings(bench: Bench, name: str, planes: Any, weight: torch.Tensor) -> dict[str, Any]:
    """CUDA-graph times of one EXL2 layer: the batch-1 GEMV by the launch rule, bf16 cuBLAS on
    the same shape, a sweep of the GEMV's launch (K slices, loads a run ahead or not; o and
    gate|up also tile widths), and (gate|up) the GEMV against dequantize + cuBLAS at 1-16 tokens,
    the GEMV with and without loads a run ahead."""
    import dataclasses

    import torch.nn.functional as F
    from timing import graph_time

    from paphos.quant.kernels import triton_exl2 as te

    n, k = weight.shape
    count = max(1, min(8, math.ceil(200e6 / planes.nbytes())))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

    def gemv_time(p: Any, split: int | None = None, warps: int | None = None, ahead: bool | None = None) -> float:
        return graph_time([lambda c=c: te.gemv(x, c, split, warps, ahead) for c in _copies(p, count)])

    t = gemv_time(planes)
    w16 = [weight.to(torch.bfloat16) for _ in range(max(1, min(4, math.ceil(200e6 / (n * k * 2)))))]
    t16 = graph_time([lambda w=w: F.linear(x, w) for w in w16])
    del w16
    split, ahead = te.gemv_launch(planes)
    r: dict[str, Any] = {"gemv_m1": {"us": t * 1e6, "GBps": planes.nbytes() / t / 1e9, "bf16_us": t16 * 1e6,
                                     "x_bf16": t16 / t, "split": split, "ahead": ahead, "block_n": planes.block_n}}  # fmt: skip
    if bench.results.get("copy_bw"):
        r["gemv_m1"]["frac_copy_bw"] = planes.nbytes() / t / bench.results["copy_bw"]
    # every layer: K slices around the rule's, each run's loads issued ahead of its multiply or not;
    # a narrow and a wide layer also: tile width (4 columns per thread, or 8)
    sweep = {}
    base = te.gemv_launch(planes)[0]
    for split in sorted({max(1, base // 2), base, base * 2, base * 4}):
        for ahead in (True, False):
            sweep[f"bn{planes.block_n}-s{split}-{'ahead' if ahead else 'after'}"] = round(
                gemv_time(planes, split, None, ahead) * 1e6, 2)
    if name in ("o", "gate_up"):
        for block_n, warps in ((256, 1), (512, 2)):
            tiles = [[i, c0] for i, cols in enumerate(planes.meta[:, 7].tolist()) for c0 in range(0, cols, block_n)]
            p = dataclasses.replace(planes, block_n=block_n, launches={},
                                    tiles=torch.tensor(tiles, dtype=torch.int32, device="cuda"))  # fmt: skip
            base = te.gemv_launch(p)[0]
            for split in sorted({max(1, base // 2), base, base * 2}):
                sweep[f"bn{block_n}-w{warps}-s{split}"] = round(gemv_time(p, split, warps) * 1e6, 2)
    r["gemv_m1_sweep_us"] = sweep
    best = min(sweep, key=sweep.get)
    print(f"  {name}: GEMV {t * 1e6:.2f} us by the rule, best {best} {sweep[best]} us; bf16 {t16 * 1e6:.2f} us", flush=True)
    if name == "gate_up":
        cross = {}
        for m in (1, 2, 4, 8, 16):
            xm = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cross[m] = {"gemv_us": graph_time([lambda xm=xm: te.gemv(xm, planes)], 16) * 1e6,
                        "dequant_cublas_us": graph_time([lambda xm=xm: te.dequant_matmul(xm, planes)], 16) * 1e6}  # fmt: skip
            for ahead in (True, False):
                cross[m][f"gemv_{'ahead' if ahead else 'after'}_us"] = graph_time(
                    [lambda xm=xm, a=ahead: te.gemv(xm, planes, ahead=a)], 16) * 1e6
        r["gemv_vs_dequant_us"] = cross
    return r


def section_exl2_kernels(bench: Bench) -> dict[str, Any]:
    from make_random_quant import EXL2_HEAD, EXL2_MIXES

    from paphos.quant.kernels import exl2_layout
    from paphos.quant.kernels import triton_exl2 as te

    c = bench.config
    h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    layers = {"qkv": [(q, h), (kv, h), (kv, h)], "o": [(h, q)], "gate_up": [(f, h), (f, h)], "down": [(h, f)]}
    cases = [(name, "4.0", shapes) for name, shapes in layers.items()]
    cases += [(name, bpw, layers[name]) for bpw in ("2.5", "6.0") for name in ("o", "down")]
    cases.append(("head", "6-bit", [(v + -v % 32, h)]))
    gen = torch.Generator().manual_seed(1)
    out: dict[str, Any] = {"cases": {}}
    ok = True
    for name, bpw, shapes in cases:
        mix = EXL2_HEAD if name == "head" else EXL2_MIXES[float(bpw)]
        planes, weight = _exl2_layer(shapes, mix, gen)
        n, k = weight.shape
        r: dict[str, Any] = {"shape": [n, k], "bits_per_weight_on_gpu": exl2_layout.bits_per_weight(planes)}
        for dtype in (torch.bfloat16, torch.float16):
            wt = torch.empty(k, n, dtype=dtype, device="cuda")
            te.dequantize_into(planes, 0, n, wt)
            r[f"dequant_exact_{str(dtype)[6:]}"] = exact = torch.equal(wt, weight.t().to(dtype))
            ok &= exact
            del wt
        for m, dtype in ((1, torch.bfloat16), (1, torch.float16), (2, torch.bfloat16), (4, torch.bfloat16),
                         (8, torch.bfloat16), (16, torch.bfloat16)):  # fmt: skip
            x = torch.randn(m, k, device="cuda").to(dtype)
            ref = x.float() @ weight.t()
            got = te.matmul(x, planes).float()
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            r[f"rel_err_m{m}_{str(dtype)[6:]}"] = err
            ok &= err < 1e-2
        if bpw in ("4.0", "6-bit"):
            r |= _exl2_timings(bench, name, planes, weight)
        out["cases"][f"{name}-{bpw}"] = r
        print(f"{name}-{bpw}: {json.dumps(r, default=str)[:600]}", flush=True)
        del planes, weight
        torch.cuda.empty_cache()
    out["pass"] = ok
    return out


def section_bf16(bench: Bench) -> dict[str, Any]:
    return run_engine(bench, None)


def section_fp8(bench: Bench) -> dict[str, Any]:
    return run_engine(bench, None, quantization="fp8")


def section_fp8_offline(bench: Bench) -> dict[str, Any]:
    return offline(bench, quantization="fp8")


def section_bf16_offline(bench: Bench) -> dict[str, Any]:
    return offline(bench)


def section_fp8_offline_kv8(bench: Bench) -> dict[str, Any]:
    return offline(bench, quantization="fp8", kv_cache_dtype="fp8")


def section_bf16_offline_kv8(bench: Bench) -> dict[str, Any]:
    return offline(bench, kv_cache_dtype="fp8")


def _format_section(name: str) -> Any:
    def section(bench: Bench) -> dict[str, Any]:
        path = _checkpoint(bench, FORMATS[name])
        try:
            return run_engine(bench, path)
        finally:
            if not bench.args.keep:
                for file in path.iterdir():
                    file.unlink()
                path.rmdir()

    return section


for _name in FORMATS:
    globals()[f"section_{_name}"] = _format_section(_name)


def print_table(results: dict[str, Any]) -> None:
    base = results.get("bf16", {})
    names = ("bf16", "gptq", "gptq_actorder", "gptq_actorder_sym", "awq", "ct_w4a16", "exl2", "exl2_mix", "fp8")
    if any(name in results for name in names):
        print_engine_table(results, base, names)
    offline_base = results.get("bf16_offline", {}).get("output_tok_s")
    for name in ("bf16_offline", "fp8_offline", "bf16_offline_kv8", "fp8_offline_kv8"):
        run = results.get(name, {})
        if "output_tok_s" in run:
            ratio = f", {run['output_tok_s'] / offline_base:.2f}x bf16_offline" if offline_base else ""
            print(f"{name}: {run['output_tok_s']:.0f} output tok/s ({run['seconds']:.0f} s, {run['prompts']} prompts"
                  f"{ratio}, {run['preemptions']} preemptions)")


def print_engine_table(results: dict[str, Any], base: dict[str, Any], names: tuple[str, ...]) -> None:
    print(f"\n{'':16} {'b1 tok/s':>9} {'x bf16':>7} {'GB/s':>7} {'of copy':>8} {'b16':>8} {'x bf16':>7} "
          f"{'b32':>8} {'x bf16':>7} {'b64':>8} {'x bf16':>7} {'pp512':>8} {'GPU GB':>7} {'/file':>6}")  # fmt: skip
    for name in names:
        r = results.get(name)
        if not r or "batch1" not in r:
            if r:
                print(f"{name:16} {r.get('error', 'incomplete')}")
            continue

        def ratio(key: str, r: dict = r) -> str:
            return f"{r[key]['tok_s'] / base[key]['tok_s']:.2f}" if key in base and "tok_s" in r.get(key, {}) else "-"

        b1, mem = r["batch1"], r["memory"]
        frac = f"{b1['frac_copy_bw']:.2f}" if b1.get("frac_copy_bw") else "-"
        over = f"{mem['weights_over_file']:.2f}" if mem.get("weights_over_file") else "-"
        print(f"{name:16} {b1['tok_s']:9.1f} {ratio('batch1'):>7} {b1['GBps']:7.0f} {frac:>8} "
              f"{r['batch16'].get('tok_s', 0):8.0f} {ratio('batch16'):>7} {r.get('batch32', {}).get('tok_s', 0):8.0f} "
              f"{ratio('batch32'):>7} {r['batch64'].get('tok_s', 0):8.0f} {ratio('batch64'):>7} "
              f"{r['pp512']['tok_s']:8.0f} {mem['weights_GB']:7.2f} {over:>6}")  # fmt: skip
        extra = sorted(int(key[5:]) for key in r if key.startswith("batch") and key[5:] not in ("1", "16", "32", "64"))
        if extra:
            print(f"{'':16} " + "  ".join(f"b{b} {r[f'batch{b}'].get('tok_s', 0):.0f} (x bf16 {ratio(f'batch{b}')})" for b in extra))
        for line in r.get("kernels", []):
            print(f"{'':16} {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--tmp", help="directory for the generated checkpoints (default: a new temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    parser.add_argument("--gmu", type=float, default=0.85)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--offline-prompts", type=int, default=1000)
    parser.add_argument("--fixtures", default="*", help="fixtures section: a glob of the fixture names (e.g. 'exl2*')")
    parser.add_argument("--batches", type=lambda v: [int(b) for b in v.split(",") if b], default=[],
                        help="engine sections: decode batch sizes measured besides 16, 32 and 64 (e.g. 2,4,8)")
    parser.add_argument("--profile", action="store_true", help="engine sections: profile batch-1 and batch-16 decode steps and a pp512 step (per-kernel "
                        "times with PAPHOS_DISABLE_PDL=1: PDL folds each kernel's wait into its time)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bench = Bench(args)
    run_sections(bench, args.sections.split(","), globals())
    bench.save()
    print_table(bench.results)


if __name__ == "__main__":
    main()
