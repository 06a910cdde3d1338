"""ZeRO-2/3 gradients: no full-size gradient buffer; each rank keeps the fp32 gradient shard it owns.

Units. Every transformer layer is one unit (one bucket), laid out as in sharded_params.py
(parameters end to end, padded to a multiple of dp; rank d owns shard d). Everything else (the
embeddings, the final LayerNorm, the last stage's tied embedding copy) is one persistent "edge"
bucket, as in the ZeRO-1 GradBuffer: it is used at both ends of the step and its tied copies are
summed over the embedding group before the data-parallel reduction.

Each layer's fp32 bucket is one tensor whose storage is sized 0 bytes except while backward
fills it; the parameters' `main_grad` are fixed views of it (the fused weight-gradient GEMMs
capture them at forward time; tensor_parallel/linear.py). Per microbatch, for each layer:
    its output's gradient arrives     the bucket gets its memory back, zeroed (the fused GEMMs
                                      accumulate there, hooks add the other gradients)
    the layer's last gradient arrives reduce-scatter the bucket (averaged, asynchronously) into
                                      this rank's shard (the step's first microbatch), or into a
                                      buffer added to the shard once it lands; then free the
                                      bucket's memory
So gradients are reduced every microbatch (the price of not keeping a full buffer), and at most
`max_in_flight` buckets exist at a time besides the one backward is filling. The edge bucket is
reduced once, in `finish()`.

The owned shards of all buckets are one flat fp32 tensor (`shard_data`) in the layout ZeRO-1's
optimizer already uses for its master shard, so DistributedOptimizer reads its gradients from
here (`owned_grad`) instead of from a full buffer.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..tensor_parallel.linear import fuses, require_hooks_without_gradient
from .grad_buffer import Bucket, GradReduction, ShardLayout, reduce
from .sharded_params import unit_offsets


class ShardedGradBuffer(GradReduction):
    """`no_sync` (GradReduction's) only decides when a shard is final: layers are reduced every
    microbatch whatever is asked, as there is no full buffer to keep."""
    mode = "reduce_scatter"
    max_in_flight = 2

    def __init__(self, layers: list[nn.Module], edge_params: Iterable[nn.Parameter],
                 dp_group: Optional[dist.ProcessGroup], tp_summed: Iterable[nn.Parameter] = (),
                 tp_group: Optional[dist.ProcessGroup] = None,
                 on_layer_reduced: Optional[Callable[[int], None]] = None, reduce_dtype: torch.dtype = torch.float32):
        """layers: the transformer layers, in forward order; edge_params: every other trainable
        parameter. on_layer_reduced(i): called once layer i's gradients have been handed to the
        reduction (ZeRO-3 frees the layer's gathered weights there). reduce_dtype: the dtype the
        sums travel in (grad_buffer.reduce)."""
        super().__init__(dp_group, tp_group, reduce_dtype)
        self.on_layer_reduced = on_layer_reduced
        units = [[p for p in m.parameters() if p.requires_grad] for m in layers]
        edge = [p for p in edge_params if p.requires_grad]
        self.device = (units[0] if units else edge)[0].device
        self.buckets, self.param_range = self._lay_out(units + ([edge] if edge else []))
        self.layout = ShardLayout(self.buckets, self.dp, self.dp_rank)
        self.edge = self.buckets[-1] if edge else None
        self.shard_data = torch.zeros(self.layout.numel, dtype=torch.float32, device=self.device)  # [sum of shards]
        self.edge_data = torch.zeros(self.edge.end - self.edge.start if edge else 0, dtype=torch.float32,
                                     device=self.device)
        require_hooks_without_gradient(p for b in self.buckets for p in b.params)
        for i, b in enumerate(self.buckets):
            b.data = self.edge_data if b is self.edge else \
                torch.zeros(b.end - b.start, dtype=torch.float32, device=self.device)        # [bucket]
            for p in b.params:
                start, end = self.param_range[id(p)]
                p.main_grad = b.data[start - b.start:end - b.start].view_as(p)
            for p in b.params:
                p.register_post_accumulate_grad_hook(self._hook(i, b, add_grad=not fuses(p)))
            if b is not self.edge:
                self._free(b)                  # sets b.live
        for i, layer in enumerate(layers):
            layer.register_forward_hook(self._arm_on_output(i))
        self.tp_summed = [g for p in tp_summed for g in self._owned_views(p)]
        self.in_flight: list[tuple] = []
        self.unreduced = self._layer_indices()   # layers whose slot this step's reductions have not written
        self.on_shard_final: Optional[Callable[[int], None]] = None

    # ---- layout ----------------------------------------------------------------------------------
    def _lay_out(self, units: list[list[nn.Parameter]]) -> tuple[list[Bucket], dict[int, tuple[int, int]]]:
        buckets, ranges, pos = [], {}, 0
        for params in units:
            offsets, size = unit_offsets(params, self.dp)
            for p, off in zip(params, offsets):
                ranges[id(p)] = (pos + off, pos + off + p.numel())
            buckets.append(Bucket(pos, pos + size, params))
            pos += size
        return buckets, ranges

    def owned_grad(self, buf_lo: int, buf_hi: int) -> torch.Tensor:
        """The reduced gradient of buffer range [buf_lo, buf_hi), which lies in this rank's shard."""
        return self.shard_data[slice(*self.layout.in_shard(buf_lo, buf_hi))]

    def _owned_views(self, p: nn.Parameter) -> list[torch.Tensor]:
        start, end = self.param_range[id(p)]
        lo, hi = self.layout.shard(self.layout.bucket_at(start))
        a, z = max(lo, start), min(hi, end)
        return [self.owned_grad(a, z)] if a < z else []

    # ---- accumulation ------------------------------------------------------------------------------
    def _arm_on_output(self, i: int):
        def forward_hook(module, args, out) -> None:
            if torch.is_grad_enabled() and torch.is_tensor(out) and out.requires_grad:
                out.register_hook(lambda grad: self._allocate(i))
        return forward_hook

    @staticmethod
    def _free(b: Bucket) -> None:
        b.data.untyped_storage().resize_(0)
        b.live = False

    def _allocate(self, i: int) -> None:
        """Layer i's backward is about to run: give its bucket memory, zeroed."""
        b = self.buckets[i]
        for item in [x for x in self.in_flight if x[2] == i]:  # its previous microbatch still travelling
            self.in_flight.remove(item)
            self._complete(item)                              # (frees the bucket)
        if b.live:                                            # already being filled in this backward
            return
        b.data.untyped_storage().resize_(b.data.numel() * b.data.element_size())
        b.data.zero_()
        b.live, b.pending = True, {id(p) for p in b.params}

    def _hook(self, i: int, b: Bucket, add_grad: bool) -> Callable[[nn.Parameter], None]:
        def hook(p: nn.Parameter) -> None:
            b.accumulate(p, add_grad)
            if b is not self.edge:
                b.pending.discard(id(p))
                if not b.pending:
                    self._reduce_layer(i)
        return hook

    # ---- reduction ---------------------------------------------------------------------------------
    def _shard_slot(self, i: int) -> torch.Tensor:
        lo, hi = self.layout.shard(i)
        off = self.layout.offsets[i]
        return self.shard_data[off:off + hi - lo]

    def _reduce_layer(self, i: int) -> None:
        """Hand layer i's bucket to the reduction (freed once the reduction completes)."""
        b = self.buckets[i]
        b.add_queued()
        while len(self.in_flight) >= self.max_in_flight:
            self._complete(self.in_flight.pop(0))
        slot, first = self._shard_slot(i), i in self.unreduced
        self.unreduced.discard(i)
        if self.dp == 1:
            (slot.copy_ if first else slot.add_)(b.data)
            self._free(b)
            self._shard_done(i)
        else:   # the step's first reduction of the layer lands in its slot, later ones are added to it
            out = slot if first else torch.empty_like(slot)
            work = reduce("reduce_scatter", out, b.data, self.dp_group, self.reduce_dtype, async_op=True)
            self.in_flight.append((work, None if first else out, i))
        if self.on_layer_reduced is not None:
            self.on_layer_reduced(i)

    def _complete(self, item: tuple) -> None:
        work, out, i = item   # out: None where the reduction wrote the shard slot itself
        work.wait()
        if out is not None:
            self._shard_slot(i).add_(out)
        self._free(self.buckets[i])
        self._shard_done(i)

    def _shard_done(self, i: int) -> None:
        """Layer i's shard holds its final gradient when the last microbatch's reduction lands;
        `on_shard_final(i)` may take it from there (the offloaded optimizer streams it to the host)."""
        if self.sync_enabled and self.on_shard_final is not None:
            self.on_shard_final(i)

    def start_step(self) -> None:
        """A new global batch: each layer's first reduction writes its shard slot (no zeroing pass over
        the shard), the edge bucket accumulates from zero."""
        self.unreduced = self._layer_indices()
        self.edge_data.zero_()

    def _layer_indices(self) -> set[int]:
        return set(range(len(self.buckets) - (self.edge is not None)))

    def finish(self, before_late: Optional[Callable[[], None]] = None) -> None:
        """Complete the layers' reductions, then reduce the edge bucket (after `before_late`)."""
        while self.in_flight:
            self._complete(self.in_flight.pop(0))
        for i in self.unreduced:   # a layer without gradients in this step (none in GPT-2): zero
            self._shard_slot(i).zero_()
        self.unreduced.clear()
        if self.edge is not None:
            self.edge.add_queued()
            if before_late is not None:
                before_late()
            slot = self._shard_slot(len(self.buckets) - 1)
            if self.dp == 1:
                slot.copy_(self.edge_data)
            else:
                reduce("reduce_scatter", slot, self.edge_data, self.dp_group, self.reduce_dtype, async_op=False)
        self._sum_over_tp()
