"""Megatron's --overlap-param-gather for the DistributedOptimizer: the all-gathers that publish a
step's weights start in the next forward, each bucket ahead of the first layer that uses it."""
from __future__ import annotations

from typing import Sequence

import torch.nn as nn

from ..tensor_parallel.mappings import all_gather_tensor


class ParamGather:
    """The deferred all-gathers, a base of DistributedOptimizer: over its `bucket_params` and
    `owned_params` in its `dp_group`. State: `gather_order` (the buckets whose all-gather waits for the
    next forward; empty: gathered at once), `gathers` (those under way), `gather_due`."""

    def _gather_ahead(self, units: Sequence[tuple[nn.Module, list[nn.Parameter]]]) -> None:
        """Megatron's --overlap-param-gather: the step's all-gathers start in the next forward, in the
        order of `units`, and each unit's forward pre-hook waits only for the buckets holding its
        parameters, so the gathers travel behind the forward's compute. A captured CUDA graph holds
        them at its start. Whatever reads the weights between steps calls `finish_pending` first."""
        bucket_of = {id(p): i for i, b in enumerate(self.buffer.buckets) for p in b.params
                     if self.bucket_params[i] is not None}
        waits = [sorted({bucket_of[id(p)] for p in params if id(p) in bucket_of}) for _, params in units]
        for mine in waits:
            self.gather_order += [i for i in mine if i not in self.gather_order]
        unused = [i for i in sorted(set(bucket_of.values())) if i not in self.gather_order]  # no unit's: first
        waits[0] += unused
        self.gather_order = unused + self.gather_order
        for (module, _), mine in zip(units, waits):
            module.register_forward_pre_hook(lambda m, args, mine=mine: self._await_gathers(mine))

    def _start_gathers(self, buckets) -> None:
        for i in buckets:
            self.gathers[i] = all_gather_tensor(self.bucket_params[i], self.owned_params[i], group=self.dp_group,
                                                async_op=True)

    def _await_gathers(self, buckets: list[int]) -> None:
        """Buckets `buckets` hold the last step's weights from here on (in stream order); starts the
        step's deferred all-gathers first if they are due."""
        if self.gather_due:
            self.gather_due = False
            self._start_gathers(self.gather_order)
        self._wait_gathers(buckets)

    def _wait_gathers(self, buckets: list[int]) -> None:
        for i in buckets:
            work = self.gathers.pop(i, None)
            if work is not None:
                work.wait()
