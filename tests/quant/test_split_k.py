"""split_k.slices: how the split-K launches (triton_int, triton_int_i8, triton_gguf_i8, fp8,
triton_exl2) cut their K steps; split_k.stream: how a stream-K launch (triton_gguf_i8) is sized.
The kernels' own tests run every cut end to end."""

from __future__ import annotations

import pytest
import torch

from paphos.quant.kernels import split_k

CPU = torch.device("cpu")


def test_steps_cut_into_equal_slices_the_last_shorter() -> None:
    cut = split_k.slices(10, 4, tiles=8, m=3, n=5, device=CPU)
    assert (cut.per, cut.count, cut.split) == (3, 4, True)  # 3 + 3 + 3 + 1 steps
    assert cut.partials.shape == (4, 3, 5) and cut.partials.dtype == torch.float32
    assert cut.counters is split_k.counters(CPU)


def test_no_split_runs_one_slice_over_every_step() -> None:
    for cut in (
        split_k.slices(10, 1, tiles=8, m=3, n=5, device=CPU),  # one slice asked for
        split_k.slices(10, 4, tiles=split_k.COUNTERS + 1, m=3, n=5, device=CPU),  # more tiles than counters
        split_k.slices(10, 4, tiles=8, m=1 << 16, n=1 << 14, device=torch.device("meta")),  # partials past int32
    ):
        assert (cut.per, cut.count, cut.split) == (10, 1, False)
        assert cut.counters is cut.partials and cut.partials.shape[0] == 1


def test_atomic_split_adds_into_one_zeroed_plane() -> None:
    cut = split_k.slices(10, 4, tiles=8, m=3, n=5, device=CPU, atomic=True)
    assert (cut.per, cut.count, cut.split, cut.atomic) == (3, 4, True, True)
    assert cut.partials is split_k.zeros(CPU, 15) and cut.partials.numel() >= 15 and not cut.partials.any()
    alone = split_k.slices(10, 1, tiles=8, m=3, n=5, device=CPU, atomic=True)
    assert (alone.count, alone.split, alone.atomic) == (1, False, False)  # one slice: stored at once
    split_k.reserve_zeros(CPU, 1 << 12)
    assert split_k.zeros(CPU, 15).numel() >= 1 << 12  # reserved at load, not shrunk by a smaller launch


def test_stream_k_runs_two_steps_a_program_at_least() -> None:
    run = split_k.stream(tiles=3, steps=8, programs=100, m=3, n=48, device=CPU)
    assert run.programs == 12  # 24 steps, two a program
    # a tile's 8 steps over runs of 2: 4 programs, or 5 where runs straddle its ends
    assert run.partials.shape == (5, 3, 48) and run.counters is split_k.counters(CPU)
    assert split_k.stream(tiles=448, steps=16, programs=264, m=16, n=28672, device=CPU).programs == 264


def test_stream_k_refuses_runs_past_int32() -> None:
    with pytest.raises(ValueError, match="too large"):
        split_k.stream(tiles=1 << 15, steps=64, programs=1 << 10, m=1, n=1, device=CPU)


def test_one_gpu_has_one_plane_however_it_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plane reserved at load on "cuda:0" is the one a launch on "cuda" gets (the current GPU):
    a second key would allocate during CUDA-graph capture, which raises."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    reserved = torch.zeros(64)  # stands in for the GPU buffer: nothing is allocated when it is found
    monkeypatch.setattr(split_k, "_ZEROS", {(torch.device("cuda", 0), "step"): reserved})
    assert split_k.zeros(torch.device("cuda"), 48) is reserved
    with pytest.raises(RuntimeError, match="not reserved"):  # more than reserved: capture would grow it
        split_k.zeros(torch.device("cuda"), 65)
