"""CPU speed and weight memory of a GGUF model: weights kept quantized vs dequantized at load.

For each mode, one `paphos.LLM` is built; then, in alternation for `--rounds` rounds, each is timed
on single-stream greedy decode (`--output-len` tokens after a `--input-len` prompt; decode tok/s
excludes the prefill step) and on one prefill of `--prefill-len` tokens; the best round counts.
Weight bytes are the model's parameters and buffers after loading.

Modes:
  native       the default: GGUF blocks stay quantized, each layer runs the first kernel that
               accepts it (int4pack for Q4_0/Q4_1/Q4_K with bf16; others dequantized at load)
  dequantized  every linear weight dequantized at load into the model dtype (the former path)

    python benchmarks/gguf_cpu.py [--model PATH] [--dtype auto] [--modes native dequantized] [--out r.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from typing import Any

import torch


def weight_bytes(model: torch.nn.Module) -> int:
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def build(mode: str, args: argparse.Namespace) -> tuple[Any, float]:
    import paphos.worker.setup as setup
    from paphos import LLM

    original = setup.quant_config_for_source
    if mode == "dequantized":
        setup.quant_config_for_source = lambda source, numerics="float": None  # type: ignore[assignment]
    try:
        t0 = time.perf_counter()
        llm = LLM(model=args.model, dtype=args.dtype, max_model_len=4096)
        return llm, time.perf_counter() - t0
    finally:
        setup.quant_config_for_source = original


_ROUND = itertools.count()


def measure(llm: Any, args: argparse.Namespace) -> tuple[float, float]:
    """(decode tok/s, prefill tok/s) of one round; prompts differ per round (no prefix-cache hits)."""
    from paphos import SamplingParams

    vocab = llm.engine.runner.model.vocab_size
    first_id = 5 + next(_ROUND) * 101
    prompt = [(first_id + 17 * i) % (vocab - 10) + 5 for i in range(args.input_len)]
    greedy = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([prompt], one)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate([prompt], greedy)
    decode_tok_s = (args.output_len - 1) / (time.perf_counter() - t0 - first)
    long_prompt = [(first_id + 31 * i) % (vocab - 10) + 5 for i in range(args.prefill_len)]
    t0 = time.perf_counter()
    llm.generate([long_prompt], one)
    return decode_tok_s, args.prefill_len / (time.perf_counter() - t0)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Builds every mode, then measures them in alternation for `--rounds` rounds and keeps each
    mode's best round: on a shared machine, load from elsewhere then hits all modes alike."""
    built = {mode: build(mode, args) for mode in args.modes}
    for llm, _ in built.values():
        measure(llm, argparse.Namespace(**{**vars(args), "output_len": 2, "prefill_len": 16}))  # warm-up
    best: dict[str, tuple[float, float]] = {mode: (0.0, 0.0) for mode in args.modes}
    for _ in range(args.rounds):
        for mode, (llm, _) in built.items():
            decode, prefill = measure(llm, args)
            best[mode] = (max(best[mode][0], decode), max(best[mode][1], prefill))
    return [
        {
            "mode": mode,
            "load_s": round(load_s, 2),
            "weight_MiB": round(weight_bytes(llm.engine.runner.model) / 2**20, 1),
            "decode_tok_s": round(best[mode][0], 1),
            "prefill_tok_s": round(best[mode][1], 1),
        }
        for mode, (llm, load_s) in built.items()
    ]


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
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = run(args)
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
