"""Run the Triton attention kernels under the Triton interpreter (CPU tensors, no GPU).

TRITON_INTERPRET is read when a kernel is decorated with @triton.jit, i.e. when
paphos.attention.triton_attention is imported. tests/conftest.py sets it suite-wide on machines
without CUDA; here it is forced only around the import of that module, also on a GPU machine, and
restored at once. If an earlier test had imported the module compiled, it is re-imported
interpreted for these tests and compiled again afterwards, so the rest of the suite is unchanged.
If Triton is not installed, these tests are not collected.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator

import pytest

_MODULE = "paphos.attention.triton_attention"


def _reimport(interpret: bool) -> bool:
    """Import (or re-execute) the kernel module with TRITON_INTERPRET forced; True if it was
    already imported compiled."""
    previous = os.environ.get("TRITON_INTERPRET")
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        from triton.runtime.interpreter import InterpretedFunction

        module = sys.modules.get(_MODULE)
        if module is None:
            importlib.import_module(_MODULE)
            return False
        if isinstance(module._prefill_kernel, InterpretedFunction) == interpret:
            return False
        # Re-executing the module rebinds its kernel globals in place, so launchers already
        # imported elsewhere (triton_backend) use the new kernels too.
        importlib.reload(module)
        return True
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


try:
    import triton

    _HAVE_TRITON = hasattr(triton, "jit")  # not a stray namespace package named triton
except ImportError:
    _HAVE_TRITON = False

if _HAVE_TRITON:
    _WAS_COMPILED = _reimport(interpret=True)
else:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(autouse=True, scope="package")
def _restore_compiled_kernels() -> Iterator[None]:
    yield
    if _HAVE_TRITON and _WAS_COMPILED:
        _reimport(interpret=False)
