"""Static cost of the int8 tensor-core kernels (GGUF's paphos/quant/gguf/triton_gguf_i8.py, the
integer family's paphos/quant/kernels/triton_int_i8.py on 4-bit group-128 planes) and of the
GGUF fused bf16 kernel they replace, for an H100/H200 (sm_90), on any machine, no GPU needed:
each kernel compiled at several launches for 16 tokens and a 4096 x 4096 weight, and from its
SASS the main loop's instructions per thread and step, thread-instructions per weight byte,
tensor-core waits (wgmma `WARPGROUP.DEPBAR`) per KiB of weights, registers and spills.

Why: the kernels are issue-bound (benchmarks/README.md), and the measured Q4_K versions rank as
their counts do: the one-dot-per-sub-block version (12.0 instructions a byte, with 76 global loads
a step inside its loop) streamed half the final one's bytes per second (8.6, 20 loads); so the
counts rank launches and versions of one kernel where no GPU is at hand (the Q4_K kernel's
scale-register change: 8.6 -> 7.5 a byte, 129.6 -> 118.8 us a layer). They do not rank kernels
of different shapes: the per-group int8 kernels for Q8_0, Q6_K and Q4_0 counted 2.3-2.5x fewer
instructions a byte than the fused kernel and ran 0.66-0.96x its speed (barriers and shared-memory
round trips the count does not weigh; triton_gguf_i8's docstring). They are not a timing:
benchmarks/bench_gguf_gpu.py `i8` is.

    python benchmarks/int8_sass.py [--out counts.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout, installed or not
from paphos.quant.gguf import planes, q6_k_tile, triton_gguf  # noqa: E402
from paphos.quant.gguf import triton_gguf_i8 as ti8  # noqa: E402
from paphos.quant.kernels import triton_int_i8  # noqa: E402
from tests.device_triton import compile_sm90  # noqa: E402

COMMON = {"q_ptr": "*i8", "dx_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"}
SHAPE = dict(M=16, N=4096, K=4096, stride_om=4096)
# name -> (kernel, its arguments besides COMMON's and SHAPE's, integer arguments, constexprs,
# weight bytes a row per step: the file's)
KERNELS = {
    "Q4_K": (ti8._q4_k_kernel, {"w_ptr": "*u8", "hi_ptr": "*u8", "sc_ptr": "*i64", "sd_ptr": "*fp16", "mn_ptr": "*i64",
                                "smin_ptr": "*fp16"}, dict(iters_per_split=4), dict(FIVE=False), 144),
    "Q5_K": (ti8._q4_k_kernel, {"w_ptr": "*u8", "hi_ptr": "*u8", "sc_ptr": "*i64", "sd_ptr": "*fp16", "mn_ptr": "*i64",
                                "smin_ptr": "*fp16"}, dict(iters_per_split=4), dict(FIVE=True), 176),
    "W4g128": (triton_int_i8._gemm_kernel, {"sum_ptr": "*i32", "w_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*fp16"},
               dict(stride_w=2048, group_shift=7, iters_per_split=8), dict(BITS=4, HAS_Z=False, ATOMIC=True), 66),
}  # fmt: skip
SCALE_POINTER = {0: "*fp16", 1: "*i8", 2: "*u8"}
LAUNCHES = ((64, 4), (128, 4), (128, 8), (64, 2), (32, 2), (16, 1))  # (rows, warps)
_ADDR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*)$")


def main_loop(sass: str) -> list[str]:
    """The instructions of the longest backward branch's body (the K loop)."""
    code = [(int(m.group(1), 16), m.group(2)) for m in map(_ADDR.match, sass.splitlines()) if m]
    loops = []
    for at, text in code:
        target = re.search(r"BRA\s.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < at:
            loops.append((int(target.group(1), 16), at))
    start, end = max(loops, key=lambda ab: ab[1] - ab[0])
    return [text for at, text in code if start <= at <= end]


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def count(name: str, rows: int, warps: int) -> dict[str, object]:
    kernel, planes, extra, constexprs, row_bytes = KERNELS[name]
    ints = SHAPE | extra
    args = COMMON | planes | {arg: "i32" for arg in ints}
    constexprs = constexprs | dict(BN=rows, BM=16, SPLIT=True, ASM=True, PDL=True, TT=4)  # 4096 x 4096: tiled
    if kernel is ti8._q4_k_kernel:  # the scale reads the engine launches at 16 tokens
        constexprs["SCALE_WORDS"] = ti8.scale_words(name, ti8.I8Config(block_m=16))
    stages = triton_int_i8.I8Config().num_stages  # both int8 kernels launch with it
    out = compile_sm90(kernel, args, constexprs, warps, ints, stages, sass=True)
    body = main_loop(out)
    ops = Counter(opcode(t) for t in body)
    step_bytes = rows * row_bytes
    waits = sum(1 for t in body if opcode(t) == "WARPGROUP" and "DEPBAR" in t)
    return {
        "type": name, "rows": rows, "warps": warps, "mma": "wgmma" if "wgmma" in out else "mma.sync",
        "loop_instructions": len(body), "per_byte": len(body) * 32 * warps / step_bytes,
        "waits_per_kib": waits * 1024 / step_bytes, "registers": int(re.search(r"REG:(\d+)", out).group(1)),
        "spill_stack": int(re.search(r"STACK:(\d+)", out).group(1)), "top": dict(ops.most_common(16)),
    }  # fmt: skip


def count_fused(type_name: str) -> dict[str, object]:
    """triton_gguf's fused bf16 kernel (the Q4_K / Q5_K int8 kernels' predecessor, and the kernel of
    the other types, Q6_K by its inline PTX) at its rule's launch for 16 tokens on a 4096 x 4096
    weight."""
    fmt = planes.FORMATS[type_name]
    cfg = triton_gguf.config_for(type_name, 4096, 4096, 16)
    args = {"x_ptr": "*bf16", "out_ptr": "*fp32", "lo_ptr": "*i8" if fmt.lo == 8 else "*i32", "hi_ptr": "*i32",
            "sc_ptr": SCALE_POINTER[fmt.scale], "sd_ptr": "*fp16", "mn_ptr": "*fp16" if fmt.mink == 1 else "*u8",
            "smin_ptr": "*fp16", "lut_ptr": "*fp32"}  # fmt: skip
    ints = dict(M=16, N=4096, K=4096, stride_xm=4096, stride_om=4096, iters_per_split=4096 // cfg.block_k)
    args |= {name: "i32" for name in ints}
    constexprs = dict(LO=fmt.lo, HI=fmt.hi, OFF=fmt.off, SG=fmt.sg, SCALE=fmt.scale, MINK=fmt.mink, LUT=fmt.lut,
                      SCMIN_NIB=fmt.scmin_nib, BM=16, BN=cfg.block_n, BK=cfg.block_k, ATOMIC=True,
                      DOT_F32=False, Q6_K_TILE=type_name == "Q6_K", ASM=True,
                      Q6_K_TRANSPOSED=q6_k_tile.TRANSPOSED, TT=planes.row_tile(type_name, 4096, 4096),
                      TILE=planes.tile_values(type_name))  # fmt: skip
    out = compile_sm90(triton_gguf._fused_kernel, args, constexprs, cfg.num_warps, ints, cfg.num_stages, sass=True)
    body = main_loop(out)
    step_bytes = cfg.block_n * cfg.block_k * planes.type_size(type_name) / fmt.block
    return {"type": type_name, "rows": cfg.block_n, "warps": cfg.num_warps, "mma": "fused bf16",
            "loop_instructions": len(body), "per_byte": len(body) * 32 * cfg.num_warps / step_bytes}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    print(f"{'kernel':7} {'rows':>4} {'warps':>5} {'mma':8} {'loop':>5} {'instr/B':>7} {'waits/KiB':>9} {'regs':>4} spill")
    for name in KERNELS:
        for bn, warps in LAUNCHES:
            r = count(name, bn, warps)
            rows.append(r)
            print(f"{name:7} {bn:4} {warps:5} {r['mma']:8} {r['loop_instructions']:5} {r['per_byte']:7.2f} "
                  f"{r['waits_per_kib']:9.2f} {r['registers']:4} {r['spill_stack']}", flush=True)  # fmt: skip
    for type_name in (*ti8.I8_MAX_TOKENS, "Q6_K", "Q8_0"):
        r = count_fused(type_name)
        rows.append(r)
        print(f"{type_name:7} {r['rows']:4} {r['warps']:5} {r['mma']:8} {r['loop_instructions']:5} {r['per_byte']:7.2f}",
              flush=True)  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
