"""Write a canonical source (ShardedCheckpoint or CanonicalFolder) as a checkpoint at any layout.

Streaming: for every parameter, the full tensor is read once, split for each target TP rank
and written straight into that rank's open shard file (StreamingSaver), so memory holds a
few tensors, never the model. Output is staged in a hidden `.<save_dir>.partial.XXXXXXXX` folder
beside it and renamed into place when complete (megapar/checkpoint/publish.py); the tracker file
is inside it, so a crash never leaves a half checkpoint.

Carried: model weights (vocab re-padded with zero rows for the target tp), optimizer state
(masters, moments, step, loss scaler, param_groups) in model_optim_rng.pt or -- for the
distributed (ZeRO-1) optimizer -- distrib_optim.pt (stored full over dp; the optimizer slices
it for any dp at load time), the LR scheduler, iteration, args (consumed samples, parallel
sizes, padded vocab). RNG states are carried only when tp and pp are unchanged (they are per
(tp, pp) position); otherwise they are dropped and the resumed run re-seeds from --seed.
"""
from __future__ import annotations

import os
from typing import Optional

from ..atomic import atomic_write_text
from ..optimizer.base import OPTIM_KINDS
from ..checkpoint.common import (SavedConfig, DISTRIB_OPTIM_FILE, MODEL_FILE, TRACKER, iter_dir,
                                 shard_dir_name)
from ..checkpoint.common import file_checksum, identity, new_run_id, write_manifest
from ..checkpoint.legacy import shard_objects
from . import retarget
from .source import Source
from ..checkpoint.publish import CANONICAL, CHECKPOINT, staged_output
from ..checkpoint.layout import chunk_layout, split, stage_keys
from ..checkpoint.stream import LazyTensor, StreamingSaver


def _shard_shape(full_shape, name: str, tp: int, padded: Optional[int]) -> tuple[int, ...]:
    from ..model.sharding import is_vocab_parallel, tp_partition_dim
    shape = list(full_shape)
    if is_vocab_parallel(name) and padded is not None:
        shape[0] = padded
    dim = tp_partition_dim(name)
    if dim is not None:
        shape[dim] //= tp
    return tuple(shape)


def _lazy(src: Source, name: str, kind: str, tp: int, padded) -> LazyTensor:
    shape, dtype = src.spec(name, kind)
    return LazyTensor(_shard_shape(shape, name, tp, padded), dtype, tag=(name, kind))


def _rng_for(meta: dict, tp: int, pp: int, tp_rank: int, pp_rank: int):
    layout = meta["source_layout"]
    if (layout["tp"], layout["pp"]) != (tp, pp):
        return None
    return meta["rng_states"].get((tp_rank, pp_rank))


def _shard_objects(src: Source, meta: dict, target: SavedConfig, keys, tp, tp_rank, pp, pp_rank, with_optim,
                   distributed, ident: dict):
    """The (model file, distrib_optim file or None) structures of one target shard (shard_objects),
    with LazyTensor placeholders for every parameter tensor (`meta`: the source's metadata; `ident`:
    the output's identity)."""
    padded = target.model.padded_vocab_size
    optim = {local: {k: _lazy(src, name, k, tp, padded) for k in OPTIM_KINDS} for local, name in keys} \
        if with_optim else None
    return shard_objects(args=target.args, model_config=target.model, iteration=src.iteration,
                         model={local: _lazy(src, name, "param", tp, padded) for local, name in keys},
                         optim_state=optim, optim_meta=src.optim_meta() if with_optim else None,
                         distributed=distributed, scheduler=meta.get("opt_param_scheduler"),
                         rng_state=_rng_for(meta, tp, pp, tp_rank, pp_rank), ident=ident)


def _feed(src: Source, savers: list[StreamingSaver], tp: int, padded) -> None:
    """Write every placeholder of the (identically structured) savers, reading each full tensor once."""
    for lazy in savers[0].pending():
        name, kind = lazy.tag
        full = src.full(name, kind)
        for r, s in enumerate(savers):
            s.write_next(split(full, name, tp, r, padded))
        del full


def write_sharded(src: Source, save_dir: str, tp: int, pp: int, dp: Optional[int] = None,
                  distributed: Optional[bool] = None, with_optim: bool = True, force: bool = False,
                  log=print, split: Optional[tuple[Optional[int], Optional[int]]] = None,
                  virtual: Optional[int] = None, extra_files: Optional[dict[str, str]] = None) -> None:
    """Write `src` as a megapar checkpoint at (tp, pp) into `save_dir` (legacy layout + tracker; `extra_files`
    {name: text} beside them, published with the rest).
    dp only updates args (ZeRO-1 state is stored full over dp); distributed=None keeps the
    source's optimizer storage, True/False forces distrib_optim.pt / model_optim_rng.pt;
    split = (first, last) layers of the first / last pipeline stage, virtual = model chunks per
    pipeline rank (interleaved 1F1B; 1 = none) (retarget)."""
    with_optim = with_optim and src.has_optim
    distributed = src.distributed if distributed is None else distributed
    target = retarget(src.saved, tp, pp, dp, distributed if with_optim else None, split, virtual)
    with staged_output(src, save_dir, force, (CHECKPOINT, CANONICAL)) as staging:
        _write_stages(src, target, staging, tp, pp, with_optim, distributed, log)
        for name, text in (extra_files or {}).items():
            atomic_write_text(os.path.join(staging, name), text)
        atomic_write_text(os.path.join(staging, TRACKER), str(src.iteration))
    chunks = target.model.virtual_pipeline_model_parallel_size
    optimizer = ("distributed" if distributed else "in model file") if with_optim else "none"
    log(f"wrote checkpoint at tensor-parallel {tp} x pipeline-parallel {pp}"
        + (f" x {chunks} model chunks" if chunks else "") + f" (iteration {src.iteration}, optimizer: {optimizer}) "
        f"to {save_dir}")


def _write_stages(src: Source, target: SavedConfig, staging: str, tp: int, pp: int, with_optim: bool, distributed: bool,
                  log) -> None:
    """Every shard file of the target layout, one pipeline stage at a time, into `staging`, each
    shard with its manifest. The output is a new set of files: it gets an identity of its own."""
    meta, padded = src.meta(), target.model.padded_vocab_size
    ident = identity(new_run_id(), src.iteration)
    it_dir = iter_dir(staging, src.iteration)
    for pp_rank in range(pp):
        keys = stage_keys(src.names, chunk_layout(target.model, pp), pp_rank)
        model_savers, optim_savers = [], []
        try:
            for tp_rank in range(tp):
                shard = os.path.join(it_dir, shard_dir_name(tp_rank, pp_rank, pp))
                os.makedirs(shard, exist_ok=True)
                obj, dist_obj = _shard_objects(src, meta, target, keys, tp, tp_rank, pp, pp_rank, with_optim,
                                               distributed, ident)
                model_savers.append(StreamingSaver(os.path.join(shard, MODEL_FILE), obj))
                if dist_obj is not None:
                    optim_savers.append(StreamingSaver(os.path.join(shard, DISTRIB_OPTIM_FILE), dist_obj))
            for savers in (model_savers, optim_savers):
                if savers:
                    _feed(src, savers, tp, padded)
                    for s in savers:
                        s.close()
        except BaseException:
            for s in model_savers + optim_savers:
                s.abort()
            raise
        for tp_rank, saver in enumerate(model_savers):
            shard = os.path.join(it_dir, shard_dir_name(tp_rank, pp_rank, pp))
            names = [MODEL_FILE] + ([DISTRIB_OPTIM_FILE] if optim_savers else [])
            write_manifest(shard, ident, {name: file_checksum(os.path.join(shard, name)) for name in names})
        log(f"  wrote pipeline stage {pp_rank + 1}/{pp} ({tp} tensor-parallel shards)")
