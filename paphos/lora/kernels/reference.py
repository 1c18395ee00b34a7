"""Torch reference of the batched multi-LoRA shrink and expand: the oracle the Triton kernels
(triton_sgmv.py) are tested against, and the path CPU runs take.

Data flow: a model layer's base matmul writes y; its LoRA apply then calls shrink (x -> h, the
tokens' low-rank activations) and expand (y += h B^T) with the step's `LoRAMapping`. Weights of
every slot are stacked and zero-padded to the maximal rank R (see triton_sgmv.py for the layout).
One matmul per non-empty slot over its gathered tokens: no per-token Python.
"""

from __future__ import annotations

import torch

from paphos.lora.kernels.mapping import LoRAMapping


def _segments(mapping: LoRAMapping) -> list[tuple[int, torch.Tensor]]:
    """(slot, its token rows as int64) for each slot with tokens. Reads the host copy of
    slot_starts where the mapping has one (no device sync)."""
    starts = mapping.slot_starts_host if mapping.slot_starts_host is not None else mapping.slot_starts.tolist()
    ids = mapping.sorted_token_ids[: starts[-1]].long()
    return [(s, ids[starts[s] : starts[s + 1]]) for s in range(len(starts) - 1) if starts[s + 1] > starts[s]]


def shrink_ref(x: torch.Tensor, a: torch.Tensor, mapping: LoRAMapping, h: torch.Tensor) -> None:
    """h[t, :] = x[t, :] @ a[s].T in float32 for each token t of slot s. x [T, K] (any row
    stride), a [S, N, K], h [T_cap, N] float32; rows of tokens without an adapter untouched."""
    for s, rows in _segments(mapping):
        h.index_copy_(0, rows, x.index_select(0, rows).float() @ a[s].float().T)


def expand_ref(
    h: torch.Tensor, b: torch.Tensor, slice_starts: tuple[int, ...], mapping: LoRAMapping, y: torch.Tensor
) -> None:
    """y[t, c] += sum_k h[t, j * R + k] * b[s, c, k] for each token t of slot s, j the slice
    holding output column c (slice_starts: n_slices + 1 offsets into y's columns); summed in
    float32, rounded once into y's dtype. h [T_cap, n_slices * R], b [S, O, R], y [T, O]."""
    r = b.shape[2]
    for s, rows in _segments(mapping):
        hs = h.index_select(0, rows)
        delta = torch.cat(
            [hs[:, j * r : (j + 1) * r] @ b[s, c0:c1].float().T
             for j, (c0, c1) in enumerate(zip(slice_starts[:-1], slice_starts[1:], strict=True))],
            dim=1,
        )  # fmt: skip
        y.index_copy_(0, rows, (y.index_select(0, rows).float() + delta).to(y.dtype))
