"""Timing helpers shared by the GPU micro-benchmarks in benchmarks/ (a script there imports them as a
sibling module: running it puts benchmarks/ on sys.path)."""
from __future__ import annotations

from typing import Callable

import torch


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """fn captured as a CUDA graph, after one run on the side stream that capture uses."""
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    return graph


def cuda_us(run: Callable[[], object], iters: int, before: Callable[[], None] = lambda: None) -> float:
    """Microseconds per call of run, by CUDA events around `iters` calls (`before` runs first,
    e.g. a barrier)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    before()
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def graphed_us(fn: Callable[[], object], iters: int, warm: int = 5) -> float:
    """Microseconds per replay of fn captured as a CUDA graph, after `warm` eager calls (compiles,
    autotuning) and `warm` replays."""
    for _ in range(warm):
        fn()
    graph = capture(fn)
    for _ in range(warm):
        graph.replay()
    return cuda_us(graph.replay, iters)
