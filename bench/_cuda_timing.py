"""GPU time of CUDA-graph replays, measured with CUDA events."""
from __future__ import annotations

import numpy as np
import torch


def median_replay_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Median GPU milliseconds of one replay of `graph`, over `replays` synchronised replays."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return float(np.median(times))
