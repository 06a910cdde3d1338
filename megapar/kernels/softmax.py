"""Scaled softmax with a causal or boolean (padding) mask: PyTorch reference and fused CUDA op.

Semantics (both implementations): probs = softmax(scale * scores) over the last dim, in fp32
math (float64 stays float64 in the reference), with masked positions (mask True, or above the
diagonal when causal) given probability 0. A row whose every position is masked gives zeros
(not NaN). The causal mask of the reference is bottom-right aligned (query i sees keys
0..i + sk - sq); the fused causal kernel needs sq == sk.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megapar.kernels import check_impl, load_fused_kernels


def _causal_mask(sq: int, sk: int, device: torch.device) -> Tensor:
    # [sq, sk] True above the (bottom-right aligned) diagonal
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1 + sk - sq)


def scaled_masked_softmax_reference(scores: Tensor, scale: float, mask: Optional[Tensor] = None,
                                    causal: bool = False) -> Tensor:
    """scores [b, np, sq, sk] -> probs, same dtype; mask bool broadcastable to [b, 1, sq, sk]."""
    compute = torch.float64 if scores.dtype == torch.float64 else torch.float32
    x = scores.to(compute) * scale
    sq, sk = scores.shape[-2:]
    masked: Optional[Tensor] = None
    if causal:
        masked = _causal_mask(sq, sk, scores.device)
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(f"megapar: softmax mask must be bool (True = masked out), got {mask.dtype}")
        masked = mask if masked is None else (mask | masked)
    if masked is None:
        return torch.softmax(x, dim=-1).to(scores.dtype)
    x = x.masked_fill(masked, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if mask is not None or sq > sk:  # only then can a row have no visible key: zeros, not NaN
        all_masked = masked.all(dim=-1, keepdim=True)
        probs = torch.where(all_masked, torch.zeros((), dtype=compute, device=scores.device), probs)
    return probs.to(scores.dtype)


def _fused_mask(mask: Tensor, scores: Tensor) -> Tensor:
    """Broadcastable bool mask -> contiguous [1 or b, 1, sq, sk] for the kernel."""
    b, _, sq, sk = scores.shape
    if mask.dtype != torch.bool:
        raise TypeError(f"megapar: softmax mask must be bool (True = masked out), got {mask.dtype}")
    if mask.device != scores.device:
        raise ValueError(f"megapar: mask is on {mask.device}, scores on {scores.device}")
    m = mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if m.dim() != 4 or m.size(1) != 1 or m.size(0) not in (1, b):
        raise ValueError(f"megapar: the fused softmax needs a mask broadcastable to [b, 1, sq, sk] "
                         f"without a per-head dimension; got {tuple(mask.shape)} for scores {tuple(scores.shape)}")
    return m.expand(m.size(0), 1, sq, sk).contiguous()


class FusedScaledMaskedSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: Tensor, scale: float, mask: Optional[Tensor], causal: bool) -> Tensor:
        ext = load_fused_kernels()
        probs = ext.scaled_masked_softmax_forward(scores.contiguous(), float(scale), mask, bool(causal))
        ctx.save_for_backward(probs)
        ctx.scale, ctx.causal = float(scale), bool(causal)
        return probs

    @staticmethod
    def backward(ctx, grad: Tensor):
        (probs,) = ctx.saved_tensors
        ext = load_fused_kernels()
        dx = ext.scaled_masked_softmax_backward(grad.contiguous(), probs, ctx.scale, ctx.causal)
        return dx, None, None, None


def scaled_masked_softmax(scores: Tensor, scale: float, mask: Optional[Tensor] = None, causal: bool = False,
                          impl: str = "torch") -> Tensor:
    """softmax(scale * scores) with masking; impl 'torch' (reference) or 'fused' (CUDA, errors if unavailable)."""
    check_impl(impl, "softmax")
    if scores.dim() != 4:
        raise ValueError(f"megapar: scores must be [b, np, sq, sk], got {tuple(scores.shape)}")
    if impl == "torch":
        return scaled_masked_softmax_reference(scores, scale, mask, causal)
    if not scores.is_cuda:
        raise RuntimeError(f"megapar: the fused softmax was requested for a tensor on {scores.device}; "
                           "it runs on CUDA tensors only")
    if causal and scores.size(-2) != scores.size(-1):
        raise ValueError(f"megapar: the fused causal softmax needs sq == sk, got {tuple(scores.shape)}")
    m = _fused_mask(mask, scores) if mask is not None else None
    return FusedScaledMaskedSoftmax.apply(scores, scale, m, causal)
