"""One flat fp32 buffer holding every parameter's gradient, reduced over data parallelism.

Each parameter gets `param.main_grad`, a view into the buffer. A hook after each backward
accumulation adds `param.grad` into `main_grad` (fp32 accumulation across microbatches, whatever
the parameter dtype) and frees `param.grad`; linear-layer weights and biases with
gradient-accumulation fusion were accumulated by backward itself (tensor_parallel/linear.py),
which hands autograd no gradient for them: their hook (still run, with `param.grad` None) adds
nothing. Vectors (LayerNorm weights and biases, unfused biases) are small and many, ~100 in GPT-2
345M, and one launch each for their fp32 += bf16 adds showed in the H100 profile
(docs/benchmarks/log_h100_20261121.md#performance-log-predicted-vs-measured): the hook queues them, and when the
bucket is complete (or in `finish()`) they are concatenated, cast once and added with one
multi-tensor add (a foreach add straight from bf16 into fp32 would fall back to one add per tensor,
as torch's foreach ops need equal dtypes).

The buffer is cut into buckets (parameters in reverse registration order, roughly the order
backward produces them). Each bucket is padded to a multiple of dp, so it splits into dp equal
shards; data-parallel rank d owns shard d of every bucket (the ZeRO-1 layout; with a single
bucket the buffer is simply cut into dp equal ranges). Reduction per bucket is either
  * all_reduce      (plain data parallelism: every rank gets the full averaged gradient), or
  * reduce_scatter  (ZeRO-1: each rank gets the averaged gradient of the shard it owns).
With `overlap=True` (and more than one dp rank) a bucket's collective starts asynchronously as soon
as its last gradient arrives during the final microbatch's backward; `finish()` waits for all of
them. Without it the fused parameters get no hook at all (each would cost a Python call per
microbatch and do nothing).

The sums travel in `reduce_dtype` (--grad-reduce-dtype): fp32 by default (Megatron's), or bf16 /
fp16, half the bytes, as DeepSpeed's communication_data_type: each bucket is divided by dp in
fp32, cast, reduced, and the result cast back into the fp32 buffer (`reduce`), so accumulation
across microbatches and the optimizer still see fp32.

`tp_summed` parameters (sequence parallelism: LayerNorms and row-parallel biases, which each TP rank
applied to other tokens) hold partial gradients: `finish()` then sums them over `tp_group` as one
flat all-reduce, after the data-parallel reduction, which commutes with it (with ZeRO-1 only the
owned ranges were reduced, and only those are read).
"""
from __future__ import annotations

import bisect
import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..tensor_parallel.linear import fuses, require_hooks_without_gradient
from ..tensor_parallel.mappings import reduce_scatter_tensor


REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class _CastBack:
    """A reduction in a narrower dtype under way: `wait()` completes it and copies the result into
    the fp32 destination."""

    def __init__(self, work, wire: torch.Tensor, dest: torch.Tensor):
        self.work, self.wire, self.dest = work, wire, dest

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.dest.copy_(self.wire)


def reduce(op: str, out: torch.Tensor, data: torch.Tensor, group: Optional[dist.ProcessGroup], dtype: torch.dtype,
           async_op: bool):
    """Average `data` over `group` with `op`: all_reduce (in place; `out` is `data`) or reduce_scatter
    (this rank's part into `out`), sent in `dtype`. NCCL averages inside the collective (its
    pre-multiplied sum: no pass of its own over `data`); other backends divide `data` in place first.
    Returns a handle to wait() on when `async_op`, else None once `out` holds the result."""
    if dist.get_backend(group) == "nccl":
        how = dist.ReduceOp.AVG
    else:
        data.div_(dist.get_world_size(group))
        how = dist.ReduceOp.SUM

    def collective(o: torch.Tensor, d: torch.Tensor):
        if op == "all_reduce":
            return dist.all_reduce(d, op=how, group=group, async_op=async_op)
        return reduce_scatter_tensor(o, d, op=how, group=group, async_op=async_op)

    if dtype == data.dtype:
        return collective(out, data)
    wire = data.to(dtype)
    wire_out = wire if op == "all_reduce" else torch.empty(out.shape, dtype=dtype, device=out.device)
    pending = _CastBack(collective(wire_out, wire), wire_out, out)
    if async_op:
        return pending
    pending.wait()
    return None


@dataclass
class Bucket:
    start: int                                 # [start, end) in the flat buffer (end padded to dp)
    end: int
    params: list[nn.Parameter]
    pending: set = field(default_factory=set)  # ids of params whose grads have not arrived yet
    handle: Optional[object] = None
    queued: dict = field(default_factory=dict)  # id(param) -> (main_grad, grad): vector grads not yet added

    def add_queued(self) -> None:
        """main_grad += grad for every queued vector gradient: one concatenation, one cast, one
        multi-tensor add."""
        if self.queued:
            main_grads, grads = zip(*self.queued.values())
            flat = torch.cat(grads).to(main_grads[0].dtype)                    # [sum of numels]
            torch._foreach_add_(list(main_grads), list(flat.split([g.numel() for g in grads])))
            self.queued.clear()

    def shard(self, dp_rank: int, dp: int) -> tuple[int, int]:
        """The [start, end) range of the buffer this dp rank owns within this bucket."""
        size = (self.end - self.start) // dp
        return self.start + dp_rank * size, self.start + (dp_rank + 1) * size

    def accumulate(self, p: nn.Parameter, add_grad: bool) -> None:
        """A gradient of `p` arrived: add it into `p.main_grad` (vectors queued for one multi-tensor
        add) and free `p.grad`; add_grad=False: backward accumulated it there itself (p.grad is None)."""
        if not add_grad:
            return
        if p.dim() == 1:
            if id(p) in self.queued:  # a second microbatch: no repeated tensor in one foreach
                self.add_queued()
            self.queued[id(p)] = (p.main_grad, p.grad)
        else:
            p.main_grad.add_(p.grad)
        p.grad = None


class ShardLayout:
    """Where this data-parallel rank's shard lies, computed once for the gradient buffer, the
    optimizer and the checkpoints: buckets end to end in one flat buffer, each padded to a multiple
    of dp and cut into dp equal shards (rank d owns shard d of every bucket); this rank's shards,
    concatenated in bucket order, form its shard buffer (ZeRO's fp32 masters and moments, ZeRO-2/3's
    gradient shard)."""

    def __init__(self, buckets: list[Bucket], dp: int, dp_rank: int):
        self.buckets, self.dp, self.dp_rank = buckets, dp, dp_rank
        self.starts = [b.start for b in buckets]
        self.offsets: list[int] = []    # per bucket: where its shard starts in the shard buffer
        pos = 0
        for b in buckets:
            self.offsets.append(pos)
            pos += (b.end - b.start) // dp
        self.numel = pos                # of the shard buffer

    def shard(self, i: int) -> tuple[int, int]:
        """Bucket i's [lo, hi) range of the flat buffer that this rank owns."""
        return self.buckets[i].shard(self.dp_rank, self.dp)

    def ranges(self) -> list[tuple[int, int, int]]:
        """Per bucket: (lo, hi, offset in the shard buffer) of this rank's shard."""
        return [(*self.shard(i), off) for i, off in enumerate(self.offsets)]

    def bucket_at(self, buf_pos: int) -> int:
        return bisect.bisect_right(self.starts, buf_pos) - 1

    def in_shard(self, buf_lo: int, buf_hi: int) -> tuple[int, int]:
        """The shard-buffer range of flat range [buf_lo, buf_hi), which lies in this rank's shard."""
        i = self.bucket_at(buf_lo)
        off = self.offsets[i] + buf_lo - self.shard(i)[0]
        return off, off + buf_hi - buf_lo


class GradReduction:
    """What both gradient buffers (this file's GradBuffer, sharded_grads.py's ShardedGradBuffer)
    share: the data-parallel group and the dtype the sums travel in, `no_sync`, the sum over the
    tensor-parallel group of the sequence-parallel parameters' gradients, and the ShardLayout
    (`layout`, set by the subclass once its buckets are laid out)."""
    mode: str
    layout: ShardLayout

    def __init__(self, dp_group: Optional[dist.ProcessGroup], tp_group: Optional[dist.ProcessGroup],
                 reduce_dtype: torch.dtype):
        self.dp_group, self.tp_group, self.reduce_dtype = dp_group, tp_group, reduce_dtype
        self.dp = 1 if dp_group is None else dist.get_world_size(dp_group)
        self.dp_rank = 0 if dp_group is None else dist.get_rank(dp_group)
        self.sync_enabled = True
        self.tp_summed: list[torch.Tensor] = []   # flat main_grad views summed over tp_group in finish()

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate only (no communication) inside this block: all but the last microbatch."""
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = True

    def _sum_over_tp(self) -> None:
        """The sequence-parallel parameters' partial gradients summed over tp_group (one flat
        all-reduce, after the data-parallel reduction, which commutes with it)."""
        if self.tp_summed:
            flat = torch.cat(self.tp_summed)
            dist.all_reduce(flat, group=self.tp_group)
            torch._foreach_copy_(self.tp_summed, list(flat.split([g.numel() for g in self.tp_summed])))


class GradBuffer(GradReduction):
    def __init__(self, params: Iterable[nn.Parameter], dp_group: Optional[dist.ProcessGroup],
                 mode: str = "all_reduce", bucket_numel: Optional[int] = None, overlap: bool = False,
                 late_params: Iterable[nn.Parameter] = (), tp_summed: Iterable[nn.Parameter] = (),
                 tp_group: Optional[dist.ProcessGroup] = None, reduce_dtype: torch.dtype = torch.float32):
        """late_params go into a final bucket that is only reduced in `finish()`, after its
        `before_late` callback (used to sum the tied embedding over the embedding group first)."""
        if mode not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"unknown grad-buffer mode {mode}")
        super().__init__(dp_group, tp_group, reduce_dtype)
        self.mode, self.overlap = mode, overlap and self.dp > 1   # one rank has nothing to overlap
        late = list(late_params)
        late_ids = {id(p) for p in late}
        params = [p for p in params if p.requires_grad and id(p) not in late_ids][::-1]
        device = (params or late)[0].device
        self.buckets = self._plan_buckets(params, bucket_numel) + ([Bucket(0, 0, late)] if late else [])
        self.param_range = self._lay_out()              # id(param) -> [start, end) in the buffer
        self.layout = ShardLayout(self.buckets, self.dp, self.dp_rank)
        self.device = device
        self.data = torch.zeros(self.buckets[-1].end if self.buckets else 0, dtype=torch.float32, device=device)
        if self.overlap:
            require_hooks_without_gradient(p for b in self.buckets for p in b.params)
        for b in self.buckets:
            for p in b.params:
                start, end = self.param_range[id(p)]
                p.main_grad = self.data[start:end].view_as(p)
                if self.overlap or not fuses(p):  # a fused parameter's hook only counts it for its bucket
                    p.register_post_accumulate_grad_hook(self._hook(b, add_grad=not fuses(p)))
        self.late_bucket = self.buckets[-1] if late else None
        self.tp_summed = [self.data[slice(*self.param_range[id(p)])] for p in tp_summed]

    # ---- layout ------------------------------------------------------------------------
    def _plan_buckets(self, params: list[nn.Parameter], bucket_numel: Optional[int]) -> list[Bucket]:
        buckets, current, size = [], [], 0
        for p in params:
            current.append(p)
            size += p.numel()
            if bucket_numel is not None and size >= bucket_numel:
                buckets.append(Bucket(0, 0, current))
                current, size = [], 0
        if current:
            buckets.append(Bucket(0, 0, current))
        return buckets

    def _lay_out(self) -> dict[int, tuple[int, int]]:
        """Lay buckets end to end, each padded to a multiple of dp; return each param's range."""
        ranges, pos = {}, 0
        for b in self.buckets:
            b.start = pos
            for p in b.params:
                ranges[id(p)] = (pos, pos + p.numel())
                pos += p.numel()
            pos += (-(pos - b.start)) % self.dp
            b.end = pos
        return ranges

    def owned_grad(self, buf_lo: int, buf_hi: int) -> torch.Tensor:
        """The (reduced) gradient of buffer range [buf_lo, buf_hi)."""
        return self.data[buf_lo:buf_hi]

    # ---- accumulation and reduction -------------------------------------------------------
    def _hook(self, bucket: Bucket, add_grad: bool) -> Callable[[nn.Parameter], None]:
        """add_grad=False: backward accumulates into main_grad itself (fixed once main_grad is set)."""
        def hook(p: nn.Parameter) -> None:
            bucket.accumulate(p, add_grad)
            if self.sync_enabled and self.overlap and bucket is not self.late_bucket:
                bucket.pending.discard(id(p))
                if not bucket.pending:
                    self._launch(bucket, async_op=True)
        return hook

    def start_step(self) -> None:
        """Reset for a new global batch: zero the gradients, arm the bucket triggers."""
        self.data.zero_()
        for b in self.buckets:
            b.pending, b.handle = {id(p) for p in b.params}, None

    def _launch(self, bucket: Bucket, async_op: bool) -> None:
        bucket.add_queued()
        if self.dp == 1 or bucket.handle is not None:
            bucket.handle = bucket.handle or "done"
            return
        view = self.data[bucket.start:bucket.end]
        out = view if self.mode == "all_reduce" else self.data[slice(*bucket.shard(self.dp_rank, self.dp))]
        bucket.handle = reduce(self.mode, out, view, self.dp_group, self.reduce_dtype, async_op) or "done"

    def finish(self, before_late: Optional[Callable[[], None]] = None) -> None:
        """Complete every bucket's reduction (launching those not yet started) and wait."""
        for b in self.buckets:
            if b is self.late_bucket and before_late is not None:
                b.add_queued()
                before_late()
            if b.handle is None:
                self._launch(b, async_op=self.overlap)
        for b in self.buckets:
            if b.handle not in (None, "done"):
                b.handle.wait()
            b.handle = "done"
        self._sum_over_tp()
