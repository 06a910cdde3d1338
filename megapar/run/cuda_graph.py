"""The whole training step as one CUDA graph (Megatron's --enable-cuda-graph with the
full-iteration scope): zeroing the gradient buffer, forward and backward of every microbatch,
gradient reduction, clipping and AdamW, replayed with one launch per iteration.

Why: the H100 profile of GPT-2 345M (micro-batch 8, compiled layers) showed the GPU idle for part
of every step, waiting for the CPU to launch kernels through the autograd engine, the compiled
layers' wrappers and the gradient hooks. A replay launches them all at once, which measured faster
on H100 (more so with the bias-gradient GEMV and the queued read-back; see
docs/benchmarks/log_h100_20261121.md#performance-log-predicted-vs-measured).
Per-layer graphs (Transformer Engine's way) would keep the hooks and the optimizer outside; one
graph for the whole step is simpler here because the step is already free of host
synchronisation (training.queue_step).

Lifecycle (per GraphedStep):
  1. the first `warmup` calls run the step eagerly on a side stream: torch.compile compiles,
     cuBLAS picks its algorithms, AdamW creates its state tensors;
  2. the next call captures the step (capture records kernels and runs none), then replays it;
  3. every later call copies its microbatches into the graph's static input tensors and replays
     (queued behind the previous replay: the caller need not wait for it). A caller that must wait
     for a step's results before the next replay (fp16's loss scale) `prefetch`es the next
     microbatches first, so that loading them is not part of the GPU's wait.
What the graph reads must stay at the same address: the parameters, the fp32 masters, the Adam
moments, the gradient buffer and the learning rate, which the optimizer keeps in a device tensor
(make_adamw, capturable=True) that the LR scheduler fills in place before each replay, and fp16's
loss scale, a device tensor the host refills after each step (optimizer/base.py, settle_overflow).
What the step allocates and frees inside itself is captured with it: ZeRO-2's per-layer gradient
buckets and ZeRO-3's gathered weights get the same addresses in the graph's memory pool at every
replay, and the collectives that fill them (reduce-scatter, all-gather, the pipeline's
send/receive, the loss broadcast of the last stage) are captured as NCCL kernels.
Random numbers: the device's default generator is registered with every capture by torch; the
tensor-parallel RNG tracker's generators (`generators`) are registered here, so dropout masks
advance from replay to replay exactly as in eager steps.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .initialize import print_rank0

# The microbatches of one step: a list of (tokens [b, s], labels [b, s]), (None, None) on a middle
# pipeline stage; a list of such lists (one per model chunk) with the interleaved schedule.
Batches = Any


class GraphedStep:
    def __init__(self, step: Callable[[Batches], torch.Tensor], warmup: int, device: torch.device,
                 generators: Sequence[torch.Generator] = ()):
        """step(microbatches) queues one training step and returns a device tensor of results
        (nothing in it may read back to the host). generators: CUDA generators the step swaps in
        besides the device's default one (the tensor-parallel RNG tracker's)."""
        if warmup < 1:
            raise ValueError("a CUDA graph needs at least one eager warm-up step (--cuda-graph-warmup-steps >= 1)")
        self.step, self.warmup, self.generators = step, warmup, list(generators)
        self.stream = torch.cuda.Stream(device)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.inputs: list[Optional[torch.Tensor]] = []   # the graph's copies of the microbatches' tensors
        self.output: Optional[torch.Tensor] = None
        self.calls = 0
        self.prefetched: Optional[Hashable] = None  # the key of the microbatches `prefetch` copied in

    def __call__(self, batches: Optional[Batches]) -> torch.Tensor:
        """Queue one step on `batches`; None: on the microbatches the last `prefetch` copied in."""
        self.calls += 1
        if batches is None and self.prefetched is None:
            raise RuntimeError("GraphedStep called without microbatches and none prefetched")
        self.prefetched = None
        if self.calls <= self.warmup:
            return self._eager(batches)
        if self.graph is None:
            self._capture(batches)
        if batches is not None:
            self._copy_in(batches)
        self.graph.replay()
        return self.output.clone()  # the next replay overwrites the graph's own output

    def prefetch(self, batches: Batches, key: Hashable) -> None:
        """Copy the next call's microbatches into the graph's inputs now, while the replay queued last
        runs: the copies are queued behind it on the same stream, so they never overwrite what it
        reads. `key` names them (the caller checks `prefetched` before its next call). Only once the
        graph exists: warm-up and capture calls take their own microbatches."""
        if self.graph is not None:
            self._copy_in(batches)
            self.prefetched = key

    def _copy_in(self, batches: Batches) -> None:
        for static, x in zip(self.inputs, tree_flatten(batches)[0], strict=True):
            if x is not None:
                static.copy_(x, non_blocking=True)

    def _eager(self, batches: Batches) -> torch.Tensor:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            out = self.step(batches)
        torch.cuda.current_stream().wait_stream(self.stream)
        out.record_stream(torch.cuda.current_stream())  # made on the side stream, read on this one
        return out

    def _capture(self, batches: Batches) -> None:
        leaves, spec = tree_flatten(batches)
        self.inputs = [None if x is None else x.clone() for x in leaves]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the warm-up's cached blocks; the graph gets its own memory pool
        self.graph = torch.cuda.CUDAGraph()
        for generator in self.generators:
            self.graph.register_generator_state(generator)
        with torch.cuda.graph(self.graph, stream=self.stream):
            self.output = self.step(tree_unflatten(self.inputs, spec))
        pool = torch.cuda.memory_stats().get("reserved_bytes.all.current", 0) / 2**20
        print_rank0(f"> captured the training step as a CUDA graph after {self.warmup} eager steps "
                    f"({pool:.0f} MB reserved)")
