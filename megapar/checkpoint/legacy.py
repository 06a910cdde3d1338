"""Checkpoints in Megatron's legacy layout (`--ckpt-format torch`; docs/design.md), written atomically.

    DIR/latest_checkpointed_iteration.txt                  written last, by rank 0
    DIR/iter_0000600/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt
    DIR/iter_0000600/mp_rank_.../distrib_optim.pt          ZeRO optimizer state (full over dp)

One writer and one reader of these files:
  * `shard_objects` builds what a shard's files hold (Megatron's dict), with tensors or
    `LazyTensor` placeholders; training's save (here) and the conversion tool
    (megapar/reshard/convert.py) both write it with StreamingSaver, one tensor at a time.
  * `read_shard`, `read_optimizer_state` and `check_optimizer_state` read and
    check a shard for training's load (here) and the conversion tool (megapar/reshard/source.py).

Training's save streams: dp rank 0 of each (tp, pp) position writes its shard as the tensors
come -- the model's one at a time (ZeRO-3 layers gathered one layer at a time), the optimizer
state one parameter and kind at a time (ZeRO: assembled on the writer from the dp ranks that
own its parts) -- so no rank holds more than its own shard plus one parameter's state. Every
rank writes into the iteration's staging folder; when all are done rank 0 renames it into place
and then writes the tracker (publish.py), so a crash mid-save never damages an earlier checkpoint. Optimizer state is
keyed by parameter name ({"state": {name: {master_param, exp_avg, exp_avg_sq}}, "step",
"grad_scaler", "param_groups"}) so any layout can be resharded.
"""
from __future__ import annotations

import argparse
import itertools
import os
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict
from typing import Iterator, Optional

import torch

from ..config.settings import ModelConfig
from ..optimizer.base import OPTIM_KINDS
from .common import (CHECKPOINT_VERSION, DISTRIB_OPTIM_FILE, MODEL_FILE, CheckpointError, check_compatible,
                     flatten_model_states, get_rng_state, has_model_state, iter_dir, load_file, loaded_line,
                     nest_model_states, read_saved_config, read_tracker, restore_scheduler, set_rng_state,
                     shard_dir_name, shard_dirs, untracked_line, identity,
                     write_manifest, read_manifest, check_checksum, check_file, check_identity, IDENTITY_FILE)
from .formats import Parts
from .stream import LazyTensor, StreamingSaver
from .publish import published_dir, staged_iteration


# ---- what a shard's files hold -----------------------------------------------------------------
def shard_objects(*, args: argparse.Namespace, model_config: ModelConfig, iteration: int | str, model: dict,
                  optim_state: Optional[dict], optim_meta: Optional[dict], distributed: bool,
                  scheduler: Optional[dict], rng_state: Optional[list],
                  ident: Optional[dict] = None) -> tuple[dict, Optional[dict]]:
    """The dicts of one shard's files: model_optim_rng.pt's, and distrib_optim.pt's for a distributed
    (ZeRO) optimizer (else None). `model`: the stage's flat state dict (keys as GPT2Model's, or
    model{j}. for model chunks), nested here; `optim_state`: {name: {kind: tensor}} with
    `optim_meta` {"step", "grad_scaler", "param_groups"}, or None to save no optimizer state;
    tensors may be LazyTensor placeholders (StreamingSaver writes them in dict order); `ident`: the
    checkpoint's identity (common.py), stored in each file."""
    obj = {"args": args, "model_config": asdict(model_config), "checkpoint_version": CHECKPOINT_VERSION,
           "iteration": iteration, **nest_model_states(model)}
    dist_obj = None
    if optim_state is not None:
        optim = {"state": optim_state, "step": optim_meta["step"], "grad_scaler": optim_meta["grad_scaler"],
                 "param_groups": optim_meta["param_groups"]}
        if distributed:
            obj["optimizer"] = {"distributed": True, "grad_scaler": optim_meta["grad_scaler"]}
            dist_obj = optim
        else:
            obj["optimizer"] = optim
    if scheduler is not None:
        obj["opt_param_scheduler"] = scheduler
    if rng_state is not None:
        obj["rng_state"] = rng_state
    if ident is not None:
        obj["identity"] = ident
        if dist_obj is not None:
            dist_obj["identity"] = ident
    return obj, dist_obj


def feed(saver: StreamingSaver, stream: Iterator[tuple]) -> None:
    """Write every placeholder of `saver` from `stream`'s items (*tag, tensor), in order, one
    tensor at a time. Each item's tag must be its placeholder's (a mismatch is a bug)."""
    for lazy in saver.pending():
        item = next(stream, None)
        if item is None or tuple(item[:-1]) != lazy.tag:
            got = "the end of the stream" if item is None else tuple(item[:-1])
            raise RuntimeError(f"{saver.path}: expected the tensor {lazy.tag}, got {got}")
        saver.write_next(item[-1])
        del item                    # before the stream makes the next one


# ---- save ---------------------------------------------------------------------------------------
def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, args: argparse.Namespace,
                    model_config: ModelConfig, topo, rank: int, save_optim: bool = True,
                    save_rng: bool = True, sharded=None, run_id: Optional[str] = None) -> None:
    """Collective: every rank calls it. `run_id`: the run's identity (common.py), stored in every file.
    `args` is stored as the checkpoint's `args` (it must
    carry consumed_train_samples), `model_config` as its `model_config` (vocabulary sizes set).
    Data-parallel rank 0 of each (tp, pp) position writes that shard, streamed (module docstring);
    the other dp ranks take part in the gathers of ZeRO-3 layers and ZeRO optimizer state. Written
    into the iteration's staging folder and published when every rank is done (publish.py); a failed
    write raises one CheckpointError on every rank."""
    with staged_iteration(root, iteration, rank) as staging:
        _stream_shard(staging, iteration, model, optimizer, scheduler, args, model_config, topo, rank, save_optim,
                      save_rng, sharded, identity(run_id, iteration))


def _stream_shard(staging: str, iteration: int, model, optimizer, scheduler, args: argparse.Namespace,
                  model_config: ModelConfig, topo, rank: int, save_optim: bool, save_rng: bool, sharded,
                  ident: dict) -> None:
    """This rank's part of the save into `staging`: dp rank 0 writes the shard's files, the other
    dp ranks feed the collectives of its streams."""
    c = topo.coord(rank)
    writer = c.dp == 0
    with_optim = save_optim and optimizer is not None and (writer or optimizer.is_distributed)
    optim_meta = optimizer.saved_meta() if with_optim else None
    model_stream = model_tensors(model, sharded) if writer or sharded is not None else iter(())
    optim_stream = optimizer.saved_tensors() if with_optim else iter(())
    if writer:
        model_ph = {k: LazyTensor(v.shape, v.dtype, tag=(k,)) for k, v in model.state_dict().items()}
        optim_ph = {n: {k: LazyTensor(shape, torch.float32, tag=(n, k)) for k in OPTIM_KINDS}
                    for n, shape in optimizer.saved_shapes()} if with_optim else None
        obj, dist_obj = shard_objects(
            args=args, model_config=model_config, iteration=iteration, model=model_ph, optim_state=optim_ph,
            optim_meta=optim_meta, distributed=with_optim and optimizer.is_distributed,
            scheduler=scheduler.state_dict() if scheduler is not None else None,
            rng_state=[get_rng_state()] if save_rng else None, ident=ident)
        _write_shard(os.path.join(staging, shard_dir_name(c.tp, c.pp, topo.pp)), obj, dist_obj, model_stream,
                     optim_stream, ident)
    else:
        for _ in itertools.chain(model_stream, optim_stream):   # the collectives of the writer's streams
            pass


def _write_shard(shard: str, obj: dict, dist_obj: Optional[dict], model_stream: Iterator, optim_stream: Iterator,
                 ident: dict) -> None:
    """The shard's files from their placeholder dicts: the model file takes the model's tensors
    (and the optimizer's, unless distrib_optim.pt does); then their manifest (identity.json)."""
    os.makedirs(shard, exist_ok=True)
    files = [(MODEL_FILE, obj, model_stream if dist_obj is not None else itertools.chain(model_stream, optim_stream))]
    if dist_obj is not None:
        files.append((DISTRIB_OPTIM_FILE, dist_obj, optim_stream))
    sums = {}
    for name, o, stream in files:
        with StreamingSaver(os.path.join(shard, name), o) as saver:
            feed(saver, stream)
        sums[name] = saver.checksum          # taken beside the file's fsync
    write_manifest(shard, ident, sums)


def model_tensors(model, sharded=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) of the model's state dict, in order, for writing (no copies: the live
    weights). With ZeRO-3 (`sharded`: the ShardedParams holding its layers) it is collective over
    the data-parallel group: every dp rank iterates it, and each layer is gathered while its
    tensors are written."""
    units = sharded.unit_of() if sharded is not None else {}
    params = dict(model.named_parameters())
    state = model.state_dict()
    for unit, items in itertools.groupby(state.items(), key=lambda kv: units.get(id(params.get(kv[0])))):
        with sharded.gathered(unit) if unit is not None else nullcontext():
            for key, t in items:
                yield key, t


def load_model_state(model, flat: dict[str, torch.Tensor], path: str, sharded=None) -> None:
    """model.load_state_dict(flat), strictly; ZeRO-3 layers (`sharded`) take only this rank's shard
    of each weight."""
    if sharded is None:
        model.load_state_dict(flat)
        return
    expected = set(model.state_dict().keys())
    missing, unexpected = sorted(expected - set(flat)), sorted(set(flat) - expected)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} does not match this model: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}; use the checkpoint's model flags")
    params = dict(model.named_parameters())
    units = sharded.unit_of()
    model.load_state_dict({k: v for k, v in flat.items() if id(params.get(k)) not in units}, strict=False)
    sharded.load_full({id(params[k]): v for k, v in flat.items() if k in params and id(params[k]) in units})


# ---- load -------------------------------------------------------------------------------------
def read_shard(path: str, mmap: bool = False) -> dict:
    """A shard's model file (load_file), refused unless it has Megatron's entries (args,
    iteration, model)."""
    state = load_file(path, mmap)
    for field in ("args", "iteration", "model"):
        if field not in state and not (field == "model" and has_model_state(state)):
            raise CheckpointError(f"checkpoint file {path} has no '{field}' entry; the file is not a "
                                  f"complete megapar checkpoint shard")
    return state


def read_optimizer_state(state: dict, path: str, mmap: bool = False) -> Optional[tuple[dict, str]]:
    """(a shard's name-keyed optimizer state, the file it is in): the model file's own `optimizer`
    entry (`state` is the model file `path`'s dict), or the distrib_optim.pt beside it when that
    entry says distributed (ZeRO); None when the shard was saved without optimizer state."""
    entry = state.get("optimizer")
    if entry is None:
        return None
    if not entry.get("distributed"):
        return entry, path
    distrib = os.path.join(os.path.dirname(path), DISTRIB_OPTIM_FILE)
    if not os.path.isfile(distrib):
        raise CheckpointError(f"checkpoint file {distrib} is missing: {path} says its optimizer state is "
                              f"distributed (ZeRO); the checkpoint is incomplete -- load an earlier iteration")
    return load_file(distrib, mmap), distrib


def check_optimizer_state(optim: dict, expected: dict[str, tuple[int, ...]], path: str, fix: str) -> None:
    """Refuse optimizer state (read from `path`) that is not of the model it is loaded with: its
    parameters must be `expected`'s {name: shape}, each with every kind of OPTIM_KINDS at that shape.
    `fix` ends the message."""
    state = optim.get("state")
    problem = _state_mismatch(state, expected) if isinstance(state, dict) else "it has no per-parameter 'state'"
    if problem:
        raise CheckpointError(f"checkpoint file {path}: its optimizer state does not match the model: {problem}; "
                              f"{fix}")


def _state_mismatch(state: dict, expected: dict[str, tuple[int, ...]]) -> Optional[str]:
    """How the parameters of `state` differ from `expected`'s (the first difference), or None."""
    missing = [n for n in expected if n not in state]
    extra = [n for n in state if n not in expected]
    if missing or extra:
        some = lambda names: ", ".join(names[:2]) + (f" ({len(names)} in all)" if len(names) > 2 else "")  # noqa: E731
        return "; ".join([f"it holds {len(state)} parameters, the model {len(expected)}"]
                         + ([f"missing {some(missing)}"] if missing else [])
                         + ([f"not in the model: {some(extra)}"] if extra else []))
    for name, shape in expected.items():
        for kind in OPTIM_KINDS:
            t = state[name].get(kind) if isinstance(state[name], dict) else None
            if not torch.is_tensor(t):
                return f"{name} has no {kind}"
            if tuple(t.shape) != tuple(shape):
                return f"the shapes of {name} differ ({kind} {tuple(t.shape)}, the model's {tuple(shape)})"
    return None


def load_checkpoint(root: str, model, optimizer, scheduler, model_config: ModelConfig, topo, rank: int,
                    load_optim: bool = True, load_rng: bool = True, finetune: bool = False,
                    sharded=None, found: Optional[dict] = None) -> tuple[int, int]:
    """Load this rank's shard, its files checked against their manifest (common.py's identity;
    `found`, if given, receives the checkpoint's {"run_id"}). Returns (iteration,
    consumed_train_samples); (0, 0) when `root`
    holds no checkpoint yet (the first run of a job whose --load is its --save: a note is printed,
    training starts from scratch; check_load_dir refuses a --load that names nothing otherwise).
    The optimizer state (full over dp in distrib_optim.pt) is memory-mapped: each rank reads only
    the parts it takes."""
    iteration = read_tracker(root)
    if iteration is None:
        untracked = untracked_line(root, "checkpoint directory")
        if untracked:
            raise CheckpointError(untracked)
        if rank == 0:
            print(f"> no checkpoint in {root} yet: starting from scratch", flush=True)
        return 0, 0
    c, folder = topo.coord(rank), published_dir(root, iteration)
    if rank == 0 and folder != iter_dir(root, iteration):
        print(f"> {iter_dir(root, iteration)} is missing (a re-save of it was stopped): loading the copy it "
              f"replaced, {folder}", flush=True)
    shard = os.path.join(folder, shard_dir_name(c.tp, c.pp, topo.pp))
    path = os.path.join(shard, MODEL_FILE)
    if not os.path.isfile(path):
        _explain_missing_shard(root, iteration, path, topo, model_config)
    with ThreadPoolExecutor(max_workers=1) as pool:     # the files' checksums are computed while the shard is read
        ident, sums = _check_files(folder, shard, iteration, topo.pp, c.dp == 0, pool)
        try:
            state = read_shard(path)
        finally:
            for done in sums:
                done.result()                            # a changed file is named as such, not as unreadable
    check_shard_identity(path, state.get("identity"), ident)
    if ident is not None and found is not None:
        found["run_id"] = ident["run_id"]
    check_compatible(read_saved_config(state, path), model_config, topo, path)
    load_model_state(model, flatten_model_states(state), path, sharded)
    if load_optim and not finetune and optimizer is not None:
        _load_optimizer(state, path, optimizer, ident)
        if scheduler is not None and "opt_param_scheduler" in state:
            restore_scheduler(scheduler, state["opt_param_scheduler"], path, rank)
    if load_rng and not finetune and "rng_state" in state:
        set_rng_state(state["rng_state"][0])
    it = 0 if iteration == "release" else int(state["iteration"])
    if rank == 0:
        print(loaded_line(root, it, finetune), flush=True)
    if finetune:
        return 0, 0
    return it, int(getattr(state["args"], "consumed_train_samples", 0))


def _check_files(folder: str, shard: str, iteration: int | str, pp: int, verify_all: bool,
                 pool: ThreadPoolExecutor) -> tuple[Optional[dict], list[Future]]:
    """This shard's files against its manifest: their sizes now; the model file's checksum and (when
    `verify_all`: one data-parallel rank per shard) every file's on `pool` (the futures returned
    raise a mismatch); its identity must be of this iteration and of the run of the first shard.
    Returns that identity (None: saved before identities)."""
    manifest = read_manifest(shard)
    if manifest is None:
        return None, []
    ident = identity(manifest["run_id"], manifest["iteration"])
    where = os.path.join(shard, IDENTITY_FILE)
    if iteration != "release" and manifest["iteration"] != iteration:
        raise CheckpointError(f"checkpoint file {where} is of iteration {manifest['iteration']}, its folder of "
                              f"{iteration}: the shard was copied from another iteration; put back the shard saved "
                              f"with it, or load an earlier iteration")
    first = read_manifest(os.path.join(folder, shard_dir_name(0, 0, pp)))
    if first is not None and first["run_id"] != manifest["run_id"]:
        raise CheckpointError(f"checkpoint file {where} is of run {manifest['run_id']}, the first shard's of run "
                              f"{first['run_id']}: the shard was copied from another run; put back the shard saved "
                              f"with it, or load an earlier iteration")
    present = [n for n in (MODEL_FILE, DISTRIB_OPTIM_FILE) if os.path.exists(os.path.join(shard, n))]
    sums = []
    for name in sorted(set(manifest["files"]) | set(present)):
        saved = manifest["files"].get(name)
        check_file(shard, name, saved, verify=False)
        if verify_all or name == MODEL_FILE:
            sums.append(pool.submit(check_checksum, os.path.join(shard, name), saved))
    return ident, sums


def verify_shards(folder: str, shards: list[str], iteration: int | str, pp: int) -> dict[str, Optional[dict]]:
    """Every file of the shard folders `shards` of the iteration folder `folder` against its manifest
    (sizes and checksums); each shard's identity (None: saved before identities).
    What a reader of a whole checkpoint (the conversion tools) calls before reading it."""
    with ThreadPoolExecutor(max_workers=1) as pool:         # one file at a time: file_checksum runs threads
        found = {shard: _check_files(folder, shard, iteration, pp, True, pool) for shard in shards}
        for _, sums in found.values():
            for done in sums:
                done.result()
    return {shard: ident for shard, (ident, _) in found.items()}


def check_shard_identity(path: str, found: Optional[dict], ident: Optional[dict]) -> None:
    """The identity a shard's file carries (`found`) must be its manifest's (`ident`); a file that
    carries one in a shard without a manifest lost its identity.json (no check would be made)."""
    if ident is not None:
        check_identity(path, found, ident)
    elif found is not None:
        manifest = os.path.join(os.path.dirname(path), IDENTITY_FILE)
        raise CheckpointError(f"checkpoint file {manifest} is missing ({os.path.basename(path)} was saved with it); "
                              f"the checkpoint is incomplete: put it back, or load an earlier iteration")


def _load_optimizer(state: dict, path: str, optimizer, ident: Optional[dict]) -> None:
    found = read_optimizer_state(state, path, mmap=True)
    if found is None:
        raise CheckpointError(f"checkpoint {path} has no optimizer state (saved with --no-save-optim); "
                              f"load it with --no-load-optim or --finetune")
    saved, where = found
    if where != path:
        check_shard_identity(where, saved.get("identity"), ident)
    check_optimizer_state(saved, dict(optimizer.saved_shapes()), where,
                          "it does not belong to this checkpoint: load an earlier iteration, or pass "
                          "--no-load-optim to load the weights alone")
    optimizer.load_saved_state(saved)


def _explain_missing_shard(root: str, iteration, path: str, topo, model_config: ModelConfig) -> None:
    """This rank's shard is missing: if another shard exists, report how its layout or model
    differs from this run (the same message on every rank); else report the missing file."""
    folder = published_dir(root, iteration)
    present = shard_dirs(folder)
    for name in present:
        other = os.path.join(folder, name, MODEL_FILE)
        if os.path.isfile(other):
            check_compatible(read_saved_config(load_file(other), other), model_config, topo, other)
            break
    raise CheckpointError(f"checkpoint file {path} is missing (found shards: {', '.join(present) or 'none'}); "
                          f"the checkpoint is incomplete -- load an earlier iteration")


class LegacyFormat:
    """`--ckpt-format torch` (formats.Format): one folder of files per (tp, pp) shard, loadable at the saved
    layout only (tools/checkpoint_util.py converts it)."""
    name = "torch"

    def holds(self, folder: str) -> bool:
        return bool(shard_dirs(folder))

    def save(self, root: str, iteration: int, parts: Parts, args: argparse.Namespace, *, save_optim: bool = True,
             save_rng: bool = True, run_id: Optional[str] = None, saves=None) -> None:
        if saves is not None:   # the config refuses --async-save without torch_dist; a caller's mistake here
            raise ValueError("the torch (legacy) checkpoint format saves synchronously only; use torch_dist")
        save_checkpoint(root, iteration, parts.model, parts.optimizer, parts.scheduler, args, parts.model_config,
                        parts.topo, parts.rank, save_optim, save_rng, parts.sharded, run_id)

    def load(self, root: str, parts: Parts, *, load_optim: bool = True, load_rng: bool = True,
             finetune: bool = False, found: Optional[dict] = None) -> tuple[int, int]:
        return load_checkpoint(root, parts.model, parts.optimizer, parts.scheduler, parts.model_config, parts.topo,
                               parts.rank, load_optim, load_rng, finetune, parts.sharded, found)


FORMAT = LegacyFormat()
