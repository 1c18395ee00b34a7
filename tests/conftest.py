"""Suite-wide setup: Triton kernels run in the Triton interpreter on CPU-only machines (CI).

The variable must be set before any kernel module is imported: `triton.jit` decides at decoration
time whether a kernel is interpreted or compiled.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
