"""Interleaved 1F1B (Megatron's schedule with virtual pipeline stages). Knows nothing of GPT-2.

Each of the p pipeline ranks holds v model chunks (`model[j]`, j < v); chunk j of rank r is
virtual stage j * p + r, so an activation goes rank 0 -> 1 -> ... -> p - 1 and then back to
rank 0's next chunk (the pipeline is a ring). A rank runs m * v chunk-microbatches: in forward
order, virtual microbatch k is microbatch (k // (p * v)) * p + k % p of chunk (k // p) % v
(Megatron's `get_model_chunk_id`; backward runs the chunks in reverse). The bubble shrinks from
(p - 1) / m to (p - 1) / (v * m) of the step, at v times the point-to-point traffic.

    Warmup    (p - r - 1) * 2 + (v - 1) * p forwards on rank r (all m * v when m == p)
    Steady    one forward and one backward per step, exchanging both with the neighbours
    Cooldown  the remaining backwards

Live forward outputs on rank r never exceed warmup + 1 (`peak_live`), each a chunk of 1/v of
the rank's layers: p + (p - 1) / v stages' worth on rank 0, against 1F1B's p.
Requirements (checked by the caller's configuration): p > 1 and m a multiple of p.

`data_iterator` is one iterator per chunk (or one shared by all); `cfg.no_sync()` wraps every
backward but the rank's last, so the data-parallel reduction runs once, after the schedule
(buckets whose last gradient came from an earlier chunk are reduced by the caller's
`finish()`, not overlapped with the last backward). With p == 2 activations and gradients go
between the same two ranks in both directions; the gradients then travel on a second group,
`cfg.pp_grad_group`, so that each kind is matched in its own order (NCCL matches messages
between two ranks by communicator only). Hang diagnostics name the phase, the microbatch and
the chunk.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections import deque
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from . import p2p
from .schedules import ForwardStep, Logs, ScheduleConfig, backward_step, deallocate_output, forward_step_and_loss


def chunk_id(k: int, p: int, v: int, forward: bool = True) -> int:
    """Model chunk of virtual microbatch k (Megatron's get_model_chunk_id)."""
    j = (k % (p * v)) // p
    return j if forward else v - 1 - j


def microbatch_id(k: int, p: int, v: int) -> int:
    """The data microbatch that virtual microbatch k carries."""
    return (k // (p * v)) * p + k % p


def num_warmup(p: int, rank: int, v: int, m: int) -> int:
    """Warmup forwards on pipeline rank `rank` (all of them when m == p)."""
    return m * v if m == p else min((p - rank - 1) * 2 + (v - 1) * p, m * v)


class _Interleaved:
    """One interleaved schedule run on one pipeline rank: the chunks' queues and their steps."""

    def __init__(self, forward_step: ForwardStep, data_iterator, model: Sequence[nn.Module], cfg: ScheduleConfig):
        self.step, self.model, self.cfg = forward_step, model, cfg
        self.p, self.rank, self.v = dist.get_world_size(cfg.pp_group), dist.get_rank(cfg.pp_group), len(model)
        self.total = cfg.num_microbatches * self.v
        self.data = list(data_iterator) if isinstance(data_iterator, (list, tuple)) else [data_iterator] * self.v
        ring = [self._global((self.rank + d) % self.p) for d in (-1, 1)]
        self.ring = dataclasses.replace(cfg, prev_rank=ring[0], next_rank=ring[1])
        if self.p == 2 and cfg.pp_grad_group is None:
            raise ValueError("interleaved 1F1B with pp == 2 sends activations and gradients between the same two "
                             "ranks: give ScheduleConfig.pp_grad_group (Topology's pp_grad group) for the gradients")
        self.grad_group = cfg.pp_grad_group if self.p == 2 else None
        self.chunk_cfg = [dataclasses.replace(cfg, prev_rank=None if self.is_first(j) else ring[0],
                                              next_rank=None if self.is_last(j) else ring[1]) for j in range(self.v)]
        self.inputs: list[deque] = [deque() for _ in range(self.v)]   # per chunk: inputs, outputs, output grads
        self.outputs: list[deque] = [deque() for _ in range(self.v)]
        self.grads: list[deque] = [deque() for _ in range(self.v)]
        self.logs: Logs = []
        self.live = self.peak_live = 0                                  # forward outputs kept for backward

    def _global(self, group_rank: int) -> int:
        return group_rank if self.cfg.pp_group is None else dist.get_global_rank(self.cfg.pp_group, group_rank)

    def is_first(self, j: int) -> bool:
        return self.rank == 0 and j == 0

    def is_last(self, j: int) -> bool:
        return self.rank == self.p - 1 and j == self.v - 1

    def chunk(self, k: int, forward: bool = True) -> int:
        return chunk_id(k, self.p, self.v, forward)

    def at(self, phase: str, k: int, forward: bool = True) -> None:
        p2p.set_step(label=self.cfg.label, schedule="interleaved-1f1b", phase=phase,
                     microbatch=microbatch_id(k, self.p, self.v), chunk=self.chunk(k, forward))

    # ---- compute -------------------------------------------------------------------------------
    def forward(self, k: int, keep: bool = True) -> Optional[torch.Tensor]:
        """Forward of virtual microbatch k; returns what goes to the next virtual stage (None on the last)."""
        j = self.chunk(k)
        if self.is_first(j):
            self.inputs[j].append(None)                                 # the first chunk reads data
        input_tensor = self.inputs[j][-1]
        output = forward_step_and_loss(self.step, self.data[j], self.model[j], self.chunk_cfg[j], input_tensor,
                                       self.logs)
        if keep:
            self.outputs[j].append(output)
            self.live += 1
            self.peak_live = max(self.peak_live, self.live)
        else:
            self.inputs[j].pop()
        return None if self.is_last(j) else output

    def backward(self, k: int) -> Optional[torch.Tensor]:
        """Backward of virtual microbatch k (in backward order); returns the input gradient to send
        to the previous virtual stage (None on the first)."""
        j = self.chunk(k, forward=False)
        if self.is_last(j):
            self.grads[j].append(None)                                  # the loss needs no incoming grad
        input_tensor, output, grad = self.inputs[j].popleft(), self.outputs[j].popleft(), self.grads[j].popleft()
        self.live -= 1
        with contextlib.nullcontext() if k == self.total - 1 else self.cfg.no_sync():
            input_grad = backward_step(input_tensor, output, grad, self.cfg)
        return None if self.is_first(j) else input_grad

    # ---- communication (ring neighbours; both directions in one batch) --------------------------
    def exchange(self, output: Optional[torch.Tensor], input_grad: Optional[torch.Tensor],
                 recv_prev: bool, recv_next: bool) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        got = p2p.communicate(self.ring, send_next=output, send_prev=input_grad, recv_prev=recv_prev,
                              recv_next=recv_next, grad_group=self.grad_group)
        if output is not None and output.requires_grad:
            deallocate_output(output)                                   # sent: keep only its autograd graph
        return got

    def put_input(self, j: int, t: Optional[torch.Tensor]) -> None:
        if t is not None:
            self.inputs[j].append(t)

    def put_grad(self, j: int, t: Optional[torch.Tensor]) -> None:
        if t is not None:
            self.grads[j].append(t)


def forward_backward_pipelining_interleaved(forward_step: ForwardStep, data_iterator: Iterator | list[Iterator],
                                            model: Sequence[nn.Module], cfg: ScheduleConfig,
                                            forward_only: bool = False) -> Logs:
    """Interleaved 1F1B over the chunks model[0..v-1] of this rank (module docstring). Returns the
    per-microbatch logs (empty off the last rank); `cfg.stats`, when given, receives
    "peak_live_outputs" (the most forward outputs held for backward at once)."""
    run = _Interleaved(forward_step, data_iterator, model, cfg)
    p, rank, v, total = run.p, run.rank, run.v, run.total
    warmup = total if forward_only else num_warmup(p, rank, v, cfg.num_microbatches)
    steady = total - warmup
    grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()

    # Warmup: forwards only; the last one also receives the first output gradient
    with grad_ctx:
        if rank > 0:
            run.at("warmup", 0)
            run.put_input(0, run.exchange(None, None, recv_prev=True, recv_next=False)[0])
        for k in range(warmup):
            run.at("warmup", k)
            output = run.forward(k, keep=not forward_only)
            next_chunk = run.chunk(k + 1)
            recv_prev = not (rank == 0 and next_chunk == 0) and k < total - 1
            recv_next = k == warmup - 1 and steady > 0 and rank < p - 1
            input_tensor, grad = run.exchange(output, None, recv_prev, recv_next)
            run.put_input(next_chunk, input_tensor)
            run.put_grad(v - 1, grad)
    if forward_only:
        return _done(run)

    # Steady state: forward k + warmup, backward k, one exchange with both neighbours
    for k in range(steady):
        fk = k + warmup
        run.at("steady", fk)
        output = run.forward(fk)
        run.at("steady", k, forward=False)
        input_grad = run.backward(k)
        if rank == 0:        # rank 0 runs p - 1 forwards ahead of the last rank, whose output it gets
            recv_prev, next_fwd = run.chunk(fk - (p - 1)) != v - 1, run.chunk(fk - (p - 1)) + 1
        else:
            recv_prev, next_fwd = True, run.chunk(fk + 1)
        if rank == p - 1:    # ... and the last rank p - 1 backwards ahead of rank 0
            prev_bwd = run.chunk(k - (p - 1), forward=False)
            recv_next, next_bwd = prev_bwd != 0, prev_bwd - 1
        else:
            recv_next, next_bwd = True, run.chunk(k + 1, forward=False)
        input_tensor, grad = run.exchange(output, input_grad, recv_prev and k < steady - 1, recv_next)
        run.put_input(next_fwd, input_tensor)
        run.put_grad(next_bwd, grad)

    # Cooldown: the remaining backwards
    if steady == 0 and rank < p - 1:   # all forwards were warmup: the first gradient is still to come
        run.at("cooldown", 0, forward=False)
        run.put_grad(v - 1, run.exchange(None, None, recv_prev=False, recv_next=True)[1])
    for k in range(steady, total):
        run.at("cooldown", k, forward=False)
        input_grad = run.backward(k)
        next_bwd = run.chunk(k + 1, forward=False)
        recv_next = not (rank == p - 1 and next_bwd == v - 1) and k < total - 1
        run.put_grad(next_bwd, run.exchange(None, input_grad, recv_prev=False, recv_next=recv_next)[1])
    return _done(run)


def _done(run: _Interleaved) -> Logs:
    p2p.set_step(phase="finished", microbatch=None, chunk=None)
    if run.cfg.stats is not None:
        run.cfg.stats["peak_live_outputs"] = run.peak_live
    return run.logs
