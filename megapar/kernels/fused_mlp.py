"""The MLP's GEMMs with the tanh GELU fused in: PyTorch references and cuBLASLt ops.

    h, pre = linear_gelu_forward(x, w, b)            pre = x @ w^T + b,  h = gelu(pre)
    g_pre, g_b = linear_dgelu_backward(g, w2, pre)   g_pre = gelu'(pre) * (g @ w2),  g_b = g_pre.sum(0)

x [T, in], w [out, in], b [out] (nn.Linear layout); g [T, o2] is the gradient of the second
linear's output and w2 [o2, f] its weight, so g @ w2 is the gradient of h; pre [T, f]. gelu is the
tanh approximation (F.gelu(approximate="tanh")). On CUDA bf16/fp16 tensors each op is one cuBLASLt
GEMM with the GELU in its epilogue (csrc/fused_mlp.cu, fp32 accumulation); on anything else the
reference runs (fp32 math, fp64 for fp64 inputs). Both are torch.library custom ops with fake
implementations, so they stay single nodes inside torch.compile graphs.

Dtypes: h, pre and g_pre have the input dtype; g_b is fp32 (fp64 for fp64 inputs). cuBLASLt writes
the bias gradient in the GEMM's output dtype (fp32 is not a documented bias type for bf16/fp16
GEMMs), so for bf16/fp16 inputs it is rounded to that dtype before the fp32 result; the reference
rounds it the same way.
"""
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from megapar.kernels import load_fused_kernels

_HALF = (torch.bfloat16, torch.float16)


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _check_2d(**tensors: Tensor) -> None:
    for name, t in tensors.items():
        if t.dim() != 2:
            raise ValueError(f"megapar: {name} must be 2-D, got shape {tuple(t.shape)}")


def gelu_tanh_grad(pre: Tensor) -> Tensor:
    """d/dx of gelu_tanh(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3)."""
    k = math.sqrt(2.0 / math.pi)
    t = torch.tanh(k * (pre + 0.044715 * pre * pre * pre))
    return 0.5 * (1.0 + t) + 0.5 * pre * (1.0 - t * t) * k * (1.0 + 3 * 0.044715 * pre * pre)


def linear_gelu_forward_reference(x: Tensor, w: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """(h, pre) in x's dtype, computed in fp32 (fp64 for fp64 inputs)."""
    c = _compute_dtype(x)
    pre = F.linear(x.to(c), w.to(c), b.to(c))                    # [T, out]
    h = F.gelu(pre, approximate="tanh")                          # [T, out]
    return h.to(x.dtype), pre.to(x.dtype)


def linear_dgelu_backward_reference(grad: Tensor, w2: Tensor, pre: Tensor) -> tuple[Tensor, Tensor]:
    """(grad_pre in grad's dtype, bias_grad fp32 or fp64), computed in fp32 (fp64 for fp64 inputs)."""
    c = _compute_dtype(grad)
    grad_h = grad.to(c) @ w2.to(c)                               # [T, f]
    grad_pre = gelu_tanh_grad(pre.to(c)) * grad_h                # [T, f]
    bias_grad = grad_pre.sum(0)                                  # [f]
    if grad.dtype in _HALF:
        bias_grad = bias_grad.to(grad.dtype)                     # as the cuBLASLt epilogue stores it
    return grad_pre.to(grad.dtype), bias_grad.to(c)


def _fused(t: Tensor) -> bool:
    return t.is_cuda and t.dtype in _HALF


@torch.library.custom_op("megapar::linear_gelu_forward", mutates_args=())
def linear_gelu_forward(x: Tensor, w: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """(h, pre) = (gelu_tanh(x @ w^T + b), x @ w^T + b); x [T, in], w [out, in], b [out]."""
    _check_2d(x=x, w=w)
    if _fused(x):  # the extension checks the rest (dtypes equal, out % 8 == 0, 16-byte alignment)
        h, pre = load_fused_kernels().linear_gelu_forward(x.contiguous(), w.contiguous(), b.contiguous())
        return h, pre
    return linear_gelu_forward_reference(x, w, b)


@linear_gelu_forward.register_fake
def _(x: Tensor, w: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    _check_2d(x=x, w=w)
    h = x.new_empty(x.shape[0], w.shape[0])                      # [T, out]
    return h, torch.empty_like(h)


@torch.library.custom_op("megapar::linear_dgelu_backward", mutates_args=())
def linear_dgelu_backward(grad: Tensor, w2: Tensor, pre: Tensor) -> tuple[Tensor, Tensor]:
    """(grad_pre, bias_grad) = (gelu_tanh'(pre) * (grad @ w2), grad_pre.sum(0));
    grad [T, o2], w2 [o2, f], pre [T, f]."""
    _check_2d(grad=grad, w2=w2, pre=pre)
    if _fused(grad):  # the extension checks the rest (dtypes equal, f % 8 == 0, 16-byte alignment)
        grad_pre, bias_grad = load_fused_kernels().linear_dgelu_backward(grad.contiguous(), w2.contiguous(),
                                                                         pre.contiguous())
        return grad_pre, bias_grad
    return linear_dgelu_backward_reference(grad, w2, pre)


@linear_dgelu_backward.register_fake
def _(grad: Tensor, w2: Tensor, pre: Tensor) -> tuple[Tensor, Tensor]:
    _check_2d(grad=grad, w2=w2, pre=pre)
    grad_pre = grad.new_empty(grad.shape[0], w2.shape[1])       # [T, f]
    return grad_pre, grad.new_empty(w2.shape[1], dtype=_compute_dtype(grad))


__all__ = ["linear_gelu_forward", "linear_dgelu_backward", "linear_gelu_forward_reference",
           "linear_dgelu_backward_reference", "gelu_tanh_grad"]
