"""Kernel timing shared by the GPU benchmarks, with no Paphos imports (so a benchmark that only
needs torch and triton runs on the bare GPU image)."""

from __future__ import annotations

import statistics
from collections.abc import Callable


def graph_time(fns: list[Callable[[], object]], calls: int = 64) -> float:
    """Seconds per call of the launches `fns` (cycled over at least `calls` calls), replayed from
    one CUDA graph: no host launch cost in the figure, as in the engine's graph-replayed decode
    steps. Median of 5 replays."""
    import torch

    for fn in fns:
        fn()
    torch.cuda.synchronize()
    calls = max(calls, 2 * len(fns))
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    del graph
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy (read + write) of 2 GiB: the denominator of the
    benchmarks' "fraction of copy bandwidth"."""
    import torch

    n = 2 << 30
    buffers = torch.empty(2, n, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        buffers[1].copy_(buffers[0])
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        buffers[1].copy_(buffers[0])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del buffers
    torch.cuda.empty_cache()
    return 2 * n / statistics.median(times)
