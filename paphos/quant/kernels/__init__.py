"""Matmul kernels by weight family, shared by the checkpoint formats that reduce to them:
`int_*` for integer codes with per-group scales (GPTQ, AWQ, compressed-tensors pack-quantized),
`fp8` for float8 weights (FP8 checkpoints, `-q fp8`). Each family has a torch reference beside
its Triton kernels; the format modules (paphos/quant/<format>.py) only convert checkpoint layouts
into the family's inputs."""
