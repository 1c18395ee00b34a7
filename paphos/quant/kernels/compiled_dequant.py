"""Inductor-compiled weight dequantizers for the CPU's GEMM path (prefill chunks, mixed steps).

Data flow: a packed CPU kernel's matmul (int4pack_cpu.py, int8_group_cpu.py) with many rows ->
`dequantize(fn, ...)` -> the weight in the activation dtype -> one dense GEMM. Eager torch spends
several passes over the weight on the unpacking (masks, shifts, a concatenation, casts); the
compiled form is one vectorized loop. Measured on one SmolLM2 layer's four int4 weights (2 shared
cores): 14.9 ms eager vs 2.2 ms compiled, so 512 rows cost 11 ms (unpack + GEMM) against 22 ms
for int4pack's own matmul, which unpacks per row tile and does not amortise it over rows.

Enabled where the compiled CPU decode step is (worker/setup.py): each weight shape is compiled by
the prefill warm-up at start-up (worker/warmup.py), after which a shape never seen falls back to
the eager dequantizer (logged once) instead of compiling in the middle of serving.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

logger = logging.getLogger(__name__)

# A prefill of this many rows reaches every dequantizer at start-up (the int4 GEMM path starts at
# int4pack_cpu.DENSE_MIN_TOKENS_OVER_NATIVE rows, or DENSE_MIN_TOKENS_COMPILED without the native
# kernel; int8 weights dequantize from 2 rows where there is no native kernel).
WARM_UP_TOKENS = 384

_state = {"enabled": False, "warming": False, "failed": False}
_compiled: dict[Callable[..., torch.Tensor], Callable[..., torch.Tensor]] = {}


def enable() -> None:
    _state["enabled"] = True


def is_enabled() -> bool:
    # is_compiling() first: inside a graph being traced the state is not read (no guard on it).
    return not torch.compiler.is_compiling() and _state["enabled"]


@contextmanager
def warming_up() -> Iterator[None]:
    """Within it, new weight shapes compile; after it, they run eagerly."""
    _state["warming"] = True
    try:
        yield
    finally:
        _state["warming"] = False


def dequantize(fn: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
    """fn(*args), through its compiled form when enabled (and not already inside a graph)."""
    if not is_enabled():
        return fn(*args)
    compiled = _compiled.get(fn)
    if compiled is None:
        compiled = _compiled[fn] = torch.compile(fn, dynamic=False)
    try:
        with torch.compiler.set_stance("default" if _state["warming"] else "fail_on_recompile"):
            return compiled(*args)
    except Exception as exc:  # noqa: BLE001 - the eager dequantizer gives the same weight
        if not _state["failed"]:
            logger.warning("compiled dequantizer not used (%s): dequantizing eagerly",
                           str(exc).splitlines()[0] if str(exc) else type(exc).__name__)  # fmt: skip
            _state["failed"] = True
        return fn(*args)
