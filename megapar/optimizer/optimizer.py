"""The non-sharded optimizer: every data-parallel rank holds the fp32 master weights and Adam
moments of all its parameters and updates all of them (the shared step path, AdamW and the
checkpoint format: base.py).
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .base import OPTIM_KINDS
from .base import BaseOptimizer, Owned, adam_state
from .grad_buffer import GradBuffer


class MixedPrecisionOptimizer(BaseOptimizer):
    """Owns every parameter whole. Its gradient is `main_grad`, all-reduced over data parallelism;
    its master is the parameter itself for fp32 models, else an fp32 copy that is written back to
    the parameter after each step."""

    grad_buffer_mode = "all_reduce"

    def __init__(self, model: nn.Module, grad_buffer: GradBuffer, cfg, scaler, tp_rank: int,
                 norm_group: Optional[dist.ProcessGroup]):
        """norm_group: ranks whose gradients together form one full model (tp x pp; the data-parallel
        replicas hold the same reduced gradients)."""
        super().__init__(model, grad_buffer, cfg, scaler, tp_rank, norm_group)
        owned = []
        for n, p in self.named:
            master = p if p.dtype == torch.float32 else p.detach().float().clone()
            owned.append(Owned(n, p, master, p.main_grad, None if master is p else p))
        self._own(owned)
        # torch AdamW: (bf16/fp16 parameter, its master), copied after each step
        self.copies = [(p, m) for m, p in zip(self.masters, self.params) if p is not None]

    def optimizer_state_bytes(self) -> int:
        """Bytes of fp32 master weights and Adam moments this rank holds (the moments counted
        before the first step too): 12 bytes per parameter, on every data-parallel rank."""
        return sum(3 * 4 * p.numel() for _, p in self.named)

    def _publish_params(self, params_written: bool) -> None:
        """fp32 masters -> bf16/fp16 parameters in one multi-tensor copy (every rank updated all of
        them, so nothing is communicated)."""
        if not params_written and self.copies:
            with torch.no_grad():
                torch._foreach_copy_([p for p, _ in self.copies], [m for _, m in self.copies])

    def saved_tensors(self) -> Iterator[tuple[str, str, Optional[torch.Tensor]]]:
        """Every parameter's master and moments as they are (host copies of device tensors, zero
        moments before the first step)."""
        for (n, _), m in zip(self.named, self.masters):
            s = self.adam.state.get(m, {})
            yield n, "master_param", m.detach().float().cpu()
            for k in OPTIM_KINDS[1:]:
                yield n, k, s[k].detach().cpu() if k in s else torch.zeros(m.shape, dtype=torch.float32)

    def _load_state(self, state: dict, step: int) -> None:
        fused = bool(self.adam.defaults.get("fused"))
        with torch.no_grad():
            for (n, p), m in zip(self.named, self.masters):
                src = state[n]
                m.copy_(src["master_param"])
                if m is not p:
                    p.copy_(m)
                self.adam.state[m] = adam_state(step, src["exp_avg"].to(self.device, torch.float32).clone(),
                                                src["exp_avg_sq"].to(self.device, torch.float32).clone(), fused)

    def owned_state(self) -> list:
        fused = bool(self.adam.defaults.get("fused"))
        out = []
        for (n, p), m in zip(self.named, self.masters):
            s = self.adam.state.get(m)
            if not s:  # before the first step: zero moments, as AdamW would create them
                s = self.adam.state[m] = adam_state(0, torch.zeros_like(m, memory_format=torch.contiguous_format),
                                                    torch.zeros_like(m, memory_format=torch.contiguous_format), fused)
            views = {"master_param": m.detach().view(-1), "exp_avg": s["exp_avg"].view(-1),
                     "exp_avg_sq": s["exp_avg_sq"].view(-1)}
            out.append((n, p, 0, p.numel(), views))
        return out

    def _finish_load(self, step: int) -> None:
        fused = bool(self.adam.defaults.get("fused"))
        for m in self.masters:
            s = self.adam.state[m]
            self.adam.state[m] = adam_state(step, s["exp_avg"], s["exp_avg_sq"], fused)
        self._publish_params(params_written=False)
