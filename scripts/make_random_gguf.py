"""Write a Llama-3-8B-shaped GGUF file with random blocks, for GPU benchmarks of the GGUF kernels.

    python scripts/make_random_gguf.py OUT.gguf --mix q4_k_m|q8_0 [--layers 32] [--seed 0] [--vocab] [--small]

Shapes: 32 layers, hidden 4096, FFN 14336, 32 query / 8 KV heads of 128, vocab 128256, RoPE base
500000 (benchmarks/configs/llama-3-8b.json). Mixes:
  q4_k_m  as llama.cpp's Q4_K_M: every tensor Q4_K except attn_v and ffn_down of the "more bits"
          layers (the first and last eighth and every third in between: 16 of 32), which are Q6_K,
          and the output head (Q6_K); norms F32. ~4.9 GB.
  q8_0    every matrix Q8_0 (embedding and head too); norms F32. ~8.5 GB.
Blocks are random bytes with their fp16 scale fields replaced so that weights are ~N(0, 0.02)
(finite, no overflow through 32 layers). Without `--vocab` the metadata has no vocabulary: load
the file with a tokenizer override (`--tokenizer DIR`; benchmarks/bench_gguf_gpu.py writes a
synthetic one). `--vocab` adds a synthetic sentencepiece-style ("llama") vocabulary of the same
size (`<unk>`, `<s>`, `</s>`, the 256 byte tokens `<0x00>`..`<0xFF>`, then made-up pieces, with
scores and token types) so that llama.cpp, which requires one, loads the file too; the tensors are
the same with or without it (same seed, same bytes). `--small` writes a toy shape (hidden 256,
FFN 512, vocab 512) for tests.
Data are generated and written one tensor at a time (numpy, vectorised): a few seconds per GB.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, TokenType

LLAMA3_8B = {
    "layers": 32, "hidden": 4096, "ffn": 14336, "heads": 32, "kv_heads": 8, "vocab": 128256,
    "rope_theta": 500000.0, "context": 8192, "rms_eps": 1e-5, "bos": 128000, "eos": 128001,
}  # fmt: skip
# A toy shape for tests (K-quant rows need multiples of 256 columns).
SMALL = {**LLAMA3_8B, "hidden": 256, "ffn": 512, "heads": 4, "kv_heads": 2, "vocab": 512, "context": 512,
         "bos": 1, "eos": 2}  # fmt: skip
FILE_TYPES = {"q4_k_m": 15, "q8_0": 7}  # llama_ftype: MOSTLY_Q4_K_M, MOSTLY_Q8_0
TARGET_STD = 0.02


def more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits (llama-quant.cpp): the layers Q4_K_M gives Q6_K attn_v/ffn_down."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_types(mix: str, n_layers: int) -> dict[str, str]:
    """GGUF tensor name -> ggml type (matrices only; norms are F32)."""
    def pick(default: str, upgraded: str, layer: int) -> str:
        return upgraded if mix == "q4_k_m" and more_bits(layer, n_layers) else default

    base = "Q4_K" if mix == "q4_k_m" else "Q8_0"
    types = {"token_embd.weight": base, "output.weight": "Q6_K" if mix == "q4_k_m" else "Q8_0"}
    for i in range(n_layers):
        for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            types[f"blk.{i}.{name}.weight"] = base
        types[f"blk.{i}.attn_v.weight"] = pick(base, "Q6_K", i)
        types[f"blk.{i}.ffn_down.weight"] = pick(base, "Q6_K", i)
    return types


def _f16_field(rng: np.random.Generator, n: int, value: float) -> np.ndarray:
    """n fp16 scales ~ value * (1 +- 10%), as bytes [n, 2]."""
    return (value * rng.uniform(0.9, 1.1, n)).astype(np.float16).view(np.uint8).reshape(n, 2)


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes per row] of random blocks whose weights have std ~TARGET_STD."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    n = rows * cols // block
    b = np.frombuffer(rng.bytes(n * size), dtype=np.uint8).reshape(n, size).copy()
    if type_name == "Q8_0":  # w = d * q, q uniform int8 (std ~74)
        b[:, 0:2] = _f16_field(rng, n, TARGET_STD / 74)
    elif type_name == "Q4_K":
        # w = d * sc * q - dmin * m, sc and m uniform 6-bit, q uniform 4-bit: with dmin = 7.5 d the
        # group means cancel on average; the std is then ~240 d.
        d = TARGET_STD / 240
        b[:, 0:2] = _f16_field(rng, n, d)
        b[:, 2:4] = _f16_field(rng, n, 7.5 * d)
    elif type_name == "Q6_K":  # w = d * sc * (q - 32): sc in [1, 32), q - 32 std ~18.5
        b[:, 192:208] = rng.integers(1, 32, size=(n, 16), dtype=np.int8).view(np.uint8)
        b[:, 208:210] = _f16_field(rng, n, TARGET_STD / (18.5 * 18))
    else:
        raise ValueError(f"no random-block recipe for {type_name}")
    return b.reshape(rows, -1)


N_SPM_SPECIAL = 3  # <unk>, <s>, </s>


def synthetic_vocab(n_vocab: int, bos: int, eos: int) -> tuple[list[str], list[float], list[int]]:
    """(pieces, scores, token types) of a sentencepiece-style vocabulary of n_vocab entries: `<unk>`,
    `<s>`, `</s>`, the byte tokens `<0x00>`..`<0xFF>` (llama.cpp finds the newline through
    `<0x0A>`), then unique made-up pieces `▁p<i>`. The ids `bos` and `eos` (the file's BOS / EOS)
    are control tokens; scores fall with the id, as in a sentencepiece model."""
    if n_vocab < N_SPM_SPECIAL + 256:
        raise ValueError(f"a vocabulary needs at least {N_SPM_SPECIAL + 256} entries, got {n_vocab}")
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [int(TokenType.UNKNOWN), int(TokenType.CONTROL), int(TokenType.CONTROL)] + [int(TokenType.BYTE)] * 256
    pieces += [f"\u2581p{i}" for i in range(len(pieces), n_vocab)]
    types += [int(TokenType.NORMAL)] * (n_vocab - len(types))
    for special, text in ((bos, "<|begin_of_text|>"), (eos, "<|end_of_text|>")):
        if special >= N_SPM_SPECIAL + 256:
            pieces[special], types[special] = text, int(TokenType.CONTROL)
    scores = [0.0] * (N_SPM_SPECIAL + 256) + [-float(i) for i in range(n_vocab - N_SPM_SPECIAL - 256)]
    return pieces, scores, types


def write(
    path: Path, mix: str, n_layers: int = 32, seed: int = 0, verbose: bool = True, vocab: bool = False,
    small: bool = False,
) -> int:
    """Write the file; returns its tensor bytes. `vocab`: add the synthetic vocabulary (for llama.cpp);
    `small`: the toy shape SMALL instead of Llama-3-8B's."""
    if mix not in FILE_TYPES:
        raise ValueError(f"--mix must be one of {', '.join(FILE_TYPES)}, got {mix!r}")
    c = {**(SMALL if small else LLAMA3_8B), "layers": n_layers}
    h, f, v = c["hidden"], c["ffn"], c["vocab"]
    kv = c["kv_heads"] * h // c["heads"]
    shapes: dict[str, tuple[int, int]] = {"token_embd.weight": (v, h), "output.weight": (v, h)}
    for i in range(n_layers):
        shapes |= {
            f"blk.{i}.attn_q.weight": (h, h), f"blk.{i}.attn_k.weight": (kv, h),
            f"blk.{i}.attn_v.weight": (kv, h), f"blk.{i}.attn_output.weight": (h, h),
            f"blk.{i}.ffn_gate.weight": (f, h), f"blk.{i}.ffn_up.weight": (f, h),
            f"blk.{i}.ffn_down.weight": (h, f),
        }  # fmt: skip
    types = tensor_types(mix, n_layers)
    norms = ["output_norm.weight"] + [f"blk.{i}.{n}.weight" for i in range(n_layers) for n in ("attn_norm", "ffn_norm")]

    w = GGUFWriter(str(path), "llama")
    w.add_name(f"random {'toy' if small else 'Llama-3-8B'}-shaped {mix.upper()}")
    w.add_file_type(FILE_TYPES[mix])
    w.add_block_count(n_layers)
    w.add_context_length(c["context"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(f)
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_rope_dimension_count(h // c["heads"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_eps"])
    w.add_vocab_size(v)
    w.add_bos_token_id(c["bos"])
    w.add_eos_token_id(c["eos"])
    if vocab:
        pieces, scores, token_types = synthetic_vocab(v, c["bos"], c["eos"])
        w.add_tokenizer_model("llama")
        w.add_token_list(pieces)
        w.add_token_scores(scores)
        w.add_token_types(token_types)

    order = ["token_embd.weight"] + [n for n in shapes if n.startswith("blk.")] + ["output.weight"]
    for name in order:
        t = types[name]
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[t]]
        rows, cols = shapes[name]
        row_bytes = cols // block * size  # the writer takes the byte shape of quantized tensors
        w.add_tensor_info(name, (rows, row_bytes), np.dtype(np.uint8), rows * row_bytes,
                          raw_dtype=GGMLQuantizationType[t])  # fmt: skip
    for name in norms:
        w.add_tensor_info(name, (h,), np.dtype(np.float32), h * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    rng = np.random.default_rng(seed)
    total, t0 = 0, time.perf_counter()
    for name in order:
        rows, cols = shapes[name]
        data = random_blocks(types[name], rows, cols, rng)
        w.write_tensor_data(data)
        total += data.nbytes
    ones = np.ones(h, dtype=np.float32)
    for _ in norms:
        w.write_tensor_data(ones)
        total += ones.nbytes
    w.close()
    if verbose:
        dt = time.perf_counter() - t0
        print(f"{path}: {mix}, {total / 1e9:.2f} GB of tensors in {dt:.1f} s", file=sys.stderr)
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--mix", default="q4_k_m", choices=sorted(FILE_TYPES))
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", action="store_true", help="add a synthetic vocabulary (llama.cpp needs one)")
    p.add_argument("--small", action="store_true", help="a toy shape (hidden 256, FFN 512, vocab 512)")
    a = p.parse_args()
    write(a.out, a.mix, a.layers, a.seed, vocab=a.vocab, small=a.small)


if __name__ == "__main__":
    main()
