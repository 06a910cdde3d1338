"""The Checkpointer: how a training run saves and loads, built once with the run.

It owns what every save and load of a run shares -- the --save/--load settings, the parts saved
(formats.Parts), the format of saves, the save in flight (--async-save) and the run's identity -- so
the training loop calls `save(iteration, consumed)` and `load()` and knows nothing of formats. Each
public method states its own guard (nothing to save, no save in flight), the way torchtitan's
checkpoint manager owns its "enabled?" checks once.

    save     the step's weights finished, the previous save published, NaN/Inf weights refused,
             then the format's save (in the background with --async-save)
    load     whichever format the tracker's iteration holds; a resume keeps the run's identity
    reserve  --async-save: the staging copies' host buffers, before the first step
    wait     the save in flight published (its failure raised)
    close    before an error ends the run: the save in flight finished, its failure only printed
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..config.settings import CheckpointConfig
from ..errors import NonFiniteLossError
from ..pipeline.p2p import set_step
from . import load_parts
from .common import CheckpointError, new_run_id, read_tracker
from .formats import Format, Parts, format_named


class Checkpointer:
    """Saves and loads one run's `parts` as `ckpt` says; collective (every rank calls each method).
    `args_of(consumed_samples)`: the `args` a checkpoint stores; `device`: where the ranks agree (the
    collectives' device)."""

    def __init__(self, ckpt: CheckpointConfig, parts: Parts, device: torch.device,
                 args_of: Callable[[int], argparse.Namespace]):
        self.ckpt, self.parts, self.device, self.args_of = ckpt, parts, device, args_of
        self.format: Format = format_named(ckpt.ckpt_format)
        self.saves: Optional[Any] = None      # --async-save: the AsyncSaves holding the save in flight
        if ckpt.async_save:
            from .dist import AsyncSaves       # torch.distributed.checkpoint: imported only when used
            self.saves = AsyncSaves(device)
        self.run_id: Optional[str] = None     # the checkpoints' identity: drawn at the first save, kept from a resume

    def _print(self, msg: str) -> None:
        if self.parts.rank == 0:
            print(msg, flush=True)

    def save(self, iteration: int, consumed_samples: int) -> None:
        """Save `iteration` to --save (after `consumed_samples` samples)."""
        ck, optimizer = self.ckpt, self.parts.optimizer
        optimizer.finish_pending()  # --delayed-param-update: the weights of the step being saved
        if self.saves is not None:
            self.saves.wait()       # the previous save is published before this one may be refused
        self.refuse_non_finite_weights(iteration)
        self._print(f" saving checkpoint at iteration {iteration:7d} to {ck.save}")
        # where a collective timeout during the save says this rank was (the next step's schedule resets it)
        set_step(label=f"saving iteration {iteration} to {ck.save}", schedule=None, phase=None, microbatch=None,
                 chunk=None, op=None)
        if self.run_id is None:     # this run's first save: one id for every rank
            drawn = [new_run_id() if self.parts.rank == 0 else None]
            dist.broadcast_object_list(drawn, src=0)
            self.run_id = drawn[0]
        self.format.save(ck.save, iteration, self.parts, self.args_of(consumed_samples),
                         save_optim=not ck.no_save_optim, save_rng=not ck.no_save_rng, run_id=self.run_id,
                         saves=self.saves)
        if self.saves is None:
            self._print(f"  successfully saved checkpoint at iteration {iteration:7d} to {ck.save}")
        else:
            self._print(f"  copied the state of iteration {iteration:7d} to host memory; writing it in the "
                        f"background")

    def load(self) -> tuple[int, int]:
        """Load --load -> (iteration, consumed samples); (0, 0) for a fine-tune or a --load without a
        checkpoint yet. A resume continues the run it loads (its identity); a fine-tune is a new run."""
        ck, found = self.ckpt, {}
        loaded = load_parts(ck.load, self.parts, load_optim=not ck.no_load_optim, load_rng=not ck.no_load_rng,
                            finetune=ck.finetune, found=found)
        if not ck.finetune:
            self.run_id = found.get("run_id")
        return loaded

    def reserve(self) -> None:
        """--async-save: allocate the host buffers of the staging copies before training (pinning takes
        seconds that would otherwise stall the first save)."""
        if self.saves is None or not self.ckpt.save:
            return
        from .dist import reserve_async_buffers
        start, p = time.time(), self.parts
        gib = reserve_async_buffers(self.saves, p.model, p.optimizer, p.model_config, p.topo, p.rank,
                                    save_optim=not self.ckpt.no_save_optim, sharded=p.sharded)
        self._print(f"> async saves: {gib:.2f} GiB of host memory on rank 0 for the staging copies "
                    f"({time.time() - start:.1f} s)")

    def wait(self) -> None:
        """Wait for the save in flight (--async-save), if any: the run ends only once it is published."""
        if self.saves is not None and self.saves.in_flight:
            self._print(f"> waiting for the background save to {self.ckpt.save} to complete")
            self.saves.wait()
            self._print(f"  successfully saved checkpoint to {self.ckpt.save}")

    def close(self) -> None:
        """Before an error ends the run: finish the save in flight (--async-save), so that it is either
        published or (failing) removed, never cut off by the exit. Its own failure is a note here: the
        error that ends the run is the one the user reads."""
        try:
            self.wait()
        except CheckpointError as e:
            self._print(f"> {e}")

    def refuse_non_finite_weights(self, iteration: int) -> None:
        """Before a save: NonFiniteLossError on every rank when any rank's weights (the model's, and the
        fp32 masters where the optimizer keeps its own) hold NaN/Inf, so the checkpoint already in --save
        is kept. An fp16 run whose weights overflowed skips every step after, and would save inf weights."""
        from .dist import model_pieces
        p = self.parts
        # ZeRO-3: the shards this rank holds
        named = [(pc.key, pc.views["param"]) for pc in model_pieces(p.model, p.sharded)]
        named += [("an fp32 master weight", m) for m in p.optimizer.masters if m is not None]
        finite = [_all_finite(t).to(self.device) for _, t in named]  # one read-back below, not one each
        ok = bool(torch.stack(finite).all()) if finite else True
        local = None if ok else next(name for name, t in named if not _all_finite(t))
        flag = torch.tensor([0.0 if local is None else 1.0 + p.rank], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0:
            return
        where = f"{local} on rank {p.rank}" if local is not None else f"rank {int(flag.item()) - 1}"
        kept = read_tracker(self.ckpt.save)
        then = (f"the checkpoint already there (iteration {kept}) is kept; lower --lr, use --bf16, or resume from it"
                if kept is not None else "no checkpoint was saved before it; lower --lr or use --bf16, and start "
                                         "again")
        raise NonFiniteLossError(f"refusing to save iteration {iteration} to {self.ckpt.save}: the weights hold "
                                 f"NaN/Inf ({where}); {then}")


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor: no NaN/Inf in `t`. Through its min and max (both propagate NaN), so the
    check allocates nothing the size of `t` (torch.isfinite would: a save must not need more memory)."""
    if t.numel() == 0:
        return torch.tensor(True, device=t.device)
    return torch.isfinite(torch.stack(torch.aminmax(t))).all()
