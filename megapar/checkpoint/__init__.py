"""Checkpoints: the one place that knows the on-disk formats (docs/design.md#checkpoint-format).

    common.py   names, the tracker, SavedConfig, RNG, the checks a load makes
    legacy.py   Megatron's legacy layout (`--ckpt-format torch`): one file per (tp, pp) shard
    dist.py     `--ckpt-format torch_dist`: every rank writes what it owns (torch.distributed.checkpoint),
                loadable at any layout; `--async-save`
    stream.py   torch.save's zip format written one tensor at a time
    publish.py  staging folders and publishing (training's iterations, the conversion tools' outputs)
    guard.py    one job per --save (its lock file), what a --save may write over, the disk checks
    formats.py  the Format Protocol both formats implement, `format_named` and `detect`
    checkpointer.py  the Checkpointer a training run saves and loads through

`save_checkpoint` writes the format asked for; `load_checkpoint` reads whichever the tracker's
iteration holds.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Optional

from . import legacy
from .common import (CHECKPOINT_VERSION, DISTRIB_OPTIM_FILE, MODEL_FILE, SHAPE_FIELDS, TRACKER, CheckpointError,
                     SavedConfig, atomic_torch_save, check_compatible, check_load_dir, check_tracked_iteration,
                     flatten_model_state, flatten_model_states, get_rng_state, has_model_state, iter_dir, load_file,
                     nest_model_state, nest_model_states, read_saved_config, read_tracker, restore_scheduler,
                     saved_layout_flags, set_rng_state, shard_dir_name)
from ..optimizer.base import OPTIM_KINDS
from .common import parse_shard_dir, shard_dirs
from .formats import DEFAULT, NAMES, Format, Parts, detect, format_named
from .legacy import load_model_state
from .guard import SaveDirLock, check_save_dirs, check_save_space
from .publish import published_dir, publish_iteration, staged_iteration, staging_dir

if TYPE_CHECKING:
    from .dist import AsyncSaves

def __getattr__(name: str) -> Any:
    """`dist` (and its AsyncSaves) on first use: torch.distributed.checkpoint and the model's sharding
    rules take seconds to import, which the flag checks that import this package (a refused command's
    only work) need not wait for."""
    if name in ("dist", "AsyncSaves"):
        module = importlib.import_module(f"{__name__}.dist")   # (`from . import dist` would recurse here)
        return module if name == "dist" else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, args, model_config, topo, rank: int,
                    save_optim: bool = True, save_rng: bool = True, fmt: str = "torch",
                    saves: Optional[AsyncSaves] = None, sharded=None, run_id: Optional[str] = None) -> None:
    """Collective: save in format `fmt` ("torch": legacy, "torch_dist"); `saves`: write in the
    background (torch_dist only); `sharded`: the ZeRO-3 parameter store (ShardedParams) holding the
    model's layer weights, None without ZeRO-3; `run_id`: the run's identity, written into every file
    (the same on every rank)."""
    format_named(fmt).save(root, iteration, Parts(model, optimizer, scheduler, model_config, topo, rank, sharded),
                           args, save_optim=save_optim, save_rng=save_rng, run_id=run_id, saves=saves)


def load_checkpoint(root: str, model, optimizer, scheduler, model_config, topo, rank: int, load_optim: bool = True,
                    load_rng: bool = True, finetune: bool = False, sharded=None,
                    found: Optional[dict] = None) -> tuple[int, int]:
    """Collective: load_parts with the parts named one by one (the tools' and tests' form)."""
    return load_parts(root, Parts(model, optimizer, scheduler, model_config, topo, rank, sharded),
                      load_optim=load_optim, load_rng=load_rng, finetune=finetune, found=found)


def load_parts(root: str, parts: Parts, *, load_optim: bool = True, load_rng: bool = True, finetune: bool = False,
               found: Optional[dict] = None) -> tuple[int, int]:
    """Collective: load the tracker's iteration of `root`, whichever format it was saved in (formats.detect),
    every file checked against the identity and checksums saved with it. Returns (iteration,
    consumed_train_samples); (0, 0) when `root` holds no checkpoint yet. `found`, if given, receives the
    checkpoint's {"run_id"} (none for a checkpoint saved before identities)."""
    iteration = read_tracker(root)
    folder = None if iteration is None else published_dir(root, iteration)
    if iteration is not None:
        check_tracked_iteration(root, iteration, folder)
    fmt = format_named(DEFAULT) if folder is None else detect(folder)
    return fmt.load(root, parts, load_optim=load_optim, load_rng=load_rng, finetune=finetune, found=found)
