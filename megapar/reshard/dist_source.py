"""Read a torch_dist checkpoint (megapar/checkpoint/dist.py) as canonical full tensors, one at a time.

The same interface as ShardedCheckpoint (names, full, spec, meta, optim_meta, release), so every
writer of a conversion (legacy shards at any layout, the canonical folder, Hugging Face) takes a
torch_dist checkpoint too. Stored tensors already are canonical (global shape, true vocabulary
rows), so `full` is one DCP read of one tensor, in one process.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..checkpoint.common import CheckpointError, iter_dir, read_saved_config, read_tracker
from ..checkpoint.dist import COMMON_FILE, Chunk, Entry, load_entries, read_common
from .source import _model_order

MODEL, OPTIM = "model.", "optim."


class DistSource:
    """Canonical view of a torch_dist checkpoint: `full(name, kind)` reads one tensor."""

    def __init__(self, root: str, iteration: Optional[int | str] = None):
        self.root = root
        if iteration is None:
            iteration = read_tracker(root)
            if iteration is None:
                raise CheckpointError(f"{root} holds no finished checkpoint (no latest_checkpointed_iteration.txt); "
                                      f"pass --iteration to pick one")
        self.iteration, self.dir = iteration, iter_dir(root, iteration)
        self.common = read_common(self.dir)
        self.saved = read_saved_config(self.common, os.path.join(self.dir, COMMON_FILE))
        self.reader = dcp.FileSystemReader(self.dir)
        try:
            stored = self.reader.read_metadata().state_dict_metadata
        except Exception as e:  # a missing or corrupt .metadata
            raise CheckpointError(f"torch_dist checkpoint {self.dir} has no readable .metadata ({type(e).__name__}); "
                                  f"it is incomplete: load an earlier iteration") from None
        self.stored = {k: v for k, v in stored.items() if isinstance(v, TensorStorageMetadata)}
        self.names = sorted((k[len(MODEL):] for k in self.stored if k.startswith(MODEL)), key=_model_order)
        self.has_optim = self.common["optimizer"] is not None
        self.distributed = bool(getattr(self.saved.args, "use_distributed_optimizer", False))

    def _fqn(self, name: str, kind: str) -> str:
        fqn = MODEL + name if kind == "param" else f"{OPTIM}{name}.{kind}"
        if fqn not in self.stored:
            raise CheckpointError(f"torch_dist checkpoint {self.dir} has no {kind} for {name}"
                                  + ("; convert with --no-optim" if kind != "param" else ""))
        return fqn

    def spec(self, name: str, kind: str = "param") -> tuple[tuple[int, ...], torch.dtype]:
        md = self.stored[self._fqn(name, kind)]
        return tuple(md.size), md.properties.dtype

    def full(self, name: str, kind: str = "param") -> torch.Tensor:
        shape, dtype = self.spec(name, kind)
        out = torch.empty(shape, dtype=dtype)
        load_entries({self._fqn(name, kind): Entry(shape, dtype, [Chunk((0,) * len(shape), out)])}, self.dir,
                     process_group=None)
        return out

    def optim_meta(self) -> Optional[dict]:
        return self.common["optimizer"]

    def meta(self) -> dict:
        layout, rng = self.common["layout"], self.common["rng_state"]
        tp, pp, dp = layout["tp"], layout["pp"], layout["dp"]
        rng_states = {} if rng is None else {(t, p): [rng[t + tp * dp * p]] for t in range(tp) for p in range(pp)}
        return {"format": "megapar-canonical", "version": 1, "args": self.saved.args,
                "model_config": self.common["model_config"], "iteration": self.iteration,
                "checkpoint_version": self.common["checkpoint_version"], "vocab_size": self.saved.model.vocab_size,
                "names": self.names, "has_optim": self.has_optim, "distributed_optimizer": self.distributed,
                "optim_meta": self.optim_meta(), "opt_param_scheduler": self.common["opt_param_scheduler"],
                "source_layout": {"tp": tp, "pp": pp, "dp": dp}, "rng_states": rng_states}

    def release(self) -> None:
        pass
