"""The LM head and the cross-entropy loss fused, in chunks of tokens: the [tokens, V/tp] logits never exist.

    loss = linear_cross_entropy_mean(hidden [N, h], weight [V/tp, h], target [N], true_vocab, tp_group)

is `vocab_parallel_cross_entropy(hidden @ weight.T, target, ...).mean()` (cross_entropy.py) with the same fp32
math, but the logits of only `chunk_rows(...)` tokens are alive at a time, in the compute dtype.

forward:  for each chunk of tokens: logits (one GEMM) -> global max, sum of exp and target logit (the same
          all-reduces over the tensor-parallel group as the unfused loss) -> the chunk's loss, and at once its
          gradient: G = softmax - one_hot (in the compute dtype), grad_hidden = G @ W, grad_weight += G.T @ x.
backward: the mean's gradient is one scalar, so the saved gradients are scaled by it (/ N): no pass over
          logits and no GEMM in the backward at all.

Why the gradient in the forward: the backward of the unfused head needs the logits (or their recomputation, one
more GEMM); computing G while the chunk's logits are still in cache costs the same two GEMMs the unfused backward
runs and keeps only grad_hidden [N, h] and grad_weight [V/tp, h] (compute dtype) alive between forward and backward,
instead of [N, V/tp] logits. The price is the contract: the fused head returns the *mean* loss over every token
(what training and evaluation use), not per-token losses. G is kept unscaled (entries in [-1, 1]) so that fp16
never underflows. grad_weight accumulates over the chunks in the weight's dtype inside the GEMM (addmm: one
rounding per chunk), which measured faster and smaller than an fp32 accumulator
(docs/benchmarks/lmhead_h200_20261128.md).

This trades time for memory: the unfused head keeps the logits and reads them in fewer, larger passes, and was
faster in every configuration measured (docs/benchmarks/lmhead_h200_20261128.md); use the fusion where the logits
do not fit.

Padded vocabulary columns (global index >= true_vocab) are masked, so padding never changes the loss. The
hidden state must already be in the tensor-parallel region (`to_tp_region`: its backward all-reduces, or
reduce-scatters under sequence parallelism, the partial grad_hidden of each rank's vocabulary range).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .cross_entropy import _all_reduce, _fused, _grad, _local_max, _sum_exp_and_target
from .layers import tp_rank_size
from .mappings import Group

# Logit elements of one chunk: 2^26 (128 MiB in bf16) keeps a chunk's GEMM large enough to run at full speed
# while its logits stay a small fraction of what the unfused head holds.
CHUNK_ELEMENTS = 1 << 26


def chunk_rows(tokens: int, local_vocab: int) -> int:
    """Tokens per chunk: balanced chunks of at most CHUNK_ELEMENTS logits (static for a static shape)."""
    chunks = -(-tokens * local_vocab // CHUNK_ELEMENTS)
    return -(-tokens // max(chunks, 1))


class _LinearCrossEntropyMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, true_vocab: int,
                group: Group):
        rank, _ = tp_rank_size(group)
        start = rank * weight.shape[0]
        tokens = hidden.shape[0]
        grad_hidden = torch.empty_like(hidden)                                                 # [N, h]
        grad_weight = torch.zeros_like(weight)                                                 # [V/tp, h]
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        rows = chunk_rows(tokens, weight.shape[0])
        unit = torch.ones(rows, dtype=torch.float32, device=hidden.device)   # d(sum of losses)/d(each loss)
        for lo in range(0, tokens, rows):
            x, t = hidden[lo:lo + rows], target[lo:lo + rows]
            logits = x @ weight.t()                                                            # [c, V/tp]
            logits_max = _fused(_local_max, logits)(logits, start, true_vocab)
            _all_reduce(logits_max, dist.ReduceOp.MAX, group)
            sum_exp, target_logit = _fused(_sum_exp_and_target, logits)(logits, t, logits_max, start, true_vocab)
            _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
            _all_reduce(target_logit, dist.ReduceOp.SUM, group)
            loss_sum += (sum_exp.log() - target_logit).sum()
            g = _fused(_grad, logits)(logits, t, logits_max, sum_exp, unit[:x.shape[0]], start, true_vocab)
            del logits
            torch.mm(g, weight, out=grad_hidden[lo:lo + rows])                                 # [c, h]
            grad_weight.addmm_(g.t(), x)                                                       # [V/tp, h]
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.tokens = tokens
        return loss_sum / tokens

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_loss / ctx.tokens
        return grad_hidden * scale, grad_weight * scale, None, None, None


def linear_cross_entropy_mean(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                              true_vocab_size: int, tp_group: Group = None) -> torch.Tensor:
    """Mean fp32 loss [] of the vocab-parallel head `weight` [V_padded/tp, h] over hidden [*, h] and targets [*]."""
    h = hidden.shape[-1]
    return _LinearCrossEntropyMean.apply(hidden.reshape(-1, h), weight, target.reshape(-1), true_vocab_size,
                                         tp_group)
