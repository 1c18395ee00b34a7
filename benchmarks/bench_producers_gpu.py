"""The kernels that produce a quantized linear's input (residual add + RMSNorm and SiLU x mul,
paphos/layers/fused.py) on the GPU, with and without the int8 parts of x they write for the next
linear: the W4 GEMV's at one row (x_int8.py), the int8 tensor-core GEMM's blocks at 16 and 32
rows (x_int8_blocks.py, triton_int_i8.x_layout), beside the standalone quantizing launch the
linear runs where no producer wrote them. The norm by columns per program (`--chunks`; "row":
one program a row). Llama-3-8B widths (hidden 4096, intermediate 14336), bf16, CUDA-graph
replays of back-to-back calls with programmatic dependent launch (as a decode step replays them).

    python3 benchmarks/bench_producers_gpu.py --out results/producers.json [--rows 1,16,32]
        [--chunks row,1024,512,256]

Prints us per call for each case and writes them to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from timing import graph_time  # noqa: E402

from paphos.layers import fused, x_int8, x_int8_blocks  # noqa: E402
from paphos.layers.x_int8_outputs import Int8Outputs  # noqa: E402
from paphos.quant.kernels import triton_int_i8  # noqa: E402

HIDDEN, INTERMEDIATE = 4096, 14336
GEMV_LAYOUT = x_int8.Int8Layout(4, 4)  # the W4 GEMV's (4-bit codes, 4-word tiles)
BLOCK_LAYOUT = triton_int_i8.x_layout(4, 3, 32)


def _us(fn: Callable[[], object]) -> float:
    return graph_time([fn], calls=64) * 1e6


def _wanted(rows: int) -> Int8Outputs:
    """The parts a W4 linear reads at `rows` tokens: the GEMV's at one, the GEMM's blocks above."""
    return Int8Outputs(gemv=GEMV_LAYOUT) if rows == 1 else Int8Outputs(blocks=BLOCK_LAYOUT)


def norm_cases(rows: int, chunks: list[str]) -> dict[str, float]:
    x, res = (torch.randn(rows, HIDDEN, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    weight = torch.randn(HIDDEN, dtype=torch.bfloat16, device="cuda")
    wanted = _wanted(rows)
    out = {"norm": _us(lambda: fused.add_rmsnorm(x, res, weight, 1e-5))}
    for chunk in chunks:
        size = HIDDEN if chunk == "row" else int(chunk)
        out[f"norm+parts chunk {chunk}"] = _us(lambda s=size: fused.add_rmsnorm(x, res, weight, 1e-5, wanted, chunk=s))
    out["quantize launch"] = _us(lambda: _quantize(x, rows))
    return out


def silu_cases(rows: int) -> dict[str, float]:
    x = torch.randn(rows, 2 * INTERMEDIATE, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(rows, INTERMEDIATE, dtype=torch.bfloat16, device="cuda")
    wanted = _wanted(rows)
    return {"silu": _us(lambda: fused.silu_and_mul(x)), "silu+parts": _us(lambda: fused.silu_and_mul(x, wanted)),
            "quantize launch": _us(lambda: _quantize(y, rows))}  # fmt: skip


def _quantize(x: torch.Tensor, rows: int) -> object:
    if rows == 1:
        return x_int8.quantize(x[0], GEMV_LAYOUT)
    return x_int8_blocks.quantize(x, BLOCK_LAYOUT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", default="1,16,32")
    parser.add_argument("--chunks", default="row,1024,512,256")
    args = parser.parse_args()
    chunks = args.chunks.split(",")
    results: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "us": {}}
    for rows in map(int, args.rows.split(",")):
        for name, cases in (("norm 4096", norm_cases(rows, chunks)), ("silu 14336", silu_cases(rows))):
            results["us"][f"{name} x {rows}"] = cases
            print(f"{name} x {rows} rows: " + ", ".join(f"{k} {v:.2f}" for k, v in cases.items()), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
