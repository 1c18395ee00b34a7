"""CPU speed and weight memory of a GGUF model: weights kept quantized vs dequantized at load.

For each mode, one `paphos.LLM` is built and timed on single-stream greedy decode (`--output-len`
tokens after a `--input-len` prompt; decode tok/s excludes the prefill step) and on one prefill of
`--prefill-len` tokens. Weight bytes are the model's parameters and buffers after loading.

Modes:
  native       the default: GGUF blocks stay quantized, each layer runs the first kernel that
               accepts it (int4pack for Q4_0/Q4_1/Q4_K with bf16; others dequantized at load)
  dequantized  every linear weight dequantized at load into the model dtype (the former path)

    python benchmarks/gguf_cpu.py [--model PATH] [--dtype auto] [--modes native dequantized] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch


def weight_bytes(model: torch.nn.Module) -> int:
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    import paphos.worker.setup as setup
    from paphos import LLM, SamplingParams

    original = setup.quant_config_for_source
    if mode == "dequantized":
        setup.quant_config_for_source = lambda source, numerics="float": None  # type: ignore[assignment]
    try:
        t0 = time.perf_counter()
        llm = LLM(model=args.model, dtype=args.dtype, max_model_len=4096)
        load_s = time.perf_counter() - t0
    finally:
        setup.quant_config_for_source = original
    model = llm.engine.runner.model
    vocab = model.vocab_size
    prompt = [(17 * i + 3) % (vocab - 10) + 5 for i in range(args.input_len)]
    greedy = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], one)  # warm-up
    t0 = time.perf_counter()
    llm.generate([prompt], one)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate([prompt], greedy)
    decode_tok_s = (args.output_len - 1) / (time.perf_counter() - t0 - first)
    long_prompt = [(31 * i + 7) % (vocab - 10) + 5 for i in range(args.prefill_len)]
    t0 = time.perf_counter()
    llm.generate([long_prompt], one)
    prefill_tok_s = args.prefill_len / (time.perf_counter() - t0)
    return {
        "mode": mode,
        "load_s": round(load_s, 2),
        "weight_MiB": round(weight_bytes(model) / 2**20, 1),
        "decode_tok_s": round(decode_tok_s, 1),
        "prefill_tok_s": round(prefill_tok_s, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF path (default: the bundled default model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--modes", nargs="+", default=["native", "dequantized"], choices=["native", "dequantized"]
    )
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [run_mode(mode, args) for mode in args.modes]
    print(f"{'mode':<12} {'load s':>7} {'weights MiB':>12} {'decode tok/s':>13} {'prefill tok/s':>14}")
    for r in rows:
        print(
            f"{r['mode']:<12} {r['load_s']:>7} {r['weight_MiB']:>12} {r['decode_tok_s']:>13} {r['prefill_tok_s']:>14}"
        )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(
                {"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(), "rows": rows},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
