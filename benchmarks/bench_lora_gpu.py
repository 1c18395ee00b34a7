"""Per-request LoRA on the GPU: decode with 64 concurrent requests using 0, 1, 4 and 16 distinct
adapters against the same engine without LoRA, on a Llama-3-8B-shaped model with dummy bf16
weights and on a random GPTQ 4-bit checkpoint of the same shape; and the time to bring an adapter
from the host cache into a device slot and from disk into the host cache.

    PYTHONPATH=<carried wheels> python benchmarks/bench_lora_gpu.py --out results/lora_gpu.json \\
        [--sections ceilings,bf16,w4,swap] [--rank 16] [--swap-rank 64]

Sections (each one's failure is recorded and the rest go on; the JSON is rewritten after each):
  correctness  a tiny random HF Llama with 4 rank-8 adapters, 12 requests mixing them and the base:
             greedy tokens and logprobs of the GPU engine (Triton kernels, CUDA graphs, bf16)
             against the CPU engine (fp32, the torch reference, proven against PEFT in the tests)
  ceilings   copy bandwidth (the denominator of the GB/s fractions)
  bf16, w4   one engine without LoRA and one with --enable-lora --max-loras 16 on the same weights:
             64 requests (128-token prompts, 128 generated, greedy) with no adapter and with
             1 / 4 / 16 distinct adapters spread round-robin, each level 3 times, interleaved; decode
             step time (median over steps with 64 rows: CUDA graphs replayed; median of the rounds),
             tok/s and the overhead against no LoRA, also paired per round against the LoRA
             engine's rows on no adapter; a greedy
             check that an adapter changes the output and the base requests of a LoRA engine
             equal the plain engine's
  swap       a rank --swap-rank adapter on all 7 projections: disk -> host cache (load_adapter,
             pinned) and host cache -> a device slot (AdapterSlots' copy, synchronised), median
  stall      what a hot swap costs the running batch: 32 requests decode on 3 adapters (rank
             --swap-rank, --max-loras 4) when a request arrives on no adapter, on a fourth adapter
             already in a slot, and on one only in the host cache (its copy into a slot then runs beside the
             steps: lora/slots.py prefetch); the longest step after the arrival in each case, and
             the arriving request's time to its first token
Adapters are written as PEFT directories (adapter_config.json + adapter_model.safetensors) with
random weights of rank --rank on q/k/v/o/gate/up/down of every layer.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(Path(__file__).parent))

from bench_gpu import (  # noqa: E402
    Bench,
    random_prompts,
    run_sections,
    section_ceilings,  # noqa: F401 - a section here too (run_sections finds it by name)
    write_synthetic_tokenizer,
)
from make_random_quant import write as write_random_quant  # noqa: E402

from paphos import LLM, SamplingParams  # noqa: E402
from paphos.lora.spec import SUPPORTED_MODULES  # noqa: E402

BATCH, PROMPT, GENERATED = 64, 128, 128
LEVELS = (0, 1, 4, 16)
ROUNDS = 3  # runs per level, interleaved (_levels)


def write_adapter(path: Path, config: dict[str, Any], rank: int, seed: int) -> Path:
    """A PEFT LoRA directory with random A and B (scale alpha / r = 2) on every projection."""
    h, f = config["hidden_size"], config["intermediate_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (fan_in, fan_out) in shapes.items():
            block = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) / fan_in**0.5).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.01).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(SUPPORTED_MODULES),
        "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM",
    }))
    return path


class LoRABench(Bench):
    def adapters(self, count: int, rank: int) -> dict[str, str]:
        names = {}
        for i in range(count):
            path = self.tmp / f"adapter-r{rank}-{i}"
            if not path.exists():
                write_adapter(path, self.config, rank, seed=i)
            names[f"lora{i}"] = str(path)
        return names

    def engine(self, model: str, lora: bool, **extra: Any) -> LLM:
        settings: dict[str, Any] = dict(
            tokenizer=str(self.tokenizer_dir), dtype="bfloat16", max_model_len=4096, max_num_seqs=BATCH,
            gpu_memory_utilization=self.args.gmu,
        )  # fmt: skip
        if model == self.args.config:
            settings["load_format"] = "dummy"
        if lora:
            settings.update(enable_lora=True, max_loras=16, max_cpu_loras=16, max_lora_rank=self.args.rank,
                            lora_modules=self.adapters(16, self.args.rank))  # fmt: skip
        settings.update(extra)
        return LLM(model, **settings)


def decode_run(llm: LLM, prompts: list[list[int]], names: list[str | None]) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """Greedy requests to completion one step at a time: decode-step stats over steps with every
    request decoding, and each request's tokens."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=GENERATED, ignore_eos=True)
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for req_id, prompt, name in zip(ids, prompts, names, strict=True):
        engine.add_request(req_id, prompt, params, lora=engine.frontend.loras.get(name) if name else None)
    tokens: dict[str, list[int]] = {req_id: [] for req_id in ids}
    steps = []
    torch.cuda.synchronize()
    start = t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        t1 = time.perf_counter()
        steps.append((t1 - t0, len(outputs)))
        t0 = t1
        for out in outputs:
            tokens[out.request_id] += out.outputs[0].token_ids
    elapsed = time.perf_counter() - start
    full = [t for t, rows in steps[1:] if rows == len(prompts)]
    step = statistics.median(full or [t for t, _ in steps[1:]])
    # full_steps: steps with every request decoding (the step time is theirs when there are some).
    stats = {"step_ms": step * 1e3, "decode_tok_s": len(prompts) / step, "full_steps": len(full),
             "overall_tok_s": len(prompts) * GENERATED / elapsed}  # fmt: skip
    return stats, {str(i): tokens[req_id] for i, req_id in enumerate(ids)}


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median step time, and every round's step time."""
    ranked = sorted(runs, key=lambda r: r["step_ms"])
    return {**ranked[len(ranked) // 2], "rounds_step_ms": [r["step_ms"] for r in runs]}


def _levels(bench: LoRABench, model: str) -> dict[str, Any]:
    """The engine without LoRA over ROUNDS runs, then the LoRA engine's levels interleaved over
    ROUNDS rounds (no adapter, 1, 4, 16, again ...), so that a drift of the GPU's clocks during the
    section lands on every level alike. Two overheads per level: against the engine without LoRA
    (medians), and paired within each round against the LoRA engine's rows on no adapter (which
    equal the plain engine's to a few tenths of a percent), the median of the rounds' ratios."""
    vocab = bench.config["vocab_size"]
    prompts = random_prompts(BATCH, PROMPT, vocab, seed=7)
    out: dict[str, Any] = {}
    plain = bench.engine(model, lora=False)
    decode_run(plain, prompts[:8], [None] * 8)  # warm-up
    runs = [decode_run(plain, prompts, [None] * BATCH) for _ in range(ROUNDS)]
    out["no_lora"], base_tokens = _median_run([r for r, _ in runs]), runs[0][1]
    del plain, runs
    gc.collect()
    torch.cuda.empty_cache()
    llm = bench.engine(model, lora=True)
    # Warm-up: every adapter into the host cache (their disk loads stay out of the timings), slots, kernels.
    decode_run(llm, prompts[:16], [f"lora{i}" for i in range(16)])
    rounds: dict[int, list[dict[str, Any]]] = {level: [] for level in LEVELS}
    changed: dict[int, int] = {}
    for _ in range(ROUNDS):
        for level in LEVELS:
            names = [None if level == 0 else f"lora{i % level}" for i in range(BATCH)]
            stats, tokens = decode_run(llm, prompts, names)
            rounds[level].append(stats)
            changed[level] = sum(tokens[str(i)] != base_tokens[str(i)] for i in range(BATCH))
    for level in LEVELS:
        stats = _median_run(rounds[level])
        stats["overhead"] = stats["step_ms"] / out["no_lora"]["step_ms"] - 1
        stats["overhead_paired"] = statistics.median(
            r["step_ms"] / b["step_ms"] - 1 for r, b in zip(rounds[level], rounds[0], strict=True)
        )
        stats["changed_vs_base"] = changed[level]
        out[f"adapters_{level}"] = stats
    out["base_rows_equal_plain_engine"] = out["adapters_0"]["changed_vs_base"] == 0
    print_levels(model, out)
    return out


def print_levels(title: str, out: dict[str, Any]) -> None:
    print(f"\n{title}: {BATCH} requests, {PROMPT} in / {GENERATED} out; step ms: median of {ROUNDS} rounds")
    print(f"{'adapters':>12} {'step ms':>8} {'decode tok/s':>13} {'overall tok/s':>14} {'overhead':>9} {'paired':>7}"
          f" {'changed':>8} {'full steps':>10}  rounds (step ms)")
    for key in ("no_lora", *(f"adapters_{n}" for n in LEVELS)):
        s = out[key]
        paired = f"{s['overhead_paired'] * 100:6.1f}%" if "overhead_paired" in s else f"{'-':>7}"
        rounds = " ".join(f"{v:.2f}" for v in s["rounds_step_ms"])
        print(f"{key:>12} {s['step_ms']:8.2f} {s['decode_tok_s']:13.0f} {s['overall_tok_s']:14.0f} "
              f"{s.get('overhead', 0) * 100:8.1f}% {paired} {s.get('changed_vs_base', '-'):>8} {s['full_steps']:>10}  {rounds}")  # fmt: skip


def section_correctness(bench: LoRABench) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)  # fmt: skip
    path = bench.tmp / "tiny"
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(architectures=["LlamaForCausalLM"], **config))
    with torch.no_grad():
        hf.lm_head.weight.mul_(10.0)  # sharper logits: fewer near-ties between fp32 and bf16 paths
    hf.save_pretrained(path)
    write_synthetic_tokenizer(path, config["vocab_size"], config["eos_token_id"])
    modules = {f"a{i}": str(write_adapter(bench.tmp / f"tiny-a{i}", config, 8, seed=50 + i)) for i in range(4)}
    prompts = random_prompts(12, 40, config["vocab_size"], seed=3)
    names = [None if i % 5 == 4 else f"a{i % 5}" for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)

    def run(device: str, dtype: str) -> list:
        llm = LLM(str(path), device=device, dtype=dtype, enable_lora=True, max_loras=4, max_lora_rank=8,
                  lora_modules=modules, max_num_seqs=16, gpu_memory_utilization=0.3)  # fmt: skip
        return [o.outputs[0] for o in llm.generate(prompts, params, lora=names)]

    cpu = run("cpu", "float32")
    out: dict[str, Any] = {}
    for dtype in ("bfloat16",):  # the Triton attention kernels keep K/V in 16 bits
        gpu = run("cuda", dtype)
        same = sum(a.token_ids == b.token_ids for a, b in zip(cpu, gpu, strict=True))
        worst = max(abs(x.logprob - y.logprob) for a, b in zip(cpu, gpu, strict=True)
                    for x, y in zip(a.logprobs, b.logprobs, strict=False) if x.token_id == y.token_id)  # fmt: skip
        out[dtype] = {"requests_identical": f"{same}/12", "max_dlogprob_same_tokens": worst}
    print(f"\ncorrectness (GPU vs CPU reference): {out}")
    return out


def section_bf16(bench: LoRABench) -> dict[str, Any]:
    return _levels(bench, bench.args.config)


def section_w4(bench: LoRABench) -> dict[str, Any]:
    path = bench.tmp / "gptq-8b"
    if not (path / "config.json").exists():
        write_random_quant(path, bench.config, "gptq", 128, seed=0)
    return _levels(bench, str(path))


def section_swap(bench: LoRABench) -> dict[str, Any]:
    from paphos.lora.host_cache import AdapterHostCache
    from paphos.lora.peft import load_adapter
    from paphos.lora.slots import AdapterSlots
    from paphos.lora.spec import lora_model_spec

    rank = bench.args.swap_rank
    llm = bench.engine(bench.args.config, lora=False, max_model_len=1024, gpu_memory_utilization=0.5)
    model = llm.engine.runner.model
    spec = lora_model_spec(model)
    paths = [bench.adapters(3, rank)[f"lora{i}"] for i in range(3)]
    disk = []
    for path in paths:  # the page cache holds them after writing: this is the parse + pin cost
        t0 = time.perf_counter()
        adapter = load_adapter(path, spec, rank, torch.bfloat16)
        adapter.weights = {k: (a.pin_memory(), b.pin_memory()) for k, (a, b) in adapter.weights.items()}
        disk.append(time.perf_counter() - t0)
    host = AdapterHostCache(spec, rank, torch.bfloat16, 4, pin_memory=True)
    slots = AdapterSlots(model, host, 2, rank, torch.bfloat16, torch.device("cuda"))
    host._entries.update({i + 1: load_adapter(p, spec, rank, torch.bfloat16) for i, p in enumerate(paths)})
    for key in list(host._entries):
        entry = host._entries[key]
        entry.weights = {k: (a.pin_memory(), b.pin_memory()) for k, (a, b) in entry.weights.items()}
    nbytes = host._entries[1].num_bytes()
    times = []
    for i in range(9):
        lora_id = i % 3 + 1
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        slots._load(lora_id, {lora_id})
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        slots.unload(lora_id)
    to_slot = statistics.median(times[1:])
    out = {"rank": rank, "adapter_MiB": nbytes / (1 << 20), "disk_to_host_ms": statistics.median(disk) * 1e3,
           "host_to_slot_ms": to_slot * 1e3, "host_to_slot_GBps": nbytes / to_slot / 1e9}  # fmt: skip
    print(f"\nrank-{rank} adapter ({out['adapter_MiB']:.0f} MiB): disk -> host {out['disk_to_host_ms']:.0f} ms, "
          f"host -> slot {out['host_to_slot_ms']:.2f} ms ({out['host_to_slot_GBps']:.1f} GB/s)")  # fmt: skip
    return out


def section_stall(bench: LoRABench) -> dict[str, Any]:
    rank = bench.args.swap_rank
    names = bench.adapters(5, rank)
    llm = bench.engine(bench.args.config, lora=False, max_model_len=1024, gpu_memory_utilization=0.6,
                       enable_lora=True, max_loras=4, max_cpu_loras=8, max_lora_rank=rank,
                       lora_modules={f"s{i}": names[f"lora{i}"] for i in range(5)})  # fmt: skip
    engine = llm.engine
    prompts = random_prompts(33, PROMPT, bench.config["vocab_size"], seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    # Every adapter into the host cache; s1..s4 end in the four slots (s0 was loaded first and evicted).
    decode_run(llm, prompts[:5], [f"s{i}" for i in range(5)])
    decode_run(llm, prompts[:4], [f"s{i}" for i in range(1, 5)])
    out: dict[str, Any] = {"rank": rank}
    for case, arriving in (("base", None), ("resident", "s4"), ("host_only", "s0")):
        ids = [f"{case}-{i}" for i in range(32)]
        for i, req_id in enumerate(ids):  # s1, s2, s3 run; s4's slot is idle
            engine.add_request(req_id, prompts[i], params, lora=engine.frontend.loras.get(f"s{1 + i % 3}"))
        steps, first = [], None
        for _ in range(12):  # the 32 prompts prefilled, decoding
            engine.step()
        torch.cuda.synchronize()
        t_add = time.perf_counter()
        lora = engine.frontend.loras.get(arriving) if arriving else None
        engine.add_request(f"{case}-new", prompts[32], params, lora=lora)
        t0 = t_add
        while engine.has_unfinished_requests():
            outputs = engine.step()
            t1 = time.perf_counter()
            steps.append((t1 - t0) * 1e3)
            t0 = t1
            if first is None and any(o.request_id == f"{case}-new" and o.outputs[0].token_ids for o in outputs):
                first = (t1 - t_add) * 1e3
        out[case] = {"median_step_ms": statistics.median(steps), "max_step_ms_after_arrival": max(steps[:20]),
                     "arrival_ttft_ms": first, "steps_after_arrival_ms": steps[:8]}  # fmt: skip
    out["stall_ms"] = out["host_only"]["max_step_ms_after_arrival"] - out["resident"]["max_step_ms_after_arrival"]
    print(f"\nhot swap of a rank-{rank} adapter under 32 decoding requests: longest step after the arrival "
          f"{out['resident']['max_step_ms_after_arrival']:.2f} ms (adapter in a slot) vs "
          f"{out['host_only']['max_step_ms_after_arrival']:.2f} ms (host cache only): {out['stall_ms']:+.2f} ms; "
          f"arrival's TTFT {out['resident']['arrival_ttft_ms']:.1f} vs {out['host_only']['arrival_ttft_ms']:.1f} ms "
          f"(a request on no adapter: longest step {out['base']['max_step_ms_after_arrival']:.2f} ms, "
          f"TTFT {out['base']['arrival_ttft_ms']:.1f} ms)")
    for case in ("base", "resident", "host_only"):
        print(f"  {case:9} steps after the arrival, ms: " + " ".join(f"{t:.1f}" for t in out[case]["steps_after_arrival_ms"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/lora_gpu.json")
    parser.add_argument("--config", default=str(ROOT / "benchmarks" / "configs" / "llama-3-8b.json"))
    parser.add_argument("--sections", default="correctness,ceilings,bf16,w4,swap,stall")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--swap-rank", type=int, default=64)
    parser.add_argument("--gmu", type=float, default=0.85)
    args = parser.parse_args()
    bench = LoRABench(args)
    bench.results["args"] = vars(args)
    run_sections(bench, args.sections.split(","), globals())


if __name__ == "__main__":
    main()
