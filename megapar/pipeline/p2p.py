"""Point-to-point communication between neighbouring pipeline stages, with hang diagnostics.

Activations go forward (stage i -> i+1), their gradients backward (i+1 -> i). Shapes and dtype
are known up front (`cfg.tensor_shape`, `cfg.dtype`), so nothing but the payload is exchanged.
Every call posts its sends and receives together through `dist.batch_isend_irecv` (one NCCL
group; non-blocking isend/irecv on gloo) before it waits on any, and neighbouring stages make
matching calls at the same schedule step. A rank lists its ops with the previous stage before
those with the next, and within one neighbouring pair the lower stage lists send-then-recv while
the upper lists recv-then-send, so both sides post matching ops in the same order: on a line of
stages that order alone would rule out a cycle of waits even on a backend that ran the ops one at
a time. The interleaved schedule's ring (interleaved.py) relies on the posting of every op before
any wait.

Waits poll the requests against a deadline (`cfg.p2p_timeout` seconds). On timeout every
waiting rank raises `PipelineTimeoutError` naming the schedule step it was stuck on, e.g.

    pipeline p2p timeout after 30s on rank 3 (pp stage 1/2): schedule 1f1b, phase steady,
    microbatch 4, waiting for recv_forward from rank 1

A rank whose peer gave up first may instead see the transport's error (gloo closes the pair on
a timeout); it raises `PipelineP2PError` with the same diagnostic prefix.
The same "what am I doing" record is kept module-wide: `current_step()` returns it as a string
so a training loop that catches a collective timeout elsewhere can report where it was.
`cfg` is a `schedules.ScheduleConfig` (fields prev_rank, next_rank, pp_group, tensor_shape,
dtype, device, p2p_timeout, label).
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .schedules import ScheduleConfig

Tensor = torch.Tensor


class PipelineP2PError(RuntimeError):
    """A pipeline send/recv failed (e.g. the peer closed the connection after its own timeout)."""


class PipelineTimeoutError(PipelineP2PError):
    """A pipeline send/recv did not complete within `cfg.p2p_timeout` seconds."""


# ---- "what am I doing" record ----------------------------------------------------------------
_STEP: dict = {"label": "", "schedule": None, "phase": None, "microbatch": None, "chunk": None, "op": None}


def set_step(**fields) -> None:
    """Update the record (keys: label, schedule, phase, microbatch, chunk, op); `chunk` is the
    model chunk of the interleaved schedule (None elsewhere)."""
    _STEP.update(fields)


def current_step() -> str:
    """Where this rank is in the pipeline schedule, e.g. 'schedule 1f1b, phase steady,
    microbatch 4, waiting for recv_forward from rank 1' ('' outside any schedule)."""
    parts = [_STEP["label"]] if _STEP["label"] else []
    for key in ("schedule", "phase", "microbatch", "chunk"):
        if _STEP[key] is not None:
            parts.append(f"{key} {_STEP[key]}")
    if _STEP["op"]:
        parts.append(_STEP["op"])
    return ", ".join(parts)


def _stage(cfg: "ScheduleConfig") -> str:
    group = cfg.pp_group
    try:
        return f"pp stage {dist.get_rank(group)}/{dist.get_world_size(group)}"
    except Exception:  # noqa: BLE001 (diagnostics must never mask the real error)
        return "pp stage ?"


def _wait(reqs: list, ops: list[tuple[str, int]], cfg: "ScheduleConfig") -> None:
    """Wait for every request; past the deadline raise with the schedule step and the pending ops.

    CUDA (NCCL) without cfg.diagnose_hangs: plain stream-ordered waits (no deadline here; a hang
    is caught by the process group's timeout). With it: poll `is_completed()`, which blocks the
    CPU until each transfer is done (slower: no CPU/GPU overlap across a send/recv). CPU (gloo): a gloo request
    only reports completion once waited on, so wait on each with the time left; gloo raises
    "Timed out waiting ..." (and closes the pair: the group is unusable after a timeout)."""
    if cfg.device.type == "cuda" and not cfg.diagnose_hangs:
        for req in reqs:  # stream-ordered: the CPU goes on queuing kernels while NCCL transfers
            req.wait()
        return
    deadline = time.monotonic() + cfg.p2p_timeout
    if cfg.device.type == "cuda":
        pause, pending = 0.0, list(range(len(reqs)))
        while pending:
            pending = [i for i in pending if not reqs[i].is_completed()]
            if pending and time.monotonic() > deadline:
                # batch_isend_irecv returns one coalesced request on NCCL: then all ops are pending
                _fail(cfg, [ops[i] for i in pending] if len(reqs) == len(ops) else ops)
            time.sleep(pause)
            pause = min(1e-3, pause * 2 + 2e-5)
    for i, req in enumerate(reqs):
        try:
            req.wait(timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
        except RuntimeError as e:
            pending = ops[i:] if len(reqs) == len(ops) else ops
            if "timed out" in str(e).lower():
                _fail(cfg, pending, e)
            set_step(op=f"waiting for {_describe(pending)}")
            raise PipelineP2PError(f"pipeline p2p failed on rank {dist.get_rank()} ({_stage(cfg)}): "
                               f"{current_step()}: {e}") from e


def _describe(ops: list[tuple[str, int]]) -> str:
    return " and ".join(f"{op} {'to' if op.startswith('send') else 'from'} rank {peer}" for op, peer in ops)


def _fail(cfg: "ScheduleConfig", pending: list[tuple[str, int]], cause: Optional[Exception] = None) -> None:
    set_step(op=f"waiting for {_describe(pending)}")
    raise PipelineTimeoutError(f"pipeline p2p timeout after {cfg.p2p_timeout:g}s on rank {dist.get_rank()} "
                               f"({_stage(cfg)}): {current_step()}") from cause


def _check(t: Tensor, what: str, cfg: "ScheduleConfig") -> Tensor:
    if tuple(t.shape) != tuple(cfg.tensor_shape) or t.dtype != cfg.dtype:
        raise ValueError(f"pipeline {what}: tensor is {tuple(t.shape)} {t.dtype} but the schedule "
                         f"expects {tuple(cfg.tensor_shape)} {cfg.dtype} (ScheduleConfig.tensor_shape/dtype)")
    return t.detach().contiguous()


def communicate(cfg: "ScheduleConfig", send_next: Optional[Tensor] = None, send_prev: Optional[Tensor] = None,
                recv_prev: bool = False, recv_next: bool = False,
                grad_group: Optional[dist.ProcessGroup] = None) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """Post the requested sends/receives as one batch and wait for all of them.

    Returns (tensor received from the previous stage, tensor received from the next stage);
    a tensor received from the previous stage is an activation and gets requires_grad=True
    when grad mode is on. `grad_group`: gradient messages (send_prev / recv_next) go over this
    group as a second batch, with tag 1 -- the interleaved schedule's ring sends activations and
    gradients between the same two ranks when pp == 2, and each kind needs its own queue (gloo
    tells them apart by tag, NCCL only by communicator)."""
    ops: list = []
    names: list[tuple[str, int]] = []
    from_prev = from_next = None

    def add(fn, tensor: Tensor, peer: int, name: str) -> None:
        grad = grad_group is not None and name in ("send_backward", "recv_backward")
        group = grad_group if grad else cfg.pp_group
        ops.append(dist.P2POp(fn, tensor, peer, group, 1 if grad else 0))
        names.append((name, peer))

    def empty() -> Tensor:
        return torch.empty(cfg.tensor_shape, dtype=cfg.dtype, device=cfg.device)

    if recv_prev:                                            # upper side of (prev, me): recv, send
        from_prev = empty()
        add(dist.irecv, from_prev, cfg.prev_rank, "recv_forward")
    if send_prev is not None:
        add(dist.isend, _check(send_prev, "send_backward", cfg), cfg.prev_rank, "send_backward")
    if send_next is not None:                                # lower side of (me, next): send, recv
        add(dist.isend, _check(send_next, "send_forward", cfg), cfg.next_rank, "send_forward")
    if recv_next:
        from_next = empty()
        add(dist.irecv, from_next, cfg.next_rank, "recv_backward")
    if not ops:
        return None, None
    groups = list(dict.fromkeys(op.group for op in ops))   # one batch per group
    order = sorted(range(len(ops)), key=lambda i: groups.index(ops[i].group))
    reqs = [r for g in groups for r in dist.batch_isend_irecv([op for op in ops if op.group is g])]
    _wait(reqs, [names[i] for i in order], cfg)
    set_step(op=None)
    if from_prev is not None and torch.is_grad_enabled():
        from_prev.requires_grad_()
    return from_prev, from_next


# ---- the six calls the schedules use (no-ops at the ends of the pipeline) -----------------------
def recv_forward(cfg: "ScheduleConfig") -> Optional[Tensor]:
    return None if cfg.is_first_stage else communicate(cfg, recv_prev=True)[0]


def send_forward(output: Tensor, cfg: "ScheduleConfig") -> None:
    if not cfg.is_last_stage:
        communicate(cfg, send_next=output)


def recv_backward(cfg: "ScheduleConfig") -> Optional[Tensor]:
    return None if cfg.is_last_stage else communicate(cfg, recv_next=True)[1]


def send_backward(input_grad: Optional[Tensor], cfg: "ScheduleConfig") -> None:
    if not cfg.is_first_stage:
        communicate(cfg, send_prev=input_grad)


def send_forward_recv_backward(output: Tensor, cfg: "ScheduleConfig") -> Optional[Tensor]:
    return None if cfg.is_last_stage else communicate(cfg, send_next=output, recv_next=True)[1]


def send_backward_recv_forward(input_grad: Optional[Tensor], cfg: "ScheduleConfig") -> Optional[Tensor]:
    return None if cfg.is_first_stage else communicate(cfg, send_prev=input_grad, recv_prev=True)[0]
