"""Torch-free engine core: block pool, prefix hashing, KV cache manager, request queue, scheduler."""
