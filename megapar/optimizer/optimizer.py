"""AdamW with fp32 master weights and fp32 gradients from the GradBuffer.

    step():  [fp16] unscale grads, detect inf/nan on any rank -> skip everywhere
             clip by the global norm (TP/PP/DP aware, replicated params counted once)
             AdamW on fp32 masters -> copy into the model's bf16/fp16/fp32 params

No weight decay on biases and LayerNorm parameters (every 1-D parameter). Optimizer state is
saved keyed by parameter name, so checkpoints can be resharded to any layout.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..model.sharding import tp_partition_dim
from .grad_buffer import GradBuffer


def no_weight_decay(name: str, p: nn.Parameter) -> bool:
    return p.ndim < 2


def counts_for_norm(name: str, tp_rank: int) -> bool:
    """Count each distinct gradient once in the global norm: TP-replicated tensors only on TP
    rank 0; the last stage's copy of the word embeddings never (the first stage counts it)."""
    if name.startswith("word_embeddings_for_head"):
        return False
    return tp_partition_dim(name) is not None or tp_rank == 0


def make_adamw(groups: list[dict], cfg, device: torch.device) -> torch.optim.AdamW:
    """Fused AdamW on GPUs (foreach on CPU). With --enable-cuda-graph it is capturable and its
    learning rate is a device tensor (the LR scheduler fills it in place; cuda_graph.py)."""
    kw = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    if device.type == "cuda":
        kw["fused"] = True
    else:
        kw["foreach"] = True
    if getattr(cfg, "enable_cuda_graph", False):
        kw.update(capturable=True, lr=torch.tensor(cfg.lr, dtype=torch.float32, device=device))
    return torch.optim.AdamW(groups, **kw)


def saved_param_groups(adam: torch.optim.Optimizer) -> list[dict]:
    """The hyper-parameters of each param group for a checkpoint (plain numbers, no tensors)."""
    return [{k: (v.item() if torch.is_tensor(v) else v) for k, v in g.items() if k != "params"}
            for g in adam.param_groups]


def decay_groups(items: list[tuple[str, nn.Parameter, torch.Tensor]], cfg) -> list[dict]:
    """Two AdamW param groups over the optimizer tensors of (name, model param, tensor) items:
    with weight decay, and without it (every 1-D model parameter: biases, LayerNorm)."""
    return [{"params": [t for n, p, t in items if not no_weight_decay(n, p)], "weight_decay": cfg.weight_decay},
            {"params": [t for n, p, t in items if no_weight_decay(n, p)], "weight_decay": 0.0}]


def unscale_and_check(grads: list[torch.Tensor], scale: float, device: torch.device,
                      inf_group: Optional[dist.ProcessGroup]) -> bool:
    """Multiply grads by 1/scale in place; True if any rank of inf_group saw inf/nan (collective
    when torch.distributed is initialised, so every rank must call it, even with no grads)."""
    found = torch.zeros(1, device=device)
    if grads:
        inv = torch.full((1,), 1.0 / scale, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
    if dist.is_initialized():
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=inf_group)
    return bool(found.item())


def clip_grads_(grads: list[torch.Tensor], norm: torch.Tensor, clip_grad: float, adam: torch.optim.AdamW) -> None:
    """Make the global gradient norm `norm` (a device tensor) at most clip_grad (0: off), without a
    host sync: grads are divided by max(1, (norm + 1e-6) / clip_grad), inside the fused AdamW
    kernel (its `grad_scale`, read by the next adam.step()) or by one foreach division."""
    if clip_grad <= 0:
        return
    divisor = ((norm + 1e-6) / clip_grad).clamp(min=1.0)
    if adam.defaults.get("fused"):
        adam.grad_scale = divisor
    elif grads:
        torch._foreach_div_(grads, divisor)


def resolve_adam_impl(impl: str, device: torch.device) -> str:
    """--adam-impl auto -> "fused" on GPUs when the csrc kernels were built at install (as Megatron
    takes apex's FusedAdam when it is importable), else "torch"; an explicit choice stays."""
    if impl != "auto":
        return impl
    from ..kernels import aot_kernels_installed
    return "fused" if device.type == "cuda" and aot_kernels_installed() else "torch"


def fused_adamw(adam: torch.optim.AdamW, grad_and_param: dict[int, tuple[torch.Tensor, Optional[torch.Tensor]]]):
    """csrc's one-launch AdamW (--adam-impl fused) over `adam`'s param groups; torch's AdamW object
    keeps the groups (LR schedule) and the state (checkpoints). grad_and_param[id(master)]: the
    master's gradient and the model tensor to write (None: the master is the parameter). Moments
    missing from the state start at zero; every parameter's state then shares one step tensor."""
    from ..kernels.adamw import MultiTensorAdamW
    masters = [m for g in adam.param_groups for m in g["params"]]
    seen = [adam.state[m]["step"] for m in masters if "step" in adam.state.get(m, {})]
    step = torch.tensor(float(seen[0]) if seen else 0.0, dtype=torch.float32, device=masters[0].device)
    groups = []
    for g in adam.param_groups:
        entries = []
        for m in g["params"]:
            s = adam.state[m]
            if "exp_avg" not in s:
                s.update(exp_avg=torch.zeros_like(m), exp_avg_sq=torch.zeros_like(m))
            s["step"] = step
            grad, param = grad_and_param[id(m)]
            entries.append((m, grad, s["exp_avg"], s["exp_avg_sq"], param))
        groups.append((entries, g["weight_decay"]))
    return MultiTensorAdamW(groups, adam.defaults["betas"], adam.defaults["eps"], step)


def adamw_update(adam: torch.optim.AdamW, impl: str, fused, masters: list[torch.Tensor], grads: list[torch.Tensor],
                 params: list[Optional[torch.Tensor]]):
    """One AdamW update of `masters` from `grads` (after clipping). impl "fused": csrc's kernel,
    which also writes `params` (the model's bf16/fp16 tensors, None where the master is the
    parameter); pass the returned kernel object back as `fused` (built here on first use).
    impl "torch": torch's AdamW, with .grad attached for the step only (with fp32 models the master
    *is* the parameter, and a standing .grad would make autograd accumulate into it); the caller
    copies the masters into `params`. Returns the kernel object (None for torch)."""
    if impl == "fused":
        if fused is None:
            fused = fused_adamw(adam, {id(m): (g, p) for m, g, p in zip(masters, grads, params)})
        fused.step([g["lr"] for g in adam.param_groups], getattr(adam, "grad_scale", None))
        return fused
    for m, g in zip(masters, grads):
        m.grad = g
    adam.step()
    for m in masters:
        m.grad = None
    return None


def adam_state(step: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, fused: bool) -> dict:
    """One parameter's torch AdamW state (the step tensor lives where torch expects it)."""
    device = exp_avg.device if fused else "cpu"
    return {"step": torch.tensor(float(step), dtype=torch.float32, device=device),
            "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def global_norm(tensors: list[torch.Tensor], group: Optional[dist.ProcessGroup], device) -> torch.Tensor:
    """L2 norm of all `tensors` of every rank of `group` (one multi-tensor kernel locally), as a
    0-dim fp32 device tensor (no host sync)."""
    total = torch.zeros(1, dtype=torch.float32, device=device)
    if tensors:
        total += torch.stack(torch._foreach_norm(tensors)).float().square().sum()
    if group is not None:
        dist.all_reduce(total, group=group)
    return total.sqrt().reshape(())


class MixedPrecisionOptimizer:
    """Full (non-sharded) optimizer: every data-parallel rank holds all masters and moments."""

    def __init__(self, model: nn.Module, grad_buffer: GradBuffer, cfg, scaler, tp_rank: int,
                 norm_group: Optional[dist.ProcessGroup], inf_group: Optional[dist.ProcessGroup]):
        """norm_group: ranks whose gradients together form one full model (tp x pp);
        inf_group: every rank (an overflow anywhere skips the step everywhere)."""
        self.cfg, self.buffer, self.scaler = cfg, grad_buffer, scaler
        self.norm_group, self.inf_group = norm_group, inf_group
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.device = self.named[0][1].device
        self.masters = {n: (p if p.dtype == torch.float32 else p.detach().float().clone()) for n, p in self.named}
        self.adam = make_adamw(decay_groups([(n, p, self.masters[n]) for n, p in self.named], cfg), cfg, self.device)
        # Fixed for the run (main_grad views never move): built once, not per step.
        self.grads = [p.main_grad for _, p in self.named]
        self.norm_grads = [p.main_grad for n, p in self.named if counts_for_norm(n, tp_rank)]
        self.master_list = [self.masters[n] for n, _ in self.named]
        self.params = [None if m is p else p for m, (_, p) in zip(self.master_list, self.named)]  # fused AdamW writes
        self.copies = [(p, m) for m, p in zip(self.master_list, self.params) if p is not None]    # torch AdamW: after
        self.adam_impl = resolve_adam_impl(cfg.adam_impl, self.device)
        self.fused_adam = None  # --adam-impl fused: built at the first step (after a checkpoint load)

    @property
    def param_groups(self) -> list[dict]:
        return self.adam.param_groups

    # ---- step ------------------------------------------------------------------------
    def step(self) -> tuple[bool, torch.Tensor]:
        """Returns (applied, grad_norm as a device tensor). applied is False when fp16 overflow
        skipped the step."""
        if self.cfg.fp16:
            found_inf = unscale_and_check(self.grads, self.scaler.scale, self.device, self.inf_group)
            self.scaler.update(found_inf)
            if found_inf:
                return False, torch.full((), float("nan"), device=self.device)
        norm = global_norm(self.norm_grads, self.norm_group, self.device)
        clip_grads_(self.grads, norm, self.cfg.clip_grad, self.adam)
        self._adam_step()
        return True, norm

    def optimizer_state_bytes(self) -> int:
        """Bytes of fp32 master weights and Adam moments this rank holds (the moments counted
        before the first step too): 12 bytes per parameter, on every data-parallel rank."""
        return sum(3 * 4 * p.numel() for _, p in self.named)

    def _adam_step(self) -> None:
        self.fused_adam = adamw_update(self.adam, self.adam_impl, self.fused_adam, self.master_list, self.grads,
                                       self.params)
        if self.fused_adam is None and self.copies:  # fp32 masters -> bf16/fp16 params, one multi-tensor kernel
            with torch.no_grad():
                torch._foreach_copy_([p for p, _ in self.copies], [m for _, m in self.copies])

    # ---- checkpoint state (keyed by parameter name) ------------------------------------
    def state_for_save(self) -> dict:
        state = {}
        for n, _ in self.named:
            m = self.masters[n]
            s = self.adam.state.get(m, {})
            state[n] = {"master_param": m.detach().float().cpu().clone(),
                        "exp_avg": s["exp_avg"].cpu().clone() if "exp_avg" in s else torch.zeros_like(m, device="cpu"),
                        "exp_avg_sq": s["exp_avg_sq"].cpu().clone() if "exp_avg_sq" in s else torch.zeros_like(m, device="cpu")}
        return {"state": state, "step": self._step_count(), "grad_scaler": self.scaler.state_dict(),
                "param_groups": saved_param_groups(self.adam)}

    def _step_count(self) -> int:
        for s in self.adam.state.values():
            return int(s["step"])
        return 0

    def load_saved_state(self, saved: dict, load_moments: bool = True) -> None:
        self.fused_adam = None  # its tables point at the moments replaced below
        missing = [n for n, _ in self.named if n not in saved["state"]]
        if missing:
            raise ValueError(f"optimizer state in checkpoint lacks parameters {missing[:3]}...")
        with torch.no_grad():
            for n, p in self.named:
                src = saved["state"][n]
                self.masters[n].copy_(src["master_param"])
                if self.masters[n] is not p:
                    p.copy_(self.masters[n])
                if load_moments:
                    self.adam.state[self.masters[n]] = adam_state(
                        saved["step"], src["exp_avg"].to(self.device, torch.float32).clone(),
                        src["exp_avg_sq"].to(self.device, torch.float32).clone(), bool(self.adam.defaults.get("fused")))
        self.scaler.load_state_dict(saved["grad_scaler"])
