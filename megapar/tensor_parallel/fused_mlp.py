"""The MLP's two GEMMs with GELU in cuBLASLt epilogues (--mlp-impl fused).

Unfused, the tanh GELU between the column-parallel and the row-parallel GEMM costs two passes
over the [T, 4h/tp] activation forward (bias + GELU) and, backward, one GELU-gradient pass plus
a column sum for the first bias. Here the first GEMM applies bias and GELU in its epilogue and
also writes the pre-activation (GELU_AUX_BIAS); backward, the second GEMM's input-gradient GEMM
applies the GELU derivative from that pre-activation and reduces the first bias's gradient in its
epilogue (DGELU_BGRAD), so neither [T, 4h/tp] elementwise pass remains.

Weight and bias gradients go straight into `main_grad` (gradient-accumulation fusion, linear.py),
and the input gradient is reduced over TP while the first weight gradient is computed, as in the
column-parallel layer. The second layer's reduction and bias stay with RowParallelLinear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.fused_mlp import linear_dgelu_backward, linear_gelu_forward
from .linear import accumulate_wgrad_, active, start_grad_x_reduction
from .mappings import Group, all_gather_dim0, tp_world


class _GeluMLP(torch.autograd.Function):
    """forward: y = gelu(x W1^T + b1) W2^T (x all-gathered along dim 0 first with sequence_parallel);
    backward: g_pre = gelu'(pre) * (g W2), W2.main_grad += g^T h, b1.main_grad += sum(g_pre),
    dx = g_pre W1 (reduced over TP behind) W1.main_grad += g_pre^T x; dW1, db1, dW2 = dummies."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, w1_main_grad: torch.Tensor,
                b1_main_grad: torch.Tensor, w2_main_grad: torch.Tensor, group: Group,
                sequence_parallel: bool) -> torch.Tensor:
        if sequence_parallel:
            x = all_gather_dim0(x, group)                                          # [s, b, h]
        lead = x.shape[:-1]
        x2d = x.reshape(-1, x.shape[-1])                                           # [T, h]
        h, pre = linear_gelu_forward(x2d, w1, b1)                                  # [T, 4h/tp] each
        ctx.save_for_backward(x2d, w1, w2, h, pre)
        # not saved tensors: every accumulation into the buffer bumps their version
        ctx.w1_main_grad, ctx.b1_main_grad, ctx.w2_main_grad = w1_main_grad, b1_main_grad, w2_main_grad
        ctx.group, ctx.sequence_parallel, ctx.lead = group, sequence_parallel, lead
        return F.linear(h.view(*lead, h.shape[-1]), w2)  # [s, b, h], a partial sum (not a view: reduced in place)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x2d, w1, w2, h, pre = ctx.saved_tensors
        w1_mg, b1_mg, w2_mg = ctx.w1_main_grad, ctx.b1_main_grad, ctx.w2_main_grad
        g2d = grad_out.reshape(-1, grad_out.shape[-1])                             # [T, h]
        grad_pre, grad_b1 = linear_dgelu_backward(g2d, w2, pre)                    # [T, 4h/tp], [4h/tp] fp32
        accumulate_wgrad_(w2_mg, g2d, h)                                           # [h, 4h/tp] += [h, T] @ [T, 4h/tp]
        grad_x, pending = start_grad_x_reduction(grad_pre.matmul(w1).view(*ctx.lead, w1.shape[1]), ctx.group,
                                                 ctx.sequence_parallel)
        accumulate_wgrad_(w1_mg, grad_pre, x2d)                                    # [4h/tp, h] += [4h/tp, T] @ [T, h]
        b1_mg.add_(grad_b1)
        if pending is not None:
            pending.wait()
        dummies = (torch.empty_like(w1), torch.empty_like(b1_mg, dtype=w1.dtype), torch.empty_like(w2))
        return grad_x, *dummies, None, None, None, None, None


def _gelu_mlp(x, fc1, fc2, group: Group, sequence_parallel: bool) -> torch.Tensor:
    return _GeluMLP.apply(x, fc1.weight, fc1.bias, fc2.weight, fc1.weight.main_grad, fc1.bias.main_grad,
                          fc2.weight.main_grad, group, sequence_parallel)


# With TP collectives inside: eager under torch.compile (as linear._linear_accumulate_eager).
_gelu_mlp_eager = torch.compiler.disable(_gelu_mlp)


def can_fuse(fc1, fc2) -> bool:
    """The fused path needs gradient-accumulation fusion on all three parameters (training)."""
    return fc1.bias is not None and all(active(p) for p in (fc1.weight, fc1.bias, fc2.weight))


def gelu_mlp(x: torch.Tensor, fc1, fc2) -> torch.Tensor:
    """fc2's partial output gelu(fc1(x)) W2^T for ColumnParallelLinear fc1 and RowParallelLinear
    fc2 (its TP reduction and bias are left to fc2.reduce_and_bias)."""
    group = fc1.tp_group
    sp = fc1.sequence_parallel and tp_world(group) > 1
    return (_gelu_mlp_eager if tp_world(group) > 1 else _gelu_mlp)(x, fc1, fc2, group, sp)
