"""Drives a model the way the model runner does (flat batches over a paged KV cache, any chunking)
for the model parity tests, and HF's logits over a whole sequence to compare with."""

from __future__ import annotations

import torch

from paphos.attention.testing import allocate_block_tables, build_metadata

BLOCK = 4
NUM_BLOCKS = 32


def scramble_weights(hf, norm_center: float, norm_spread: float = 0.3) -> None:
    """Larger-than-default random weights and non-trivial norms (norm_center + noise: 1 for
    x * w norms, 0 for Gemma's (1 + w) ones), so that mistakes show in the logits."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(norm_center + norm_spread * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


def assert_schedule_matches_hf(
    model, caches, hf, vocab_size: int, lengths: list[int], steps: list[list[int]], seed: int, tol: float
) -> None:
    """Random sequences of `lengths` tokens (drawn in turn from `seed`) run as `steps`
    (`run_schedule`); every computed position's logits within `tol` of HF's over the whole sequence."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths]
    for seq, out in zip(seqs, run_schedule(model, caches, seqs, steps), strict=True):
        torch.testing.assert_close(out, hf_logits(hf, seq), rtol=0, atol=tol)


def run_schedule(model, caches, seqs: list[torch.Tensor], steps: list[list[int]]) -> list[torch.Tensor]:
    """Drive the model like a runner would: steps[s][i] tokens of sequence i are computed in step
    s (0 = not scheduled). Returns, per sequence, the logits of every computed position."""
    tables = allocate_block_tables(
        [len(s) for s in seqs], BLOCK, NUM_BLOCKS, torch.Generator().manual_seed(1)
    )
    done = [0] * len(seqs)
    device = seqs[0].device  # the GPU benchmark drives a CUDA model with it too
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in steps:
        active = [i for i, n in enumerate(step) if n]
        ids, pos = [], []
        for i in active:
            ids.append(seqs[i][done[i] : done[i] + step[i]])
            pos.append(torch.arange(done[i], done[i] + step[i], device=device))
        md = build_metadata(
            [step[i] for i in active], [done[i] + step[i] for i in active], [tables[i] for i in active], BLOCK,
            device=device,
        )
        with torch.inference_mode():
            hidden = model(torch.cat(ids), torch.cat(pos), caches, md)
            logits = model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (md.num_tokens, model.vocab_size)
        for i, rows in zip(active, logits.split([step[i] for i in active]), strict=True):
            out[i].append(rows)
            done[i] += step[i]
    assert done == [len(s) for s in seqs]
    return [torch.cat(o) for o in out]
