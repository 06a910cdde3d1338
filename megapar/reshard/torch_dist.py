"""torch_dist checkpoints (megapar/checkpoint/dist.py) in the conversion tools: read one as canonical
full tensors, one at a time (`DistSource`, the interface of ShardedCheckpoint), and write any source
as one (`write_dist`), in one process.

Stored tensors already are canonical (global shape, true vocabulary rows), so `full` is one DCP
read of one tensor, and the writer hands DCP each canonical tensor as it is written (at most one
source tensor in memory). A written checkpoint keeps the source's args and LR schedule; it holds no
RNG state (the ranks of the source layout do not carry over).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..atomic import atomic_write_text
from ..optimizer.base import OPTIM_KINDS
from ..checkpoint.common import (TRACKER, CheckpointError, atomic_torch_save, iter_dir,
                                 read_saved_config, read_tracker)
from ..checkpoint.dist import (COMMON_FILE, Chunk, Deferred, Entry, check_files, common_record, fqn, load_entries,
                               read_common, save_entries)
from ..checkpoint.publish import CANONICAL, CHECKPOINT, staged_output
from .source import Source, _model_order


class DistSource:
    """Canonical view of a torch_dist checkpoint: `full(name, kind)` reads one tensor."""

    def __init__(self, root: str, iteration: Optional[int | str] = None):
        self.root = root
        if iteration is None:
            iteration = read_tracker(root)
            if iteration is None:
                raise CheckpointError(f"{root} holds no finished checkpoint (no {TRACKER}); pass --iteration to "
                                      f"pick one")
        self.iteration, self.dir = iteration, iter_dir(root, iteration)
        self.common = read_common(self.dir)
        check_files(self.dir, self.common, iteration, None, 0)     # every file is the one saved with common.pt
        self.saved = read_saved_config(self.common, os.path.join(self.dir, COMMON_FILE))
        try:
            stored = dcp.FileSystemReader(self.dir).read_metadata().state_dict_metadata
        except Exception as e:  # a missing or corrupt .metadata
            raise CheckpointError(f"torch_dist checkpoint {self.dir} has no readable .metadata ({type(e).__name__}); "
                                  f"it is incomplete: load an earlier iteration") from None
        self.stored = {k: v for k, v in stored.items() if isinstance(v, TensorStorageMetadata)}
        prefix = fqn("")
        self.names = sorted((k[len(prefix):] for k in self.stored if k.startswith(prefix)), key=_model_order)
        self.has_optim = self.common["optimizer"] is not None
        self.distributed = bool(getattr(self.saved.args, "use_distributed_optimizer", False))

    def spec(self, name: str, kind: str = "param") -> tuple[tuple[int, ...], torch.dtype]:
        md = self.stored.get(fqn(name, kind))
        if md is None:
            raise CheckpointError(f"torch_dist checkpoint {self.dir} has no {kind} for {name}"
                                  + ("; convert with --no-optim" if kind in OPTIM_KINDS else ""))
        return tuple(md.size), md.properties.dtype

    def full(self, name: str, kind: str = "param") -> torch.Tensor:
        shape, dtype = self.spec(name, kind)
        out = torch.empty(shape, dtype=dtype)
        load_entries({fqn(name, kind): Entry(shape, dtype, [Chunk((0,) * len(shape), out)])}, self.dir, None)
        return out

    def optim_meta(self) -> Optional[dict]:
        return self.common["optimizer"]

    def meta(self) -> dict:
        """The canonical form's metadata (megapar/reshard/canonical.py), RNG states by (tp, pp) shard."""
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


def write_dist(src: Source, out_dir: str, with_optim: bool = True, force: bool = False, log=print) -> None:
    """Write `src` (any reshard source) as a torch_dist checkpoint in `out_dir` (staged, then moved
    into place; megapar/checkpoint/publish.py says what `force` may replace)."""
    with_optim = with_optim and src.has_optim
    kinds = ("param",) + (OPTIM_KINDS if with_optim else ())
    entries = {}
    for name in src.names:
        for kind in kinds:
            shape, dtype = src.spec(name, kind)
            read = Deferred(shape, lambda n=name, k=kind: src.full(n, k))
            entries[fqn(name, kind)] = Entry(shape, dtype, [Chunk((0,) * len(shape), read)])
    meta = src.meta()
    layout = dict(meta["source_layout"], virtual=src.saved.model.virtual_pipeline_model_parallel_size)
    common = common_record(src.saved.args, src.saved.model, src.iteration, layout, meta["opt_param_scheduler"],
                           src.optim_meta() if with_optim else None, rng=None)
    with staged_output(src, out_dir, force, (CHECKPOINT, CANONICAL)) as staging:
        folder = iter_dir(staging, src.iteration)
        os.makedirs(folder)
        atomic_torch_save(common, os.path.join(folder, COMMON_FILE))
        save_entries(entries, folder, None)
        atomic_write_text(os.path.join(staging, TRACKER), str(src.iteration))
    log(f"wrote torch_dist checkpoint ({len(src.names)} parameters{', optimizer state' if with_optim else ''}, "
        f"iteration {src.iteration}) to {out_dir}; it loads at any layout")
