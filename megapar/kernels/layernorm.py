"""LayerNorm over the last dim: PyTorch reference (fp32 math for half inputs) and the fused
CUDA op, plus a fused residual-add + LayerNorm. `LayerNorm` keeps the parameter names
`weight` and `bias` (checkpoint keys)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from megapar.kernels import check_impl, load_fused_kernels


def layer_norm_reference(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias in fp32 (float64 stays float64); x's dtype out."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(compute)
    mean = xf.mean(dim=-1, keepdim=True)
    var = (xf - mean).pow(2).mean(dim=-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps) * weight.to(compute) + bias.to(compute)
    return y.to(x.dtype)


class FusedLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
        ext = load_fused_kernels()
        x = x.contiguous()
        y, mean, rstd = ext.layer_norm_forward(x, None, weight.contiguous(), bias.contiguous(), float(eps))
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = load_fused_kernels().layer_norm_backward(grad.contiguous(), x, mean, rstd, weight.contiguous(),
                                                              None)
        return dx, dw, db, None


class FusedAddLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor, eps: float):
        ext = load_fused_kernels()
        y, s, mean, rstd = ext.layer_norm_forward(x.contiguous(), residual.contiguous(), weight.contiguous(),
                                                  bias.contiguous(), float(eps))
        ctx.save_for_backward(s, weight, mean, rstd)
        return y, s

    @staticmethod
    def backward(ctx, grad_y: Optional[Tensor], grad_s: Optional[Tensor]):
        s, weight, mean, rstd = ctx.saved_tensors
        if grad_y is None:
            grad_y = torch.zeros_like(s)
        ds = grad_s.contiguous() if grad_s is not None else None
        dx, dw, db = load_fused_kernels().layer_norm_backward(grad_y.contiguous(), s, mean, rstd, weight.contiguous(),
                                                              ds)
        return dx, dx, dw, db, None


def _check_fused(x: Tensor) -> None:
    if not x.is_cuda:
        raise RuntimeError(f"megapar: the fused LayerNorm was requested for a tensor on {x.device}; "
                           "it runs on CUDA tensors only")


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float, impl: str = "torch") -> Tensor:
    """LayerNorm over the last dim; impl 'torch' (reference) or 'fused' (CUDA, errors if unavailable)."""
    check_impl(impl, "layernorm")
    if impl == "torch":
        return layer_norm_reference(x, weight, bias, eps)
    _check_fused(x)
    # Parameters follow the activation dtype (e.g. fp32 master params under autocast); the
    # cast is differentiable, so their gradients come back in their own dtype.
    return FusedLayerNorm.apply(x, weight.to(x.dtype), bias.to(x.dtype), eps)


def fused_add_layer_norm(x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor, eps: float,
                         impl: str = "torch") -> Tuple[Tensor, Tensor]:
    """(layer_norm(x + residual), x + residual); the sum is rounded to x's dtype before normalizing."""
    check_impl(impl, "layernorm")
    if impl == "torch":
        s = x + residual
        return layer_norm_reference(s, weight, bias, eps), s
    _check_fused(x)
    if residual.dtype != x.dtype or residual.shape != x.shape:
        raise ValueError(f"megapar: residual {residual.dtype}{tuple(residual.shape)} must match x "
                         f"{x.dtype}{tuple(x.shape)} for the fused add + LayerNorm")
    return FusedAddLayerNorm.apply(x, residual, weight.to(x.dtype), bias.to(x.dtype), eps)


class LayerNorm(torch.nn.Module):
    """torch.nn.LayerNorm over the last dim with a selectable implementation ('torch' | 'fused')."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, impl: str = "torch") -> None:
        super().__init__()
        check_impl(impl, "layernorm")
        if impl == "fused":
            load_fused_kernels()  # fail at construction, not at the first step
        self.hidden_size, self.eps, self.impl = hidden_size, eps, impl
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, self.impl)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, impl={self.impl}"
