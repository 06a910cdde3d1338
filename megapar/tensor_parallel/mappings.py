"""Conjugate autograd collectives for the tensor-parallel region.

Each function takes its process group explicitly. Pairs are conjugate: the forward of one is
the backward of the other.

    copy_to_tp      forward: identity;              backward: all-reduce
    reduce_from_tp  forward: all-reduce;            backward: identity
    scatter_to_tp   forward: keep my last-dim slice; backward: all-gather (last dim)
    gather_from_tp  forward: all-gather (last dim);  backward: keep my last-dim slice

Sequence parallelism (--sequence-parallel) splits the activations outside the TP region along the
sequence, dim 0 of [s, b, h]:

    scatter_to_sp         forward: keep my dim-0 slice;  backward: all-gather (dim 0)
    gather_from_sp        forward: all-gather (dim 0);   backward: reduce-scatter (dim 0)
    reduce_scatter_to_sp  forward: reduce-scatter (dim 0); backward: all-gather (dim 0)

Under torch.compile every mapping over more than one rank runs eagerly (a graph break each): traced
into a compiled layer, the in-place all-reduce inside an autograd.Function crashed the first tp 2 step
on 2x H200 with an illegal memory access (docs/benchmarks/log_h100_20261121.md#performance-log-predicted-vs-measured).
Over one rank every mapping is the identity, decided in the graph (`group.size()` is a constant to
torch.compile), so a layer at tp 1 compiles whole.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]

# torch >= 2.13 renames the single-tensor collectives (the old names warn); older ones lack the new.
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def tp_world(group: Group) -> int:
    return 1 if group is None else group.size()


Mapping = Callable[[torch.Tensor, Group], torch.Tensor]


def _eager_over_ranks(fn: Mapping) -> Mapping:
    """`fn` outside torch.compile (a graph break) when `group` has more than one rank; the identity,
    traced, when it has one."""
    eager = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def mapping(x: torch.Tensor, group: Group) -> torch.Tensor:
        return x if tp_world(group) == 1 else eager(x, group)
    return mapping


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _all_reduce_copy(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _all_reduce(x.clone(), group)


def _identity(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x


def _split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    n = tp_world(group)
    if x.shape[-1] % n:
        raise ValueError(f"last dim {x.shape[-1]} not divisible by tensor-parallel size {n}")
    return x.chunk(n, dim=-1)[dist.get_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp_world(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


def _sequence_part(x: torch.Tensor, group: Group) -> int:
    """Length of one rank's part of dim 0 (the sequence)."""
    n = tp_world(group)
    if x.shape[0] % n:
        raise ValueError(f"sequence length {x.shape[0]} not divisible by tensor-parallel size {n}")
    return x.shape[0] // n


def _split_first(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x.split(_sequence_part(x, group), dim=0)[dist.get_rank(group)].contiguous()


def all_gather_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[s/tp, ...] of every rank -> [s, ...] (no autograd)."""
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * tp_world(group), *x.shape[1:]))
    all_gather_tensor(out, x, group=group)
    return out


def reduce_scatter_dim0(x: torch.Tensor, group: Group, async_op: bool = False):
    """[s, ...] summed over the ranks, this rank's [s/tp, ...] part (no autograd).
    Returns (out, work): work is the pending collective with async_op, else None."""
    x = x.contiguous()
    out = x.new_empty((_sequence_part(x, group), *x.shape[1:]))
    return out, reduce_scatter_tensor(out, x, group=group, async_op=async_op)


def _reduce_scatter_first(x: torch.Tensor, group: Group) -> torch.Tensor:
    return reduce_scatter_dim0(x, group)[0]


class _Conjugate(torch.autograd.Function):
    """forward: fwd(x, group); backward: bwd(grad, group). One class for every pair below."""

    @staticmethod
    def forward(ctx, x, group, fwd, bwd):
        ctx.group, ctx.bwd = group, bwd
        return fwd(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.bwd(grad, ctx.group), None, None, None


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce, in place on a contiguous x; backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        if x.is_contiguous():
            ctx.mark_dirty(x)
        return _all_reduce(x, group)  # in place, or on a contiguous copy

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@_eager_over_ranks
def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: identity; backward: all-reduce the gradient over `group`."""
    return _Conjugate.apply(x, group, _identity, _all_reduce_copy)


@_eager_over_ranks
def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: all-reduce (sum) over `group`, in place when x is contiguous (pass a fresh tensor,
    such as a GEMM output, that nothing else reads; autograd refuses one saved for backward);
    backward: identity."""
    return _ReduceFromTP.apply(x, group)


@_eager_over_ranks
def scatter_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: keep this rank's slice of the last dim; backward: all-gather the last dim."""
    return _Conjugate.apply(x, group, _split_last, _gather_last)


@_eager_over_ranks
def gather_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: all-gather along the last dim; backward: keep this rank's slice."""
    return _Conjugate.apply(x, group, _gather_last, _split_last)


@_eager_over_ranks
def scatter_to_sp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: keep this rank's slice of dim 0 (the sequence); backward: all-gather dim 0."""
    return _Conjugate.apply(x, group, _split_first, all_gather_dim0)


@_eager_over_ranks
def gather_from_sp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: all-gather dim 0 (the sequence); backward: reduce-scatter dim 0 (sums the gradients
    of the TP ranks, which each used the whole sequence)."""
    return _Conjugate.apply(x, group, all_gather_dim0, _reduce_scatter_first)


@_eager_over_ranks
def reduce_scatter_to_sp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: sum over `group` and keep this rank's slice of dim 0; backward: all-gather dim 0."""
    return _Conjugate.apply(x, group, _reduce_scatter_first, all_gather_dim0)


def to_tp_region(x: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    """The input of a column-parallel GEMM: x replicated over `group` (copy_to_tp), or this rank's
    part of the sequence (gather_from_sp)."""
    return gather_from_sp(x, group) if sequence_parallel else copy_to_tp(x, group)
