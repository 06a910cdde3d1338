"""What every megapar optimizer shares: AdamW on fp32 master weights, fed by the GradBuffer's fp32
gradients, and one step path (`BaseOptimizer.step`):

    1. reduce grads    the GradBuffer reduces during backward and in `grad_buffer.finish()`, which
                       the caller runs before step(), in the optimizer's `grad_buffer_mode`
    2. norm            L2 norm of the gradients this rank counts, summed over norm_group
    3. overflow        [fp16] the gradients still carry the loss scale: a non-finite norm (the same
                       on every rank) is an overflow, which skips the step on every rank and backs
                       the scaler off; the norm is divided by the scale (under a CUDA graph the
                       skip happens inside AdamW and the scaler updates after the step)
    4. clip            gradients /= max(1, norm / clip_grad) [fp16: and /= scale], without a host
                       sync, inside AdamW or by one foreach division
    5. step            AdamW on the masters this rank owns (torch's, or csrc's fused kernel)
    6. publish         the model parameters take the new masters' values on every rank

Subclasses differ only in what a rank owns and how it comes back together: the non-sharded
MixedPrecisionOptimizer (optimizer.py) owns every parameter; the DistributedOptimizer of ZeRO
stages 1-3 (distrib_optimizer.py) owns 1/dp of every bucket, reads the reduced gradients from
whichever gradient buffer the stage uses and publishes into whole buckets or ZeRO-3 shards; with
CPU offload its masters and moments live on the host (`step_grads` are host copies, made by
`_stage_grads` between the norm and the clipping).

No weight decay on biases and LayerNorm parameters (every 1-D parameter). Checkpoints hold the
full optimizer state keyed by parameter name, so they load at any layout and into either optimizer.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Iterator, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.adamw import adamw as adamw_functional

from ..config.settings import TrainConfig
from ..model.sharding import tp_partition_dim
from .grad_buffer import GradBuffer

if TYPE_CHECKING:
    from .nvme import NvmeState

# The optimizer state of each parameter, in file order: {"state": {name: {kind: fp32 tensor}}, ...}
OPTIM_KINDS = ("master_param", "exp_avg", "exp_avg_sq")


# ---- AdamW ---------------------------------------------------------------------------------------
def no_weight_decay(name: str, p: nn.Parameter) -> bool:
    return p.ndim < 2


def counts_for_norm(name: str, tp_rank: int) -> bool:
    """Count each distinct gradient once in the global norm: TP-replicated tensors only on TP
    rank 0; the last stage's copy of the word embeddings never (the first stage counts it)."""
    if name.startswith("word_embeddings_for_head") or ".word_embeddings_for_head." in name:  # model{j}. chunks
        return False
    return tp_partition_dim(name) is not None or tp_rank == 0


def make_adamw(groups: list[dict], cfg: TrainConfig, device: torch.device,
               cpu_fused: bool = False) -> torch.optim.AdamW:
    """Fused AdamW on GPUs (foreach on CPU, or torch's vectorised fused CPU kernel with
    `cpu_fused`: the offloaded step). With --enable-cuda-graph it is capturable and its learning
    rate is a device tensor (the LR scheduler fills it in place; cuda_graph.py)."""
    kw = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    if device.type == "cuda" or cpu_fused:
        kw["fused"] = True
    else:
        kw["foreach"] = True
    if cfg.enable_cuda_graph:
        kw.update(capturable=True, lr=torch.tensor(cfg.lr, dtype=torch.float32, device=device))
    return torch.optim.AdamW(groups, **kw)


def saved_param_groups(adam: torch.optim.Optimizer) -> list[dict]:
    """The hyper-parameters of each param group for a checkpoint (plain numbers, no tensors)."""
    return [{k: (v.item() if torch.is_tensor(v) else v) for k, v in g.items() if k != "params"}
            for g in adam.param_groups]


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
        fused.step([g["lr"] for g in adam.param_groups], getattr(adam, "grad_scale", None),
                   getattr(adam, "found_inf", None), [g["weight_decay"] for g in adam.param_groups])
        return fused
    for m, g in zip(masters, grads):
        m.grad = g
    adam.step()
    for m in masters:
        m.grad = None
    return None


def adamw_group_update(group: dict, masters: list[torch.Tensor], grads: list[torch.Tensor],
                       exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor],
                       grad_scale: Optional[torch.Tensor] = None) -> None:
    """What `adam.step()` does for the tensors of param group `group`, on given tensors: AdamW with
    the group's hyper-parameters (and the clipping's divisor `grad_scale`, the AdamW object's
    `grad_scale`) on `masters` and their moments, each of whose step counts `steps` (from
    adam.state) goes up by one. For state stepped a chunk at a time (the offloaded step) and from a
    snapshot of the group (the delayed update runs while the LR schedule moves on); elementwise, so
    updating the tensors in any grouping gives the bits one `adam.step()` over all of them would."""
    beta1, beta2 = group["betas"]
    adamw_functional(masters, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=group["foreach"],
                     capturable=group["capturable"], differentiable=group["differentiable"],
                     fused=group["fused"], grad_scale=grad_scale, found_inf=None, amsgrad=group["amsgrad"],
                     beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                     maximize=group["maximize"])


def adam_state(step: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, fused: bool) -> dict:
    """One parameter's torch AdamW state (the step tensor lives where torch expects it)."""
    device = exp_avg.device if fused else "cpu"
    return {"step": torch.tensor(float(step), dtype=torch.float32, device=device),
            "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


# ---- the shared step: norm, overflow, clip ----------------------------------------------------------
def global_norm(tensors: list[torch.Tensor], group: Optional[dist.ProcessGroup], device) -> torch.Tensor:
    """L2 norm of all `tensors` of every rank of `group` (one multi-tensor kernel locally), as a
    0-dim fp32 device tensor (no host sync)."""
    total = torch.zeros(1, dtype=torch.float32, device=device)
    if tensors:  # (host tensors, such as offloaded masters, are summed where they are)
        total += torch.stack(torch._foreach_norm(tensors)).float().square().sum().to(device)
    if group is not None:
        dist.all_reduce(total, group=group)
    return total.sqrt().reshape(())


def clip_grads_(grads: list[torch.Tensor], norm: torch.Tensor, clip_grad: float, adam: torch.optim.AdamW,
                loss_scale: Optional[torch.Tensor] = None) -> None:
    """Make the global gradient norm `norm` (a device tensor) at most clip_grad (0: off), without a
    host sync: grads are divided by max(1, (norm + 1e-6) / clip_grad), inside the fused AdamW
    kernel (its `grad_scale`, read by the next adam.step()) or by one foreach division.
    loss_scale: a device tensor the grads are still multiplied by (`norm` is already the unscaled
    one); it is divided out in the same place."""
    divisor = ((norm + 1e-6) / clip_grad).clamp(min=1.0) if clip_grad > 0 else None
    if loss_scale is not None:
        divisor = loss_scale if divisor is None else divisor * loss_scale
    if divisor is None:
        return
    step_device = adam.param_groups[0]["params"][0].device if adam.param_groups[0]["params"] else norm.device
    divisor = divisor.to(step_device)  # offload: the step runs on the CPU
    if adam.defaults.get("fused"):
        adam.grad_scale = divisor
    elif grads:
        torch._foreach_div_(grads, divisor)


# ---- the base class --------------------------------------------------------------------------------
class Owned(NamedTuple):
    """One tensor AdamW updates on this rank: a whole parameter, or the part of one this rank owns."""
    name: str                     # the model parameter's name (weight decay, norm counting)
    param: nn.Parameter           # the model parameter it belongs to
    master: torch.Tensor          # fp32 weights AdamW updates (its state is keyed by this tensor)
    grad: torch.Tensor            # the matching reduced fp32 gradient, a view of the GradBuffer
    model_tensor: Optional[torch.Tensor]  # the bf16/fp16 model weights the fused AdamW writes; None: fp32,
                                          # the master is the model's tensor


class BaseOptimizer(ABC):
    """AdamW with fp32 masters; `step()` runs the shared path of the module docstring.

    A subclass
      * sets `grad_buffer_mode`: how the GradBuffer must reduce ("all_reduce": every rank gets
        every averaged gradient; "reduce_scatter": each rank only its owned ranges);
      * in __init__, calls super().__init__(), lays out its state, then `self._own(owned)` with
        the tensors this rank updates, in a fixed order (it fixes the norm's summation order);
      * implements `_publish_params(params_written)`: after the update, make every model parameter
        equal its master on every rank (`params_written`: the fused AdamW already wrote this
        rank's `model_tensor`s);
      * implements `saved_tensors()` and `_load_state(state, step)`: the checkpoint state
        {name: {master_param, exp_avg, exp_avg_sq}} of every parameter (full, fp32, CPU), one
        tensor at a time on the rank that saves it (it may be collective), and this rank's share
        of it;
      * implements `optimizer_state_bytes()`, and may override `_step_count()` (e.g. to agree
        over ranks; it is called on every rank when saving).
    After `_own`, these lists are aligned and fixed for the run (the CUDA graph and the fused
    AdamW's pointer tables rely on the tensors never moving): `masters`, `grads`, `params` (the
    `model_tensor`s), and `norm_grads` (the grads this rank counts in the global norm).
    """

    is_distributed = False        # checkpoints: the state is saved by every data-parallel rank together
    grad_buffer_mode = "all_reduce"
    nvme: Optional[NvmeState] = None   # --optimizer-nvme-offload: where the state lives (DistributedOptimizer)

    def __init__(self, model: nn.Module, grad_buffer: GradBuffer, cfg, scaler, tp_rank: int,
                 norm_group: Optional[dist.ProcessGroup], offload: bool = False):
        """norm_group: the ranks whose norm_grads together hold each distinct gradient once (every
        other rank holds copies of them, so the norm, and an fp16 overflow, is the same on every
        rank); offload: AdamW runs on the CPU (torch's fused CPU kernel) over host masters and
        `step_grads`."""
        if grad_buffer.dp > 1 and grad_buffer.mode != self.grad_buffer_mode:
            raise ValueError(f"{type(self).__name__} needs a GradBuffer built with mode={self.grad_buffer_mode!r}")
        self.cfg, self.buffer, self.scaler, self.tp_rank = cfg, grad_buffer, scaler, tp_rank
        self.norm_group = norm_group
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        missing = [n for n, p in self.named if id(p) not in grad_buffer.param_range]
        if missing:
            raise ValueError(f"parameters {missing[:3]} are not in the gradient buffer")
        self.device, self.offload = grad_buffer.device, offload
        # fp16 under --enable-cuda-graph: the loss scale is a device tensor the graph reads at replay, an
        # overflow skips the update on the device, and the host settles the scaler after the step
        # (settle_overflow)
        self.device_scale = torch.tensor(scaler.scale, dtype=torch.float32, device=self.device) \
            if cfg.fp16 and cfg.enable_cuda_graph else None

    def _own(self, owned: list[Owned]) -> None:
        """Take `owned` as the tensors this rank updates; build AdamW over them (two param groups:
        with and without weight decay)."""
        self.masters = [o.master for o in owned]
        self.grads = [o.grad for o in owned]
        self.step_grads = self.grads  # what AdamW reads (offload: CPU copies, see _stage_grads)
        self.params = [o.model_tensor for o in owned]
        self.norm_grads = [o.grad for o in owned if counts_for_norm(o.name, self.tp_rank)]
        self.norm_masters = [o.master for o in owned if counts_for_norm(o.name, self.tp_rank)]
        decay = [{"params": [o.master for o in owned if not no_weight_decay(o.name, o.param)],
                  "weight_decay": self.cfg.weight_decay},
                 {"params": [o.master for o in owned if no_weight_decay(o.name, o.param)], "weight_decay": 0.0}]
        step_device = torch.device("cpu") if self.offload else self.device
        self.adam = make_adamw(decay, self.cfg, step_device, cpu_fused=self.offload)
        self.adam_impl = resolve_adam_impl(self.cfg.adam_impl, step_device)
        self.fused_adam = None  # --adam-impl fused: built at the first step (after a checkpoint load)

    @property
    def param_groups(self) -> list[dict]:
        """AdamW's param groups (the LR scheduler sets their "lr")."""
        return self.adam.param_groups

    # ---- step ------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float | torch.Tensor:
        """What the schedule multiplies the loss by: the scaler's scale (a device tensor under a CUDA graph)."""
        return self.scaler.scale if self.device_scale is None else self.device_scale

    def step(self) -> tuple[bool, torch.Tensor]:
        """Steps 2-6 of the module docstring; call after `grad_buffer.finish()`, on every rank.
        Returns (applied, grad norm as a 0-dim device tensor); applied is False (and the norm
        nan) when an fp16 overflow skipped the step. Nothing reads back to the host except
        fp16's overflow check, so the step can be captured in a CUDA graph; under a graph
        (`device_scale`) fp16 reads nothing back either: an overflow skips the update on the
        device and returns a nan norm, and the caller settles it with `settle_overflow`."""
        norm = global_norm(self.norm_grads, self.norm_group, self.device)
        scale = None
        if self.cfg.fp16:
            # The gradients keep their scale, which the clipping divides out: no pass of its own over
            # them. norm_group's ranks hold every distinct gradient once and compute the same norm, so
            # an inf/nan on any rank makes it non-finite on every rank.
            overflow = (~torch.isfinite(norm)).float()
            scale = self.device_scale if self.device_scale is not None else \
                torch.tensor(self.scaler.scale, dtype=torch.float32, device=self.device)
            norm = norm / scale  # exact for power-of-two scales
            if self.device_scale is not None:
                self.adam.found_inf = overflow  # AdamW skips on the device; settle_overflow after the step
            else:
                skipped = bool(overflow.item())
                self.scaler.update(skipped)
                if skipped:
                    return False, torch.full((), float("nan"), device=self.device)
        self._stage_grads()
        clip_grads_(self.step_grads, norm, self.cfg.clip_grad, self.adam, scale)
        self._apply_update()
        if self.device_scale is not None:
            norm = torch.where(self.adam.found_inf > 0, float("nan"), norm)
        return True, norm

    def settle_overflow(self, grad_norm: float) -> bool:
        """fp16 under a CUDA graph, after the step's results reached the host: a non-finite gradient
        norm means the step overflowed and was skipped on the device. Update the scaler as the eager
        step does and put its scale where the next replay reads it. Returns whether the step applied."""
        found_inf = not math.isfinite(grad_norm)
        self.scaler.update(found_inf)
        self.device_scale.fill_(self.scaler.scale)
        return not found_inf

    def _load_scaler(self, state: dict) -> None:
        self.scaler.load_state_dict(state)
        if self.device_scale is not None:
            self.device_scale.fill_(self.scaler.scale)

    def _apply_update(self) -> None:
        """Steps 5 and 6 (the offloaded optimizer steps and publishes chunk by chunk, or in the
        background with --delayed-param-update)."""
        self._publish_params(params_written=self._update())

    def params_norm(self) -> torch.Tensor:
        """--log-params-norm: the L2 norm of the fp32 master weights after the last step, each
        distinct weight counted once over norm_group as the gradient norm counts it (Megatron's
        params norm), as a 0-dim device tensor. Collective over norm_group."""
        self.settle_masters()
        return global_norm(self.norm_masters, self.norm_group, self.device)

    def settle_masters(self) -> None:
        """Make the masters hold the last step's values (an update still running is waited for)."""

    def finish_pending(self) -> None:
        """Make the model's weights those of the last step (the delayed update publishes the step
        running in the background); before a checkpoint or an evaluation. Collective where publishing is."""

    def _update(self) -> bool:
        """Step 5: AdamW on the owned masters from `step_grads` (already clipped). True when it also
        wrote this rank's model-dtype `params` (the fused kernel does)."""
        self.fused_adam = adamw_update(self.adam, self.adam_impl, self.fused_adam, self.masters, self.step_grads,
                                       self.params)
        return self.fused_adam is not None

    def _stage_grads(self) -> None:
        """Bring the reduced gradients to where AdamW runs (`step_grads`); nothing by default."""

    @abstractmethod
    def _publish_params(self, params_written: bool) -> None:
        """Make every model parameter equal its (new) master on every rank; params_written: the
        update already wrote this rank's `params` (`_update`)."""

    def close(self) -> None:
        """Release what outlives the process's memory (NVMe offload: the state files); at the run's end."""

    @abstractmethod
    def optimizer_state_bytes(self) -> int:
        """Bytes of fp32 master weights and Adam moments this rank holds."""

    # ---- checkpoint state (full, keyed by parameter name) ------------------------------------------
    def saved_meta(self) -> dict:
        """{"step", "grad_scaler", "param_groups"}: what a checkpoint stores beside the per-parameter
        state. Collective where `_step_count` is (call it on every rank)."""
        return {"step": self.step_count(), "grad_scaler": self.scaler.state_dict(),
                "param_groups": self.saved_param_groups()}

    def saved_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every parameter whose state a checkpoint holds, in file order; each
        has the fp32 tensors OPTIM_KINDS of that shape."""
        return [(n, tuple(p.shape)) for n, p in self.named]

    @abstractmethod
    def saved_tensors(self) -> Iterator[tuple[str, str, Optional[torch.Tensor]]]:
        """(name, kind, tensor) for each parameter of `saved_shapes` and each kind of OPTIM_KINDS,
        in that order, one at a time: on the rank that saves, the full-shape fp32 CPU tensor
        (valid until the next item is asked for: it may be the live state); None on the others.
        With `is_distributed` every data-parallel rank iterates it (each parameter is assembled
        from the ranks that own its parts); without, data-parallel rank 0 alone does."""

    def state_for_save(self) -> Optional[dict]:
        """The whole checkpoint state in memory, {"state": {name: {kind: tensor}}, "step",
        "grad_scaler", "param_groups"}, on the rank that saves (None on the others; called like
        `saved_tensors`). For small models and tests: checkpoints stream `saved_tensors` instead."""
        meta = self.saved_meta()
        state: dict = {}
        for name, kind, t in self.saved_tensors():
            if t is not None:
                state.setdefault(name, {})[kind] = t.clone()
        return {"state": state, **meta} if state else None

    def load_saved_state(self, saved: dict) -> None:
        """Restore from `state_for_save()`'s format (saved at any layout, by either optimizer; its
        names and shapes checked against `saved_shapes` by the checkpoint reader): the masters,
        moments and step count, the model parameters (set to the masters), the loss scaler."""
        self.fused_adam = None  # its pointer tables point at the moments about to be replaced
        self._load_state(saved["state"], int(saved["step"]))
        self._load_scaler(saved["grad_scaler"])

    # ---- torch_dist checkpoint state (this rank's share, read and written in place) ---------------------
    def step_count(self) -> int:
        """Completed AdamW steps (collective where `_step_count` is: call it on every rank)."""
        return self._step_count()

    def saved_param_groups(self) -> list[dict]:
        return saved_param_groups(self.adam)

    def finish_load(self, step: int, grad_scaler: dict) -> None:
        """After the views of `owned_state()` were filled: the step count, the model parameters from
        the masters where they are separate, the loss scaler."""
        self.fused_adam = None  # its pointer tables may point at replaced state
        self._finish_load(step)
        self._load_scaler(grad_scaler)

    @abstractmethod
    def owned_state(self) -> list[tuple[str, nn.Parameter, int, int, dict[str, torch.Tensor]]]:
        """This rank's AdamW state as views of its own memory: per owned tensor (parameter name,
        parameter, [lo, hi) of the flattened parameter, {master_param, exp_avg, exp_avg_sq: 1-D
        views of hi - lo fp32 elements}). A torch_dist save writes from them, a load reads into them,
        then calls `finish_load`."""

    @abstractmethod
    def _finish_load(self, step: int) -> None:
        """Set the step count of every owned tensor's state to `step`; publish the masters if needed."""

    def _step_count(self) -> int:
        """Completed AdamW steps on this rank (every owned tensor has the same count; 0 before the first)."""
        state = self.adam.state.get(self.masters[0], {}) if self.masters else {}
        return int(state["step"]) if "step" in state else 0

    @abstractmethod
    def _load_state(self, state: dict, step: int) -> None:
        """Take this rank's share of a full name-keyed `state` (checked to cover every parameter):
        masters, moments with step count `step`, and the model parameters set to the masters."""
