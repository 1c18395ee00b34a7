"""Native CPU kernels for bf16 models on x86 CPUs with AVX512-BF16 (cpu_kernels.c): packed-weight
matmuls for several activation rows (the int8-group LM head and layers, the int4pack layers), the
causal attention of whole prompts and the paged attention of decode rows.

Data flow: int8_group_cpu.matmul / int4pack_cpu.matmul -> `int8_group_mm` / `int4pack_mm`
(torch ops, so that the compiled decode step calls them from inside its graphs) -> the C kernels;
attention/torch_ref.py -> `prefill_attention` (prefill steps, eager) and `decode_attention` (a torch
op, eager and inside the compiled decode step).

Why: torch's int4pack matmul runs ~170 GMAC/s at 16 rows on two cores where bf16 arithmetic
allows twice that, and the int8 head's dequantize-then-GEMM writes and reads its weight in bf16 on
every call (a 49152 x 576 head at 16 rows: 5.6 ms in the decode step). The C kernels dequantize a
block of 16 weight rows into a buffer that stays in cache and multiply it with every row from
there (`vdpbf16ps`): the same head 2.9 ms, a 16-sequence SmolLM2 Q4_0 step 24.5 -> 19.2 ms.
SDPA's CPU kernel spends 3.3 ms a layer on a 512-token prompt of SmolLM2 (45 GMAC/s) and is
called once per sequence; the native attention takes 0.85 ms, all whole prompts of a step in one
call. Decode attention reads each sequence's blocks straight from the paged cache, one task per
(sequence, KV head) with the query heads of its group: 16 sequences x 128 tokens of SmolLM2 take
~20 us a layer with the cache in L2 against 82 us for the fused reductions inductor generates.

The source is compiled once per machine by the system C compiler (the one inductor uses for the
compiled decode step) into Paphos' cache directory, keyed by the source's hash. Without a
compiler, on other CPUs, or with PAPHOS_NATIVE_CPU=0, `available()` is False and the callers keep
their torch paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from paphos.default_model import default_cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
ENV_SWITCH = "PAPHOS_NATIVE_CPU"
INT8_GROUPS = (16, 32)
# Rows from which the int4 kernel beats torch's int4pack matmul (SmolLM2's layer shapes, 2 cores:
# at 4 rows 45 vs 43 us for gate|up, at 8 64 vs 84, at 16 98 vs 165).
INT4_MIN_ROWS = 8
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class _Loaded:
    library: ctypes.CDLL | None = None
    tried = False


def load() -> bool:
    """Builds (once per machine) and opens the library; whether the native kernels are usable.
    Called where packed weights are prepared, never inside a compiled graph."""
    if not _Loaded.tried:
        _Loaded.tried = True
        _Loaded.library = _open()
    return _Loaded.library is not None


@contextmanager
def disabled() -> Iterator[None]:
    """Within it, callers take their torch paths (tests of those paths, A/B measurements)."""
    library, _Loaded.library = _Loaded.library, None
    try:
        yield
    finally:
        _Loaded.library = library


def available() -> bool:
    """Whether `load()` found the native kernels usable (a plain read: cheap inside a graph)."""
    return _Loaded.library is not None


def _open() -> ctypes.CDLL | None:
    if os.environ.get(ENV_SWITCH, "1") == "0" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        path = _build()
    except (OSError, subprocess.SubprocessError) as exc:
        logger.info("native CPU kernels not built (%s): using torch's paths", exc)
        return None
    library = ctypes.CDLL(str(path))
    if not library.paphos_cpu_has_avx512_bf16():
        logger.info("this CPU has no AVX512-BF16: the native CPU kernels are off")
        return None
    library.paphos_int8_group_mm.argtypes = [_PTR, _PTR, _I64, _PTR, _PTR, ctypes.c_int32, _I64, _I64, _I64]
    library.paphos_int4pack_mm.argtypes = [_PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64]
    library.paphos_prefill_attention.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64,
                                                 _I64, _I64, _I64, ctypes.c_float]  # fmt: skip
    library.paphos_decode_attention.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64,
                                                _I64, ctypes.c_float]  # fmt: skip
    library.paphos_row_stats.argtypes = [_PTR, ctypes.c_int32, _I64, _I64, _I64, _PTR, _PTR, _PTR]
    return library


def _build() -> Path:
    """The shared library for this source, compiled into the cache unless already there."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler on PATH")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + compiler.encode()).hexdigest()[:16]
    target_dir = default_cache_dir().parent / "native"
    target = target_dir / f"cpu_kernels-{digest}.so"
    if target.is_file():
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: concurrent builders (tensor-parallel ranks,
    # test workers) never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target_dir) as work:
        built = Path(work) / target.name
        subprocess.run([compiler, "-O3", "-fPIC", "-shared", "-fopenmp", str(SOURCE), "-o", str(built)],
                       check=True, capture_output=True, timeout=300)  # fmt: skip
        os.replace(built, target)
    logger.info("built the native CPU kernels: %s", target)
    return target


def int8_group_supported(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> bool:
    k = q.shape[1]
    return (
        available()
        and x.dtype == torch.bfloat16
        and k % 32 == 0
        and k // scales.shape[1] in INT8_GROUPS
        and scales.dtype == torch.float32
    )


def int4pack_supported(x: torch.Tensor, packed: torch.Tensor) -> bool:
    # The int4pack layout this reads is the one int4pack_cpu.unpack checks once per process.
    return available() and x.dtype == torch.bfloat16 and packed.shape[0] % 64 == 0


_ops = torch.library.Library("paphos", "FRAGMENT")
_ops.define("int8_group_mm(Tensor x, Tensor q, Tensor scales, ScalarType out_dtype) -> Tensor")
_ops.define("int4pack_mm(Tensor x, Tensor packed, Tensor scale_zero, int group_size) -> Tensor")
_ops.define("decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, float scale) -> Tensor")


def _int8_group_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    x, q, scales = x.contiguous(), q.contiguous(), scales.contiguous()
    m, (n, k) = x.shape[0], q.shape
    y = torch.empty(m, n, dtype=out_dtype)
    _Loaded.library.paphos_int8_group_mm(q.data_ptr(), scales.data_ptr(), k // scales.shape[1], x.data_ptr(),
                                         y.data_ptr(), int(out_dtype == torch.bfloat16), m, n, k)  # fmt: skip
    return y


def _int4pack_mm(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group_size: int) -> torch.Tensor:
    m, n, k = x.shape[0], packed.shape[0], x.shape[1]
    if m < INT4_MIN_ROWS:
        # Decided here, not in the graph that calls this, where the batch size is symbolic.
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scale_zero)
    x, packed, scale_zero = x.contiguous(), packed.contiguous(), scale_zero.contiguous()
    y = torch.empty(m, n, dtype=torch.bfloat16)
    _Loaded.library.paphos_int4pack_mm(packed.data_ptr(), scale_zero.data_ptr(), group_size, x.data_ptr(),
                                       y.data_ptr(), m, n, k)  # fmt: skip
    return y


def _decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()  # no copy when the metadata's int32 comes
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty(batch, num_heads, head_dim, dtype=torch.bfloat16)
    _Loaded.library.paphos_decode_attention(
        q.data_ptr(), q.stride(0), kv_cache.data_ptr(), kv_cache.shape[2], tables.data_ptr(), tables.stride(0),
        lens.data_ptr(), out.data_ptr(), out.stride(0), batch, num_heads, kv_cache.shape[3], head_dim, scale,
    )
    return out


_ops.impl("int8_group_mm", _int8_group_mm, "CPU")
_ops.impl("decode_attention", _decode_attention, "CPU")
_ops.impl("decode_attention", lambda q, kv_cache, block_tables, seq_lens, scale: q.new_empty(q.shape), "Meta")
_ops.impl("int4pack_mm", _int4pack_mm, "CPU")
_ops.impl("int8_group_mm", lambda x, q, scales, out_dtype: x.new_empty(x.shape[0], q.shape[0], dtype=out_dtype), "Meta")
_ops.impl("int4pack_mm", lambda x, packed, scale_zero, group_size: x.new_empty(x.shape[0], packed.shape[0]), "Meta")


def int8_group_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x bf16 [M, K] @ (q * scales per group)^T -> [M, N] in out_dtype (float32 or bf16)."""
    return torch.ops.paphos.int8_group_mm(x, q, scales, out_dtype)


def int4pack_mm(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """x bf16 [M, K] @ the int4pack weight^T -> bf16 [M, N] (torch's int4pack matmul below
    INT4_MIN_ROWS rows)."""
    return torch.ops.paphos.int4pack_mm(x, packed, scale_zero, group_size)


def prefill_attention_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """q [T, Hq, D], k and v [T, Hkv, D] on the CPU in bf16, heads contiguous within a row."""
    head_dim = q.shape[2]
    return (
        available()
        and q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype == torch.bfloat16
        and head_dim % 2 == 0
        and head_dim <= 256
        and q.shape[1] % k.shape[1] == 0
        and all(t.stride(2) == 1 and t.stride(1) == head_dim for t in (q, k, v))
    )


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, starts: list[int], lens: list[int],
    scale: float,
) -> None:
    """Causal attention of whole prompts, each attending to its own rows only: rows starts[s] ..
    starts[s] + lens[s] - 1 of q, k, v (see `prefill_attention_supported`) -> the same rows of out
    (bf16, heads contiguous). Eager only (the prefill steps that call it are not compiled)."""
    assert out.dtype == torch.bfloat16 and out.stride(2) == 1 and out.stride(1) == q.shape[2]
    starts_t = torch.tensor(starts, dtype=torch.int64)
    lens_t = torch.tensor(lens, dtype=torch.int64)
    _Loaded.library.paphos_prefill_attention(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), out.data_ptr(),
        out.stride(0), starts_t.data_ptr(), lens_t.data_ptr(), len(starts), q.shape[1], k.shape[1], q.shape[2],
        scale,
    )


def decode_attention_supported(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """q [B, Hq, D] and the cache [blocks, 2, block_size, Hkv, D] on the CPU in bf16, the cache
    contiguous; D a multiple of 32 up to 256, at most 16 query heads per KV head."""
    head_dim, num_kv_heads = q.shape[2], kv_cache.shape[3]
    return (
        available()
        and q.device.type == "cpu"
        and q.dtype == kv_cache.dtype == torch.bfloat16
        and head_dim % 32 == 0
        and head_dim <= 256
        and q.shape[1] % num_kv_heads == 0
        and q.shape[1] // num_kv_heads <= 16
        and kv_cache.is_contiguous()
    )


def decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Each row of q [B, Hq, D] attends to its sequence's seq_lens[b] tokens in the paged cache
    (block_tables [B, blocks]) -> bf16 [B, Hq, D]: softmax(q k^T * scale) v in fp32 (see
    `decode_attention_supported`). A torch op, so the compiled decode step calls it in its graph."""
    return torch.ops.paphos.decode_attention(q, kv_cache, block_tables, seq_lens, scale)


def row_stats_supported(logits: torch.Tensor) -> bool:
    return (
        available()
        and logits.device.type == "cpu"
        and logits.dtype in (torch.bfloat16, torch.float32)
        and logits.stride(1) == 1
    )


def row_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 or float32 logits [R, V] -> float32 max [R], int64 first argmax [R], float32 logsumexp [R], as
    torch computes them in float32, in one pass per statistic over each row in cache."""
    rows, vocab = logits.shape
    top = torch.empty(rows, dtype=torch.float32)
    first = torch.empty(rows, dtype=torch.int64)
    lse = torch.empty(rows, dtype=torch.float32)
    _Loaded.library.paphos_row_stats(logits.data_ptr(), int(logits.dtype == torch.bfloat16), logits.stride(0), rows,
                                     vocab, top.data_ptr(), first.data_ptr(), lse.data_ptr())  # fmt: skip
    return top, first, lse
