"""Vocab-parallel cross entropy: never gathers the full logits.

Each TP rank holds logits for a contiguous vocabulary range [start, end). Columns at or beyond
the true vocabulary size (padding) are masked to -inf, so padding never changes the loss.

forward:  global max (all-reduce MAX) -> sum of exp (all-reduce SUM) and the target logit
          (all-reduce SUM; only the owning rank contributes) -> loss = log(sum) - target.
backward: grad = softmax - one_hot(target), restricted to this rank's range.

Versions: the first one upcast the logits to an fp32 copy, masked it, and kept the fp32 softmax
for backward: ~7 passes over a [tokens, V] fp32 tensor, a large share of a GPT-2 345M step in an
H100 profile (docs/benchmarks/log_h100_20261121.md#performance-log-predicted-vs-measured). This one keeps only the
logits (in their own dtype) plus two fp32 numbers per
token, and does each step as one elementwise pass with fp32 math; on CUDA each pass is compiled
into a single fused kernel. The math is identical on CPU (eager) and GPU.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..kernels.inductor import COMPILE_OPTIONS
from .layers import tp_rank_size
from .mappings import Group


def _all_reduce(x: torch.Tensor, op, group: Group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)


def _masked(logits: torch.Tensor, start: int, true_vocab: int) -> torch.Tensor:
    """fp32 logits with padded columns (global index >= true_vocab) at -inf.   [*, V/tp]"""
    cols = torch.arange(start, start + logits.shape[-1], device=logits.device)
    return logits.float().masked_fill(cols >= true_vocab, float("-inf"))


def _local_max(logits, start: int, true_vocab: int) -> torch.Tensor:
    return _masked(logits, start, true_vocab).amax(dim=-1)                                  # [*]


def _sum_exp_and_target(logits, target, logits_max, start: int, true_vocab: int):
    x = _masked(logits, start, true_vocab) - logits_max.unsqueeze(-1)
    sum_exp = x.exp().sum(dim=-1)                                                           # [*]
    in_range = (target >= start) & (target < start + logits.shape[-1])
    local = (target - start).clamp(0, logits.shape[-1] - 1)
    target_logit = x.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, 0.0)
    return sum_exp, target_logit


def _grad(logits, target, logits_max, sum_exp, grad_loss, start: int, true_vocab: int) -> torch.Tensor:
    x = _masked(logits, start, true_vocab)
    softmax = (x - logits_max.unsqueeze(-1)).exp() / sum_exp.unsqueeze(-1)                  # [*, V/tp]
    cols = torch.arange(start, start + logits.shape[-1], device=logits.device)
    one_hot = (cols == target.unsqueeze(-1)).float()
    return ((softmax - one_hot) * grad_loss.unsqueeze(-1)).to(logits.dtype)


_FUSED: dict[str, object] = {}


def _fused(fn, x: torch.Tensor):
    """`fn` compiled into one kernel on CUDA (MEGAPAR_NO_COMPILE_CE=1 turns it off); eager on CPU."""
    if not x.is_cuda or os.environ.get("MEGAPAR_NO_COMPILE_CE") == "1":
        return fn
    if fn.__name__ not in _FUSED:
        _FUSED[fn.__name__] = torch.compile(fn, dynamic=False, options=COMPILE_OPTIONS)
    return _FUSED[fn.__name__]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, true_vocab: int, group: Group):
        rank, _ = tp_rank_size(group)
        start = rank * logits.shape[-1]
        logits_max = _fused(_local_max, logits)(logits, start, true_vocab)
        _all_reduce(logits_max, dist.ReduceOp.MAX, group)
        sum_exp, target_logit = _fused(_sum_exp_and_target, logits)(logits, target, logits_max, start, true_vocab)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
        _all_reduce(target_logit, dist.ReduceOp.SUM, group)
        ctx.save_for_backward(logits, target, logits_max, sum_exp)
        ctx.start, ctx.true_vocab = start, true_vocab
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, target, logits_max, sum_exp = ctx.saved_tensors
        grad = _fused(_grad, logits)(logits, target, logits_max, sum_exp, grad_loss.contiguous(), ctx.start,
                                     ctx.true_vocab)
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, true_vocab_size: int,
                                 tp_group: Group = None) -> torch.Tensor:
    """Per-token fp32 loss [*] from vocab-parallel logits [*, V_padded/tp] and targets [*].

    Math is fp32 whatever the logits dtype; the gradient comes back in the logits' dtype."""
    return _VocabParallelCrossEntropy.apply(logits, target, true_vocab_size, tp_group)
