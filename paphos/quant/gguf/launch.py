"""The GGUF kernels' launch configurations (triton_gguf.py's fused kernel, triton_gemv.py's
batch-1 GEMV): `config_for`'s and `default_gemv_config`'s rules by type, shape and tokens, each
measured on an H100 or H200 (the docstrings say which), and the tables the benchmark's sweeps
fill (TUNED_CONFIGS, GEMV_CONFIGS) that override them. Pure Python, read at every launch.
"""

from __future__ import annotations

import dataclasses
import math

from paphos.quant.gguf import triton_gemv
from paphos.quant.gguf.planes import FORMATS, Format


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    block_m: int = 1  # 1: CUDA-core GEMV (M == 1 only); >= 16: tl.dot tiles of BLOCK_M tokens


# (type, N, K, token bucket) -> config, filled by the benchmark's sweep or by hand; buckets are
# 1, 16, 32, 64, 128 (the smallest >= M).
TUNED_CONFIGS: dict[tuple[str, int, int, int], KernelConfig] = {}
M_BUCKETS = (1, 16, 32, 64, 128)
NUM_SMS_GUESS = 132



def m_bucket(m: int) -> int:
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


def fit_block_k(block_k: int, k: int, fmt: Format) -> int:
    """The largest power of two <= block_k dividing K (K is a multiple of 32: every GGUF block)."""
    while block_k > 32 and k % block_k:
        block_k //= 2
    return block_k


def default_config(type_name: str, n: int, k: int, m: int) -> KernelConfig:
    """A launch configuration by rule (overridden by TUNED_CONFIGS): enough programs to fill the
    GPU several times over, each reading a few KiB of weights per iteration. Short K steps on a
    deeper pipeline (64 rows, 64 values of K a step, 3 stages, at most 8 K slices) where the H100
    measured them faster: Q6_K's tiles of 16 and 32 tokens (q6_k_tile.py; 16 tokens, us against 32
    x 128, 2 stages: the head 529.7 -> 436.3, down 92.7 -> 65.3, v 10.1 -> 9.4; the float32 decode
    before took 651.0 / 89.4 / 12.2) and Q8_0's of 64 tokens (its int8 GEMM takes up to 32), K
    split towards 2 programs per SM there as the sweep's winners were (against 64 x 128 on 2
    stages: gate|up 173.3 -> 144.4 us unsplit, down 113.0 -> 107.4 in 8 slices; the head's winner,
    424.3 against 454.7, had 2 stages; the engine at batch 64 7307 -> 7938 tok/s with the three,
    8062 with this rule and the int8 GEMM to 32 tokens)."""
    fmt = FORMATS[type_name]
    bm = 1 if m == 1 else max(16, _next_pow2(m))
    q8_0_64 = type_name == "Q8_0" and bm == 64
    short_steps = (type_name == "Q6_K" and 1 < bm <= 32) or q8_0_64
    bn, bk = (16, 256) if m == 1 else ((32 if bm <= 32 and not short_steps else 64), 64 if short_steps else 128)
    bk = fit_block_k(bk, k, fmt)
    n_iters = k // bk
    programs = math.ceil(n / bn)
    split, max_split, per_sm = 1, 8 if short_steps else n_iters, 2 if q8_0_64 else 4
    while programs * split < per_sm * NUM_SMS_GUESS and n_iters // (split * 2) >= 4 and split < max_split:
        split *= 2
    return KernelConfig(bn, bk, split, 4, 3 if short_steps else 2, bm)


def _next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def config_for(type_name: str, n: int, k: int, m: int) -> KernelConfig:
    cfg = TUNED_CONFIGS.get((type_name, n, k, m_bucket(m))) or default_config(type_name, n, k, m)
    if m > 1 and cfg.block_m == 1:
        cfg = KernelConfig(cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps, cfg.num_stages, 16)
    return cfg


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_n: int = triton_gemv.DEFAULT_BLOCK_N
    num_warps: int = triton_gemv.DEFAULT_WARPS
    chunk: int | None = None  # float codes: values of K per iteration (None: one tile group per thread)
    int8_x: bool | None = None  # None: integer dots where the format allows (triton_gemv.integer_dots)
    rows_per_program: int | None = None  # integer dots: rows per program (None: 4 * block_n)


# (type, N, K) -> the batch-1 GEMV's launch configuration, filled by the benchmark's sweep.
GEMV_CONFIGS: dict[tuple[str, int, int], GemvConfig] = {}
# Float-code formats: the configuration that won on most Llama-3-8B shapes on the H200
# (bench_gguf_gpu.py `gemv`): one row per program (registers go to the high-bit planes).
GEMV_FLOAT_DEFAULTS: dict[str, GemvConfig] = {
    "Q5_K": GemvConfig(1, 2), "Q5_0": GemvConfig(1, 2), "Q5_1": GemvConfig(1, 2), "Q2_K": GemvConfig(1, 4),
}  # fmt: skip


def default_gemv_config(type_name: str, rows: int, k: int) -> GemvConfig:
    """By rule where the benchmark's sweep has not tuned the shape, from the H200 sweeps of the
    integer GEMV (Llama-3-8B shapes, benchmarks/README.md): one row per step and four per
    program (many short programs) won or came within 7 % everywhere but where a row holds more
    than 256 tile groups of x and its codes take more registers than 4 bits (Q8_0 and Q6_K down
    projections): there 8 warps and 8 rows per program halve each thread's share of x (Q8_0
    19.4 us against 21.3, Q6_K 20.9 against 23.3). Blocks of 2 rows past 256 tile groups
    collapse (the Q4_K down projection: 34 to 233 us against 15.2)."""
    fmt = FORMATS[type_name]
    if not triton_gemv.integer_dots(fmt):
        return GEMV_FLOAT_DEFAULTS.get(type_name, GemvConfig(1, 4))
    if k // fmt.tile_values > 256 and (fmt.lo == 8 or fmt.hi):
        return GemvConfig(1, 8, rows_per_program=8)
    return GemvConfig(1, 4, rows_per_program=4)
