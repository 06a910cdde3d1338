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

Under torch.compile the four run eagerly (a graph break each): traced into a compiled layer, the
in-place all-reduce inside an autograd.Function crashed the first tp 2 step on 2x H200 with an
illegal memory access.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]

# torch >= 2.13 renames the single-tensor collectives (the old names warn); older ones lack the new.
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def tp_world(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if tp_world(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    n = tp_world(group)
    if n == 1:
        return x
    if x.shape[-1] % n:
        raise ValueError(f"last dim {x.shape[-1]} not divisible by tensor-parallel size {n}")
    return x.chunk(n, dim=-1)[dist.get_rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    n = tp_world(group)
    if n == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


def _split_first(x: torch.Tensor, group: Group) -> torch.Tensor:
    n = tp_world(group)
    if x.shape[0] % n:
        raise ValueError(f"sequence length {x.shape[0]} not divisible by tensor-parallel size {n}")
    return x.chunk(n, dim=0)[dist.get_rank(group)].contiguous()


def all_gather_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[s/tp, ...] of every rank -> [s, ...] (no autograd)."""
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * tp_world(group), *x.shape[1:]))
    all_gather_tensor(out, x, group=group)
    return out


def _reduce_scatter_first(x: torch.Tensor, group: Group) -> torch.Tensor:
    n = tp_world(group)
    if x.shape[0] % n:
        raise ValueError(f"sequence length {x.shape[0]} not divisible by tensor-parallel size {n}")
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    reduce_scatter_tensor(out, x, group=group)
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        if not x.is_contiguous():
            return _all_reduce(x, group)  # a contiguous copy, reduced
        ctx.mark_dirty(x)
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


@torch.compiler.disable
def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: identity; backward: all-reduce the gradient over `group`."""
    return x if tp_world(group) == 1 else _CopyToTP.apply(x, group)


@torch.compiler.disable
def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: all-reduce (sum) over `group`, in place when x is contiguous (pass a fresh tensor,
    such as a GEMM output, that nothing else reads; autograd refuses one saved for backward);
    backward: identity."""
    return x if tp_world(group) == 1 else _ReduceFromTP.apply(x, group)


@torch.compiler.disable
def scatter_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: keep this rank's slice of the last dim; backward: all-gather the last dim."""
    return x if tp_world(group) == 1 else _ScatterToTP.apply(x, group)


@torch.compiler.disable
def gather_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: all-gather along the last dim; backward: keep this rank's slice."""
    return x if tp_world(group) == 1 else _GatherFromTP.apply(x, group)


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_first(grad, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


@torch.compiler.disable
def scatter_to_sp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: keep this rank's slice of dim 0 (the sequence); backward: all-gather dim 0."""
    return x if tp_world(group) == 1 else _ScatterToSP.apply(x, group)


@torch.compiler.disable
def gather_from_sp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: all-gather dim 0 (the sequence); backward: reduce-scatter dim 0 (sums the gradients
    of the TP ranks, which each used the whole sequence)."""
    return x if tp_world(group) == 1 else _GatherFromSP.apply(x, group)


@torch.compiler.disable
def reduce_scatter_to_sp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: sum over `group` and keep this rank's slice of dim 0; backward: all-gather dim 0."""
    return x if tp_world(group) == 1 else _ReduceScatterToSP.apply(x, group)
