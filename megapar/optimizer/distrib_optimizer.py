"""ZeRO-1 (`--use-distributed-optimizer`): AdamW whose fp32 master weights and moments are
sharded over the data-parallel group.

Layout. The GradBuffer (mode="reduce_scatter") lays every gradient out in one flat fp32 buffer,
cut into buckets each padded to a multiple of dp; dp rank d owns shard d of every bucket. This
optimizer mirrors that layout three times:
  * param buffer (model dtype, full size): every model parameter becomes a view of it
    (`p.data = param_buf[range]`), so the all-gather after the step writes straight into the
    model, bucket by bucket;
  * master shard (fp32): the concatenation of this rank's owned shards, one per bucket. For an
    fp32 model the owned shards of the param buffer *are* the masters (no copy, like the
    non-sharded optimizer, whose fp32 masters are the parameters);
  * exp_avg / exp_avg_sq shards (fp32), laid out like the master shard.
Each parameter contributes to AdamW the part of it that falls in an owned shard ("part": a view
of the master shard), with `.grad` the matching view of the reduce-scattered grad buffer and
torch state pre-seeded with views of the moment shards. Parts keep the weight-decay group of
their parameter (no decay for 1-D parameters).

step():  [fp16] unscale the owned grads, inf/nan on any rank -> every rank skips
         global norm: each rank's owned parts of the parameters that `counts_for_norm`,
         summed over `norm_group` (every rank: tp x pp x dp) -> clip owned grads
         AdamW (fused on CUDA, foreach on CPU) on the owned parts
         masters -> param buffer (cast), all-gather each bucket over the DP group

Checkpoints: `state_for_save()` (collective over the DP group) all-gathers the shards bucket by
bucket and returns, on dp rank 0, the same name-keyed full state as MixedPrecisionOptimizer
(None on other dp ranks); `load_saved_state()` takes each rank's parts of that full state, so a
checkpoint loads at any data-parallel size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..tensor_parallel.mappings import all_gather_tensor
from .grad_buffer import GradBuffer
from .optimizer import (adam_state, adamw_update, clip_grads_, counts_for_norm, decay_groups, global_norm,
                        make_adamw, resolve_adam_impl, saved_param_groups, unscale_and_check)


@dataclass
class Part:
    """The piece of parameter `name` this dp rank owns: [p_lo, p_hi) of the flattened
    parameter = [buf_lo, buf_hi) of the grad/param buffers = [lo, hi) of the shard buffers."""
    name: str
    param: nn.Parameter
    p_lo: int
    p_hi: int
    buf_lo: int
    buf_hi: int
    lo: int
    hi: int


class DistributedOptimizer:
    """ZeRO-1 AdamW; same interface as MixedPrecisionOptimizer plus `is_distributed = True`."""

    is_distributed = True

    def __init__(self, model: nn.Module, grad_buffer: GradBuffer, cfg, scaler, tp_rank: int,
                 dp_group: Optional[dist.ProcessGroup], norm_group: Optional[dist.ProcessGroup] = None,
                 inf_group: Optional[dist.ProcessGroup] = None):
        """grad_buffer: built over this model's parameters with mode="reduce_scatter" and
        `dp_group`. norm_group: every rank whose owned shards together make up the whole
        model's gradient (all tp x pp x dp ranks; None = the world when torch.distributed is
        initialised). inf_group: every rank (an overflow anywhere skips the step everywhere).
        Model parameters are re-pointed into a flat buffer (their values are kept)."""
        if grad_buffer.dp > 1 and grad_buffer.mode != "reduce_scatter":
            raise ValueError("DistributedOptimizer needs a GradBuffer built with mode='reduce_scatter'")
        self.cfg, self.buffer, self.scaler = cfg, grad_buffer, scaler
        self.dp_group, self.inf_group = dp_group, inf_group
        self.norm_group = norm_group if norm_group is not None or not dist.is_initialized() else dist.group.WORLD
        self.dp, self.dp_rank = grad_buffer.dp, grad_buffer.dp_rank
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        missing = [n for n, p in self.named if id(p) not in grad_buffer.param_range]
        if missing:
            raise ValueError(f"parameters {missing[:3]} are not in the gradient buffer")
        self.device, self.dtype = grad_buffer.data.device, self.named[0][1].dtype
        if any(p.dtype != self.dtype for _, p in self.named):
            raise ValueError("DistributedOptimizer needs every parameter in one dtype")
        self._build_buffers()
        self.parts = self._plan_parts()
        self.masters = [self._master(pt) for pt in self.parts]   # AdamW's params (its state is keyed by them)
        # Fixed for the run (the flat buffers never move): this rank's gradient parts, and the owned
        # ranges of the param buffer that the fused AdamW writes (None: fp32, the master is the param).
        self.grads = [self.buffer.data[pt.buf_lo:pt.buf_hi] for pt in self.parts]
        self.norm_grads = [g for pt, g in zip(self.parts, self.grads) if counts_for_norm(pt.name, tp_rank)]
        low = self.master_shard is not None
        self.params = [self.param_buf[pt.buf_lo:pt.buf_hi] if low else None for pt in self.parts]
        self.adam = make_adamw(decay_groups([(pt.name, pt.param, m) for pt, m in zip(self.parts, self.masters)], cfg),
                               cfg, self.device)
        self._torch_fused = bool(self.adam.defaults.get("fused"))
        self.adam_impl = resolve_adam_impl(cfg.adam_impl, self.device)
        self._reset_moments(step=0)

    # ---- layout --------------------------------------------------------------------------
    def _shard_ranges(self) -> list[tuple[int, int, int]]:
        """Per bucket: (buf_lo, buf_hi, offset in the shard buffers) of this rank's shard."""
        out, offset = [], 0
        for b in self.buffer.buckets:
            lo, hi = b.shard(self.dp_rank, self.dp)
            out.append((lo, hi, offset))
            offset += hi - lo
        return out

    def _build_buffers(self) -> None:
        self.shards = self._shard_ranges()
        shard_numel = sum(hi - lo for lo, hi, _ in self.shards)
        self.param_buf = torch.zeros_like(self.buffer.data, dtype=self.dtype)
        with torch.no_grad():
            for n, p in self.named:
                start, end = self.buffer.param_range[id(p)]
                self.param_buf[start:end].copy_(p.detach().reshape(-1))
                p.data = self.param_buf[start:end].view_as(p)
        f32 = dict(dtype=torch.float32, device=self.device)
        self.master_shard = None if self.dtype == torch.float32 else torch.zeros(shard_numel, **f32)
        if self.master_shard is not None:
            for lo, hi, off in self.shards:
                self.master_shard[off:off + hi - lo].copy_(self.param_buf[lo:hi])
        self.exp_avg, self.exp_avg_sq = torch.zeros(shard_numel, **f32), torch.zeros(shard_numel, **f32)

    def _plan_parts(self) -> list[Part]:
        names = {id(p): n for n, p in self.named}
        parts = []
        for b, (lo, hi, off) in zip(self.buffer.buckets, self.shards):
            for p in b.params:
                start, end = self.buffer.param_range[id(p)]
                a, z = max(lo, start), min(hi, end)
                if a < z:
                    parts.append(Part(names[id(p)], p, a - start, z - start, a, z, off + a - lo, off + z - lo))
        return parts

    def _master(self, pt: Part) -> torch.Tensor:
        if self.master_shard is None:
            return self.param_buf[pt.buf_lo:pt.buf_hi]
        return self.master_shard[pt.lo:pt.hi]

    def _master_of_bucket(self, i: int) -> torch.Tensor:
        lo, hi, off = self.shards[i]
        return self.param_buf[lo:hi] if self.master_shard is None else self.master_shard[off:off + hi - lo]

    def _reset_moments(self, step: int) -> None:
        """Seed torch's AdamW state with views of the flat moment shards."""
        self.fused_adam = None  # --adam-impl fused: (re)built at the next step over the new state
        for pt, m in zip(self.parts, self.masters):
            self.adam.state[m] = adam_state(step, self.exp_avg[pt.lo:pt.hi],
                                                           self.exp_avg_sq[pt.lo:pt.hi], self._torch_fused)

    @property
    def param_groups(self) -> list[dict]:
        return self.adam.param_groups

    def optimizer_state_bytes(self) -> int:
        """Bytes of fp32 master weights and Adam moments this rank holds (~12/dp per parameter;
        for fp32 models the masters are the owned part of the parameters themselves)."""
        shard_numel = self.exp_avg.numel()
        return 3 * 4 * shard_numel

    # ---- step ------------------------------------------------------------------------------
    def step(self) -> tuple[bool, torch.Tensor]:
        """Returns (applied, grad_norm as a device tensor); applied is False when fp16 overflow
        skipped the step.
        Call after `grad_buffer.finish()`. Collective over every rank."""
        if self.cfg.fp16:
            found_inf = unscale_and_check(self.grads, self.scaler.scale, self.device, self.inf_group)
            self.scaler.update(found_inf)
            if found_inf:
                return False, torch.full((), float("nan"), device=self.device)
        norm = global_norm(self.norm_grads, self.norm_group, self.device)
        clip_grads_(self.grads, norm, self.cfg.clip_grad, self.adam)
        self.fused_adam = adamw_update(self.adam, self.adam_impl, self.fused_adam, self.masters, self.grads,
                                       self.params)
        self._publish_params(copy=self.fused_adam is None)
        return True, norm

    @torch.no_grad()
    def _publish_params(self, copy: bool = True) -> None:
        """Owned masters -> param buffer (model dtype) unless the optimizer wrote it (copy=False),
        then all-gather every bucket."""
        handles = []
        for i, (b, (lo, hi, _)) in enumerate(zip(self.buffer.buckets, self.shards)):
            if copy and self.master_shard is not None:
                self.param_buf[lo:hi].copy_(self._master_of_bucket(i))
            if self.dp > 1:
                handles.append(all_gather_tensor(self.param_buf[b.start:b.end], self.param_buf[lo:hi],
                                                 group=self.dp_group, async_op=True))
        for h in handles:
            h.wait()

    # ---- checkpoint state (name-keyed, full over dp) ------------------------------------------
    def _gather_full(self, kind: str) -> Optional[torch.Tensor]:
        """The full flat (buffer-layout) fp32 tensor of `kind` on dp rank 0 (CPU), else None."""
        full = torch.zeros(self.buffer.data.numel(), dtype=torch.float32) if self.dp_rank == 0 else None
        for i, (b, (lo, hi, off)) in enumerate(zip(self.buffer.buckets, self.shards)):
            shard = self._master_of_bucket(i) if kind == "master_param" else \
                getattr(self, kind)[off:off + hi - lo]
            shard = shard.float().contiguous()
            if self.dp > 1:
                out = torch.empty(b.end - b.start, dtype=torch.float32, device=self.device)
                all_gather_tensor(out, shard, group=self.dp_group)
            else:
                out = shard
            if full is not None:
                full[b.start:b.end].copy_(out)
        return full

    def state_for_save(self) -> Optional[dict]:
        """Collective over the DP group. On dp rank 0: {"state": {name: {master_param, exp_avg,
        exp_avg_sq}} (full, unsharded tensors), "step", "grad_scaler", "param_groups"} -- the
        format of MixedPrecisionOptimizer.state_for_save. None on the other dp ranks."""
        fulls = {k: self._gather_full(k) for k in ("master_param", "exp_avg", "exp_avg_sq")}
        step = self._step_count()                       # collective too
        if self.dp_rank != 0:
            return None
        state = {}
        for n, p in self.named:
            start, end = self.buffer.param_range[id(p)]
            state[n] = {k: f[start:end].view(p.shape).clone() for k, f in fulls.items()}
        return {"state": state, "step": step, "grad_scaler": self.scaler.state_dict(),
                "param_groups": saved_param_groups(self.adam)}

    def _step_count(self) -> int:
        """Completed AdamW steps (every part has the same count; agreed over dp)."""
        step = torch.zeros(1, dtype=torch.float32, device=self.device)
        if self.masters:
            step.fill_(float(self.adam.state[self.masters[0]]["step"]))
        if self.dp > 1:
            dist.all_reduce(step, op=dist.ReduceOp.MAX, group=self.dp_group)
        return int(step.item())

    def load_saved_state(self, saved: dict, load_moments: bool = True) -> None:
        """Take this rank's parts of a full name-keyed state (saved at any dp, or by the
        non-sharded optimizer); also sets the model parameters to the saved masters."""
        missing = [n for n, _ in self.named if n not in saved["state"]]
        if missing:
            raise ValueError(f"optimizer state in checkpoint lacks parameters {missing[:3]}...")
        for n, p in self.named:
            if saved["state"][n]["master_param"].numel() != p.numel():
                raise ValueError(f"optimizer state for {n} has shape {tuple(saved['state'][n]['master_param'].shape)}, "
                                 f"the model's parameter {tuple(p.shape)}")
        with torch.no_grad():
            for n, p in self.named:
                p.copy_(saved["state"][n]["master_param"].view(p.shape))
            self.exp_avg.zero_()
            self.exp_avg_sq.zero_()
            for pt, m in zip(self.parts, self.masters):
                src = saved["state"][pt.name]
                if self.master_shard is not None:
                    m.copy_(src["master_param"].reshape(-1)[pt.p_lo:pt.p_hi])
                if load_moments:
                    self.exp_avg[pt.lo:pt.hi].copy_(src["exp_avg"].reshape(-1)[pt.p_lo:pt.p_hi])
                    self.exp_avg_sq[pt.lo:pt.hi].copy_(src["exp_avg_sq"].reshape(-1)[pt.p_lo:pt.p_hi])
        self._reset_moments(step=int(saved["step"]) if load_moments else 0)
        self.scaler.load_state_dict(saved["grad_scaler"])

    def memory_report(self) -> str:
        """One log line: optimizer-state bytes on this rank vs the non-sharded optimizer."""
        full = 3 * 4 * sum(p.numel() for _, p in self.named)
        mine = self.optimizer_state_bytes()
        return (f"distributed optimizer (ZeRO-1, dp={self.dp}): optimizer state {mine / 2**20:.2f} MiB on this rank "
                f"({mine / max(full, 1):.3f} of the non-sharded {full / 2**20:.2f} MiB)")
