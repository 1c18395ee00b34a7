"""The batched multi-LoRA kernels: a model layer's LoRA apply hands them the step's token -> slot
mapping (mapping.py) and its projection's stacked slot weights. shrink: h = x A^T per token;
expand: y += h B^T into the base matmul's output. The torch reference (reference.py) runs
anywhere; the Triton kernels (triton_sgmv.py, imported by whoever runs on CUDA) are
CUDA-graph capturable."""

from paphos.lora.kernels.mapping import HostMapping, LoRAMapping, build_mapping
from paphos.lora.kernels.reference import expand_ref, shrink_ref

__all__ = ["HostMapping", "LoRAMapping", "build_mapping", "expand_ref", "shrink_ref"]
