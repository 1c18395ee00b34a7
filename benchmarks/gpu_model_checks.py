"""Model paths that only a GPU runs, checked against the references the CPU tests use: Qwen3's
per-head q/k RMSNorm (the fused norm kernel takes [T, heads, D]) and a checkpoint's per-layer
FP8 KV-cache scales through the Triton attention kernels.

Where it sits: benchmarks/ drives the models directly through tests/models/paged.py's schedule
(chunked prompts, mixed steps, decode rows over the paged cache), standing in for scheduler and
model runner, eager (no CUDA graph). For each check it prints and writes to --out:
  * KV scales (Llama, Qwen3, Gemma 3 tiny random models, tests/quant/test_kv_cache_scales.py's):
    our model in fp16 and bf16 with an fp8 cache and per-layer scales, against the torch
    emulation in float32 (K/V rounded through the same scales), and against the emulation with
    every scale 1.0; the first distance must stay near the 16-bit model's rounding and well
    under the second (the scales act, per layer);
  * Qwen3 and a Llama control (tests/models/test_qwen3_parity.py's model): our fp16 and bf16
    logits against HF transformers in float32 on the CPU, with the share of equal argmaxes.
On the CPU (`--device cpu`, TRITON_INTERPRET=1) the same numbers come from the interpreter.

    python benchmarks/gpu_model_checks.py --out checks.json [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tests.models.paged as paged  # noqa: E402
from paphos.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from paphos.models.registry import resolve_model_class  # noqa: E402
from tests.models.fp8_kv import FP8, caches, emulated, layer_scales, ours  # noqa: E402
from tests.models.test_qwen3_parity import make_hf as make_qwen3  # noqa: E402
from tests.quant.test_kv_cache_scales import STEPS, _hf, _seqs  # noqa: E402

DTYPES = (torch.float16, torch.bfloat16)


def run_on(device: str, model: torch.nn.Module, cache_dtype: torch.dtype, seqs: list[torch.Tensor],
           steps: list[list[int]]) -> torch.Tensor:  # fmt: skip
    cache = [c.to(device) for c in caches(model, cache_dtype, paged.NUM_BLOCKS, paged.BLOCK)]
    return torch.cat(paged.run_schedule(model.to(device), cache, [s.to(device) for s in seqs], steps)).cpu()


def kv_scales(device: str, arch: str) -> dict[str, dict[str, float]]:
    config, hf = _hf(arch)
    seqs = _seqs(config.vocab_size)
    scales = layer_scales(config, hf, seqs, STEPS)
    want = emulated(config, hf, scales, seqs, STEPS)
    ones = emulated(config, hf, [(1.0, 1.0)] * len(scales), seqs, STEPS)
    out = {}
    for dtype in DTYPES:
        got = run_on(device, ours(config, hf, dtype, scales, TritonAttentionBackend()), FP8, seqs, STEPS)
        out[str(dtype)] = {"vs_emulation": (got - want).abs().max().item(),
                           "vs_all_scales_one": (got - ones).abs().max().item(),
                           "the_scales_effect": (want - ones).abs().max().item()}  # fmt: skip
    return out


def against_hf(device: str, arch: str) -> dict[str, dict[str, float]]:
    config, hf = make_qwen3() if arch == "qwen3" else _hf(arch)
    ids = torch.randint(0, config.vocab_size, (39,), generator=torch.Generator().manual_seed(4))
    ref = paged.hf_logits(hf, ids)
    out = {}
    for dtype in DTYPES:
        model = resolve_model_class(config)(config, dtype, TritonAttentionBackend()).eval()
        model.load_weights(hf.state_dict().items())
        got = run_on(device, model, dtype, [ids], [[17], [13]] + [[1]] * 9)
        out[str(dtype)] = {"max_abs_dlogit": (got - ref).abs().max().item(), "ref_max_abs": ref.abs().max().item(),
                           "argmax_agree": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()}  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else args.device}
    for arch in ("llama", "qwen3", "gemma3"):
        results[f"kv_scales_{arch}"] = kv_scales(args.device, arch)
        print(f"fp8 KV cache with {arch}'s per-layer scales: {results[f'kv_scales_{arch}']}", flush=True)
    for arch in ("qwen3", "llama"):
        results[f"{arch}_vs_hf"] = against_hf(args.device, arch)
        print(f"{arch} against HF float32: {results[f'{arch}_vs_hf']}", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
