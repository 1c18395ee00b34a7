"""Split-K for the small-M Triton matmuls (triton_int.py, triton_int_i8.py, fp8.py,
triton_exl2.py, gguf/triton_gguf_i8.py): the K slices of one output tile run in separate programs
(more programs than a narrow layer's tiles alone give 132 SMs); each stores its float32 partial,
and the last one to finish (an atomic count per tile) sums them. No second launch, and that last
program resets the tile's count, so the launch replays from a CUDA graph. `slices` plans a
launch's cut and its buffers.

An atomic launch (`slices(atomic=True)`, ATOMIC in `sum_slices`) adds each partial into one
float32 plane instead (vector atomic adds), which the last program reads once and sets back to
zero: one round trip where summing 32-64 stored partials took several, 1.1-1.9 us of the EXL2
GEMV's 10.9-21.0 us on the narrow layers of an H100, and 77.7 -> 75.2 us for the int8 GEMM's
Llama-3-8B layer at 16 tokens (benchmarks/README.md, "EXL2: split-K sums by atomic adds"). The
order of the adds varies from run to run, so the sum may differ in its last float32 bit (as the
GGUF fused kernel's split-K adds, triton_gguf.py); the stored partials sum in a fixed order. The
EXL2 GEMV and the int8 tensor-core GEMM (triton_int_i8.py) launch it; the GGUF int8 kernels and
fp8.py keep stored partials (not measured with it).

Stream-K (`stream`, `stream_contributors`): a launch of exactly P programs, as many as the GPU
holds at once, cuts the tiles' K steps laid end to end (tile-major) into P equal runs, so a
program may finish one tile and start the next; the programs that share a tile sum their
partials as the slices of a split launch do. Every program streams the same number of weight
bytes and none waits for a second wave, whatever the tile count."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

NUM_SMS_GUESS = 132  # H100 / H200: the split rules' programs-per-SM targets count against it
COUNTERS = 1 << 16  # tile counters per device, zero between launches: the most tiles one launch splits
_COUNTERS: dict[tuple[torch.device, str], torch.Tensor] = {}
_ZEROS: dict[tuple[torch.device, str], torch.Tensor] = {}


def num_sms(device: torch.device) -> int:
    """The device's multiprocessors, which a stream-K launch fills exactly (NUM_SMS_GUESS where
    the interpreter runs it on the CPU)."""
    if device.type != "cuda":
        return NUM_SMS_GUESS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _indexed(device: torch.device) -> torch.device:
    """`device` with its index ("cuda" -> "cuda:<current>"), so that a reservation and a launch
    that name one GPU differently share its buffers."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def counters(device: torch.device, stream: str = "step") -> torch.Tensor:
    """The tile counters of `device` for the split launches of one stream (they run one after
    another there, and each leaves its counters at zero); kernels on another stream, which may run
    at the same time, name it (`stream`) and get counters of their own. Made on first use, which
    the engine's eager warm-up runs before graph capture."""
    device = _indexed(device)
    buf = _COUNTERS.get((device, stream))
    if buf is None:
        _COUNTERS[(device, stream)] = buf = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return buf


def zeros(device: torch.device, elems: int, stream: str = "step") -> torch.Tensor:
    """At least `elems` float32 zeros on `device` that the atomic launches of one stream add their
    partials into and leave at zero (`counters` says why per stream). It grows only outside CUDA
    graph capture (a buffer made during capture would live in the graph's pool): the layers
    reserve it at load (`reserve_zeros`)."""
    device = _indexed(device)
    buf = _ZEROS.get((device, stream))
    if buf is None or buf.numel() < elems:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"split_k.zeros: {elems} floats not reserved before CUDA graph capture")
        _ZEROS[(device, stream)] = buf = torch.zeros(elems, dtype=torch.float32, device=device)
    return buf


def reserve_zeros(device: torch.device, elems: int, stream: str = "step") -> None:
    """Grows `zeros` of `device` to `elems` floats (at load, before graph capture)."""
    zeros(device, elems, stream)


@dataclass(frozen=True)
class Slices:
    """How a launch cuts its K steps: `per` steps a slice, `count` slices; `split` whether the
    programs of a tile sum float32 partials (more than one slice, a counter for every tile, the
    partial planes addressable in int32); `partials` [count, M, N] and `counters` the kernel's
    buffers (a one-plane dummy and the partials when not split); `atomic` (split only): the
    partials are added into one zeroed plane (`zeros`, [M, N] of it), `sum_slices`' ATOMIC."""

    per: int
    count: int
    split: bool
    partials: torch.Tensor
    counters: torch.Tensor
    atomic: bool = False


def slices(
    steps: int, wanted: int, tiles: int, m: int, n: int, device: torch.device, atomic: bool = False
) -> Slices:
    """`steps` K steps cut into at most `wanted` slices of equal length (the last may be shorter),
    for a launch of `tiles` output tiles of an [m, n] output on `device`; `atomic`: a split launch
    adds its partials into `zeros`."""
    per = max(1, math.ceil(steps / max(1, wanted)))
    count = math.ceil(steps / per)
    split = count > 1 and tiles <= COUNTERS and count * m * n < 1 << 31
    if not split:
        per, count = steps, 1
    if split and atomic:
        return Slices(per, count, True, zeros(device, m * n), counters(device), True)
    partials = torch.empty(count, m, n, dtype=torch.float32, device=device)
    return Slices(per, count, split, partials, counters(device) if split else partials)


@dataclass(frozen=True)
class Stream:
    """A stream-K launch: `programs` programs over `steps` K steps of each of `tiles` tiles;
    `partials` [most programs sharing a tile, M, N] and `counters` its buffers."""

    programs: int
    partials: torch.Tensor
    counters: torch.Tensor


def stream(tiles: int, steps: int, programs: int, m: int, n: int, device: torch.device) -> Stream:
    """Plans a stream-K launch of at most `programs` programs, each with two K steps or more."""
    total = tiles * steps
    programs = max(1, min(programs, total // 2))
    if programs * total >= 1 << 31 or tiles > COUNTERS:  # the kernels' int32 run arithmetic
        raise ValueError(f"stream-K: {tiles} tiles x {steps} steps is too large for {programs} programs")
    sharing = math.ceil(steps / (total // programs)) + 1  # a tile's steps over the shortest runs
    partials = torch.empty(min(sharing, programs), m, n, dtype=torch.float32, device=device)
    return Stream(programs, partials, counters(device))


if triton is not None:

    @triton.jit
    def stream_program_of(step, programs, total):
        """The program whose run holds global K step `step` (runs: p * total // programs ..)."""
        return ((step + 1) * programs - 1) // total

    @triton.jit
    def stream_contributors(tile, steps, program, programs, total):
        """(this program's slice index among the programs sharing `tile`, how many share it)."""
        first = stream_program_of(tile * steps, programs, total)
        last = stream_program_of((tile + 1) * steps - 1, programs, total)
        return program - first, last - first + 1

    @triton.jit
    def fence(ASM: tl.constexpr):
        """A GPU-scope memory fence in every thread (the interpreter runs programs one by one)."""
        if ASM:
            tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                      pack=1)  # fmt: skip

    @triton.jit
    def sum_slices(
        acc, part_ptr, count_ptr, tile, at, mask, slice_id, slices, plane, ASM: tl.constexpr,
        ATOMIC: tl.constexpr = False,
    ):  # fmt: skip
        """Stores this program's partial `acc` at part_ptr[slice_id * plane + at] (ATOMIC: adds it
        at part_ptr[at], a zeroed plane) -> (whether this program finished the tile last; then
        the sum of every slice's partial, else zeros)."""
        if ATOMIC:
            tl.atomic_add(part_ptr + at, acc, mask=mask, sem="relaxed", scope="gpu")
        else:
            tl.store(part_ptr + slice_id * plane + at, acc, mask=mask)
        fence(ASM)  # every thread's partial is visible GPU-wide before the count says so
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        last = done == slices - 1
        total = tl.zeros_like(acc)
        if last:
            fence(ASM)
            if ATOMIC:
                total = tl.load(part_ptr + at, mask=mask, other=0.0, cache_modifier=".cg")
                # every value read before any is zeroed: the compiler may give the load and the
                # store different layouts, so another thread may zero what this one reads (the
                # int8 GEMM's wgmma accumulator did: outputs read as zero now and then)
                tl.debug_barrier()
                tl.store(part_ptr + at, tl.zeros_like(acc), mask=mask)  # zero again for the next launch
            else:
                # UNROLL slices' loads in flight at once: one at a time, narrow layers split 32-64
                # ways waited an L2 round trip per slice at the end of every tile
                UNROLL: tl.constexpr = (16 if acc.numel <= 256 else 8 if acc.numel <= 512 else 4 if acc.numel <= 1024
                                        else 2 if acc.numel <= 2048 else 1)  # fmt: skip
                for s0 in range(0, slices, UNROLL):
                    for u in tl.static_range(UNROLL):
                        s_ok = (at * 0 + s0 + u) < slices  # (the interpreter cannot AND a scalar bool)
                        total += tl.load(part_ptr + (s0 + u) * plane + at, mask=mask & s_ok, other=0.0,
                                         cache_modifier=".cg")  # fmt: skip
            tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next launch
        return last, total

    @triton.jit
    def store_tile(acc, out_ptr, part_ptr, count_ptr, rows, row_ok, ms, m_ok, M, N, stride_om, tile, slice_id,
                   slices, SPLIT: tl.constexpr, ASM: tl.constexpr, ATOMIC: tl.constexpr = False):  # fmt: skip
        """A program's float32 out^T tile `acc` [rows, tokens ms] into out [M, N] (its dtype): at
        once, or with SPLIT through `sum_slices` (partials in one [M, N] plane per slice, or with
        ATOMIC added into one) by the program that finishes tile `tile` last."""
        mask = row_ok[:, None] & m_ok[None, :]
        o = out_ptr + ms.to(tl.int64)[None, :] * stride_om + rows[:, None]
        if SPLIT:
            last, total = sum_slices(acc, part_ptr, count_ptr, tile, ms[None, :] * N + rows[:, None], mask, slice_id,
                                     slices, M * N, ASM, ATOMIC)  # fmt: skip
            if last:
                tl.store(o, total.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=mask)
