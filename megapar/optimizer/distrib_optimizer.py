"""ZeRO stages 1-3 (`--zero-stage`, `--use-distributed-optimizer` = 1): AdamW whose fp32 master
weights and moments are sharded over the data-parallel group (the shared step path, AdamW and the
checkpoint format: base.py). Stage 1 reads its gradients from the flat GradBuffer, stages 2-3 from
the ShardedGradBuffer's owned shard (sharded_grads.py); at stage 3 the layers' weights are the
ShardedParams' shards (sharded_params.py); `offload` keeps masters and moments on the CPU, and
`nvme_root` in files there (nvme.py), stepped chunk by chunk.

Layout. The GradBuffer (mode="reduce_scatter") lays every gradient out in one flat fp32 buffer,
cut into buckets each padded to a multiple of dp; dp rank d owns shard d of every bucket. This
optimizer mirrors that layout three times:
  * per bucket, a model-dtype tensor of the whole bucket: every model parameter becomes a view
    of it (`p.data = bucket[range]`), so the all-gather after the step writes straight into the
    model, bucket by bucket (a ZeRO-3 unit has none: its owned shard is the unit's, gathered by
    its next forward);
  * master shard (fp32): the concatenation of this rank's owned shards, one per bucket. For an
    fp32 model without offload the owned shards of the parameters *are* the masters (no copy,
    like the non-sharded optimizer, whose fp32 masters are the parameters);
  * exp_avg / exp_avg_sq shards (fp32), laid out like the master shard.
Each parameter contributes to AdamW the part of it that falls in an owned shard ("part": a view
of the master shard), with the matching view of the reduce-scattered grad buffer as its gradient
and torch state pre-seeded with views of the moment shards. Parts keep the weight-decay group of
their parameter (no decay for 1-D parameters).

Where the shared step differs from the non-sharded optimizer's:
  reduce   reduce-scatter: each rank's owned shards hold the dp-averaged gradient
  norm     each rank's owned parts of the parameters that `counts_for_norm`, summed over
           `norm_group` (every rank: tp x pp x dp)
  publish  masters -> owned model-dtype shards (cast), all-gather each whole bucket over the DP
           group
With offload the step runs on the host, chunk by chunk (offload.py: `HostStep`); with
`forward_units` the all-gathers wait for the next forward (param_gather.py: `ParamGather`).

Checkpoints: `saved_tensors()` (collective over the DP group) assembles on dp rank 0 one
parameter's full state at a time from the parts the dp ranks own: the same name-keyed state as
MixedPrecisionOptimizer's, streamed into the file; `load_saved_state()` takes each rank's parts
of that full state, so a checkpoint loads at any data-parallel size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..pinned import host_buffer
from .base import OPTIM_KINDS, BaseOptimizer, Owned, adam_state
from .nvme import CHUNK_NUMEL, KINDS, NvmeState
from .offload import HostStep
from .param_gather import ParamGather
from .sharded_params import ShardedParams


@dataclass
class Part:
    """The piece of parameter `name` this dp rank owns: [p_lo, p_hi) of the flattened
    parameter = [buf_lo, buf_hi) of the grad/param buffers (in bucket `bucket`) = [lo, hi) of
    the shard buffers."""
    name: str
    param: nn.Parameter
    bucket: int
    p_lo: int
    p_hi: int
    buf_lo: int
    buf_hi: int
    lo: int
    hi: int


class DistributedOptimizer(HostStep, ParamGather, BaseOptimizer):
    """ZeRO-1/2/3 AdamW: owns this dp rank's shard of every bucket of the gradient buffer."""

    is_distributed = True
    grad_buffer_mode = "reduce_scatter"

    def __init__(self, model: nn.Module, grad_buffer, cfg, scaler, tp_rank: int,
                 dp_group: Optional[dist.ProcessGroup], norm_group: Optional[dist.ProcessGroup] = None,
                 sharded_params: Optional[ShardedParams] = None,
                 offload: bool = False, stage: int = 1, nvme_root: Optional[str] = None, delayed: bool = False,
                 forward_units: Sequence[tuple[nn.Module, list[nn.Parameter]]] = ()):
        """grad_buffer: built over this model's parameters with mode="reduce_scatter" and
        `dp_group` (a GradBuffer at stage 1, a ShardedGradBuffer at stages 2-3). norm_group: every
        rank whose owned shards together make up the whole model's gradient (all tp x pp x dp
        ranks; None = the world when torch.distributed is initialised). sharded_params: stage 3's
        layer units, whose owned shards are the parameters this optimizer writes. offload: masters,
        moments and the AdamW step on the CPU; nvme_root (implies offload): masters and moments in
        files under nvme_root/rank_NNNNN/ (call `close()` at the end to delete them). delayed (needs
        offload): --delayed-param-update, the CPU step runs in the background and is published at
        the next step. forward_units: (module, the parameters its forward is the first to use), in
        forward order; given, with dp > 1 and no offload, the all-gathers after a step wait for the
        next forward, each bucket ahead of its first unit (`_gather_ahead`; build_zero gives them on
        GPUs, where NCCL gathers in place: gloo's all-gather would add a temporary copy of the
        bucket). Model parameters outside the units are re-pointed into one buffer per bucket (their
        values are kept)."""
        if norm_group is None and dist.is_initialized():
            norm_group = dist.group.WORLD
        self.stage, self.nvme_root = stage, nvme_root
        offload = offload or nvme_root is not None
        if delayed and not offload:
            raise ValueError("the delayed parameter update needs the offloaded (CPU) step")
        super().__init__(model, grad_buffer, cfg, scaler, tp_rank, norm_group, offload)
        self.dp_group, self.dp, self.dp_rank = dp_group, grad_buffer.dp, grad_buffer.dp_rank
        self.dtype = self.named[0][1].dtype
        if any(p.dtype != self.dtype for _, p in self.named):
            raise ValueError("DistributedOptimizer needs every parameter in one dtype")
        self.units = sharded_params.unit_of() if sharded_params is not None else {}
        self._build_buffers()
        self.parts = self._plan_parts()
        # The fused AdamW writes the owned model-dtype ranges (None: the master is the param).
        low = self.master_shard is not None and not offload
        self._own([Owned(pt.name, pt.param, self._master(pt), self.buffer.owned_grad(pt.buf_lo, pt.buf_hi),
                         self._owned_param(pt) if low else None) for pt in self.parts])
        self.chunks = self._plan_chunks(CHUNK_NUMEL) if offload else []
        if offload:
            self.step_grads = [self.cpu_grads[pt.lo:pt.hi] for pt in self.parts]
            self._stream_layer_grads()
            self._prepare_sends(delayed)
        self._reset_moments(step=0)
        self.gather_order: list[int] = []       # buckets whose all-gather waits for the next forward
        self.gathers: dict[int, object] = {}    # bucket -> its all-gather under way
        self.gather_due = False                 # the next forward starts them
        if forward_units and self.dp > 1 and not offload:
            self._gather_ahead(forward_units)

    # ---- layout --------------------------------------------------------------------------
    def _build_buffers(self) -> None:
        """Per bucket, the model-dtype tensors: the whole bucket (every parameter a view of it;
        None for a ZeRO-3 unit, whose weights are gathered on demand) and this rank's shard of it.
        Then the fp32 master and moment shards (on the CPU with offload)."""
        self.shards = self.buffer.layout.ranges()   # per bucket: (buf_lo, buf_hi, offset in the shard buffers)
        shard_numel = self.buffer.layout.numel
        self.bucket_params: list[Optional[torch.Tensor]] = []
        self.owned_params: list[torch.Tensor] = []
        for b, (lo, hi, _) in zip(self.buffer.buckets, self.shards):
            unit = self.units.get(id(b.params[0]))
            if unit is not None:
                self.bucket_params.append(None)
                self.owned_params.append(unit.shard)
                continue
            full = torch.zeros(b.end - b.start, dtype=self.dtype, device=self.device)           # [bucket]
            with torch.no_grad():
                for p in b.params:
                    start, end = self.buffer.param_range[id(p)]
                    full[start - b.start:end - b.start].copy_(p.detach().reshape(-1))
                    p.data = full[start - b.start:end - b.start].view_as(p)
            self.bucket_params.append(full)
            self.owned_params.append(full[lo - b.start:hi - b.start])
        pin = self.device.type == "cuda"  # host buffers the GPU copies from or into (megapar/pinned.py)
        separate = self.dtype != torch.float32 or self.offload
        self.nvme: Optional[NvmeState] = None
        if self.nvme_root is not None:  # the flat shards are memory maps of the files
            rank = dist.get_rank() if dist.is_initialized() else 0
            self.nvme = NvmeState(self.nvme_root, rank, shard_numel, pin=pin)
            self.master_shard, self.exp_avg, self.exp_avg_sq = (self.nvme.mapped[k] for k in KINDS)
        elif self.offload:  # the moments are never copied: not pinned
            self.master_shard = host_buffer(shard_numel, torch.float32, pinned=pin, zero=True)
            self.exp_avg, self.exp_avg_sq = (torch.zeros(shard_numel, dtype=torch.float32) for _ in range(2))
        else:
            f32 = dict(dtype=torch.float32, device=self.device)
            self.master_shard = torch.zeros(shard_numel, **f32) if separate else None
            self.exp_avg, self.exp_avg_sq = torch.zeros(shard_numel, **f32), torch.zeros(shard_numel, **f32)
        if self.master_shard is not None:
            for owned, (lo, hi, off) in zip(self.owned_params, self.shards):
                self.master_shard[off:off + hi - lo].copy_(owned)
        if self.offload:  # the reduced gradients come to the CPU for the step
            self.cpu_grads = host_buffer(shard_numel, torch.float32, pinned=pin, zero=True)

    def _plan_parts(self) -> list[Part]:
        names = {id(p): n for n, p in self.named}
        parts = []
        for i, (b, (lo, hi, off)) in enumerate(zip(self.buffer.buckets, self.shards)):
            for p in b.params:
                start, end = self.buffer.param_range[id(p)]
                a, z = max(lo, start), min(hi, end)
                if a < z:
                    parts.append(Part(names[id(p)], p, i, a - start, z - start, a, z, off + a - lo, off + z - lo))
        return parts

    def _owned_param(self, pt: Part) -> torch.Tensor:
        """The model-dtype weights of part `pt` (in its bucket's owned shard)."""
        lo = self.shards[pt.bucket][0]
        return self.owned_params[pt.bucket][pt.buf_lo - lo:pt.buf_hi - lo]

    def _master(self, pt: Part) -> torch.Tensor:
        if self.master_shard is None:
            return self._owned_param(pt)
        return self.master_shard[pt.lo:pt.hi]

    def _master_of_bucket(self, i: int) -> torch.Tensor:
        lo, hi, off = self.shards[i]
        return self.owned_params[i] if self.master_shard is None else self.master_shard[off:off + hi - lo]

    def _reset_moments(self, step: int) -> None:
        """Seed torch's AdamW state with views of the flat moment shards, at step count `step`."""
        fused = bool(self.adam.defaults.get("fused"))
        for pt, m in zip(self.parts, self.masters):
            self.adam.state[m] = adam_state(step, self.exp_avg[pt.lo:pt.hi], self.exp_avg_sq[pt.lo:pt.hi], fused)

    def optimizer_state_bytes(self) -> int:
        """Bytes of fp32 master weights and Adam moments this rank holds (~12/dp per parameter;
        for fp32 models the masters are the owned part of the parameters themselves)."""
        return 3 * 4 * self.exp_avg.numel()

    def memory_report(self) -> str:
        """One log line: optimizer-state bytes on this rank vs the non-sharded optimizer."""
        full = 3 * 4 * sum(p.numel() for _, p in self.named)
        mine = self.optimizer_state_bytes()
        where = (f"NVMe files (under {self.nvme.folder})" if self.nvme is not None else
                 "CPU" if self.offload else "GPU" if self.device.type == "cuda" else "CPU")
        return (f"distributed optimizer (ZeRO-{self.stage}, dp={self.dp}): optimizer state {mine / 2**20:.2f} MiB "
                f"on this rank's {where} ({mine / max(full, 1):.3f} of the non-sharded {full / 2**20:.2f} MiB)")

    def close(self) -> None:
        if self.offload:   # a delayed update still running finishes first (close runs in `finally`: raise nothing)
            self.worker.shutdown(wait=True)
        if self.nvme is not None:
            self.nvme.close()

    def finish_pending(self) -> None:
        """--delayed-param-update: the update running in the background finished, its weights sent to
        the device and all-gathered; with the all-gathers deferred to the next forward, those done now
        (always: a replayed CUDA graph leaves them due without telling the host), and still due for
        the next forward, so that a graph captured after this call captures them. Collective over dp."""
        if self.gather_order:
            self._start_gathers(self.gather_order)
            self._wait_gathers(self.gather_order)
        self._publish_delayed()

    def step(self) -> tuple[bool, torch.Tensor]:
        """BaseOptimizer's step, after publishing a delayed update still pending: step N's gradients
        were computed with the weights of step N - 2 (the ZeRO-Offload paper's one-step delay). The
        deferred all-gathers are not redone here: this step's forward already waited for them."""
        self._publish_delayed()
        return super().step()

    # ---- publish ---------------------------------------------------------------------------
    @torch.no_grad()
    def _publish_params(self, params_written: bool) -> None:
        """Owned masters -> owned model-dtype shards unless the update wrote them (the fused AdamW,
        the offloaded step's chunks), then all-gather every whole bucket over the DP group: now, or,
        with `gather_order`, in the next forward (a ZeRO-3 unit is gathered by its next forward)."""
        if self.offload and self.h2d is not None:   # the chunks' copies (_send)
            torch.cuda.current_stream(self.device).wait_stream(self.h2d)
            self.h2d.synchronize()                  # the host may write the masters again from here on
        if not params_written and self.master_shard is not None:
            for i in range(len(self.buffer.buckets)):
                self.owned_params[i].copy_(self._master_of_bucket(i))
        if self.gather_order:
            self.gather_due = True
            return
        if self.dp > 1:
            self._start_gathers(i for i, full in enumerate(self.bucket_params) if full is not None)
            self._await_gathers(list(self.gathers))

    # ---- checkpoint state (name-keyed, full over dp) ------------------------------------------
    def saved_tensors(self) -> Iterator[tuple[str, str, Optional[torch.Tensor]]]:
        """Collective over the DP group: each parameter's state assembled on dp rank 0 from the
        parts the dp ranks own, one parameter and kind at a time (never the whole state)."""
        bucket_of = {id(p): i for i, b in enumerate(self.buffer.buckets) for p in b.params}
        largest = max((p.numel() for _, p in self.named), default=0)
        # one buffer for every item, so rank 0 holds one parameter's state at a time
        buf = torch.empty(largest, dtype=torch.float32, device=self.device) if self.dp_rank == 0 else None
        for n, p in self.named:
            for kind in OPTIM_KINDS:
                yield n, kind, self._assembled(bucket_of[id(p)], p, kind, buf)

    def _assembled(self, i: int, p: nn.Parameter, kind: str, buf: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Parameter `p`'s full fp32 `kind` state (p's shape, on the host) on dp rank 0, assembled
        in `buf`; None on the others: each dp rank sends rank 0 its owned range of p in bucket `i`
        (point to point, so no other rank holds more than its own shard)."""
        start, end = self.buffer.param_range[id(p)]
        b = self.buffer.buckets[i]
        full = buf[:end - start] if buf is not None else None
        for d in range(self.dp):
            lo, hi = b.shard(d, self.dp)
            a, z = max(lo, start), min(hi, end)
            if a >= z:
                continue
            if d == self.dp_rank:
                mine = self._shard_state(i, kind)[a - lo:z - lo].to(self.device, torch.float32)
                if full is not None:
                    full[a - start:z - start].copy_(mine)
                else:
                    dist.send(mine, dist.get_global_rank(self.dp_group, 0), group=self.dp_group)
            elif full is not None:
                dist.recv(full[a - start:z - start], dist.get_global_rank(self.dp_group, d), group=self.dp_group)
        return None if full is None else full.view(p.shape).cpu()

    def _shard_state(self, i: int, kind: str) -> torch.Tensor:
        """This rank's owned shard of bucket `i` in the state `kind` (a view)."""
        if kind == "master_param":
            return self._master_of_bucket(i)
        lo, hi, off = self.shards[i]
        return getattr(self, kind)[off:off + hi - lo]

    def _step_count(self) -> int:
        """Completed AdamW steps, agreed over dp (collective; a rank may own no part)."""
        step = torch.full((1,), float(super()._step_count()), dtype=torch.float32, device=self.device)
        if self.dp > 1:
            dist.all_reduce(step, op=dist.ReduceOp.MAX, group=self.dp_group)
        return int(step.item())

    def owned_state(self) -> list:
        return [(pt.name, pt.param, pt.p_lo, pt.p_hi,
                 {"master_param": m, "exp_avg": self.exp_avg[pt.lo:pt.hi], "exp_avg_sq": self.exp_avg_sq[pt.lo:pt.hi]})
                for pt, m in zip(self.parts, self.masters)]

    def _finish_load(self, step: int) -> None:
        """The model weights were read with the masters (ZeRO-3 shards included): only the step count."""
        self._reset_moments(step)

    def _load_state(self, state: dict, step: int) -> None:
        """Every model parameter from its saved master (the non-owned ranges too, so no all-gather
        is needed), then this rank's parts of the masters and moments."""
        with torch.no_grad():
            for n, p in self.named:
                if id(p) not in self.units:
                    p.copy_(state[n]["master_param"].view(p.shape))
            for pt, m in zip(self.parts, self.masters):
                src = state[pt.name]
                if id(pt.param) in self.units:
                    self._owned_param(pt).copy_(src["master_param"].reshape(-1)[pt.p_lo:pt.p_hi])
                if self.master_shard is not None:
                    m.copy_(src["master_param"].reshape(-1)[pt.p_lo:pt.p_hi])
                self.exp_avg[pt.lo:pt.hi].copy_(src["exp_avg"].reshape(-1)[pt.p_lo:pt.p_hi])
                self.exp_avg_sq[pt.lo:pt.hi].copy_(src["exp_avg_sq"].reshape(-1)[pt.p_lo:pt.p_hi])
        self._reset_moments(step)
