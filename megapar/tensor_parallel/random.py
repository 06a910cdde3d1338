"""RNG-state tracking for tensor parallelism, and activation checkpointing that replays it.

Two RNG streams per rank:
  * the default torch generator: seeded identically on every TP rank of a pipeline stage, used
    for dropout on replicated activations (embedding and hidden dropout), which must match;
  * the tracker's "model-parallel" stream: seeded differently per TP rank, used for dropout
    inside the TP region (attention probabilities of this rank's heads), which must differ.

`checkpoint(fn, *args)` runs `fn` without storing activations and recomputes it in backward
with every RNG stream restored to its forward-time state, so recomputed dropout masks match.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

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
    """Named RNG states that can be swapped in with `fork(name)`."""

    def __init__(self) -> None:
        self.states: dict[str, tuple[torch.Tensor, Any]] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name} already exists")
        saved = _get_state()
        torch.manual_seed(seed)
        self.states[name] = _get_state()
        _set_state(saved)

    def get_states(self) -> dict[str, tuple[torch.Tensor, Any]]:
        return {k: (v[0].clone(), None if v[1] is None else v[1].clone()) for k, v in self.states.items()}

    def set_states(self, states: dict[str, tuple[torch.Tensor, Any]]) -> None:
        self.states = {k: (v[0].clone(), None if v[1] is None else v[1].clone()) for k, v in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block on RNG stream `name`, then restore the default stream."""
        if name not in self.states:
            raise KeyError(f"RNG state {name} was never added (call seed_everything first)")
        outer = _get_state()
        _set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state()
            _set_state(outer)


_TRACKER = RNGStatesTracker()  # process-local RNG bookkeeping (not a process group or config)


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def seed_everything(seed: int, tp_rank: int, pp_rank: int) -> None:
    """Megatron's seeding: default stream seed+100*pp (same across TP, DP);
    model-parallel stream seed+2718+tp_rank (+100*pp)."""
    import random

    import numpy as np

    stage_seed = seed + 100 * pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed % 2**32)
    torch.manual_seed(stage_seed)
    _TRACKER.states.clear()
    _TRACKER.add(MODEL_PARALLEL_RNG, stage_seed + 2718 + tp_rank)


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, *args):
        ctx.fn = fn
        ctx.rng = _get_state()
        ctx.tracker = _TRACKER.get_states()
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
        # Recompute under the forward-time RNG states, then put the current ones back.
        now, now_tracker = _get_state(), _TRACKER.get_states()
        _set_state(ctx.rng)
        _TRACKER.set_states(ctx.tracker)
        try:
            with torch.enable_grad():
                outputs = ctx.fn(*inputs)
        finally:
            _set_state(now)
            _TRACKER.set_states(now_tracker)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, *[x.grad if torch.is_tensor(x) else None for x in inputs])


def checkpoint(fn: Callable, *args):
    """Activation checkpointing: forward without saving activations, recompute in backward."""
    return _CheckpointFunction.apply(fn, *args)
