"""Exhaustive check of the sampler kernels' temperature division (paphos/sample/fast/kernels.py
`divide`: a product and one fma correction) against IEEE division (`tl.math.div_rn`, what torch's
`x / T` computes) on every float32 x, for a set of temperatures.

Usage (CUDA):
    python benchmarks/sampler_division_check.py [--out results/division.json] [--random 64]

Prints, per temperature, the number of float32 bit patterns x whose quotients differ (NaN payloads
aside): in range (2^-100 <= |x| and |x / T| < 2^127) and outside it (where the fma's residual
underflows, or x / T rounds to the largest float or overflows: no logit is that small but 0, or
that large), and the largest differing |x| in range; writes the same as JSON. Any difference in
range is a defect.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paphos.sample.fast import kernels  # noqa: E402

TINY = 2.0**-100  # |x| below this: the residual underflows and the last place may differ
HUGE = 2.0**127  # |x / T| from this on: the product may overflow where the quotient does not
# Temperatures users set (SillyTavern presets, Kobold sliders) and awkward ones.
FIXED = (0.05, 0.1, 0.2, 0.25, 0.3, 0.33, 0.4, 0.5, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.99, 1.0, 1.01,
         1.05, 1.1, 1.2, 1.25, 1.3, 1.5, 1.75, 2.0, 2.5, 3.0, 5.0, 7.0, 10.0, 1e-3, 1e-4, 100.0)


@triton.jit
def _check_kernel(d, out_ptr, PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr, TINY: tl.constexpr,
                  HUGE: tl.constexpr):
    """Program p checks the bit patterns p * PER_PROGRAM ... + PER_PROGRAM - 1: the number of
    differing quotients in range and outside it, and the largest differing |x| in range (its
    float bits: non-negative floats order as their bits)."""
    rd = tl.math.div_rn(1.0, d)
    base = tl.program_id(0).to(tl.int64) * PER_PROGRAM
    big = tl.zeros([BLOCK], tl.int32)
    small = tl.zeros([BLOCK], tl.int32)
    largest = tl.zeros([BLOCK], tl.int32)
    for start in range(0, PER_PROGRAM, BLOCK):
        x = (base + start + tl.arange(0, BLOCK)).to(tl.uint32).to(tl.float32, bitcast=True)
        want = tl.math.div_rn(x, d)
        got = kernels.divide(x, d, rd)
        differ = (want.to(tl.int32, bitcast=True) != got.to(tl.int32, bitcast=True)) & ~((want != want) & (got != got))
        ax = tl.abs(x)
        in_range = (ax >= TINY) & (tl.abs(want) < HUGE)
        big += (differ & in_range).to(tl.int32)
        small += (differ & ~in_range).to(tl.int32)
        largest = tl.maximum(largest, tl.where(differ & in_range, ax.to(tl.int32, bitcast=True), 0))
    tl.atomic_add(out_ptr + 0, tl.sum(big.to(tl.int64), axis=0))
    tl.atomic_add(out_ptr + 1, tl.sum(small.to(tl.int64), axis=0))
    tl.atomic_max(out_ptr + 2, tl.max(largest, axis=0).to(tl.int64))


def check(d: float) -> dict[str, object]:
    out = torch.zeros(3, dtype=torch.int64, device="cuda")
    per_program = 1 << 16
    _check_kernel[((1 << 32) // per_program,)](d, out, PER_PROGRAM=per_program, BLOCK=1024, TINY=TINY, HUGE=HUGE,
                                               num_warps=8)
    big, small, largest = out.tolist()
    largest_value = torch.tensor([largest], dtype=torch.int64).to(torch.int32).view(torch.float32).item()
    return {"temperature": d, "differ_in_range": big, "differ_outside": small, "largest_differing_x": largest_value}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--random", type=int, default=64, help="random temperatures in [0.01, 10] besides the fixed ones")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    randoms = (10 ** (torch.rand(args.random, generator=gen) * 3 - 2)).tolist()
    temps = [float(torch.tensor(t, dtype=torch.float32)) for t in (*FIXED, *randoms)]
    t0 = time.perf_counter()
    rows = [check(t) for t in temps]
    seconds = time.perf_counter() - t0
    bad = [r for r in rows if r["differ_in_range"]]
    for r in rows:
        print(f"T={r['temperature']:.9g}: differ in range {r['differ_in_range']} (largest |x| "
              f"{r['largest_differing_x']:.3g}), outside {r['differ_outside']}")
    print(f"{len(temps)} temperatures x 2^32 float32 x in {seconds:.1f} s: "
          f"{len(bad)} temperatures with a differing quotient in range")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows, "seconds": seconds, "temperatures_with_defects": len(bad)}, indent=1))


if __name__ == "__main__":
    main()
