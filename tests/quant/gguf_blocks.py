"""Random GGUF blocks of any type and tiny GGUF files made of them, for the GGUF tests.

Blocks are random bytes (so every bit pattern of quants, signs and grid indices occurs) with the
fp16/fp32 scale fields replaced by finite values of a chosen magnitude."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# Byte offsets of each type's fp16 scale fields (d, and m/dmin where present).
F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,),
    "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_S": (0,), "IQ1_M": (), "TQ1_0": (52,), "TQ2_0": (64,),
}  # fmt: skip


def random_blocks(
    name: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.05
) -> np.ndarray:
    """uint8 [rows, bytes per row] of ggml type `name` for a [rows, cols] tensor; scale fields
    ~ N(0, scale) (fp32/fp16/bf16 tensors: values ~ N(0, 10 * scale))."""
    qtype = GGMLQuantizationType[name]
    block, size = GGML_QUANT_SIZES[qtype]
    if name in ("F32", "F16", "BF16"):
        values = (rng.standard_normal((rows, cols)) * 10 * scale).astype(np.float32)
        if name == "BF16":
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return values.astype(np.float16 if name == "F16" else np.float32).view(np.uint8)
    n = rows * cols // block
    blocks = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    scales = (rng.standard_normal((n, 2)) * scale).astype(np.float16).view(np.uint8)
    for i, at in enumerate(F16_FIELDS.get(name, ())):
        blocks[:, at : at + 2] = scales[:, 2 * i : 2 * i + 2]
    if name == "Q8_K":
        blocks[:, :4] = (rng.standard_normal((n, 1)) * scale).astype(np.float32).view(np.uint8)
    if name == "MXFP4":  # E8M0 scale exponents: the subnormal cases 0, 1 and a finite range
        blocks[:, 0] = rng.choice(np.r_[0, 1, 100:140], size=n).astype(np.uint8)
    if name == "IQ1_M":
        # Its fp16 d is the top nibbles of the four scale words; bound the exponent (finite d).
        blocks[:, 55] &= 0x3F
    return blocks.reshape(rows, -1)


# Per-type scale magnitudes that give weights of ~0.05 (a K-quant's d multiplies a 6-bit scale
# and a 4-6 bit quant).
_SCALE = {"Q4_0": 0.01, "Q4_1": 0.005, "Q5_0": 0.005, "Q5_1": 0.003, "Q8_0": 0.0005, "F32": 0.005}


# Two layers that each mix Q4_0, Q4_K, Q6_K and Q8_0, every projection changing type between
# them (Q4_K / Q6_K blocks are 256 values: with hidden 512 and intermediate 1024 the row-parallel
# inputs of `-tp 2` stay whole blocks).
MIXED_TYPE_LAYERS = [
    {"attn_q": "Q4_0", "attn_k": "Q4_K", "attn_v": "Q8_0", "attn_output": "Q6_K",
     "ffn_gate": "Q4_K", "ffn_up": "Q6_K", "ffn_down": "Q4_0"},
    {"attn_q": "Q6_K", "attn_k": "Q8_0", "attn_v": "Q4_0", "attn_output": "Q4_K",
     "ffn_gate": "Q8_0", "ffn_up": "Q4_0", "ffn_down": "Q6_K"},
]  # fmt: skip


def weight_scale(name: str) -> float:
    return _SCALE.get(name, 1e-4)


def write_tiny_llama(
    path: Path,
    layer_types: list[dict[str, str]],
    *,
    hidden: int = 256,
    inter: int = 512,
    seed: int = 0,
    split_max_tensors: int = 0,
) -> Path:
    """A llama-architecture GGUF file with one layer per entry of `layer_types` (GGUF projection
    name -> ggml type, e.g. {"attn_q": "Q4_K", ...}; missing ones are Q8_0), 4 heads of 64,
    2 KV heads, vocabulary 32, tied Q8_0 embeddings. Written as `split_max_tensors`-tensor split
    files when set (then `path` is the name before the -0000i-of-0000N suffix)."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama", split_max_tensors=split_max_tensors)
    heads, kv_heads, vocab = 4, 2, 32
    writer.add_block_count(len(layer_types))
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_uint32("llama.vocab_size", vocab)

    def add(name: str, type_name: str, rows: int, cols: int) -> None:
        raw = random_blocks(type_name, rows, cols, rng, weight_scale(type_name))
        if type_name == "F32":
            writer.add_tensor(name, raw.view(np.float32))
        else:
            writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[type_name])

    add("token_embd.weight", "Q8_0", vocab, hidden)
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    kv = hidden // heads * kv_heads
    shapes = {
        "attn_q": (hidden, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden),
        "attn_output": (hidden, hidden), "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
        "ffn_down": (hidden, inter),
    }  # fmt: skip
    for i, types in enumerate(layer_types):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(
                f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
            )
        for proj, (rows, cols) in shapes.items():
            add(f"blk.{i}.{proj}.weight", types.get(proj, "Q8_0"), rows, cols)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
