"""The DistributedOptimizer's offloaded step, `HostStep` (as Megatron keeps cpu_offloading/ apart): AdamW on
the host chunk by chunk (whole parts of one bucket, up to nvme.CHUNK_NUMEL elements), each chunk's new masters
sent to the device while the CPU steps the next, the gradients brought to the host during backward. NVMe:
the chunks' state streams from the files (`NvmeState.stream`); the flat shards are memory maps of them, so
checkpoints read them as CPU offload's host buffers. `delayed` (--delayed-param-update): the chunks step on a
worker thread during the next forward and backward, and are sent at the next step (`finish_pending`).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import torch

from ..pinned import host_buffer
from .base import adamw_group_update
from .nvme import CHUNK_NUMEL, KINDS


@dataclass
class Chunk:
    """NVMe offload: what one streamed range steps: [lo, hi) of the shard buffers, covering whole
    consecutive parts of one bucket ((index in `parts`, AdamW param group) of each)."""
    bucket: int
    lo: int
    hi: int
    members: list[tuple[int, int]]


class HostStep:
    """A base of DistributedOptimizer: reads its layout (`shards`, `parts`, `owned_params`, the host shards,
    `cpu_grads`, `nvme`) and AdamW (`adam`, `masters`); `_prepare_sends` sets up the state of its own."""

    def _plan_chunks(self, limit: int) -> list[Chunk]:
        """Offload: the parts in shard order, cut into chunks of at most `limit` elements (or one part) that
        never straddle a bucket; a part is never split, so AdamW sees the tensors CPU offload gives it."""
        group_of = {id(m): g for g, group in enumerate(self.adam.param_groups) for m in group["params"]}
        chunks: list[Chunk] = []
        for j in sorted(range(len(self.parts)), key=lambda j: self.parts[j].lo):
            pt, member = self.parts[j], (j, group_of[id(self.masters[j])])
            last = chunks[-1] if chunks else None
            if last is not None and last.bucket == pt.bucket and last.hi == pt.lo and pt.hi - last.lo <= limit:
                last.hi = pt.hi
                last.members.append(member)
            else:
                chunks.append(Chunk(pt.bucket, pt.lo, pt.hi, [member]))
        return chunks

    def _prepare_sends(self, delayed: bool) -> None:
        """The side stream and device buffer the new weights travel through (GPUs), and the thread the
        delayed update runs on."""
        cuda = self.device.type == "cuda"
        self.h2d = torch.cuda.Stream(self.device) if cuda else None
        stage_numel = min(CHUNK_NUMEL, max((c.hi - c.lo for c in self.chunks), default=0))
        self.h2d_stage = torch.empty(stage_numel, dtype=torch.float32, device=self.device) \
            if cuda and self.dtype != torch.float32 else None
        self.delayed = delayed
        # --delayed-param-update on a GPU with a 16-bit model: the worker also casts each chunk's new
        # masters into this pinned copy (hidden behind the next step), so the exposed send moves 2 B
        # per parameter instead of 4 (the same rounding as the device's cast)
        self.host_weights = host_buffer(self.buffer.layout.numel, self.dtype, pinned=True) \
            if delayed and self.h2d_stage is not None else None
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megapar-delayed-update")
        self.pending: Optional[Future] = None   # the update running in the background
        self.unpublished = False                # it finished, the model does not have its weights yet

    def _apply_update(self) -> None:
        """Offload: AdamW over the host state chunk by chunk, each chunk's new weights copied to the
        device while the CPU steps the next one, then the all-gathers. --delayed-param-update: the
        steps only, on the worker thread (while the next step's forward and backward run), from a
        snapshot of the hyper-parameters; `finish_pending` publishes them."""
        if not self.offload:
            return super()._apply_update()
        hyper = ([dict(g) for g in self.adam.param_groups], getattr(self.adam, "grad_scale", None))
        if self.delayed:
            self.pending = self.worker.submit(self._step_chunks, hyper, False)
            return
        self._step_chunks(hyper, send=True)
        self._publish_params(params_written=True)

    def _step_chunks(self, hyper: tuple[list[dict], Optional[torch.Tensor]], send: bool) -> None:
        """Every chunk's AdamW (on the host state, or streamed from the NVMe files); send: each
        chunk's weights to the device after its step."""
        if send:
            self._start_sends()
        if self.nvme is not None:
            self.nvme.stream([(c.lo, c.hi - c.lo) for c in self.chunks],
                             lambda i, state: self._step_chunk(i, state, hyper, send))
            return
        shards = dict(zip(KINDS, (self.master_shard, self.exp_avg, self.exp_avg_sq)))
        for i, c in enumerate(self.chunks):
            self._step_chunk(i, {k: t[c.lo:c.hi] for k, t in shards.items()}, hyper, send)

    @torch.no_grad()
    def _step_chunk(self, i: int, state: dict[str, torch.Tensor], hyper: tuple[list[dict], Optional[torch.Tensor]],
                    send: bool) -> None:
        """AdamW on chunk `i`'s parts, its state (`state[kind]`: [lo, hi) of the shard buffers)
        resident or in NVMe's host slots, with the param groups and clipping divisor `hyper`; send:
        then its new masters to the owned model-dtype shard (an NVMe slot is refilled once this
        returns, so that copy is waited for)."""
        c = self.chunks[i]
        groups, grad_scale = hyper
        for g, group in enumerate(groups):
            mine = [j for j, gj in c.members if gj == g]
            if not mine:
                continue
            views = {k: [state[k][self.parts[j].lo - c.lo:self.parts[j].hi - c.lo] for j in mine] for k in KINDS}
            adamw_group_update(group, views["master_param"], [self.step_grads[j] for j in mine], views["exp_avg"],
                               views["exp_avg_sq"], [self.adam.state[self.masters[j]]["step"] for j in mine],
                               grad_scale)
        if send:
            self._send(c, state["master_param"], wait=self.nvme is not None)
        elif self.host_weights is not None:
            self.host_weights[c.lo:c.hi].copy_(state["master_param"])

    def _start_sends(self) -> None:
        """The weights about to be overwritten may still be read by queued work (the delayed update
        publishes right after backward): the copies wait for it."""
        if self.h2d is not None:
            self.h2d.wait_stream(torch.cuda.current_stream(self.device))

    @torch.no_grad()
    def _send(self, c: Chunk, masters: torch.Tensor, wait: bool = False) -> None:
        """Chunk `c`'s new weights (host: fp32 masters, or `host_weights`, already in the model's dtype)
        into its owned model-dtype shard. On GPUs, from pinned memory without blocking, on the `h2d`
        stream: fp32 through a device buffer, cast there (torch's own cross-dtype copy would cast on
        the CPU into pageable memory and copy that synchronously). wait: return once `masters` has
        been read."""
        off = self.shards[c.bucket][2]
        dst = self.owned_params[c.bucket][c.lo - off:c.hi - off]
        if self.h2d is None or dst.device.type != "cuda":   # a CPU run, or a ZeRO-3 shard kept on the CPU
            dst.copy_(masters)
            return
        with torch.cuda.stream(self.h2d):
            if self.h2d_stage is None or masters.dtype == dst.dtype:
                dst.copy_(masters, non_blocking=True)
            else:
                n = self.h2d_stage.numel()
                for a in range(0, masters.numel(), n):   # [piece] through the one buffer, in stream order
                    piece = self.h2d_stage[:min(n, masters.numel() - a)]
                    piece.copy_(masters[a:a + piece.numel()], non_blocking=True)
                    dst[a:a + piece.numel()].copy_(piece)
        if wait:
            self.h2d.synchronize()

    def _join(self) -> None:
        """Wait for the delayed update running in the background (re-raises its error)."""
        if self.pending is not None:
            future, self.pending = self.pending, None
            future.result()
            self.unpublished = True

    def settle_masters(self) -> None:
        """The masters hold the last step's values: a delayed update running in the background is
        waited for (it is published at the next step, as without the wait)."""
        if self.offload:
            self._join()

    def _publish_delayed(self) -> None:
        """--delayed-param-update: wait for the background update and send its weights to the model
        (collective over dp); nothing otherwise."""
        if not self.offload:
            return
        self._join()
        if self.unpublished:
            self.unpublished = False
            self._start_sends()
            weights = self.master_shard if self.host_weights is None else self.host_weights
            for c in self.chunks:
                self._send(c, weights[c.lo:c.hi])
            self._publish_params(params_written=True)

    def _stream_layer_grads(self) -> None:
        """Stages 2-3: copy each layer's gradient shard to the host as soon as the last microbatch's
        reduction completes it, on a side stream, while backward goes on through the earlier layers
        (fp16's copies carry the loss scale, which AdamW divides out). Not with sequence parallelism
        (`finish()` sums some shard ranges over tp after the layers are done)."""
        self.streamed: set[int] = set()
        self.d2h: Optional[torch.cuda.Stream] = None
        if not hasattr(self.buffer, "on_shard_final") or self.buffer.tp_summed:
            return
        self.d2h = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.buffer.on_shard_final = self._copy_out

    def _copy_out(self, i: int) -> None:
        self._join()   # the delayed update may still read the previous step's gradients
        lo, hi, off = self.shards[i]
        src, dst = self.buffer.owned_grad(lo, hi), self.cpu_grads[off:off + hi - lo]
        if self.d2h is None:
            dst.copy_(src)
        else:
            self.d2h.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.d2h):
                dst.copy_(src, non_blocking=True)
                src.record_stream(self.d2h)
        self.streamed.add(i)

    def _stage_grads(self) -> None:
        """Offload: the reduced gradient shard to the CPU for the step (the buckets not already
        streamed out during backward)."""
        if self.offload:
            for i, (lo, hi, off) in enumerate(self.shards):
                if i not in self.streamed:
                    self.cpu_grads[off:off + hi - lo].copy_(self.buffer.owned_grad(lo, hi), non_blocking=True)
            self.streamed.clear()
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
                if self.d2h is not None:
                    self.d2h.synchronize()
