"""Write a random checkpoint directory of a Llama-shaped HF config in a quantized layout, for GPU
benchmarks of the GPTQ / AWQ / compressed-tensors / FP8 / EXL2 paths (as make_random_gguf.py does
for GGUF).

    python scripts/make_random_quant.py OUT_DIR \\
        --format gptq|gptq-actorder|gptq-actorder-sym|awq|ct-w4a16|ct-fp8|fp8-block|exl2|exl2-mix \\
        [--config benchmarks/configs/llama-3-8b.json] [--group-size 128] [--seed 0]

The layouts are the ones the real tools write (paphos/quant/gptq.py, awq.py, compressed_tensors.py
document them): GPTQ v1 4-bit symmetric (`gptq`), asymmetric with act-order (`gptq-actorder`: one
random input permutation per layer input, shared by the projections that read it, as GPTQ's
Hessian order is) or symmetric with act-order (`gptq-actorder-sym`, TheBloke's usual `sym: true,
desc_act: true`: act-order's cost alone, against `gptq`), AutoAWQ GEMM 4-bit with zero points, compressed-tensors pack-quantized W4A16
symmetric, compressed-tensors float-quantized FP8 (per-channel scales, dynamic activations), and
ExLlamaV2's EXL2 (paphos/quant/exl2.py documents it) with bit widths mixed inside each tensor as
its converter mixes them, groups in descending bits: `exl2` 4.0 bits per weight (a quarter of the
rows in 5-bit groups of 32, half in 4-bit groups of 64, a quarter in 3-bit groups of 128),
`exl2-mix` 2.5 bpw in even layers (3-bit groups of 64, 2-bit groups of 128, half each) and 6.0 in
odd ones (8-bit groups of 32, 6-bit groups of 64, 4-bit groups of 128: 1/4, 1/2, 1/4); both with a
6-bit head and a random input permutation per tensor (the code streams are random words, so
no encoder is needed: any bit pattern is a valid code stream). Codes are random; scales are set so that weights are ~N(0, 0.02)-sized (finite through every
layer). Embedding, head and norms are bf16 (EXL2: fp16 as the converter writes them, and the
head is quantized). The directory has config.json with the format's
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

FORMATS = ("gptq", "gptq-actorder", "gptq-actorder-sym", "awq", "ct-w4a16", "ct-fp8", "fp8-block", "exl2", "exl2-mix")
GPTQ_ACT_ORDER = ("gptq-actorder", "gptq-actorder-sym")
# EXL2 bit allocations: (bits, rows per group, share of the input rows), descending bits.
EXL2_MIXES = {
    4.0: ((5, 32, 0.25), (4, 64, 0.5), (3, 128, 0.25)),
    2.5: ((3, 64, 0.5), (2, 128, 0.5)),
    6.0: ((8, 32, 0.25), (6, 64, 0.5), (4, 128, 0.25)),
}
EXL2_HEAD = ((6, 128, 1.0),)
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
    if fmt in ("gptq", *GPTQ_ACT_ORDER):
        sym = fmt != "gptq-actorder"
        zeros = torch.full((groups, n), 7) if sym else torch.randint(5, 10, (groups, n), generator=gen)
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
    if fmt in ("ct-fp8", "fp8-block"):
        weight = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        if fmt == "ct-fp8":  # per channel, bf16
            return {f"{name}.weight": weight, f"{name}.weight_scale": _scales(gen, n, 1, dtype=torch.bfloat16) * 0.01}
        # DeepSeek-V3 / Qwen3-FP8: float32 scales per 128 x 128 block
        scales = _scales(gen, -(-n // 128), -(-k // 128), dtype=torch.float32) * 0.01
        return {f"{name}.weight": weight, f"{name}.weight_scale_inv": scales}
    raise ValueError(f"unknown format {fmt!r}")


def exl2_groups(k: int, mix: tuple[tuple[int, int, float], ...]) -> list[tuple[int, int]]:
    """(bits, rows) per group of a K-input tensor: each width's share of the rows in whole runs
    of 32, in its group size (the last group of the tensor takes what is left)."""
    groups, row = [], 0
    for i, (bits, size, share) in enumerate(mix):
        end = k if i == len(mix) - 1 else row + round(k * share / 32) * 32
        while row < end:
            groups.append((bits, min(size, end - row)))
            row += groups[-1][1]
    return groups


def exl2_tensors(name: str, n: int, k: int, mix: tuple[tuple[int, int, float], ...],
                 gen: torch.Generator) -> dict[str, torch.Tensor]:  # fmt: skip
    """One EXL2 linear [n, k] (n a multiple of 32, as the converter pads it): random code streams,
    scale codes 12..15 and maxima such that weights are ~TARGET_STD-sized at every width."""
    groups = exl2_groups(k, mix)
    words = [-(-rows * bits // 32) for bits, rows in groups]
    starts = torch.tensor([0, *words]).cumsum(0)[:-1]
    qs = torch.randint(12, 16, (len(groups), n), generator=gen, dtype=torch.int64)
    nibbles = (qs.view(len(groups), -1, 8) << (4 * torch.arange(8))).sum(-1)
    # scale = (qs + 1)**2 / 256 * max, about 0.8 max; a uniform b-bit code has std 2**b / sqrt(12)
    smax = torch.tensor([TARGET_STD * 12**0.5 / 2**bits / 0.8 for bits, _ in groups]) * (0.9 + 0.2 * torch.rand(len(groups), generator=gen))
    return {
        f"{name}.q_weight": _words(gen, sum(words), n),
        f"{name}.q_scale": torch.where(nibbles >= 2**31, nibbles - 2**32, nibbles).to(torch.int32),
        f"{name}.q_scale_max": smax.to(torch.float16),
        f"{name}.q_groups": torch.stack([torch.tensor([b for b, _ in groups]), starts], 1).flatten().to(torch.int16),
        f"{name}.q_invperm": torch.randperm(k, generator=gen).to(torch.int32),
    }


def exl2_mix(fmt: str, layer: int) -> tuple[tuple[int, int, float], ...]:
    if fmt == "exl2":
        return EXL2_MIXES[4.0]
    return EXL2_MIXES[2.5 if layer % 2 == 0 else 6.0]


def quantization_config(fmt: str, group: int) -> dict:
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
    if fmt in ("exl2", "exl2-mix"):
        return {"quant_method": "exl2", "version": "0.3.2", "bits": 4.0 if fmt == "exl2" else 4.25, "head_bits": 6,
                "calibration": {"rows": 0, "length": 0, "dataset": "random (scripts/make_random_quant.py)"}}  # fmt: skip
    if fmt in ("gptq", *GPTQ_ACT_ORDER):
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": fmt in GPTQ_ACT_ORDER,
                "sym": fmt != "gptq-actorder",
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
    exl2 = fmt in ("exl2", "exl2-mix")
    dense = torch.float16 if exl2 else torch.bfloat16
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": (torch.randn(v, h, generator=gen) * TARGET_STD).to(dense),
        "model.norm.weight": torch.ones(h, dtype=dense),
    }
    if exl2:
        tensors |= exl2_tensors("lm_head", v + -v % 32, h, EXL2_HEAD, gen)
    else:
        tensors["lm_head.weight"] = (torch.randn(v, h, generator=gen) * TARGET_STD).to(torch.bfloat16)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        act = fmt in GPTQ_ACT_ORDER
        attn_perm, mlp_perm, down_perm = (torch.randperm(n, generator=gen) if act else None for n in (h, h, f))
        for name, n, k, perm in (
            ("self_attn.q_proj", q, h, attn_perm), ("self_attn.k_proj", kv, h, attn_perm),
            ("self_attn.v_proj", kv, h, attn_perm), ("self_attn.o_proj", h, q, torch.randperm(q, generator=gen) if act else None),
            ("mlp.gate_proj", f, h, mlp_perm), ("mlp.up_proj", f, h, mlp_perm), ("mlp.down_proj", h, f, down_perm),
        ):  # fmt: skip
            if exl2:
                tensors |= exl2_tensors(f"{p}.{name}", n, k, exl2_mix(fmt, i), gen)
            else:
                tensors |= linear_tensors(fmt, f"{p}.{name}", n, k, group, perm, gen)
        tensors[f"{p}.input_layernorm.weight"] = torch.ones(h, dtype=dense)
        tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(h, dtype=dense)
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
