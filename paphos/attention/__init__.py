"""Attention over the paged KV cache: a backend protocol, the torch reference, (later) Triton."""
