"""Compile every sampler Triton kernel (paphos/sample/fast/kernels.py) for an H100/H200 (sm_90)
on any machine, no GPU needed: catches kernels that run under the interpreter but do not lower
for the GPU. Prints registers-free facts that matter: shared memory and local-memory (spill) use.

    python benchmarks/sampler_kernels_compile_check.py [--arch 90]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout, installed or not
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from paphos.sample.fast import kernels as k  # noqa: E402

P32, P64, I32 = "*fp32", "*i64", "i32"


def specs() -> list[tuple[str, object, dict[str, str], dict[str, object], int]]:
    """(name, kernel, signature of the runtime arguments, constexprs, num_warps) as the wrappers
    in kernels.py launch them (128k vocabulary: tiles of 1024)."""
    block, nbp = k.split_block(128256), 128
    x = {"x_ptr": P32, "stride": I32, "n_cols": I32}
    out = [
        ("stats (row stats)", k._stats_kernel,
         {**x, "t_ptr": P32, "pmax_ptr": P32, "parg_ptr": P64, "psum_ptr": P32, "pmass_ptr": P32},
         {"BLOCK": block, "SCALED": False, "BINS": 0}, 4),
        ("stats (top-p bins)", k._stats_kernel,
         {**x, "t_ptr": P32, "pmax_ptr": P32, "parg_ptr": P64, "psum_ptr": P32, "pmass_ptr": P32},
         {"BLOCK": block, "SCALED": True, "BINS": k.NBINS}, 8),
        ("stats combine", k._stats_combine_kernel,
         {"pmax_ptr": P32, "parg_ptr": P64, "psum_ptr": P32, "nb": I32, "max_ptr": P32, "arg_ptr": P64,
          "lse_ptr": P32}, {"NBP": nbp}, 1),
        ("tail select", k._tail_select_kernel,
         {"pmax_ptr": P32, "parg_ptr": P64, "psum_ptr": P32, "pmass_ptr": P32, "nb": I32, "p_ptr": P32,
          "arg_ptr": P64, "fstate_ptr": P32, "state_ptr": P64},
         {"NBP": nbp, "BINS": k.NBINS, "FS": k.FSTATE, "ST": k.STATE}, 4),
        ("tail gather", k._tail_gather_kernel,
         {**x, "t_ptr": P32, "state_ptr": P64, "buf_ptr": P64},
         {"CAP": k.TAIL_CAP, "BLOCK": block, "ST": k.STATE}, 4),
        ("tail boundary", k._tail_boundary_kernel,
         {**x, "t_ptr": P32, "fstate_ptr": P32, "state_ptr": P64, "buf_ptr": P64, "last_v_ptr": P32},
         {"CAP": k.TAIL_CAP, "K": k.TAIL_PIVOTS, "SBLOCK": 512, "FIRST_STEP": k.TAIL_FIRST_STEP, "FS": k.FSTATE,
          "ST": k.STATE}, 8),
        ("race combine", k._race_combine_kernel,
         {"pbest_ptr": P32, "pid_ptr": P64, "nb": I32, "out_ptr": P64}, {"NBP": nbp}, 1),
    ]
    for tail in (False, True):
        out.append((f"race (tail={tail})", k._race_kernel,
                    {**x, "step_ptr": P64, "t_ptr": P32, "mp_ptr": P32, "fstate_ptr": P32, "state_ptr": P64,
                     "pbest_ptr": P32, "pid_ptr": P64},
                    {"BLOCK": block, "TAIL": tail, "FS": k.FSTATE, "ST": k.STATE}, 4))
    out += [
        ("prefix moments", k._prefix_moments_kernel, {**x, "part_ptr": P32}, {"BLOCK": block}, 4),
        ("prefix combine", k._prefix_combine_kernel, {"part_ptr": P32, "nb": I32, "stats_ptr": P32},
         {"NBP": nbp, "NS": k.PREFIX_STATS}, 1),
    ]
    out.append(("chain (widest)", k._chain_kernel,
                {"val_ptr": P32, "id_ptr": P64, "width": I32, "prm_ptr": P32, "prm_stride": I32,
                 "code_ptr": "*i32", "n_codes": I32, "stats_ptr": P32, "seed_ptr": P64, "pos_ptr": P64,
                 "greedy_ptr": "*i1", "out_ptr": P64},
                {"BLOCK": k.CHAIN_MAX_WIDTH, "NUM_DRAWS": 2, "NS": k.PREFIX_STATS}, 8))
    for dtype in ("bf16", "fp16"):
        out.append((f"stats (row stats, {dtype})", k._stats_kernel,
                    {**x, "x_ptr": f"*{dtype}", "t_ptr": P32, "pmax_ptr": P32, "parg_ptr": P64, "psum_ptr": P32,
                     "pmass_ptr": P32}, {"BLOCK": block, "SCALED": False, "BINS": 0}, 4))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    failed = 0
    for name, fn, signature, constexprs, warps in specs():
        start = time.perf_counter()
        try:
            sig = {**signature, **{c: "constexpr" for c in constexprs}}
            compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=target,
                                      options={"num_warps": warps})
        except Exception as exc:  # report every kernel, then fail
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        ptx = compiled.asm["ptx"]
        local = "yes" if ".local" in ptx else "no"
        print(f"ok   {name:<28} shared {compiled.metadata.shared:>6} B  local memory {local:<3} "
              f"{time.perf_counter() - start:5.1f} s")
    if failed:
        sys.exit(f"{failed} kernel(s) failed to compile for sm_{args.arch}")


if __name__ == "__main__":
    main()
