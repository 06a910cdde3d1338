"""The canonical unsharded form on disk: a folder of full tensors plus metadata.

    DIR/metadata.pt          args, model_config, iteration, true vocab_size, parameter names in model order,
                             optimizer step / loss-scaler state / param_groups, LR scheduler,
                             RNG states of the source shards and the source layout
    DIR/tensors/<name>.pt    one file per parameter: {"param": full tensor, and with optimizer
                             state "master_param", "exp_avg", "exp_avg_sq"} (fp32)

Names are the tp=1/pp=1 model's keys (global layer indices, no word_embeddings_for_head);
vocab-parallel tensors hold exactly `vocab_size` rows (no padding). Every conversion reads a
source through this form (ShardedCheckpoint is the same view computed on the fly).
"""
from __future__ import annotations

import os

import torch

from ..optimizer.base import OPTIM_KINDS
from ..checkpoint.common import (CheckpointError, SavedConfig, atomic_torch_save, load_file,
                                 read_saved_config)
from ..checkpoint.publish import CANONICAL, CHECKPOINT, staged_output
from .source import Source
from ..checkpoint.stream import LazyTensor, StreamingSaver

META = "metadata.pt"


def is_canonical(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META))


class CanonicalFolder:
    """Reader with the same interface as ShardedCheckpoint (names, full, spec, meta)."""

    def __init__(self, path: str):
        meta_path = os.path.join(path, META)
        m = load_file(meta_path, mmap=True)
        if m.get("format") != "megapar-canonical":
            raise CheckpointError(f"{meta_path} is not a megapar canonical checkpoint (format={m.get('format')!r})")
        self.path, self._meta = path, m
        self.saved: SavedConfig = read_saved_config(m, meta_path)
        self.iteration = m["iteration"]
        self.names, self.has_optim, self.distributed = m["names"], m["has_optim"], m["distributed_optimizer"]
        self.specs = m["specs"]

    def meta(self) -> dict:
        return self._meta

    def optim_meta(self):
        return self._meta["optim_meta"]

    def _file(self, name: str) -> str:
        return os.path.join(self.path, "tensors", f"{name}.pt")

    def full(self, name: str, kind: str = "param") -> torch.Tensor:
        path = self._file(name)
        entry = load_file(path, mmap=True)
        if kind not in entry:
            raise CheckpointError(f"canonical file {path} lacks {kind}"
                                  + ("; convert with --no-optim" if kind in OPTIM_KINDS else ""))
        t = entry[kind].clone()
        want = tuple(self.specs[name][kind][0])
        if tuple(t.shape) != want:
            raise CheckpointError(f"canonical file {path}: {kind} has shape {tuple(t.shape)}, metadata says {want}")
        return t

    def spec(self, name: str, kind: str = "param"):
        if kind not in self.specs[name]:
            raise CheckpointError(f"canonical checkpoint {self.path} has no {kind} for {name}; convert with --no-optim")
        shape, dtype = self.specs[name][kind]
        return tuple(shape), dtype

    def release(self) -> None:
        pass


def write_canonical(src: Source, out_dir: str, with_optim: bool = True, force: bool = False, log=print) -> None:
    """Stream `src` (ShardedCheckpoint or CanonicalFolder) into a canonical folder, one
    parameter at a time. Written into a staging folder beside `out_dir`, renamed into place at the
    end (megapar/checkpoint/publish.py: what `force` may replace)."""
    with staged_output(src, out_dir, force, (CHECKPOINT, CANONICAL)) as staging:
        meta = _write_canonical_files(src, staging, with_optim)
    log(f"wrote canonical checkpoint ({len(meta['specs'])} parameters, iteration {meta['iteration']}) to {out_dir}")


def _write_canonical_files(src: Source, staging: str, with_optim: bool) -> dict:
    os.makedirs(os.path.join(staging, "tensors"))
    kinds = ("param",) + (OPTIM_KINDS if with_optim and src.has_optim else ())
    specs = {}
    for name in src.names:       # one parameter file at a time, one tensor of it in memory at a time
        specs[name] = {k: src.spec(name, k) for k in kinds}
        lazy = {k: LazyTensor(*specs[name][k]) for k in kinds}
        with StreamingSaver(os.path.join(staging, "tensors", f"{name}.pt"), lazy) as saver:
            for k in kinds:
                saver.write_next(src.full(name, k))
    meta = dict(src.meta())
    meta["specs"] = specs
    if not (with_optim and src.has_optim):
        meta.update(has_optim=False, optim_meta=None)
    atomic_torch_save(meta, os.path.join(staging, META))
    return meta
