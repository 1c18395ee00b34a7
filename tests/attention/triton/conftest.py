"""Run the Triton attention kernels under the Triton interpreter (CPU tensors, no GPU).

TRITON_INTERPRET is read when a kernel is decorated with @triton.jit, i.e. when
the kernel modules (paphos.attention.triton_attention, triton_prefill, triton_kv_write) are imported. tests/conftest.py sets it suite-wide on machines
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

# Each kernel module with one of its kernels, by which a compiled import is recognised.
_MODULES = (
    # the merge kernel writes the o projection's int8 parts with these helpers
    ("paphos.layers.x_int8", "store_groups"),
    ("paphos.layers.x_int8_blocks", "store_blocks"),
    ("paphos.layers.x_int8_outputs", "write_after_store"),
    ("paphos.layers.fused", "_rope_kernel"),  # its rotation is part of the K/V write kernel
    ("paphos.attention.triton_attention", "_decode_split_kernel"),
    ("paphos.attention.triton_prefill", "_prefill_kernel"),  # after the helpers it imports
    ("paphos.attention.triton_kv_write", "_write_kv_kernel"),
)


def _reimport(interpret: bool) -> bool:
    """Import (or re-execute) the kernel modules with TRITON_INTERPRET forced; True if one was
    already imported compiled."""
    previous = os.environ.get("TRITON_INTERPRET")
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        from triton.runtime.interpreter import InterpretedFunction

        reloaded = False
        for name, kernel in _MODULES:
            module = sys.modules.get(name)
            if module is None:
                importlib.import_module(name)
            elif isinstance(getattr(module, kernel), InterpretedFunction) != interpret:
                # Re-executing the module rebinds its kernel globals in place, so launchers
                # already imported elsewhere (triton_backend) use the new kernels too.
                importlib.reload(module)
                reloaded = True
        return reloaded
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
