"""Reading device results back to the host without draining the GPU's queue."""
from __future__ import annotations

from typing import Optional

import torch


def to_host(t: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.cuda.Event]]:
    """Queue a copy of device tensor t into pinned host memory right behind the work that made it,
    so waiting for it (the event) waits for that work only, not for work queued after it. The event
    keeps its GPU timestamp: the time between two of them is the time between the two steps'
    completions, whatever the host did between. On the CPU: (t, None)."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    ready = torch.cuda.Event(enable_timing=True)
    ready.record()
    return host, ready


def wait_host(host: torch.Tensor, ready: Optional[torch.cuda.Event]) -> torch.Tensor:
    """The host tensor of `to_host`, once its copy has landed."""
    if ready is not None:
        ready.synchronize()
    return host
