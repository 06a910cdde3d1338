"""Deferred weight gradients for zero-bubble pipeline schedules (Qi et al. 2023's WeightGradStore).

A zero-bubble schedule splits each backward into B, the input gradients (on the critical path: the
previous stage waits for them), and W, the weight-gradient GEMMs, which it runs later to fill the
pipeline's bubbles. The linear layers (tensor_parallel/linear.py) do the split: a weight marked by
`WeightGradStore.attach` carries the store, and the fused-accumulation backward of its GEMM, when it
runs inside `store.deferring()`, computes only the input gradient and hands the store the weight
gradient's work (`main_grad += g^T x`, with the tensors it reads) instead of doing it. Outside
`deferring()` (evaluation, any other schedule) the same backward accumulates at once. Every other
gradient (LayerNorm, embeddings, biases, the LM head) is computed in B as before.

    with store.deferring():        # one microbatch's B
        backward(...)
    ...
    store.run_oldest()             # that microbatch's W, when the schedule says so

The queue is one list per microbatch in B order; W runs them first in, first out. Nothing here
reads a tensor's value or syncs with the device, so a CUDA graph can capture it. The backward of a
CUDA tensor runs on autograd's device thread while the calling thread waits, so the state is a
plain attribute, not thread-local.
"""
from __future__ import annotations

import contextlib
from collections import deque
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.nn as nn

WeightGradWork = Callable[[], None]


class WeightGradStore:
    def __init__(self) -> None:
        self._collecting: Optional[list[WeightGradWork]] = None   # the B running now, if any
        self._queue: deque[list[WeightGradWork]] = deque()        # per microbatch whose W has not run

    @classmethod
    def attach(cls, params: Iterable[nn.Parameter]) -> "WeightGradStore":
        """A new store, carried by every 2-D parameter of `params` whose GEMM accumulates its own
        gradient (`fused_grad_accumulation`): the weights whose gradient work it may defer."""
        store = cls()
        for p in params:
            if p.ndim == 2 and getattr(p, "fused_grad_accumulation", False):
                p.wgrad_store = store
        return store

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """A B pass: the attached weights' gradient work done in this block is queued as one
        microbatch's W (possibly empty: a stage may hold no attached weight)."""
        if self._collecting is not None:
            raise RuntimeError("WeightGradStore.deferring() is not reentrant: one B at a time")
        self._collecting = []
        try:
            yield
        finally:
            self._queue.append(self._collecting)
            self._collecting = None

    def defer(self, work: WeightGradWork) -> bool:
        """Queue `work` for the current B and return True; False (the caller runs it now) outside B."""
        if self._collecting is None:
            return False
        self._collecting.append(work)
        return True

    @property
    def pending(self) -> int:
        """Microbatches whose B has run but whose W has not."""
        return len(self._queue)

    def run_oldest(self) -> None:
        """W of the oldest pending microbatch: its weight-gradient GEMMs, in its B's order, without
        autograd recording them (as inside the backward they were split from)."""
        with torch.no_grad():
            for work in self._queue.popleft():
                work()

    def clear(self) -> None:
        """Drop pending work (after a failed step, so that the next one starts empty)."""
        self._queue.clear()
        self._collecting = None
