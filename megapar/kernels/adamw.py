"""AdamW on fp32 master weights that also writes the model's bf16/fp16 parameters: the csrc
multi-tensor kernel (one launch per step) and its PyTorch reference.

Each entry is one parameter (or a ZeRO-1 part of one): (master, grad, exp_avg, exp_avg_sq, param),
all flat-compatible views of the same numel; master, grad and moments fp32, param the model's
bf16/fp16 tensor or None (fp32 model: the master is the parameter). The update is torch's AdamW:

    g = grad / grad_scale                      (grad_scale: global-norm clipping and fp16's loss scale, or 1)
    master *= 1 - lr * weight_decay
    exp_avg = b1 * exp_avg + (1 - b1) g;       exp_avg_sq = b2 * exp_avg_sq + (1 - b2) g^2
    master -= lr / (1 - b1^t) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - b2^t) + eps)
    param = master  (rounded to the model dtype)

The gradients are read, not written (torch's fused AdamW writes them back unscaled).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from . import load_fused_kernels

Entry = tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]  # master, grad, exp_avg, exp_avg_sq, param
LR = Union[float, Tensor]


@torch.no_grad()
def adamw_reference(groups: Sequence[tuple[list[Entry], float]], lrs: Sequence[LR], step: Tensor,
                    grad_scale: Optional[Tensor], beta1: float, beta2: float, eps: float) -> None:
    """The update above in PyTorch ops, in place. groups: (entries, weight_decay); step: the new
    step number (already incremented), a 0-dim or [1] tensor."""
    t = float(step)
    for (entries, wd), lr in zip(groups, lrs):
        lr = float(lr)
        step_size, bc2_sqrt = lr / (1 - beta1 ** t), (1 - beta2 ** t) ** 0.5
        for master, grad, m, v, param in entries:
            g = grad.view_as(master) if grad_scale is None else grad.view_as(master) / grad_scale
            master.mul_(1 - lr * wd)
            m.mul_(beta1).add_(g, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            master.addcdiv_(m, v.sqrt().div_(bc2_sqrt).add_(eps), value=-step_size)
            if param is not None:
                param.view_as(master).copy_(master)


def _vectorizable(e: Entry) -> bool:
    """16-byte fp32 / 8-byte low-precision accesses of 4 elements are aligned for every pointer."""
    master, grad, m, v, param = e
    return all(t.data_ptr() % 16 == 0 for t in (master, grad, m, v)) and (param is None or param.data_ptr() % 8 == 0)


def _check(e: Entry, device: torch.device) -> None:
    master, grad, m, v, param = e
    for name, t in (("master", master), ("grad", grad), ("exp_avg", m), ("exp_avg_sq", v)):
        if t.dtype != torch.float32 or t.device != device or not t.is_contiguous() or t.numel() != master.numel():
            raise ValueError(f"fused AdamW: {name} must be a contiguous float32 tensor on {device} with "
                             f"{master.numel()} elements, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if param is not None and (param.dtype not in (torch.bfloat16, torch.float16) or param.device != device
                              or not param.is_contiguous() or param.numel() != master.numel()):
        raise ValueError(f"fused AdamW: the model parameter must be a contiguous bf16/fp16 tensor on {device} "
                         f"with {master.numel()} elements, got {param.dtype} {tuple(param.shape)}")


class MultiTensorAdamW:
    """The csrc kernel over fixed entries: tables of raw pointers are built here once (the
    tensors must stay where they are, as CUDA graphs need anyway), so step() is two tiny
    device-side copies (learning rates, step number) and one launch, and can be captured."""

    def __init__(self, groups: Sequence[tuple[list[Entry], float]], betas: tuple[float, float], eps: float,
                 step: Tensor):
        """groups: (entries, weight_decay) per AdamW param group; step: fp32 [1] device tensor
        holding the number of steps taken (incremented by step())."""
        self.kernels = load_fused_kernels()
        self.betas, self.eps, self.step_count = betas, eps, step
        device = step.device
        entries = [(e, gi) for gi, (es, _) in enumerate(groups) for e in es if e[0].numel() > 0]
        dtypes = {e[4].dtype for e, _ in entries if e[4] is not None}
        if len(dtypes) > 1 or (dtypes and any(e[4] is None for e, _ in entries)):
            raise ValueError(f"fused AdamW: every parameter must have the same dtype, got {dtypes}")
        self.param_dtype = str(dtypes.pop() if dtypes else torch.float32).removeprefix("torch.")
        rows, chunks, size = [], [], self.kernels.adamw_chunk_elems
        for i, (e, gi) in enumerate(entries):
            _check(e, device)
            n = e[0].numel()
            rows.append([*(0 if t is None else t.data_ptr() for t in e), n, gi, int(_vectorizable(e))])
            chunks.extend([i, s] for s in range(0, n, size))
        self.tensors = torch.tensor(rows, dtype=torch.int64).reshape(-1, self.kernels.adamw_table_cols).to(device)
        self.chunks = torch.tensor(chunks, dtype=torch.int64).reshape(-1, 2).to(device)
        self.hyper = torch.tensor([[0.0, wd] for _, wd in groups], dtype=torch.float32, device=device)
        self.weight_decays = [wd for _, wd in groups]  # what `hyper` holds (step() rewrites a changed one)
        self._keep = entries  # the tables point into these tensors

    @torch.no_grad()
    def step(self, lrs: Sequence[LR], grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None,
             weight_decays: Optional[Sequence[float]] = None) -> None:
        """One AdamW update with these learning rates (per group: a float, or a device tensor that
        a captured step reads at replay) and, when given, weight decays (per group; a changed one
        is written before the launch: --weight-decay-incr-style, never inside a capture). found_inf:
        a one-element fp32 device tensor, nonzero when an fp16 overflow skips this update (torch's
        fused AdamW's argument of that name): nothing is written and the step number stays, decided
        on the device."""
        for i, lr in enumerate(lrs):
            if torch.is_tensor(lr):
                self.hyper[i, 0].copy_(lr)
            else:
                self.hyper[i, 0].fill_(lr)
        for i, wd in enumerate(weight_decays or ()):
            if wd != self.weight_decays[i]:
                self.hyper[i, 1].fill_(wd)
                self.weight_decays[i] = wd
        self.step_count.add_(1)
        if found_inf is not None:
            self.step_count.sub_(found_inf.reshape(self.step_count.shape))
            found_inf = found_inf.reshape(1).float()
        self.kernels.adamw_step(self.tensors, self.chunks, self.hyper, self.step_count,
                                None if grad_scale is None else grad_scale.reshape(1).float(), found_inf,
                                self.betas[0], self.betas[1], self.eps, self.param_dtype)
