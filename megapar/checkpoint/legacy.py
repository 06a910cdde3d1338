"""Checkpoints in Megatron's legacy layout (`--ckpt-format torch`; docs/design.md), written atomically.

    DIR/latest_checkpointed_iteration.txt                  written last, by rank 0
    DIR/iter_0000600/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt
    DIR/iter_0000600/mp_rank_.../distrib_optim.pt          ZeRO-1 optimizer state (full over dp)

Every rank writes into the iteration's staging folder; when all are done rank 0 renames it into
place and then writes the tracker (publish.py), so a crash mid-save never damages an earlier checkpoint.
Optimizer state is keyed by parameter name ({"state": {name: {master_param, exp_avg,
exp_avg_sq}}, "step", "grad_scaler", "param_groups"}) so any layout can be resharded.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import asdict
from typing import Optional

import torch

from ..arguments import ModelConfig
from .common import (CHECKPOINT_VERSION, DISTRIB_OPTIM_FILE, MODEL_FILE, CheckpointError, atomic_torch_save,
                     check_compatible, flatten_model_states, get_rng_state, iter_dir, load_file, nest_model_states,
                     read_saved_config, read_tracker, restore_scheduler, set_rng_state, shard_dir_name)
from .publish import published_dir, staged_iteration


# ---- save -------------------------------------------------------------------------------------
def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, args: argparse.Namespace,
                    model_config: ModelConfig, topo, rank: int, save_optim: bool = True,
                    save_rng: bool = True) -> None:
    """Collective: every rank calls it. `args` is stored as the checkpoint's `args` (it must
    carry consumed_train_samples), `model_config` as its `model_config` (vocabulary sizes set).
    Written into the iteration's staging folder and published when every rank is done (publish.py);
    a failed write raises one CheckpointError on every rank."""
    with staged_iteration(root, iteration, rank) as staging:
        _write_shard(staging, iteration, model, optimizer, scheduler, args, model_config, topo, rank, save_optim,
                     save_rng)


def _write_shard(staging: str, iteration: int, model, optimizer, scheduler, args: argparse.Namespace,
                 model_config: ModelConfig, topo, rank: int, save_optim: bool, save_rng: bool) -> None:
    """This rank's files of the checkpoint into `staging` (collective: ZeRO gathers over dp)."""
    c = topo.coord(rank)
    shard = os.path.join(staging, shard_dir_name(c.tp, c.pp, topo.pp))
    distributed = optimizer is not None and optimizer.is_distributed
    # ZeRO-1 gathers its shards over dp (every dp rank takes part); the full optimizer's state is
    # identical on all dp ranks, so only the writer copies it out.
    wants_optim = save_optim and optimizer is not None and (distributed or c.dp == 0)
    optim_state = optimizer.state_for_save() if wants_optim else None
    model_state = model_state_for_save(model, writer=c.dp == 0)
    if c.dp == 0:
        os.makedirs(shard, exist_ok=True)
        state = {"args": args, "model_config": asdict(model_config), "checkpoint_version": CHECKPOINT_VERSION,
                 "iteration": iteration, **nest_model_states(model_state)}
        if optim_state is not None:
            state["optimizer"] = {"distributed": True, "grad_scaler": optim_state["grad_scaler"]} \
                if distributed else optim_state
            if distributed:
                atomic_torch_save(optim_state, os.path.join(shard, DISTRIB_OPTIM_FILE))
        if scheduler is not None:
            state["opt_param_scheduler"] = scheduler.state_dict()
        if save_rng:
            state["rng_state"] = [get_rng_state()]
        atomic_torch_save(state, os.path.join(shard, MODEL_FILE))


def model_state_for_save(model, writer: bool) -> Optional[dict[str, torch.Tensor]]:
    """The model's flat state dict as CPU copies (no views: torch.save would save the whole
    storage) on the `writer`, None elsewhere. With ZeRO-3 (`model.sharded_params`) it is
    collective over the data-parallel group: one layer at a time is gathered on the device."""
    sharded = getattr(model, "sharded_params", None)
    if sharded is None:
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()} if writer else None
    names = {id(p): n for n, p in model.named_parameters()}
    in_units = {names[id(p)] for u in sharded.units for p in u.params}
    full = {}
    for params in sharded.full_tensors():
        if writer:
            full.update({names[id(p)]: p.detach().to("cpu", copy=True) for p in params})
    if not writer:
        return None
    return {k: full[k] if k in in_units else v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def load_model_state(model, flat: dict[str, torch.Tensor], path: str) -> None:
    """model.load_state_dict(flat), strictly; ZeRO-3 layers take only this rank's shard of each weight."""
    sharded = getattr(model, "sharded_params", None)
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
def load_checkpoint(root: str, model, optimizer, scheduler, model_config: ModelConfig, topo, rank: int,
                    load_optim: bool = True, load_rng: bool = True, finetune: bool = False) -> tuple[int, int]:
    """Load this rank's shard. Returns (iteration, consumed_train_samples); (0, 0) when `root`
    holds no checkpoint yet (the first run of a job whose --load is its --save: a note is printed,
    training starts from scratch; check_load_dir refuses a --load that names nothing otherwise)."""
    iteration = read_tracker(root)
    if iteration is None:
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
    state = load_file(path)
    check_compatible(read_saved_config(state, path), model_config, topo, path)
    load_model_state(model, flatten_model_states(state), path)
    restore_optim = load_optim and not finetune and optimizer is not None
    if restore_optim and "optimizer" not in state:
        raise CheckpointError(f"checkpoint {path} has no optimizer state (saved with --no-save-optim); "
                              f"load it with --no-load-optim or --finetune")
    if restore_optim:
        saved = state["optimizer"]
        if saved.get("distributed"):
            saved = load_file(os.path.join(shard, DISTRIB_OPTIM_FILE))
        optimizer.load_saved_state(saved)
        if scheduler is not None and "opt_param_scheduler" in state:
            restore_scheduler(scheduler, state["opt_param_scheduler"], path, rank)
    if load_rng and not finetune and "rng_state" in state:
        set_rng_state(state["rng_state"][0])
    if finetune:
        return 0, 0
    it = 0 if iteration == "release" else int(state["iteration"])
    if rank == 0:
        print(f"  successfully loaded checkpoint from {root} at iteration {it}", flush=True)
    return it, int(getattr(state["args"], "consumed_train_samples", 0))


def _explain_missing_shard(root: str, iteration, path: str, topo, model_config: ModelConfig) -> None:
    """This rank's shard is missing: if another shard exists, report how its layout or model
    differs from this run (the same message on every rank); else report the missing file."""
    folder = published_dir(root, iteration)
    present = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    for name in present:
        other = os.path.join(folder, name, MODEL_FILE)
        if os.path.isfile(other):
            check_compatible(read_saved_config(load_file(other), other), model_config, topo, other)
            break
    raise CheckpointError(f"checkpoint file {path} is missing (found shards: {', '.join(present) or 'none'}); "
                          f"the checkpoint is incomplete -- load an earlier iteration")

