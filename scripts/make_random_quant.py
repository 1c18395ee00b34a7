"""Write a random checkpoint directory of a Llama-shaped HF config in a quantized layout, for GPU
benchmarks of the GPTQ / AWQ / compressed-tensors / FP8 paths (as make_random_gguf.py does for GGUF).

    python scripts/make_random_quant.py OUT_DIR --format gptq|gptq-actorder|awq|ct-w4a16|ct-fp8 \\
        [--config benchmarks/configs/llama-3-8b.json] [--group-size 128] [--seed 0]

The layouts are the ones the real tools write (paphos/quant/gptq.py, awq.py, compressed_tensors.py
document them): GPTQ v1 4-bit symmetric (`gptq`) or asymmetric with act-order (`gptq-actorder`: one
random input permutation per layer input, shared by the projections that read it, as GPTQ's
Hessian order is), AutoAWQ GEMM 4-bit with zero points, compressed-tensors pack-quantized W4A16
symmetric, compressed-tensors float-quantized FP8 (per-channel scales, dynamic activations).
Codes are random; scales are set so that weights are ~N(0, 0.02)-sized (finite through every
layer). Embedding, head and norms are bf16. The directory has config.json with the format's
quantization_config and one model.safetensors; no tokenizer (pass one with --tokenizer).
Tensors are generated with torch on the CPU, one at a time: a few seconds per GB.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

FORMATS = ("gptq", "gptq-actorder", "awq", "ct-w4a16", "ct-fp8")
TARGET_STD = 0.02
CODE_STD = 4.6  # std of a uniform 4-bit code around its middle


def _words(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int32)


def _scales(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return (TARGET_STD / CODE_STD * (0.9 + 0.2 * torch.rand(shape, generator=gen))).to(dtype)


def _pack_along_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int [R, C] -> int32 [R * bits / 32, C] (value j of a word at bits j * bits)."""
    per = 32 // bits
    v = values.to(torch.int64).reshape(-1, per, values.shape[1])
    words = sum(v[:, j] << (bits * j) for j in range(per))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def linear_tensors(fmt: str, name: str, n: int, k: int, group: int, perm: torch.Tensor | None,
                   gen: torch.Generator) -> dict[str, torch.Tensor]:  # fmt: skip
    """The checkpoint tensors of one linear `name` (e.g. model.layers.0.mlp.down_proj), [n, k]."""
    groups = -(-k // group)
    if fmt in ("gptq", "gptq-actorder"):
        zeros = torch.full((groups, n), 7) if fmt == "gptq" else torch.randint(5, 10, (groups, n), generator=gen)
        g_idx = torch.arange(k, dtype=torch.int32) // group
        if perm is not None:
            g_idx = g_idx[torch.argsort(perm)]  # input row perm[j] is the j-th in group order
        return {
            f"{name}.qweight": _words(gen, k // 8, n),
            f"{name}.qzeros": _pack_along_rows(zeros.t().contiguous(), 4).t().contiguous(),  # v1: zero - 1
            f"{name}.scales": _scales(gen, groups, n),
            f"{name}.g_idx": g_idx,
        }
    if fmt == "awq":
        zeros = torch.randint(6, 11, (n, groups), generator=gen)
        return {
            f"{name}.qweight": _words(gen, k, n // 8),
            f"{name}.qzeros": _pack_along_rows(zeros, 4).t().contiguous(),
            f"{name}.scales": _scales(gen, groups, n),
        }
    if fmt == "ct-w4a16":
        return {
            f"{name}.weight_packed": _words(gen, n, k // 8),
            f"{name}.weight_scale": _scales(gen, n, groups, dtype=torch.bfloat16),
            f"{name}.weight_shape": torch.tensor([n, k], dtype=torch.int64),
        }
    if fmt == "ct-fp8":
        weight = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        return {f"{name}.weight": weight, f"{name}.weight_scale": _scales(gen, n, 1, dtype=torch.bfloat16) * 0.01}
    raise ValueError(f"unknown format {fmt!r}")


def quantization_config(fmt: str, group: int) -> dict:
    if fmt in ("gptq", "gptq-actorder"):
        act = fmt == "gptq-actorder"
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act, "sym": not act,
                "checkpoint_format": "gptq", "lm_head": False}  # fmt: skip
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True}
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}
    activations = None
    if fmt == "ct-fp8":
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
        activations = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
    return {
        "quant_method": "compressed-tensors", "quantization_status": "compressed", "ignore": ["lm_head"],
        "format": "float-quantized" if fmt == "ct-fp8" else "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}},
    }  # fmt: skip


def write(out: Path, config: dict, fmt: str, group: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": (torch.randn(v, h, generator=gen) * TARGET_STD).to(torch.bfloat16),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": (torch.randn(v, h, generator=gen) * TARGET_STD).to(torch.bfloat16),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        act = fmt == "gptq-actorder"
        attn_perm, mlp_perm, down_perm = (torch.randperm(n, generator=gen) if act else None for n in (h, h, f))
        for name, n, k, perm in (
            ("self_attn.q_proj", q, h, attn_perm), ("self_attn.k_proj", kv, h, attn_perm),
            ("self_attn.v_proj", kv, h, attn_perm), ("self_attn.o_proj", h, q, torch.randperm(q, generator=gen) if act else None),
            ("mlp.gate_proj", f, h, mlp_perm), ("mlp.up_proj", f, h, mlp_perm), ("mlp.down_proj", h, f, down_perm),
        ):  # fmt: skip
            tensors |= linear_tensors(fmt, f"{p}.{name}", n, k, group, perm, gen)
        tensors[f"{p}.input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config | {"quantization_config": quantization_config(fmt, group)}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("--config", type=Path, default=Path(__file__).parents[1] / "benchmarks/configs/llama-3-8b.json")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    t0 = time.perf_counter()
    write(args.out, json.loads(args.config.read_text()), args.format, args.group_size, args.seed)
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"wrote {args.out} ({args.format}, {size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
