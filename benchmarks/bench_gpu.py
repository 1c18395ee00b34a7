"""The GPU path in one process: hardware ceilings, correctness against the reference paths, and
engine timings on a Llama-3-8B-shaped model with dummy bf16 weights, with HF `transformers`
`generate` (static cache) on the same shapes as the peer.

    python benchmarks/bench_gpu.py --out results/gpu.json [--sections decode,sweep,...]
        [--smollm2 PATH.gguf] [--config benchmarks/configs/llama-3-8b.json]

Sections (all by default, run in this order; each one's failure is recorded and the rest go on;
the JSON is rewritten after every section so a timeout keeps what finished):
  ceilings     copy bandwidth (bytes read + written / s) and bf16 GEMM TFLOP/s, measured here
  correctness  a tiny random Llama (HF checkpoint) and, with --smollm2, SmolLM2 dequantized to
               bf16: greedy tokens of the GPU path (Triton + CUDA graphs) vs the GPU torch
               reference backend (eager) vs the CPU reference path, on prompts that mix decode
               rows, chunked prefill and prefix-cache hits; a divergence reports the reference's
               top-2 logprob gap there (a near-tie when small)
  decode       batch-1 decode at context 128 and 4096: TPOT, tok/s, GB/s and fraction of copy BW
               (bytes per step = weights except the input embedding + the KV read)
  profile      CUDA time by kernel kind of one eager decode step at batch 1 and 256, and the host
               share of an engine step (engine step time - graph replay time)
  sweep        decode step time at batch 1..256 (the weight-bound to KV-bound curve)
  concurrent   64 sequences, 128-token prompts, 128 generated: decode tok/s and overall tok/s
  ttft         a lone 1024-token prompt: time to the first token
  prefill      4 x 4096-token prompts: prefill tok/s
  hf           transformers generate, static cache, greedy, 128 in / 128 out, batch 1/16/64
  offline      1000 prompts x 1000 in / 1000 out and 128 x 32 in / 2048 out (ignore_eos)
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paphos import LLM  # noqa: E402
from paphos.layers import pdl  # noqa: E402
from paphos.sampling_params import SamplingParams  # noqa: E402

SECTIONS = ("ceilings", "correctness", "decode", "profile", "sweep", "concurrent", "ttft", "prefill", "offline", "hf")
DEFAULT_CONFIG = Path(__file__).parent / "configs" / "llama-3-8b.json"


# ----------------------------------------------------------------------------- helpers


def cuda_time(fn: Callable[[], object], warmup: int = 3, iters: int = 10) -> float:
    """Median seconds of `fn` on the GPU, by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def engine_steps(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[tuple[float, int]]:
    """Runs greedy requests for the prompts to completion one engine step at a time: (step seconds,
    rows decoded) per step."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", prompt, params)
    steps = []
    torch.cuda.synchronize()
    # Every step ends by reading its sampled ids back, so the gaps between step returns are the
    # step periods, also when the decode lookahead keeps the next step running in between.
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        t1 = time.perf_counter()
        steps.append((t1 - t0, len(outputs)))
        t0 = t1
    return steps


def offline_run(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, profile_at: int | None = None
) -> dict[str, Any]:
    """Every prompt to completion one engine step at a time (as `LLM.generate` runs them): output
    tok/s, and where the wall time went: steps that only decode against steps that also prefill,
    decode step times by batch size, preemptions and the KV cache's fill. `profile_at`: after
    that many decode-only steps, `kernel_profile` of the next 4 (and of the first step that
    prefills a full token budget): what a step at this workload's batch spends per kernel."""
    engine = llm.engine
    scheduler = engine.scheduler
    scheduled: list[tuple[int, int]] = []
    schedule = scheduler.schedule

    def recording_schedule() -> Any:
        out = schedule()
        scheduled.append((out.total_num_scheduled_tokens, len(out.num_scheduled_tokens)))
        return out

    scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    produced = 0
    steps: list[tuple[float, int, int]] = []  # (seconds, tokens, requests)
    profiles: dict[str, Any] = {}
    profiled_s, profiled_tokens = 0.0, 0  # the profiled steps', left out of the throughput
    preempted_before = scheduler.num_preemptions_total
    peak_running, peak_kv = 0, 0.0

    def one_step() -> None:
        nonlocal produced, peak_running, peak_kv
        for delta in engine.step():
            produced += sum(len(c.token_ids) for c in delta.outputs)
        peak_running, peak_kv = max(peak_running, scheduler.num_running), max(peak_kv, scheduler.kv_usage)

    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"offline-{time.monotonic_ns()}-{i}", prompt, params)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = t0 = time.perf_counter()
        decode_steps = 0
        while engine.has_unfinished_requests():
            one_step()
            t1 = time.perf_counter()
            steps.append((t1 - t0, *scheduled[-1]))
            tokens, requests = scheduled[-1]
            decode_steps += tokens == requests
            before = produced
            if profile_at is not None and "decode" not in profiles and decode_steps >= profile_at:
                profiles["decode"] = {"requests": requests, **kernel_profile(one_step, 4)}
                print_profile(f"offline decode step ({requests} sequences)", profiles["decode"])
            elif profile_at is not None and "prefill" not in profiles and tokens >= scheduler.max_num_batched_tokens:
                profiles["prefill"] = {"tokens": tokens, "requests": requests, **kernel_profile(one_step, 1)}
                print_profile(f"offline prefill step ({tokens} tokens)", profiles["prefill"])
            t0, profiled_s = time.perf_counter(), profiled_s + time.perf_counter() - t1
            profiled_tokens += produced - before
        elapsed = time.perf_counter() - start - profiled_s
    finally:
        scheduler.schedule = schedule  # type: ignore[method-assign]
    decode = [(t, r) for t, tok, r in steps if tok == r]
    mixed = [(t, tok, r) for t, tok, r in steps if tok != r]
    by_batch: dict[str, Any] = {}
    for low, high in ((1, 63), (64, 127), (128, 191), (192, 255), (256, 1 << 20)):
        times = [t for t, r in decode if low <= r <= high]
        if times:
            by_batch[f"{low}-{min(high, max(r for _, r in decode))}"] = {
                "steps": len(times), "seconds": sum(times), "median_ms": statistics.median(times) * 1e3}
    return {
        "prompts": len(prompts), "seconds": elapsed, "output_tok_s": (produced - profiled_tokens) / elapsed,
        "total_tok_s": (produced - profiled_tokens + sum(map(len, prompts))) / elapsed,
        "decode_only": {"steps": len(decode), "seconds": sum(t for t, _ in decode),
                        "mean_batch": statistics.fmean(r for _, r in decode) if decode else 0.0, "by_batch": by_batch},
        "with_prefill": {"steps": len(mixed), "seconds": sum(t for t, _, _ in mixed),
                         "prefill_tokens": sum(tok - r for _, tok, r in mixed)},
        "preemptions": scheduler.num_preemptions_total - preempted_before,
        "peak_running": peak_running, "peak_kv_usage": peak_kv, **profiles,
    }  # fmt: skip


def print_offline(name: str, run: dict[str, Any]) -> None:
    d, m = run["decode_only"], run["with_prefill"]
    print(f"{name}: {run['output_tok_s']:.0f} output tok/s in {run['seconds']:.1f} s; decode-only steps "
          f"{d['steps']} in {d['seconds']:.1f} s (mean batch {d['mean_batch']:.0f}), steps with prefill "
          f"{m['steps']} in {m['seconds']:.1f} s ({m['prefill_tokens']} tokens); {run['preemptions']} preemptions, "
          f"peak {run['peak_running']} running, KV {run['peak_kv_usage']:.0%}", flush=True)
    for batch, row in d["by_batch"].items():
        print(f"   batch {batch}: {row['steps']} steps, {row['seconds']:.1f} s, median {row['median_ms']:.2f} ms")


def kernel_profile(fn: Callable[[], object], calls: int, top: int = 25) -> dict[str, Any]:
    """`fn` run `calls` times under torch.profiler (CPU ops and CUDA kernels, CUDA graph replays'
    kernels included): per call, the GPU time of each kernel (top `top`), the GPU busy time, the
    wall time, and the host ops / kernel launches issued. With programmatic dependent launch on
    (`pdl`), a kernel's time includes its wait for the one before it, so the kernel times and the
    busy time overstate the work; `PAPHOS_DISABLE_PDL=1` gives the per-kernel breakdown."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(calls):
            fn()
        sync()
    wall = (time.perf_counter() - t0) / calls
    events = prof.key_averages()
    kernels = [e for e in events if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    host = [e for e in events if e.device_type.name == "CPU"]
    launches = sum(e.count for e in host if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                       "cudaLaunchKernelExC"))  # fmt: skip
    rows = sorted(kernels, key=lambda e: -e.device_time_total)
    return {
        "pdl": pdl.ENABLED,
        "wall_ms_per_call": wall * 1e3,
        "gpu_busy_ms_per_call": sum(e.device_time_total for e in kernels) / calls / 1e3,
        "host_aten_ops_per_call": sum(e.count for e in host if e.key.startswith("aten::")) / calls,
        "launches_per_call": launches / calls,
        "kernels": [{"name": e.key[:120], "ms_per_call": e.device_time_total / calls / 1e3,
                     "count_per_call": e.count / calls} for e in rows[:top]],
    }  # fmt: skip


def print_profile(title: str, prof: dict[str, Any]) -> None:
    print(f"{title}: wall {prof['wall_ms_per_call']:.3f} ms, GPU busy {prof['gpu_busy_ms_per_call']:.3f} ms, "
          f"{prof['host_aten_ops_per_call']:.0f} aten ops, {prof['launches_per_call']:.0f} launches per call")
    if prof.get("pdl"):
        print("   (PDL on: each kernel's time includes its wait for the one before; PAPHOS_DISABLE_PDL=1 to split them)")
    for k in prof["kernels"]:
        print(f"   {k['ms_per_call']:8.4f} ms  x{k['count_per_call']:6.1f}  {k['name']}")


def profile_decode(llm: LLM, vocab: int, batch: int = 1) -> dict[str, Any]:
    """kernel_profile of decode engine steps of `batch` 128-token prompts, past their prefill."""
    engine = llm.engine
    for i, prompt in enumerate(random_prompts(batch, 128, vocab, 3)):
        engine.add_request(f"profile-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    for _ in range(8):
        engine.step()
    try:
        return kernel_profile(engine.step, 16)
    finally:
        while engine.has_unfinished_requests():
            engine.step()


def profile_prefill(llm: LLM, vocab: int, calls: int = 3) -> dict[str, Any]:
    """kernel_profile of pp512 engine steps (each call prefills one new 512-token prompt), then
    the host's Python time of two more under cProfile: where a step's wall time goes when it
    exceeds the GPU's busy time."""
    import cProfile
    import pstats

    engine = llm.engine
    prompts = iter(random_prompts(calls + 2, 512, vocab, 200))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def prefill() -> None:
        engine.add_request(f"pp512-{time.monotonic_ns()}", next(prompts), params)
        while engine.has_unfinished_requests():
            engine.step()

    out = kernel_profile(prefill, calls)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(2):
        prefill()
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, func), (_, calls_n, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"fn": f"{Path(path).name}:{line}:{func}", "calls": calls_n / 2, "self_ms": tottime * 500,
                     "cum_ms": cumtime * 500})  # fmt: skip
    out["python_by_self_ms"] = sorted(rows, key=lambda r: -r["self_ms"])[:25]
    out["python_by_cum_ms"] = sorted(rows, key=lambda r: -r["cum_ms"])[:40]
    for r in out["python_by_self_ms"][:15]:
        print(f"   self {r['self_ms']:7.2f} ms  cum {r['cum_ms']:7.2f}  x{r['calls']:6.0f}  {r['fn']}")
    return out


def run_sections(bench: Any, names: list[str], namespace: dict[str, Any]) -> None:
    """Runs `section_<name>(bench)` of `namespace` for each name into bench.results, saving after
    each; a failing section is recorded (and its GPU memory released) and the rest go on."""
    t_start = time.perf_counter()
    for name in names:
        t0 = time.perf_counter()
        try:
            bench.results[name] = namespace[f"section_{name}"](bench)
        except Exception as e:  # one broken section must not lose the others' figures
            traceback.print_exc()
            bench.results[name] = {"error": f"{type(e).__name__}: {e}"}
            gc.collect()
            torch.cuda.empty_cache()
        bench.results.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t0, 1)
        print(f"--- {name} done in {time.perf_counter() - t0:.1f} s (total {time.perf_counter() - t_start:.0f} s): "
              f"{json.dumps(bench.results[name], default=str)[:800]}", flush=True)  # fmt: skip
        bench.save()


def write_synthetic_tokenizer(directory: Path, vocab_size: int, eos_id: int) -> None:
    """A word-level tokenizer with one token per id: dummy models need a tokenizer object, and
    detokenizing through it keeps the engine's per-token host work in the measurement."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": f"t{eos_id}", "model_max_length": 1 << 20,
    }))


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(n)]


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.results: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
        self.tmp = Path(tempfile.mkdtemp(prefix="paphos-bench-"))
        self.config = json.loads(Path(args.config).read_text())
        self.tokenizer_dir = self.tmp / "tokenizer"
        write_synthetic_tokenizer(self.tokenizer_dir, self.config["vocab_size"], self.config["eos_token_id"])
        self._llm: LLM | None = None

    def save(self) -> None:
        Path(self.args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(self.args.out).write_text(json.dumps(self.results, indent=1, default=str))

    # The engine on the 8B dummy model, built once and shared by the timing sections.
    def llm(self) -> LLM:
        if self._llm is None:
            self._llm = LLM(
                self.args.config, load_format="dummy", tokenizer=str(self.tokenizer_dir), dtype="bfloat16",
                max_model_len=8192, max_num_seqs=256, max_num_batched_tokens=self.args.max_num_batched_tokens,
                gpu_memory_utilization=self.args.gmu, kv_cache_dtype=self.args.kv_cache_dtype,
                decode_lookahead=self.args.decode_lookahead,
            )
        return self._llm

    def engine_steps(self, prompts: list[list[int]], max_tokens: int) -> list[tuple[float, int]]:
        return engine_steps(self.llm(), prompts, max_tokens)

    def weight_bytes(self) -> int:
        model = self.llm().engine.runner.model
        embed = model.model.embed_tokens.weight
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        return total - (0 if model.tie_word_embeddings else embed.numel() * embed.element_size())

    def kv_bytes_per_token(self) -> int:
        cache = self.llm().engine.runner.kv_caches
        return sum(c[0, :, 0].numel() * c.element_size() for c in cache)


# ----------------------------------------------------------------------------- sections


def section_ceilings(bench: Bench) -> dict[str, Any]:
    n = 2 << 30  # 2 GiB: well past L2
    buffers = torch.empty(2, n, dtype=torch.uint8, device="cuda")
    t = cuda_time(lambda: buffers[1].copy_(buffers[0]), iters=20)
    copy_bw = 2 * n / t
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    t = cuda_time(lambda: a @ b, iters=20)
    bench.results["copy_bw"] = copy_bw
    return {"copy_GBps": copy_bw / 1e9, "bf16_gemm_TFLOPs": 2 * 8192**3 / t / 1e12}


def _compare_greedy(
    make: Callable[..., LLM], variants: dict[str, dict[str, Any]], prompts: list[list[int]], max_tokens: int
) -> dict[str, Any]:
    """Greedy tokens of each variant vs the first one (the reference), with the reference's
    top-2 logprob gap at the first divergence of each prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outs: dict[str, list] = {}
    for name, kwargs in variants.items():
        llm = make(**kwargs)
        outs[name] = [o.outputs[0] for o in llm.generate(prompts, params)]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    ref_name = next(iter(variants))
    ref = outs[ref_name]
    report: dict[str, Any] = {"reference": ref_name, "prompts": len(prompts), "max_tokens": max_tokens}
    for name, got in outs.items():
        if name == ref_name:
            continue
        equal, divergences = 0, []
        for i, (r, g) in enumerate(zip(ref, got, strict=True)):
            if r.token_ids == g.token_ids:
                equal += 1
                continue
            at = next(j for j, (x, y) in enumerate(zip(r.token_ids, g.token_ids, strict=False)) if x != y)
            top = r.logprobs[at].top_logprobs
            gap = top[0] - top[1] if len(top) > 1 else None
            divergences.append({"prompt": i, "position": at, "ref_top2_gap": gap})
        report[name] = {"identical": equal, "divergences": divergences}
    return report


def _tiny_checkpoint(directory: Path) -> Path:
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():  # sharper logits than the init's std 0.02: fewer near-ties
            if p.dim() > 1:
                p.normal_(0, 0.08)
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
    write_synthetic_tokenizer(directory, 512, 2)
    return directory


def section_correctness(bench: Bench) -> dict[str, Any]:
    tiny = _tiny_checkpoint(bench.tmp / "tiny")
    # Shared prefixes (prefix-cache hits), long prompts (chunked under a 64-token budget) and
    # short ones decoding beside them (mixed steps).
    base = random_prompts(1, 150, 512, 7)[0]
    prompts = [base[:n] + extra for n, extra in ((150, []), (120, [5, 6, 7]), (40, [9] * 30))]
    prompts += random_prompts(5, 9, 512, 8) + random_prompts(2, 300, 512, 9)
    common = {"max_num_batched_tokens": 64, "max_num_seqs": 16, "dtype": "bfloat16", "seed": 0}

    def make(**kw: Any) -> LLM:
        return LLM(str(tiny), **{**common, **kw})

    variants = {
        "cpu_torch_ref": {"device": "cpu"},
        "gpu_triton_graphs": {"device": "cuda", "gpu_memory_utilization": 0.3},
        "gpu_torch_ref_eager": {"device": "cuda", "attention_backend": "torch", "enforce_eager": True,
                                "gpu_memory_utilization": 0.3},
        "gpu_triton_fp8_kv": {"device": "cuda", "kv_cache_dtype": "fp8", "gpu_memory_utilization": 0.3},
    }
    out = {"tiny": _compare_greedy(make, variants, prompts, 32)}
    if bench.args.smollm2:
        from paphos.quant.gguf import kernels as gguf_kernels
        from paphos.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf(Path(bench.args.smollm2))
        texts = [
            "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
            "Translate to German: The weather is nice today.", "1, 2, 3, 4, 5,", "Écris un poème sur la mer.",
        ]
        chat = [tok.encode(t) for t in texts]

        def make_smol(**kw: Any) -> LLM:
            # "Dequantized to bf16": every variant multiplies by the same bf16 weights, whatever
            # quantized kernels the device would otherwise pick (the Triton GGUF kernels are
            # checked against dequantization in benchmarks/bench_gguf_gpu.py).
            saved = gguf_kernels.KERNELS[:]
            gguf_kernels.KERNELS[:] = [gguf_kernels.DequantizedAtLoadKernel]
            try:
                return LLM(bench.args.smollm2, **{**common, **kw})
            finally:
                gguf_kernels.KERNELS[:] = saved

        out["smollm2"] = _compare_greedy(make_smol, {k: variants[k] for k in list(variants)[:3]}, chat, 32)
    return out


def section_hf(bench: Bench) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in bench.config.items() if k not in ("architectures", "torch_dtype")})
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialise in bf16 directly: 16 GB, not 32
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    out = {}
    for batch in bench.args.hf_batches:
        ids = torch.randint(10, config.vocab_size - 10, (batch, 128), device="cuda")
        kwargs = dict(max_new_tokens=128, min_new_tokens=128, do_sample=False, cache_implementation="static",
                      pad_token_id=0)
        # Warm-up with the timed shapes: a static cache of another length recompiles and re-tunes.
        model.generate(ids, **kwargs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, **kwargs)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        out[f"batch{batch}"] = {"seconds": elapsed, "output_tok_s": batch * 128 / elapsed}
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _decode_stats(bench: Bench, steps: list[tuple[float, int]], batch: int, context: int) -> dict[str, Any]:
    decode = [t for t, rows in steps[1:] if rows == batch]
    tpot = statistics.median(decode)
    step_bytes = bench.weight_bytes() + batch * context * bench.kv_bytes_per_token()
    bw = bench.results.get("copy_bw")
    return {
        "batch": batch, "context": context, "step_ms": tpot * 1e3, "tok_s": batch / tpot,
        "GBps": step_bytes / tpot / 1e9, "frac_copy_bw": step_bytes / tpot / bw if bw else None,
    }


def section_decode(bench: Bench) -> dict[str, Any]:
    vocab = bench.config["vocab_size"]
    out = {}
    for context in (128, 4096):
        steps = bench.engine_steps(random_prompts(1, context, vocab, context), 128)
        out[f"ctx{context}"] = _decode_stats(bench, steps, 1, context + 64)
    return out


def section_sweep(bench: Bench) -> dict[str, Any]:
    vocab = bench.config["vocab_size"]
    out = {}
    for batch in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        steps = bench.engine_steps(random_prompts(batch, 128, vocab, 1000 + batch), 64)
        out[f"batch{batch}"] = _decode_stats(bench, steps, batch, 128 + 32)
    return out


def section_concurrent(bench: Bench) -> dict[str, Any]:
    vocab = bench.config["vocab_size"]
    t0 = time.perf_counter()
    steps = bench.engine_steps(random_prompts(64, 128, vocab, 64), 128)
    elapsed = time.perf_counter() - t0
    stats = _decode_stats(bench, steps, 64, 128 + 64)
    stats["overall_output_tok_s"] = 64 * 128 / elapsed
    return stats


def section_ttft(bench: Bench) -> dict[str, Any]:
    vocab = bench.config["vocab_size"]
    times = []
    for seed in range(6):
        steps = bench.engine_steps(random_prompts(1, 1024, vocab, 5000 + seed), 1)
        times.append(sum(t for t, _ in steps))
    return {"ttft_ms_median": statistics.median(times[1:]) * 1e3, "ttft_ms_all": [t * 1e3 for t in times]}


def section_prefill(bench: Bench) -> dict[str, Any]:
    vocab = bench.config["vocab_size"]
    times = []
    for seed in range(3):  # the first run also pays one-time costs (cuBLAS heuristics, allocator growth)
        t0 = time.perf_counter()
        bench.engine_steps(random_prompts(4, 4096, vocab, 7 + seed), 1)
        times.append(time.perf_counter() - t0)
    elapsed = min(times[1:])
    return {"seconds": elapsed, "prefill_tok_s": 4 * 4096 / elapsed, "seconds_all": times}


def section_offline(bench: Bench) -> dict[str, Any]:
    vocab = bench.config["vocab_size"]
    llm = bench.llm()
    out = {}
    for name, n, inp, outp in (("128x32_2048", 128, 32, 2048), ("1000x1000_1000", bench.args.offline_prompts, 1000, 1000)):
        params = SamplingParams(temperature=0.0, max_tokens=outp, ignore_eos=True)
        out[name] = offline_run(llm, random_prompts(n, inp, vocab, 99 + n), params)
        print_offline(f"offline {name}", out[name])
    return out


def section_profile(bench: Bench) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for batch in (1, 256):
        out[f"batch{batch}"] = _profile_decode_step(bench, batch)
    out["host_batch1"] = _profile_engine_host(bench)
    return out


def _profile_engine_host(bench: Bench) -> dict[str, float]:
    """Mean ms per decode step spent in each engine stage at batch 1 (wall clock; the runner's
    share includes waiting for the GPU)."""
    engine = bench.llm().engine
    totals: dict[str, float] = {}
    originals = []
    for owner, attr, label in (
        (engine.scheduler, "schedule", "schedule"), (engine.runner, "execute", "runner.execute"),
        (engine.scheduler, "update_from_output", "update_from_output"),
        (engine.output_processor, "process", "output_processor"),
        (engine.runner.sampler, "__call__", "sampler"),
    ):
        fn = getattr(owner, attr)
        originals.append((owner, attr, fn))

        def timed(*a: Any, _fn: Callable = fn, _label: str = label, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                totals[_label] = totals.get(_label, 0.0) + time.perf_counter() - t0

        if attr == "__call__":
            engine.runner.sampler = _CallWrapper(timed)
        else:
            setattr(owner, attr, timed)
    try:
        steps = bench.engine_steps(random_prompts(1, 128, bench.config["vocab_size"], 42), 129)
    finally:
        engine.runner.sampler = originals[-1][0]
        for owner, attr, _fn in originals[:-1]:
            delattr(owner, attr)
    n = len(steps)
    return {label: t / n * 1e3 for label, t in totals.items()} | {"step": sum(t for t, _ in steps) / n * 1e3}


class _CallWrapper:
    def __init__(self, fn: Callable) -> None:
        self._fn = fn

    def __call__(self, *a: Any, **k: Any) -> Any:
        return self._fn(*a, **k)


def _profile_decode_step(bench: Bench, batch: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from paphos.attention.testing import build_metadata

    runner = bench.llm().engine.runner
    model = runner.model
    ctx = 160
    blocks = -(-ctx // 16)
    tables = [list(range(1 + i * blocks, 1 + (i + 1) * blocks)) for i in range(batch)]
    md = build_metadata([1] * batch, [ctx] * batch, tables, 16, "cuda")
    ids = torch.randint(10, 1000, (batch,), device="cuda")
    pos = torch.full((batch,), ctx - 1, device="cuda")

    def step() -> None:
        with torch.inference_mode():
            model.compute_logits(model(ids, pos, runner.kv_caches, md))

    eager = cuda_time(step)
    graphs = runner.decode_graphs
    replay = cuda_time(lambda: graphs.run(ids, pos, md)) if graphs is not None else None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    for evt in prof.key_averages():
        name = evt.key.lower()
        kind = ("gemm" if any(s in name for s in ("gemm", "gemv", "cutlass", "matmul", "sm90", "nvjet"))
                else "attention" if any(s in name for s in ("attn", "attention", "paged", "decode", "kv"))
                else "norm" if "rmsnorm" in name else "rope" if "rope" in name
                else "silu" if "silu" in name else "other")
        kinds[kind] = kinds.get(kind, 0.0) + evt.device_time_total / 1e3
    top = sorted(((e.key, e.device_time_total / 1e3) for e in prof.key_averages()), key=lambda x: -x[1])[:8]
    return {"eager_step_ms": eager * 1e3, "graph_replay_ms": replay * 1e3 if replay else None,
            "cuda_ms_by_kind": kinds, "top_kernels_ms": top}


# ----------------------------------------------------------------------------- main


def print_table(results: dict[str, Any]) -> None:
    print("\n=== bench_gpu results ===")
    for section, value in results.items():
        if not isinstance(value, dict):
            print(f"{section}: {value}")
            continue
        print(f"[{section}]")
        for key, item in value.items():
            if isinstance(item, float):
                item = round(item, 3)
            elif isinstance(item, dict):
                item = {k: round(v, 3) if isinstance(v, float) else v for k, v in item.items()}
            print(f"  {key}: {item}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--smollm2", help="SmolLM2 GGUF path for the correctness section")
    # Leaves room for the HF peer (16 GB of weights + its static cache) beside the engine.
    parser.add_argument("--gmu", type=float, default=0.75)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--decode-lookahead", action=argparse.BooleanOptionalAction, default=None,
                        help="default: the engine's (on with CUDA graphs)")
    parser.add_argument("--offline-prompts", type=int, default=1000)
    parser.add_argument("--hf-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    args = parser.parse_args()
    bench = Bench(args)
    run_sections(bench, args.sections.split(","), globals())
    print_table(bench.results)


if __name__ == "__main__":
    main()
