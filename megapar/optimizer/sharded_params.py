"""ZeRO-3 parameters: each transformer layer's weights sharded over the data-parallel group,
gathered for its forward and again for its backward, freed in between.

Layout. A layer is one *unit*: its parameters (registration order) laid end to end in one flat
buffer of the model dtype, padded to a multiple of dp; data-parallel rank d keeps shard d of it
(`shard`, persistent). The parameters are views of the flat full buffer (`full`), whose storage
is resized to 0 bytes while the layer is released and back to full size when it is gathered
(the views stay valid: they share the storage object). The same unit layout is what the ZeRO-2/3
gradient buffer and the optimizer shard (sharded_grads.py, distrib_optimizer.py), so a rank's
parameter shard, gradient shard and master shard cover the same elements.

Life of a unit in one microbatch (hooks on the layer module; nothing GPT-2 specific):
    forward pre-hook     gather (all-gather the shards), and start gathering the next unit
    forward post-hook    release, unless backward is running (recompute re-runs the forward
                         inside backward and needs the weights until the layer's grads exist);
                         with grad enabled, hook the output: its gradient arriving means this
                         layer's backward is about to start
    output-grad hook     gather again (and start gathering the previous unit)
    grads all arrived    release (called by the gradient buffer once it has the layer's grads)

Initialisation: `shard_layer(layer)` is called right after each layer is built (model/gpt2.py),
so the model is never whole on one rank: one layer at a time is full, with the name-seeded
values every layout shares. The embeddings and the final LayerNorm (the "edge") stay whole:
they are small next to the layers and are used at both ends of the step.

`--param-cpu-offload`: the shards live in pinned CPU memory and are copied to the GPU as part
of the gather.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..pinned import host_buffer
from ..tensor_parallel.mappings import all_gather_tensor


def unit_offsets(params: list[nn.Parameter], dp: int) -> tuple[list[int], int]:
    """Each parameter's start in its unit's flat buffer, and the buffer's size padded to dp."""
    offsets, pos = [], 0
    for p in params:
        offsets.append(pos)
        pos += p.numel()
    return offsets, pos + (-pos) % dp


def in_backward() -> bool:
    """True while autograd runs a backward pass on this thread (e.g. a recompute)."""
    return torch._C._current_graph_task_id() != -1


class Unit:
    """One layer's parameters: the persistent owned shard and the gatherable full buffer."""

    def __init__(self, module: nn.Module, dp: int, dp_rank: int, dp_group, offload: bool):
        self.module, self.dp, self.dp_rank, self.dp_group = module, dp, dp_rank, dp_group
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.offsets, self.numel = unit_offsets(self.params, dp)
        p0 = self.params[0]
        self.device, self.dtype = p0.device, p0.dtype
        self.full = torch.zeros(self.numel, dtype=self.dtype, device=self.device)  # [numel]
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets):
                self.full[off:off + p.numel()].copy_(p.detach().reshape(-1))
                p.data = self.full[off:off + p.numel()].view_as(p)
        size = self.numel // dp
        shard = self.full[dp_rank * size:(dp_rank + 1) * size]
        if offload:
            self.shard = host_buffer(size, self.dtype, pinned=self.device.type == "cuda")  # [numel / dp]
            self.shard.copy_(shard)
        else:
            self.shard = shard.clone()                                                # [numel / dp]
        self.gathered, self.handle = True, None
        self.release()

    @property
    def nbytes(self) -> int:
        return self.numel * self.full.element_size()

    def start_gather(self) -> None:
        """Allocate the full buffer and all-gather the shards into it (asynchronously)."""
        if self.gathered:
            return
        self.full.untyped_storage().resize_(self.nbytes)
        shard = self.shard.to(self.device, non_blocking=True) if self.shard.device != self.device else self.shard
        if self.dp == 1:
            self.full.copy_(shard)
        else:
            self.handle = all_gather_tensor(self.full, shard, group=self.dp_group, async_op=True)
        self.gathered = True

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None

    def gather(self) -> None:
        self.start_gather()
        self.wait()

    def release(self) -> None:
        """Free the full buffer (the owned shard stays)."""
        if self.gathered:
            self.wait()
            self.full.untyped_storage().resize_(0)
            self.gathered = False


class ShardedParams:
    """The ZeRO-3 units of one model (one per transformer layer, in forward order)."""

    def __init__(self, dp_group: Optional[dist.ProcessGroup], offload: bool = False):
        self.dp_group, self.offload = dp_group, offload
        self.dp = 1 if dp_group is None else dist.get_world_size(dp_group)
        self.dp_rank = 0 if dp_group is None else dist.get_rank(dp_group)
        self.units: list[Unit] = []

    # ---- building -----------------------------------------------------------------------------
    def shard_layer(self, layer: nn.Module) -> None:
        """Make `layer` a unit (its full weights are freed now) and hook its forward."""
        unit = Unit(layer, self.dp, self.dp_rank, self.dp_group, self.offload)
        index = len(self.units)
        self.units.append(unit)
        layer.register_forward_pre_hook(lambda m, args: self._before_forward(index))
        layer.register_forward_hook(lambda m, args, out: self._after_forward(index, out))

    def unit_of(self) -> dict[int, Unit]:
        """id(param) -> its unit."""
        return {id(p): u for u in self.units for p in u.params}

    # ---- hooks --------------------------------------------------------------------------------
    def _before_forward(self, i: int) -> None:
        self.units[i].gather()
        if i + 1 < len(self.units) and not in_backward():
            self.units[i + 1].start_gather()

    def _after_forward(self, i: int, out) -> None:
        if in_backward():   # a recompute inside backward: the backward that follows needs the weights
            return
        if torch.is_grad_enabled() and torch.is_tensor(out) and out.requires_grad:
            out.register_hook(self._before_backward_hook(i))
        self.units[i].release()

    def _before_backward_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self.units[i].gather()
            if i > 0:
                self.units[i - 1].start_gather()
        return hook

    # ---- whole-model views (checkpoints) -------------------------------------------------------
    @contextmanager
    def gathered(self, unit: Unit) -> Iterator[None]:
        """Collective over the DP group: `unit`'s full weights (its parameters) for the duration of
        the block, released after unless they were gathered before; a checkpoint writes the layers
        this way, one at a time."""
        was = unit.gathered
        unit.gather()
        try:
            yield
        finally:
            if not was:
                unit.release()

    @torch.no_grad()
    def load_full(self, values: dict[int, torch.Tensor]) -> None:
        """Set each unit's owned shard from full parameter values (id(param) -> tensor, any device)."""
        for u in self.units:
            u.release()
            size = u.numel // u.dp
            lo, hi = u.dp_rank * size, (u.dp_rank + 1) * size
            for p, off in zip(u.params, u.offsets):
                a, z = max(lo, off), min(hi, off + p.numel())
                if a < z:
                    u.shard[a - lo:z - lo].copy_(values[id(p)].reshape(-1)[a - off:z - off])
