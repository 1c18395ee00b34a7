"""Compile every sampler Triton kernel (paphos/sample/fast/kernels.py, tail_kernels.py,
history_kernels.py) for an H100/H200 (sm_90) on any machine, no GPU needed: catches kernels that run under the interpreter but do not lower
for the GPU. Prints what ptxas built for each (registers per thread, spill stack bytes, spill loads
and stores inside loops: cuobjdump of the cubin) and the shared memory.

    python benchmarks/sampler_kernels_compile_check.py [--arch 90]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout, installed or not
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from paphos.sample.fast import history_kernels as hk  # noqa: E402
from paphos.sample.fast import kernels as k  # noqa: E402
from paphos.sample.fast import tail_kernels as tk  # noqa: E402
from paphos.sample.metadata import COL  # noqa: E402

P32, P64, I32 = "*fp32", "*i64", "i32"


def specs() -> list[tuple[str, object, dict[str, str], dict[str, object], int]]:
    """(name, kernel, signature of the runtime arguments, constexprs, num_warps) as the wrappers
    in kernels.py launch them (128k vocabulary: tiles of 1024)."""
    block, nbp = k.split_block(128256), 128
    x = {"x_ptr": P32, "stride": I32, "n_cols": I32}
    out = [
        ("stats (row stats)", k._stats_kernel, {**x, "pmax_ptr": P32, "parg_ptr": P64, "psum_ptr": P32},
         {"BLOCK": block}, 4),
        ("stats combine", k._stats_combine_kernel,
         {"pmax_ptr": P32, "parg_ptr": P64, "psum_ptr": P32, "nb": I32, "max_ptr": P32, "arg_ptr": P64,
          "lse_ptr": P32}, {"NBP": nbp}, 1),
        ("race combine", k._race_combine_kernel,
         {"pbest_ptr": P32, "pid_ptr": P64, "nb": I32, "out_ptr": P64}, {"NBP": nbp}, 1),
    ]
    for launch in (tk.TAIL_LAUNCH_FEW, tk.TAIL_LAUNCH_MANY):
        out.append((f"dense tail ({'x'.join(map(str, launch))})", tk._dense_tail_kernel,
                    {"raw_ptr": P32, "work_ptr": P32, "stride_raw": I32, "stride_work": I32, "n_cols": I32,
                     "col_ptr": P32, "col_stride": I32, "seed_ptr": P64, "pos_ptr": P64, "greedy_ptr": "*i1",
                     "buf_ptr": P64, "tok_ptr": P64, "id_ptr": P64, "flt_ptr": P32, "n_rows": I32},
                    {"T_COL": 0, "P_COL": 5, "MP_COL": 7, "SAME": True, "NUM_DRAWS": 2, "BLOCK": launch.block,
                     "DEPTH": launch.depth, "BINS": tk.NBINS, "CAP": tk.TAIL_CAP, "K": tk.TAIL_PIVOTS, "SBLOCK": tk.TAIL_SBLOCK,
                     "FIRST_STEP": tk.TAIL_FIRST_STEP, "ASM": True}, launch.warps))
    out.append(("race", k._race_kernel, {**x, "step_ptr": P64, "pbest_ptr": P32, "pid_ptr": P64},
                {"BLOCK": block}, 4))
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
    for chunk in (512, hk.MAX_BLOCK):  # a 512-token history (bench_sampler.py), the widest chunk
        out.append((f"history (chunk {chunk})", hk._history_kernel,
                    {"x_ptr": P32, "x_stride": I32, "hist_ptr": P64, "hist_stride": I32, "length": I32,
                     "nout_ptr": P64, "brk_ptr": P64, "brk_stride": I32, "n_brk": I32, "prm_ptr": P32,
                     "prm_stride": I32, "code_ptr": "*i32", "key_ptr": P64, "agg_ptr": P64, "scratch_stride": I32},
                    {"P0": COL[hk.HISTORY_PARAMS[0]], "NC": len(hk.HISTORY_CODE), "BLOCK": chunk,
                     "LOG_BLOCK": chunk.bit_length() - 1}, hk.warps_for(chunk)))
    for dtype in ("bf16", "fp16"):
        out.append((f"stats (row stats, {dtype})", k._stats_kernel,
                    {**x, "x_ptr": f"*{dtype}", "pmax_ptr": P32, "parg_ptr": P64, "psum_ptr": P32},
                    {"BLOCK": block}, 4))
    return out


def _resource_usage(cubin: bytes) -> tuple[int, int, int]:
    """(registers per thread, stack bytes, spill loads and stores inside loops) as ptxas built the
    kernel: a non-zero stack is a spill; one in straight-line code costs a few accesses per
    program, one inside a loop costs them per iteration."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {usage!r}")
    code = [(int(a, 16), text) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    # A loop is the span from a backward branch's target to the branch; not the jump back from an
    # out-of-line block of a collective under divergence (ptxas places it at the end, ENDCOLLECTIVE
    # then BRA), which runs once per entry.
    loops = [(int(t, 16), a) for i, (a, text) in enumerate(code)
             for t in re.findall(r"BRA\s+(?:`\(.*?\)\s*)?(0x[0-9a-f]+)", text)
             if int(t, 16) <= a and not (i and code[i - 1][1].startswith("ENDCOLLECTIVE"))]  # fmt: skip
    in_loops = sum(1 for a, text in code if re.search(r"\b(LDL|STL)\b", text) and any(lo <= a <= hi for lo, hi in loops))
    return int(found.group(1)), int(found.group(2)), in_loops


_specs: list[tuple[str, object, dict[str, str], dict[str, object], int]] = []


def _compile(index: int, arch: int) -> str:
    """The report line of one kernel of `_specs` (a pool worker's job)."""
    name, fn, signature, constexprs, warps = _specs[index]
    start = time.perf_counter()
    try:
        sig = {**signature, **{c: "constexpr" for c in constexprs}}
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                                  target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    except Exception as exc:  # report every kernel, then fail
        return f"FAIL {name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    registers, stack, loop_spills = _resource_usage(compiled.asm["cubin"])
    return (f"ok   {name:<28} registers {registers:>3}  spill stack {stack:>4} B  spill accesses in loops "
            f"{loop_spills:>3}  shared {compiled.metadata.shared:>6} B  {time.perf_counter() - start:5.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    _specs.extend(specs())
    # One compile per core (each is single-threaded); forked, so the kernels need no pickling.
    with ProcessPoolExecutor(os.cpu_count() or 1, mp_context=multiprocessing.get_context("fork")) as pool:
        failed = 0
        for line in pool.map(_compile, range(len(_specs)), [args.arch] * len(_specs)):
            print(line, flush=True)  # as each finishes, in the specs' order
            failed += line.startswith("FAIL")
    if failed:
        sys.exit(f"{failed} kernel(s) failed to compile for sm_{args.arch}")


if __name__ == "__main__":
    main()
