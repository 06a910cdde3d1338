"""Forward-backward schedules. They know nothing of GPT-2: they get a forward-step function,
a data iterator and a model stage.

    forward_step(data_iterator, model) -> (output_tensor, loss_func)
        On the last stage output_tensor is what loss_func consumes; loss_func(output_tensor)
        returns (loss scalar, {name: detached value for logging}). On other stages
        output_tensor is the activation sent to the next stage and loss_func is ignored.

Every schedule returns the list of per-microbatch logging dicts (empty off the last stage).
The loss of each microbatch is divided by num_microbatches, and multiplied by
`cfg.loss_scale` (fp16) before backward.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

ForwardStep = Callable[[Iterator, nn.Module], tuple[torch.Tensor, Callable]]


@dataclass
class ScheduleConfig:
    num_microbatches: int
    tensor_shape: tuple[int, ...] = ()                 # inter-stage activation shape, [s, b, h]
    dtype: torch.dtype = torch.float32                 # inter-stage activation dtype
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    pp_group: Optional[dist.ProcessGroup] = None
    prev_rank: Optional[int] = None                    # global ranks of the pipeline neighbours
    next_rank: Optional[int] = None
    loss_scale: float = 1.0
    no_sync: Callable[[], ContextManager] = contextlib.nullcontext  # wraps all but the last backward

    @property
    def is_first_stage(self) -> bool:
        return self.prev_rank is None

    @property
    def is_last_stage(self) -> bool:
        return self.next_rank is None


def forward_step_and_loss(forward_step: ForwardStep, data_iterator: Iterator, model: nn.Module,
                          cfg: ScheduleConfig, input_tensor: Optional[torch.Tensor],
                          logs: list[dict[str, Any]]) -> torch.Tensor:
    """Run one microbatch forward; on the last stage turn the output into the scaled loss."""
    if hasattr(model, "set_input_tensor"):
        model.set_input_tensor(input_tensor)
    output, loss_func = forward_step(data_iterator, model)
    if cfg.is_last_stage:
        loss, log = loss_func(output)
        logs.append(log)
        output = loss / cfg.num_microbatches
    return output


def backward_step(input_tensor: Optional[torch.Tensor], output: torch.Tensor,
                  output_grad: Optional[torch.Tensor], cfg: ScheduleConfig) -> Optional[torch.Tensor]:
    """Backward through this stage; returns the gradient w.r.t. the stage input (or None)."""
    if input_tensor is not None:
        input_tensor.retain_grad()
    if output_grad is None:                      # last stage: output is the scalar loss
        output = output * cfg.loss_scale
    torch.autograd.backward(output, grad_tensors=output_grad)
    return None if input_tensor is None else input_tensor.grad


def forward_backward_no_pipelining(forward_step: ForwardStep, data_iterator: Iterator, model: nn.Module,
                                   cfg: ScheduleConfig, forward_only: bool = False) -> list[dict[str, Any]]:
    """pp == 1: gradient accumulation over microbatches; grads sync only on the last one."""
    logs: list[dict[str, Any]] = []
    for i in range(cfg.num_microbatches):
        last = i == cfg.num_microbatches - 1
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            with cfg.no_sync() if not last and not forward_only else contextlib.nullcontext():
                output = forward_step_and_loss(forward_step, data_iterator, model, cfg, None, logs)
                if not forward_only:
                    backward_step(None, output, None, cfg)
    return logs


def get_forward_backward_func(pp: int, schedule: str = "1f1b") -> Callable[..., list[dict[str, Any]]]:
    """The schedule for this pipeline size: no pipelining for pp == 1, else 1F1B or AFAB."""
    if pp == 1:
        return forward_backward_no_pipelining
    raise NotImplementedError("pipeline schedules for pp > 1 are being added in megapar/pipeline/")
