"""Kernel modules re-imported under the Triton interpreter for CPU tests, and back afterwards.

TRITON_INTERPRET is read when a kernel is decorated, so a module already imported compiled (on a
GPU machine, or by an earlier test) is re-executed with the variable set; re-executing rebinds its
kernel globals in place, so launchers imported elsewhere use the new kernels too. Modules are
given callees first, the module under test last.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType


def reimport(modules: tuple[str, ...], probe: str, interpret: bool) -> bool:
    """Import `modules` with TRITON_INTERPRET forced to `interpret`; if the last one's kernel
    `probe` was built the other way, re-execute them all. True if they were re-executed."""
    from triton.runtime.interpreter import InterpretedFunction

    previous = os.environ.get("TRITON_INTERPRET")
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in modules:
            importlib.import_module(name)
        if isinstance(getattr(sys.modules[modules[-1]], probe), InterpretedFunction) == interpret:
            return False
        for name in modules:
            importlib.reload(sys.modules[name])
        return True
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


@contextmanager
def interpreted(modules: tuple[str, ...], probe: str) -> Iterator[ModuleType]:
    """The last of `modules` with its kernels interpreted, compiled again afterwards if they were."""
    was_compiled = reimport(modules, probe, interpret=True)
    try:
        yield sys.modules[modules[-1]]
    finally:
        if was_compiled:
            reimport(modules, probe, interpret=False)
