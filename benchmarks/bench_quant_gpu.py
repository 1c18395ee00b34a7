"""GPTQ / AWQ / compressed-tensors / FP8 on the GPU: the engine on random Llama-3-8B-shaped
checkpoints of each format against bf16 dummy weights of the same shape, in one process.

    PYTHONPATH=<carried wheels> python benchmarks/bench_quant_gpu.py --out results/quant_gpu.json \\
        [--sections ceilings,bf16,gptq,gptq_actorder,awq,ct_w4a16,fp8,fp8_offline,bf16_offline]

Sections (each one's failure is recorded and the rest go on; the JSON is rewritten after each):
  fixtures       the real-tool fixtures of tests/quant/data/checkpoints on the GPU in bf16 (the
                 Triton int kernels, the FP8 GEMM) against the tools' fp32 references: max |dlogit|
                 with one token per step (batch-1 GEMV), 8 prompts one token each (M = 8) and 8
                 prompts of 16 tokens in one step (M = 128), and the kernel summary lines
  ceilings       copy bandwidth (read + write bytes / s), the denominator of "fraction of copy BW"
  bf16           dummy bf16 weights (the baseline of every ratio)
  gptq, gptq_actorder, awq, ct_w4a16
                 a checkpoint written by scripts/make_random_quant.py (4-bit, group 128; GPTQ v1
                 symmetric, GPTQ asymmetric with act-order, AutoAWQ GEMM, pack-quantized W4A16)
  fp8            dummy bf16 weights quantized at load (`quantization="fp8"`: per-channel weight
                 scales, dynamic per-token activations; the same kernels as an FP8 checkpoint)
  fp8_offline, bf16_offline   1000 prompts x 1000 tokens in, 1000 out (`LLM.generate`)
  fp8_offline_kv8, bf16_offline_kv8   the same with an fp8 KV cache (at this batch the KV cache's
                 reads outweigh the weights')
Each engine section (paphos.LLM, CUDA graphs): batch-1 decode tok/s with the GB/s of the weight
bytes one token reads and its fraction of copy BW, batch-16 / 64 decode tok/s, pp512 tok/s,
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

SECTIONS = ("fixtures", "ceilings", "bf16", "gptq", "gptq_actorder", "awq", "ct_w4a16", "fp8", "fp8_offline", "bf16_offline",
            "fp8_offline_kv8", "bf16_offline_kv8")
DEFAULT_CONFIG = Path(__file__).parent / "configs" / "llama-3-8b.json"
FORMATS = {"gptq": "gptq", "gptq_actorder": "gptq-actorder", "awq": "awq", "ct_w4a16": "ct-w4a16"}


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
            tokenizer=str(self.tokenizer_dir), dtype="bfloat16", max_model_len=4096, max_num_seqs=256,
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


_ITEMSIZE = {"F32": 4, "I32": 4, "I64": 8, "F16": 2, "BF16": 2, "F8_E4M3": 1, "I8": 1, "U8": 1}


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
        for batch in (16, 64):
            steps = engine_steps(llm, random_prompts(batch, 128, vocab, 10 + batch), 64)
            decode = [t for t, rows in steps[1:] if rows == batch]
            out[f"batch{batch}"] = {"tok_s": batch / statistics.median(decode)} if decode else {"error": "no pure decode steps"}
        times = [engine_steps(llm, random_prompts(1, 512, vocab, 100 + s), 1)[0][0] for s in range(4)]
        out["pp512"] = {"tok_s": 512 / min(times[1:]), "ms": min(times[1:]) * 1e3}
        if bench.args.profile:
            out["profile_batch1"] = profile_decode(llm, vocab)
            print_profile("batch-1 decode step", out["profile_batch1"])
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
        t0 = time.perf_counter()
        results = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True))
        elapsed = time.perf_counter() - t0
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    produced = sum(len(r.outputs[0].token_ids) for r in results)
    return {"prompts": len(prompts), "seconds": elapsed, "output_tok_s": produced / elapsed}


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
    from paphos.attention.torch_ref import TorchReferenceBackend
    from paphos.loader import load_model_source
    from paphos.models.registry import resolve_model_class
    from paphos.quant.registry import select_quant_config

    data = ROOT / "tests" / "quant" / "data"
    out: dict[str, Any] = {}
    for path in sorted((data / "checkpoints").iterdir()):
        ref = load_file(str(data / "references" / f"{path.name}.safetensors"))
        source = load_model_source(str(path))
        config = select_quant_config(source, None)
        with torch.device("cuda"):
            model = resolve_model_class(source.hf_config)(source.hf_config, torch.bfloat16, TorchReferenceBackend(), config)
        source.load_into(model, show_progress=False)
        ids = ref["input_ids"].cuda()
        blocks = len(ids) * 4 + 1
        paged.NUM_BLOCKS = blocks
        want = ref["dequant_logits"].cuda()
        errors = {}
        for label, seqs, steps in (
            ("M=1", [ids[0]], [[1]] * 16), ("M=8", list(ids), [[1] * 8] * 16), ("M=128", list(ids), [[16] * 8]),
        ):
            caches = [torch.zeros(model.kv_cache_shape_per_layer(blocks, paged.BLOCK), dtype=torch.bfloat16, device="cuda")
                      for _ in range(model.num_layers)]  # fmt: skip
            got = torch.stack(paged.run_schedule(model, caches, seqs, steps))
            errors[label] = (got - want[: len(seqs)]).abs().max().item()
        tool = (ref["dequant_logits"] - ref["tool_logits"]).abs().max().item()
        out[path.name] = {"max_abs_dlogit": errors, "tool_bf16_or_fp16_vs_reference": tool, "kernels": config.summary()}
        print(f"{path.name:30} {errors}  (the tool's own kernels: {tool:.3f})  {config.summary()}", flush=True)
        del model
    worst = max(max(r["max_abs_dlogit"].values()) - max(r["tool_bf16_or_fp16_vs_reference"], 0.1) for r in out.values())
    out["pass"] = worst <= 0.15
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
    print(f"\n{'':16} {'b1 tok/s':>9} {'x bf16':>7} {'GB/s':>7} {'of copy':>8} {'b16':>8} {'x bf16':>7} "
          f"{'b64':>8} {'pp512':>8} {'GPU GB':>7} {'/file':>6}")  # fmt: skip
    for name in ("bf16", "gptq", "gptq_actorder", "awq", "ct_w4a16", "fp8"):
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
              f"{r['batch16'].get('tok_s', 0):8.0f} {ratio('batch16'):>7} {r['batch64'].get('tok_s', 0):8.0f} "
              f"{r['pp512']['tok_s']:8.0f} {mem['weights_GB']:7.2f} {over:>6}")  # fmt: skip
        for line in r.get("kernels", []):
            print(f"{'':16} {line}")
    for name in ("bf16_offline", "fp8_offline", "bf16_offline_kv8", "fp8_offline_kv8"):
        if "output_tok_s" in results.get(name, {}):
            print(f"{name}: {results[name]['output_tok_s']:.0f} output tok/s ({results[name]['seconds']:.0f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--tmp", help="directory for the generated checkpoints (default: a new temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    parser.add_argument("--gmu", type=float, default=0.85)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--offline-prompts", type=int, default=1000)
    parser.add_argument("--profile", action="store_true", help="engine sections: profile a batch-1 decode and a pp512 step")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bench = Bench(args)
    run_sections(bench, args.sections.split(","), globals())
    bench.save()
    print_table(bench.results)


if __name__ == "__main__":
    main()
