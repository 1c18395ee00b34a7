"""Kernels compiled on the user's machine from C sources in this package (cpu.py: the CPU ones)."""
