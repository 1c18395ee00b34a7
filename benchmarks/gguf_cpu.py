"""CPU speed and weight memory of GGUF models: Paphos (weights kept quantized, or dequantized at
load) against llama.cpp (llama-cpp-python, in this process) in the same run.

For each model in turn, every mode is built; then, in alternation for `--rounds` rounds, each is
timed on single-stream greedy decode (`--output-len` tokens after a `--input-len` prompt; decode
tok/s excludes the prefill step) and on one prefill of `--prefill-len` tokens; the best round
counts. Prompts are the same token ids for every mode and differ per round (no prefix-cache hits).
Weight bytes: the model's parameters and buffers after loading, RoPE tables aside (llama.cpp:
`llama_model_size`).

Modes:
  native       Paphos' default: GGUF blocks stay quantized, each layer runs the first kernel that
               accepts it (int4pack for Q4_0/Q4_1/Q4_K with bf16; others dequantized at load)
  dequantized  Paphos with every linear weight dequantized at load into the model dtype
  llamacpp     llama.cpp through llama-cpp-python's low-level `Llama.eval` (the same thread count
               as torch; greedy = argmax of its logits): not a project dependency, install its
               wheel to use it

Models: `--models` takes GGUF paths or the names `default` (the bundled SmolLM2-135M Q4_1) and
`gemma3` (Gemma-3-270M Q4_K_M from Paphos' model cache, assembled there by
`tests/models/conftest.py`).

    python benchmarks/gguf_cpu.py [--models default gemma3] [--dtype auto] \
        [--modes native llamacpp] [--out r.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"


def weight_bytes(model: torch.nn.Module) -> int:
    """Parameters and buffers, without the RoPE cos/sin tables: those scale with the model's
    maximum context (Gemma 3's two tables of 32k positions: 64 MiB), not with its weights."""
    from paphos.layers.rotary import RotaryEmbedding

    tables = {id(b) for m in model.modules() if isinstance(m, RotaryEmbedding) for b in m.buffers()}
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in tables}
    return sum(t.numel() * t.element_size() for t in tensors.values())


class LlamaCpp:
    """llama.cpp on the same GGUF, driven like `paphos.LLM` in `measure`: a fresh context per
    request, greedy decode by argmax over its logits."""

    def __init__(self, model: str, max_len: int) -> None:
        import llama_cpp

        threads = torch.get_num_threads()
        self.llm = llama_cpp.Llama(
            model_path=model, n_ctx=max_len, n_batch=max_len, n_ubatch=512, n_threads=threads,
            n_threads_batch=threads, verbose=False,
        )  # fmt: skip
        self.vocab_size = self.llm.n_vocab()
        self.weight_bytes = int(llama_cpp.llama_model_size(self.llm._model.model))  # noqa: SLF001

    def generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        self.llm.reset()
        self.llm.eval(prompt)
        out: list[int] = []
        while True:
            out.append(int(np.argmax(self.llm.scores[self.llm.n_tokens - 1])))
            if len(out) == max_tokens:
                return out
            self.llm.eval(out[-1:])


def resolve_model(name: str) -> str:
    if name == "default":
        from paphos.default_model import default_model_path

        return str(default_model_path())
    if name == "gemma3":
        from paphos.default_model import default_cache_dir

        path = Path(default_cache_dir()) / GEMMA3_FILE
        if not path.is_file():
            raise SystemExit(
                f"{path} not found: run `pytest tests/models/test_gemma3_gguf.py` once to assemble it"
            )
        return str(path)
    return name


def build(mode: str, model: str, args: argparse.Namespace) -> tuple[Any, float]:
    if mode == "llamacpp":
        t0 = time.perf_counter()
        llm = LlamaCpp(model, max_len=max(args.prefill_len, args.input_len + args.output_len) + 16)
        return llm, time.perf_counter() - t0
    import paphos.worker.setup as setup
    from paphos import LLM

    original = setup.select_quant_config
    if mode == "dequantized":
        setup.select_quant_config = lambda source, quantization, numerics: None  # type: ignore[assignment]
    try:
        t0 = time.perf_counter()
        llm = LLM(model=model, dtype=args.dtype, max_model_len=4096, cpu_kv_cache_gb=1.0)
        return llm, time.perf_counter() - t0
    finally:
        setup.select_quant_config = original


_ROUND = itertools.count()


def _vocab_size(llm: Any) -> int:
    return llm.vocab_size if isinstance(llm, LlamaCpp) else llm.engine.runner.model.vocab_size


def _generate(llm: Any, prompt: list[int], max_tokens: int) -> None:
    if isinstance(llm, LlamaCpp):
        llm.generate(prompt, max_tokens)
        return
    from paphos import SamplingParams

    llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def measure(llm: Any, args: argparse.Namespace, round_id: int) -> tuple[float, float]:
    """(decode tok/s, prefill tok/s) of one round; prompts differ per round (no prefix-cache hits)
    and are the same for every mode of a round."""
    vocab = _vocab_size(llm)
    first_id = 5 + round_id * 101
    prompt = [(first_id + 17 * i) % (vocab - 10) + 5 for i in range(args.input_len)]
    t0 = time.perf_counter()
    _generate(llm, prompt, 1)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    _generate(llm, prompt, args.output_len)
    decode_tok_s = (args.output_len - 1) / (time.perf_counter() - t0 - first)
    long_prompt = [(first_id + 31 * i) % (vocab - 10) + 5 for i in range(args.prefill_len)]
    t0 = time.perf_counter()
    _generate(llm, long_prompt, 1)
    return decode_tok_s, args.prefill_len / (time.perf_counter() - t0)


def run(model: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Builds every mode for `model`, then measures them in alternation for `--rounds` rounds and
    keeps each mode's best round: on a shared machine, load from elsewhere then hits all modes alike."""
    built = {mode: build(mode, model, args) for mode in args.modes}
    for llm, _ in built.values():
        warm = argparse.Namespace(**{**vars(args), "output_len": 2, "prefill_len": 16})
        measure(llm, warm, next(_ROUND))
    best: dict[str, tuple[float, float]] = {mode: (0.0, 0.0) for mode in args.modes}
    for _ in range(args.rounds):
        round_id = next(_ROUND)
        for mode, (llm, _) in built.items():
            decode, prefill = measure(llm, args, round_id)
            best[mode] = (max(best[mode][0], decode), max(best[mode][1], prefill))
    rows = []
    for mode, (llm, load_s) in built.items():
        size = llm.weight_bytes if isinstance(llm, LlamaCpp) else weight_bytes(llm.engine.runner.model)
        rows.append({
            "model": Path(model).name, "mode": mode, "load_s": round(load_s, 2),
            "weight_MiB": round(size / 2**20, 1), "decode_tok_s": round(best[mode][0], 1),
            "prefill_tok_s": round(best[mode][1], 1),
        })  # fmt: skip
    built.clear()  # free this model's engines before the next model's
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--models", "--model", nargs="+", default=["default", "gemma3"],
        help="GGUF paths, or `default` / `gemma3` (default: both)",
    )  # fmt: skip
    ap.add_argument(
        "--dtype", default="auto", help="Paphos' --dtype (auto: bf16 where the CPU has bf16 dot products)"
    )
    ap.add_argument(
        "--modes", nargs="+", default=["native", "llamacpp"], choices=["native", "dequantized", "llamacpp"]
    )
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    models = [resolve_model(m) for m in args.models]
    rows = [row for model in models for row in run(model, args)]
    print(
        f"{torch.get_num_threads()} threads, dtype {args.dtype}, decode {args.output_len} tokens after "
        f"{args.input_len}, prefill {args.prefill_len}, best of {args.rounds} rounds"
    )
    head = f"{'model':<34} {'mode':<12} {'load s':>7} {'weights MiB':>12} {'decode tok/s':>13} {'prefill tok/s':>14}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(
            f"{r['model']:<34} {r['mode']:<12} {r['load_s']:>7} {r['weight_MiB']:>12} {r['decode_tok_s']:>13} "
            f"{r['prefill_tok_s']:>14}"
        )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "models": models, "dtype": args.dtype, "threads": torch.get_num_threads(),
                    "settings": {k: getattr(args, k) for k in ("input_len", "output_len", "prefill_len", "rounds")},
                    "rows": rows,
                },
                f, indent=2,
            )  # fmt: skip
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
