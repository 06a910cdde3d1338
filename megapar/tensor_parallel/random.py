"""RNG-state tracking for tensor parallelism, and activation checkpointing that replays it.

Two RNG streams per rank:
  * the default torch generator: seeded identically on every TP rank of a pipeline stage, used
    for dropout on replicated activations (embedding and hidden dropout), which must match;
  * the tracker's "model-parallel" stream: seeded differently per TP rank, used for dropout
    inside the TP region (attention probabilities of this rank's heads), which must differ.

On a GPU each tracker stream is a CUDA `torch.Generator` of its own, swapped into the device's
default generator by `fork` with `graphsafe_set_state` (a pointer swap: the stream advances in
place). A CUDA graph capture allows that swap but not `set_rng_state` (a copy through the host),
so dropout can be captured: the graph registers the tracker's generators (`generators()`) and
every replay then advances their philox offsets as an eager step would. On the CPU the streams
are plain state tensors swapped with `torch.set_rng_state`.

`checkpoint(fn, *args, rng=...)` runs `fn` without storing activations and recomputes it in
backward with every RNG stream restored to its forward-time state, so recomputed dropout masks
match; with `rng=False` (no dropout inside `fn`) nothing is saved or restored, which is what a
CUDA graph capture needs (reading an RNG state reads the host).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"


def _get_state() -> tuple[torch.Tensor, Any]:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_state(state: tuple[torch.Tensor, Any]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


class RNGStatesTracker:
    """Named RNG streams that can be swapped in with `fork(name)`: on `device` (a CUDA device)
    one generator each, else CPU state tensors."""

    def __init__(self) -> None:
        self.cpu: dict[str, torch.Tensor] = {}
        self.cuda: dict[str, torch.Generator] = {}
        self.device: Optional[torch.device] = None

    def reset(self, device: Optional[torch.device] = None) -> None:
        """Forget every stream; new ones live on `device` when it is a CUDA device."""
        self.cpu, self.cuda, self.device = {}, {}, None
        if device is not None and device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)

    def add(self, name: str, seed: int) -> None:
        if name in self.cpu:
            raise ValueError(f"RNG state {name} already exists")
        self.cpu[name] = torch.Generator().manual_seed(seed).get_state()
        if self.device is not None:
            self.cuda[name] = torch.Generator(device=self.device).manual_seed(seed)

    def generators(self) -> list[torch.Generator]:
        """The CUDA generators of the streams (a CUDA graph registers them before capturing)."""
        return list(self.cuda.values())

    def get_states(self) -> dict[str, tuple[torch.Tensor, Any]]:
        """{name: (CPU state, CUDA state or None)}, copies (a checkpoint stores them)."""
        return {k: (v.clone(), self.cuda[k].get_state() if k in self.cuda else None) for k, v in self.cpu.items()}

    def set_states(self, states: dict[str, tuple[torch.Tensor, Any]]) -> None:
        """Restore `get_states()`'s values, into the same generators (a captured graph keeps them)."""
        for k, (cpu, cuda) in states.items():
            self.cpu[k] = cpu.clone()
            if cuda is not None and self.device is not None:
                if k not in self.cuda:  # (a recompute restores states twice per layer: no new generator each time)
                    self.cuda[k] = torch.Generator(device=self.device)
                self.cuda[k].set_state(cuda)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block on RNG stream `name`, then restore the default stream."""
        if name not in self.cpu:
            raise KeyError(f"RNG state {name} was never added (call seed_everything first)")
        if name in self.cuda:
            default = torch.cuda.default_generators[self.device.index]
            outer = default.graphsafe_get_state()
            default.graphsafe_set_state(self.cuda[name])
            try:
                yield
            finally:
                default.graphsafe_set_state(outer)
            return
        outer = torch.get_rng_state()
        torch.set_rng_state(self.cpu[name])
        try:
            yield
        finally:
            self.cpu[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


_TRACKER = RNGStatesTracker()  # process-local RNG bookkeeping (not a process group or config)


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def seed_everything(seed: int, tp_rank: int, pp_rank: int, device: Optional[torch.device] = None) -> None:
    """Megatron's seeding: default stream seed+100*pp (same across TP, DP);
    model-parallel stream seed+2718+tp_rank (+100*pp), a generator on `device` if it is a GPU."""
    import random

    import numpy as np

    stage_seed = seed + 100 * pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed % 2**32)
    torch.manual_seed(stage_seed)
    _TRACKER.reset(device)
    _TRACKER.add(MODEL_PARALLEL_RNG, stage_seed + 2718 + tp_rank)


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, rng, *args):
        ctx.fn = fn
        ctx.rng = _get_state() if rng else None
        ctx.tracker = _TRACKER.get_states() if rng else None
        ctx.tensor_mask = [torch.is_tensor(a) for a in args]
        ctx.save_for_backward(*[a for a in args if torch.is_tensor(a)])
        ctx.others = [a for a in args if not torch.is_tensor(a)]
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, *grads):
        tensors, others = iter(ctx.saved_tensors), iter(ctx.others)
        inputs = []
        for is_tensor in ctx.tensor_mask:
            if is_tensor:
                t = next(tensors)
                inputs.append(t.detach().requires_grad_(t.requires_grad))
            else:
                inputs.append(next(others))
        with _rng_as_in_forward(ctx.rng, ctx.tracker), torch.enable_grad():
            outputs = ctx.fn(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *[x.grad if torch.is_tensor(x) else None for x in inputs])


@contextlib.contextmanager
def _rng_as_in_forward(rng, tracker):
    """Recompute under the forward-time RNG states (None: not saved), then put the current ones back."""
    if rng is None:
        yield
        return
    now, now_tracker = _get_state(), _TRACKER.get_states()
    _set_state(rng)
    _TRACKER.set_states(tracker)
    try:
        yield
    finally:
        _set_state(now)
        _TRACKER.set_states(now_tracker)


def checkpoint(fn: Callable, *args, rng: bool = True):
    """Activation checkpointing: forward without saving activations, recompute in backward.
    rng: `fn` draws random numbers (dropout), so the recompute must replay the forward's RNG
    states; pass False when it does not (then a CUDA graph can capture the checkpoint)."""
    return _CheckpointFunction.apply(fn, rng, *args)
