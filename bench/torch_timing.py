"""Timing shared by the PyTorch reference benchmarks: the median time of a callable between two CUDA events."""
import statistics

import torch


def median_ms(fn, warmup=5, reps=20):
    """Median milliseconds of `reps` runs of fn, each between two events, after `warmup` runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)
