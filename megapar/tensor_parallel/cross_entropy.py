"""Vocab-parallel cross entropy: never gathers the full logits.

Each TP rank holds logits for a contiguous vocabulary range [start, end). Columns at or beyond
the true vocabulary size (padding) are masked to -inf, so padding never changes the loss.

forward:  global max (all-reduce MAX) -> sum of exp (all-reduce SUM) and the target logit
          (all-reduce SUM; only the owning rank contributes) -> loss = log(sum) - target.
backward: grad = softmax - one_hot(target), restricted to this rank's range.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .layers import tp_rank_size
from .mappings import Group


def _all_reduce(x: torch.Tensor, op, group: Group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, true_vocab: int, group: Group):
        rank, size = tp_rank_size(group)
        per_rank = logits.shape[-1]
        start = rank * per_rank
        logits = logits.float()                                                   # [*, V/tp]
        if start + per_rank > true_vocab:                                          # padded columns here
            pad = torch.arange(start, start + per_rank, device=logits.device) >= true_vocab
            logits = logits.masked_fill(pad, float("-inf"))
        logits_max = logits.max(dim=-1).values                                     # [*]
        _all_reduce(logits_max, dist.ReduceOp.MAX, group)
        logits = logits - logits_max.unsqueeze(-1)

        in_range = (target >= start) & (target < start + per_rank)                # [*]
        local_target = (target - start).masked_fill(~in_range, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(~in_range, 0.0)
        _all_reduce(target_logit, dist.ReduceOp.SUM, group)

        exp = logits.exp_()                                                        # in place: [*, V/tp]
        sum_exp = exp.sum(dim=-1)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
        loss = sum_exp.log() - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, in_range, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, in_range, local_target = ctx.saved_tensors
        grad = softmax                                                             # reuse the buffer
        flat = grad.view(-1, grad.shape[-1])
        rows = torch.arange(flat.shape[0], device=grad.device)
        flat[rows, local_target.reshape(-1)] -= in_range.reshape(-1).to(grad.dtype)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, true_vocab_size: int,
                                 tp_group: Group = None) -> torch.Tensor:
    """Per-token loss [*] from vocab-parallel logits [*, V_padded/tp] and targets [*].

    The gradient w.r.t. the logits is fp32 (math is fp32 whatever the logits dtype)."""
    return _VocabParallelCrossEntropy.apply(logits, target, true_vocab_size, tp_group)
