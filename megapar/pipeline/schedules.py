"""Forward-backward schedules. They know nothing of GPT-2: they get a forward-step function,
a data iterator and a model stage.

    forward_step(data_iterator, model) -> (output_tensor, loss_func)
        On the last stage output_tensor is what loss_func consumes; loss_func(output_tensor)
        returns (loss scalar, {name: detached value for logging}). On other stages
        output_tensor is the activation sent to the next stage and loss_func is ignored.

Every schedule returns the list of per-microbatch logging dicts (empty off the last stage);
`average_logs` (collective over the pipeline group) makes their mean known to every stage, so
rank 0 can log it. The loss of each microbatch is divided by num_microbatches, and multiplied by
`cfg.loss_scale` (fp16) before backward. `cfg.no_sync()` wraps the backward of every microbatch
but the last, so data-parallel gradient reduction runs once per step (ZB-H1 wraps every pass: its
gradients are complete only after the last W, and the caller reduces them after the schedule).

Schedules for pp > 1 (inter-stage tensors are `cfg.tensor_shape` [s, b, h] in `cfg.dtype`):
  afab   all forwards, then all backwards (the simple reference; holds m microbatches).
  1f1b   warmup of pp - stage - 1 forwards, then one forward / one backward, then the remaining
         backwards: at most pp microbatches of activations alive on any stage.
  forward_only=True runs the forward-only schedule (evaluation) for either.
  interleaved 1F1B (v model chunks per rank, Megatron's virtual pipeline stages) lives in
         interleaved.py; `get_forward_backward_func(pp, "1f1b", virtual=v)` picks it.
  ZB-H1 (1F1B with each backward split into B and a deferred W, zero_bubble.py):
         `get_forward_backward_func(pp, "1f1b", zero_bubble=True)` picks it.
A sent activation's storage is freed at once (`deallocate_output`); its autograd graph stays
and `backward_step` runs the autograd engine directly, without torch.autograd.backward's shape
check. A p2p wait longer than `cfg.p2p_timeout` raises p2p.PipelineTimeoutError naming the
schedule, phase, microbatch and operation; `p2p.current_step()` reports the same at any time.
"""
from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from . import p2p

if TYPE_CHECKING:
    from ..tensor_parallel.wgrad_store import WeightGradStore

ForwardStep = Callable[[Iterator, nn.Module], tuple[torch.Tensor, Callable]]
Logs = list[dict[str, Any]]


@dataclass
class ScheduleConfig:
    num_microbatches: int
    tensor_shape: tuple[int, ...] = ()                 # inter-stage activation shape, [s, b, h]
    dtype: torch.dtype = torch.float32                 # inter-stage activation dtype
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    pp_group: Optional[dist.ProcessGroup] = None       # None: the default (world) group
    prev_rank: Optional[int] = None                    # global ranks of the pipeline neighbours
    next_rank: Optional[int] = None
    loss_scale: Union[float, torch.Tensor] = 1.0         # fp16; a device tensor in a CUDA-graphed step
    no_sync: Callable[[], ContextManager] = contextlib.nullcontext  # wraps all but the last backward
    p2p_timeout: float = 600.0                         # seconds a p2p wait may take before it raises
    label: str = ""                                    # prefix for diagnostics, e.g. "iteration 12"
    diagnose_hangs: bool = False                       # NCCL: poll waits against p2p_timeout (blocks the CPU)
    stats: Optional[dict] = None                       # interleaved: receives "peak_live_outputs"
    pp_grad_group: Optional[dist.ProcessGroup] = None  # interleaved, pp == 2: gradients travel on this group
    log_keys: tuple[str, ...] = ()                     # what every microbatch's loss_func logs (average_logs)
    wgrad_store: Optional["WeightGradStore"] = None    # zero-bubble: where B queues the weight gradients

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


def deallocate_output(output: torch.Tensor) -> None:
    """Free a sent activation's storage but keep the tensor and its grad_fn for backward
    (Megatron's deallocate_output_tensor). Views are left alone: freeing them saves nothing."""
    if output._base is None:
        output.data = torch.empty((1,), device=output.device, dtype=output.dtype)


def backward_step(input_tensor: Optional[torch.Tensor], output: torch.Tensor,
                  output_grad: Optional[torch.Tensor], cfg: ScheduleConfig) -> Optional[torch.Tensor]:
    """Backward through this stage; returns the gradient w.r.t. the stage input (or None).
    `output` may have been pseudo-freed by `deallocate_output`."""
    if input_tensor is not None:
        input_tensor.retain_grad()
    if output_grad is None:                      # last stage: output is the scalar loss
        torch.autograd.backward(output * cfg.loss_scale)
    else:                                        # the engine itself: no shape check against output
        torch.autograd.Variable._execution_engine.run_backward(
            (output,), (output_grad,), False, False, (), True, True)  # keep_graph, create_graph,
    return None if input_tensor is None else input_tensor.grad      # inputs, allow_unreachable, accumulate


def forward_backward_no_pipelining(forward_step: ForwardStep, data_iterator: Iterator, model: nn.Module,
                                   cfg: ScheduleConfig, forward_only: bool = False) -> Logs:
    """pp == 1: gradient accumulation over microbatches; grads sync only on the last one."""
    logs: Logs = []
    for i in range(cfg.num_microbatches):
        last = i == cfg.num_microbatches - 1
        p2p.set_step(label=cfg.label, schedule="no-pipelining", phase="forward-backward", microbatch=i)
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            with cfg.no_sync() if not last and not forward_only else contextlib.nullcontext():
                output = forward_step_and_loss(forward_step, data_iterator, model, cfg, None, logs)
                if not forward_only:
                    backward_step(None, output, None, cfg)
    p2p.set_step(phase="finished", microbatch=None)
    return logs


class _Stage:
    """One schedule run on one stage: forward/backward of a microbatch plus the activations kept."""

    def __init__(self, name: str, forward_step: ForwardStep, data_iterator: Iterator, model: nn.Module,
                 cfg: ScheduleConfig):
        self.step, self.data, self.model, self.cfg, self.name = forward_step, data_iterator, model, cfg, name
        self.logs: Logs = []
        self.inputs: deque = deque()           # per microbatch in flight: stage input, stage output
        self.outputs: deque = deque()
        self.backwards = 0

    def at(self, phase: str, microbatch: Any) -> None:
        p2p.set_step(label=self.cfg.label, schedule=self.name, phase=phase, microbatch=microbatch)

    def forward(self, input_tensor: Optional[torch.Tensor], keep: bool = True) -> torch.Tensor:
        output = forward_step_and_loss(self.step, self.data, self.model, self.cfg, input_tensor, self.logs)
        if keep:
            self.inputs.append(input_tensor)
            self.outputs.append(output)
        return output

    def sent(self, output: torch.Tensor) -> None:
        if not self.cfg.is_last_stage:
            deallocate_output(output)

    def backward(self, output_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Backward of the oldest microbatch in flight; grads sync only for the last one."""
        last = self.backwards == self.cfg.num_microbatches - 1
        self.backwards += 1
        with contextlib.nullcontext() if last else self.cfg.no_sync():
            return backward_step(self.inputs.popleft(), self.outputs.popleft(), output_grad, self.cfg)

    def done(self) -> Logs:
        p2p.set_step(phase="finished", microbatch=None)
        return self.logs


def forward_only_pipelining(forward_step: ForwardStep, data_iterator: Iterator, model: nn.Module,
                            cfg: ScheduleConfig, name: str = "forward-only") -> Logs:
    """Evaluation: every microbatch forward through the pipeline, nothing kept for backward."""
    run = _Stage(name, forward_step, data_iterator, model, cfg)
    with torch.no_grad():
        for i in range(cfg.num_microbatches):
            run.at("forward-only", i)
            p2p.send_forward(run.forward(p2p.recv_forward(cfg), keep=False), cfg)
    return run.done()


def forward_backward_pipelining_afab(forward_step: ForwardStep, data_iterator: Iterator, model: nn.Module,
                                     cfg: ScheduleConfig, forward_only: bool = False) -> Logs:
    """All forwards, then all backwards (GPipe order): the reference, holding m microbatches."""
    if forward_only:
        return forward_only_pipelining(forward_step, data_iterator, model, cfg, "afab")
    run = _Stage("afab", forward_step, data_iterator, model, cfg)
    for i in range(cfg.num_microbatches):
        run.at("forward", i)
        output = run.forward(p2p.recv_forward(cfg))
        p2p.send_forward(output, cfg)
        run.sent(output)
    for i in range(cfg.num_microbatches):
        run.at("backward", i)
        p2p.send_backward(run.backward(p2p.recv_backward(cfg)), cfg)
    return run.done()


def forward_backward_pipelining_1f1b(forward_step: ForwardStep, data_iterator: Iterator, model: nn.Module,
                                     cfg: ScheduleConfig, forward_only: bool = False) -> Logs:
    """1F1B (PipeDream-flush, Megatron's non-interleaved schedule): stage k of pp runs
    pp - k - 1 warmup forwards, then alternates one forward and one backward, then drains the
    remaining backwards. At most pp - k microbatches are in flight on stage k."""
    if forward_only:
        return forward_only_pipelining(forward_step, data_iterator, model, cfg, "1f1b")
    m = cfg.num_microbatches
    num_warmup = min(dist.get_world_size(cfg.pp_group) - dist.get_rank(cfg.pp_group) - 1, m)
    num_steady = m - num_warmup
    run = _Stage("1f1b", forward_step, data_iterator, model, cfg)

    # Warmup: forwards only, filling the pipeline
    for i in range(num_warmup):
        run.at("warmup", i)
        output = run.forward(p2p.recv_forward(cfg))
        p2p.send_forward(output, cfg)
        run.sent(output)

    # Steady state (1F1B): forward microbatch num_warmup + i, backward microbatch i
    run.at("steady", num_warmup)
    input_tensor = p2p.recv_forward(cfg) if num_steady > 0 else None
    for i in range(num_steady):
        run.at("steady", f"{num_warmup + i} (forward), {i} (backward)")
        output = run.forward(input_tensor)
        output_grad = p2p.send_forward_recv_backward(output, cfg)
        run.sent(output)
        input_grad = run.backward(output_grad)
        if i == num_steady - 1:
            p2p.send_backward(input_grad, cfg)
        else:
            run.at("steady", f"{i} (backward), {num_warmup + i + 1} (forward)")
            input_tensor = p2p.send_backward_recv_forward(input_grad, cfg)

    # Cooldown: the backwards of the warmup microbatches
    for i in range(num_steady, m):
        run.at("cooldown", i)
        p2p.send_backward(run.backward(p2p.recv_backward(cfg)), cfg)
    return run.done()


def average_logs(logs: Logs, cfg: ScheduleConfig) -> dict[str, torch.Tensor]:
    """Mean of each logged value over the microbatches as a 0-dim float64 tensor on cfg.device,
    known to every stage of the pipeline (collective over `cfg.pp_group`: the last stage
    broadcasts). {} when nothing was logged. With one stage, or with `cfg.log_keys` naming what
    is logged, nothing is read back to the host (the broadcast is one device tensor), so the
    caller can launch the optimizer before waiting for the loss, or capture the step in a CUDA
    graph; without them the last stage sends its keys and values as a Python object."""
    mean = {k: torch.stack([torch.as_tensor(log[k], device=cfg.device) for log in logs]).double().mean()
            for k in logs[0]} if logs else {}
    if cfg.is_first_stage and cfg.is_last_stage:
        return mean
    last = dist.get_world_size(cfg.pp_group) - 1
    if cfg.log_keys:
        values = torch.stack([mean[k] for k in cfg.log_keys]) if cfg.is_last_stage else \
            torch.empty(len(cfg.log_keys), dtype=torch.float64, device=cfg.device)       # [keys]
        dist.broadcast(values, group=cfg.pp_group, group_src=last)
        return dict(zip(cfg.log_keys, values.unbind()))
    box = [{k: v.item() for k, v in mean.items()}]  # one host copy per key
    dist.broadcast_object_list(box, group=cfg.pp_group, device=cfg.device, group_src=last)
    return {k: torch.tensor(v, dtype=torch.float64, device=cfg.device) for k, v in box[0].items()}


def get_forward_backward_func(pp: int, schedule: str = "1f1b", virtual: Optional[int] = None,
                              zero_bubble: bool = False) -> Callable[..., Logs]:
    """The schedule for this pipeline size: no pipelining for pp == 1, else 1F1B or AFAB; with
    virtual (model chunks per rank) > 1, interleaved 1F1B (pipeline/interleaved.py); with
    zero_bubble, ZB-H1 (pipeline/zero_bubble.py: pp > 1, the 1f1b schedule, no model chunks)."""
    if zero_bubble:
        if pp == 1 or schedule != "1f1b" or (virtual is not None and virtual > 1):
            raise ValueError(f"the zero-bubble schedule needs pp > 1, the 1f1b schedule and no virtual pipeline "
                             f"(pp {pp}, {schedule}, virtual {virtual})")
        from .zero_bubble import forward_backward_pipelining_zb_h1
        return forward_backward_pipelining_zb_h1
    if virtual is not None and virtual > 1:
        if pp == 1 or schedule != "1f1b":
            raise ValueError(f"the interleaved schedule needs pp > 1 and the 1f1b schedule (pp {pp}, {schedule})")
        from .interleaved import forward_backward_pipelining_interleaved
        return forward_backward_pipelining_interleaved
    if pp == 1:
        return forward_backward_no_pipelining
    funcs = {"1f1b": forward_backward_pipelining_1f1b, "afab": forward_backward_pipelining_afab}
    if schedule not in funcs:
        raise ValueError(f"unknown pipeline schedule {schedule!r}: choose one of {sorted(funcs)}")
    return funcs[schedule]
