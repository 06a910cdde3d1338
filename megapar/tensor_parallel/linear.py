"""F.linear whose weight gradient goes straight into the fp32 gradient buffer.

Megatron's --gradient-accumulation-fusion, without apex. Unfused, a bf16 weight's gradient takes
three trips through memory each microbatch: the weight-gradient GEMM writes a bf16 tensor, autograd
hands it to the parameter, and the GradBuffer hook adds it into the fp32 `main_grad` (345M on an
H100: 4.8 ms of a 49 ms step). Fused, the GEMM itself accumulates in fp32 into `main_grad`
(cuBLAS with bf16 inputs, an fp32 C and beta = 1: `torch.addmm(..., out_dtype=float32)`), and
autograd receives an uninitialised dummy so the GradBuffer's per-parameter hook still fires (it
drives the bucketed all-reduce) but adds nothing. A weight takes this path only when it is marked
`fuse_wgrad` by its layer and has a `main_grad` (set by the GradBuffer); the hook reads the same mark.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


@torch.library.custom_op("megapar::accumulate_wgrad_", mutates_args=("main_grad",))
def accumulate_wgrad_(main_grad: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor) -> None:
    """main_grad [out, in] += grad_out^T [out, T] @ x [T, in], accumulated in main_grad's dtype."""
    if main_grad.is_cuda and grad_out.dtype != main_grad.dtype:
        torch.addmm(main_grad, grad_out.t(), x, out_dtype=main_grad.dtype, out=main_grad)
    else:  # CPU (no mixed-dtype GEMM) or an fp32 model
        main_grad.addmm_(grad_out.t().to(main_grad.dtype), x.to(main_grad.dtype))


@accumulate_wgrad_.register_fake
def _(main_grad: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor) -> None:
    return None


class _LinearAccumulateWgrad(torch.autograd.Function):
    """forward: x W^T + b; backward: dx = g W, W.main_grad += g^T x, db = sum(g), dW = dummy."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                main_grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.main_grad = main_grad  # not saved: every accumulation into the buffer bumps its version
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        main_grad = ctx.main_grad
        grad_x = grad_out.matmul(weight)                                       # [*, in]
        g2d = grad_out.reshape(-1, grad_out.shape[-1])                         # [T, out]
        accumulate_wgrad_(main_grad, g2d, x.reshape(-1, x.shape[-1]))         # [out, in] += [out, T] @ [T, in]
        grad_b = g2d.sum(0) if ctx.has_bias else None
        return grad_x, torch.empty_like(weight), grad_b, None


def linear(x: torch.Tensor, weight: torch.nn.Parameter, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear, with the weight gradient fused into `weight.main_grad` when the weight allows it."""
    if getattr(weight, "fuse_wgrad", False) and hasattr(weight, "main_grad") and weight.requires_grad \
            and torch.is_grad_enabled():
        return _LinearAccumulateWgrad.apply(x, weight, bias, weight.main_grad)
    return F.linear(x, weight, bias)


def wgrad_in_main_grad(p: torch.nn.Parameter) -> bool:
    """True when backward accumulates p's gradient into p.main_grad itself (p.grad is a dummy)."""
    return getattr(p, "fuse_wgrad", False)
