"""ZB-H1, the zero-bubble schedule of Qi et al. 2023 ("Zero Bubble Pipeline Parallelism") with
1F1B's activation memory. Knows nothing of GPT-2.

Each backward is split in two: B, the input gradient, sent to the previous stage at once (it is
on the critical path), and W, the weight gradients, which nothing downstream waits for. The
model's linear layers do the split (tensor_parallel/wgrad_store.py): inside `store.deferring()`
their backward queues the weight-gradient GEMMs, and `store.run_oldest()` runs one microbatch's
queue. Stage s of p runs, with F a forward:

    Warmup    min(p - s - 1, m) F                         (1F1B's)
    Steady    F, B, then W while more than s are pending   (one F and one B per step, as 1F1B)
    Cooldown  B, then W while more than s are pending
    Flush     the s (or fewer) W still pending

Stage s thus holds back s W's, which run at the end, where 1F1B's stage s sits idle while the
gradients of the last microbatches travel down to stage 0: with F = B = W in time the cooldown
bubble (p - 1)(F + B + W) shrinks to (p - 1)(F + B - W). A stage keeps at most p - s microbatches'
activations (F done, B not: 1F1B's bound) and at most p microbatches begun and not finished (F
done, W not: 1F1B's stage 0), which is ZB-H1's memory (ZB-H2, which holds more to remove the
warmup bubble too, is not offered). `cfg.stats`, when given, receives "order" (the (pass,
microbatch) list this stage ran), "peak_live_outputs" and "peak_unfinished".

Gradients are complete only after the last W, so every B and W runs under `cfg.no_sync()` and
the data-parallel reduction is left whole to the caller's `finish()` after the schedule (no bucket
is reduced during the last backward, as the overlapped 1F1B does). Without `cfg.wgrad_store`
(a model whose weights carry none) the schedule runs with W passes that do nothing: each
backward is then whole in B. Communication is 1F1B's, except that B's input gradient is sent
alone, before the W and the next forward's receive, so that the previous stage gets it at once.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from . import p2p
from ..tensor_parallel.wgrad_store import WeightGradStore
from .schedules import ForwardStep, Logs, ScheduleConfig, _Stage, backward_step, forward_only_pipelining


class _ZeroBubbleStage(_Stage):
    """A _Stage whose backward is B (the input gradient) and W (the deferred weight gradients)."""

    def __init__(self, forward_step: ForwardStep, data_iterator: Iterator, model: nn.Module, cfg: ScheduleConfig):
        super().__init__("zb-h1", forward_step, data_iterator, model, cfg)
        self.store = cfg.wgrad_store or WeightGradStore()
        if self.store.pending:
            raise RuntimeError("zero-bubble schedule: the weight-gradient store holds work of an earlier step")
        self.held_back = dist.get_rank(cfg.pp_group)       # stage s defers s W's
        self.order: list[tuple[str, int]] = []
        self.forwards = self.weights = 0
        self.peak_live = self.peak_unfinished = 0

    def forward(self, input_tensor: Optional[torch.Tensor], keep: bool = True) -> torch.Tensor:
        self.order.append(("F", self.forwards))
        self.forwards += 1
        output = super().forward(input_tensor)
        self.peak_live = max(self.peak_live, len(self.outputs))
        self.peak_unfinished = max(self.peak_unfinished, self.forwards - self.weights)
        return output

    def backward(self, output_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """B of the oldest microbatch in flight: its input gradient; its weight gradients are queued."""
        self.order.append(("B", self.backwards))
        self.backwards += 1
        with self.cfg.no_sync(), self.store.deferring():
            return backward_step(self.inputs.popleft(), self.outputs.popleft(), output_grad, self.cfg)

    def weight_passes(self, keep: int) -> None:
        """W of the oldest microbatches until `keep` are pending."""
        while self.store.pending > keep:
            self.order.append(("W", self.weights))
            self.weights += 1
            with self.cfg.no_sync():
                self.store.run_oldest()

    def backward_and_weights(self, output_grad: Optional[torch.Tensor]) -> None:
        """B, its input gradient sent to the previous stage at once, then the W's due."""
        p2p.send_backward(self.backward(output_grad), self.cfg)
        self.weight_passes(keep=self.held_back)

    def done(self) -> Logs:
        self.weight_passes(keep=0)
        if self.cfg.stats is not None:
            self.cfg.stats.update(order=list(self.order), peak_live_outputs=self.peak_live,
                                  peak_unfinished=self.peak_unfinished)
        return super().done()


def forward_backward_pipelining_zb_h1(forward_step: ForwardStep, data_iterator: Iterator, model: nn.Module,
                                      cfg: ScheduleConfig, forward_only: bool = False) -> Logs:
    """ZB-H1 on this stage (module docstring). Returns the per-microbatch logs (empty off the last stage)."""
    if forward_only:
        return forward_only_pipelining(forward_step, data_iterator, model, cfg, "zb-h1")
    m, p = cfg.num_microbatches, dist.get_world_size(cfg.pp_group)
    num_warmup = min(p - dist.get_rank(cfg.pp_group) - 1, m)
    num_steady = m - num_warmup
    run = _ZeroBubbleStage(forward_step, data_iterator, model, cfg)
    try:
        # Warmup: forwards only, filling the pipeline (1F1B's)
        for i in range(num_warmup):
            run.at("warmup", i)
            output = run.forward(p2p.recv_forward(cfg))
            p2p.send_forward(output, cfg)
            run.sent(output)

        # Steady state: one forward, one B (sent at once), then the W's due
        run.at("steady", num_warmup)
        input_tensor = p2p.recv_forward(cfg) if num_steady > 0 else None
        for i in range(num_steady):
            run.at("steady", f"{num_warmup + i} (forward), {i} (backward)")
            output = run.forward(input_tensor)
            output_grad = p2p.send_forward_recv_backward(output, cfg)
            run.sent(output)
            run.backward_and_weights(output_grad)
            if i < num_steady - 1:
                run.at("steady", f"{num_warmup + i + 1} (forward)")
                input_tensor = p2p.recv_forward(cfg)

        # Cooldown: the remaining B's, W's filling the waits between them; then the held-back W's
        for i in range(num_steady, m):
            run.at("cooldown", i)
            run.backward_and_weights(p2p.recv_backward(cfg))
        run.at("flush", None)
        return run.done()
    except BaseException:
        run.store.clear()
        raise
