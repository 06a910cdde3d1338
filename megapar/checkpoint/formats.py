"""The checkpoint formats behind one Protocol, and the one place that decides a folder's format.

A `Format` is what `--ckpt-format` names: legacy.py's LEGACY ("torch", Megatron's shard files) and
dist.py's DIST ("torch_dist", torch.distributed.checkpoint). Callers look a format up by name
(`format_named`) or ask which one an iteration folder holds (`detect`); nothing else compares format
names. dist.py imports torch.distributed.checkpoint, which takes seconds: the registry imports a
format's module only when the format is asked for, so the flag checks that import this package do
not wait for it.
"""
from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import Any, Optional, Protocol

# name -> the module (in this package) whose FORMAT implements it. Detection asks them in this order:
# torch_dist's files name it, while a legacy folder is whatever holds Megatron's shard folders.
_MODULES = {"torch_dist": "dist", "torch": "legacy"}
NAMES = tuple(sorted(_MODULES))
DEFAULT = "torch"    # what a folder that no format holds (missing, emptied) is read as: its loader says what is wrong


@dataclass
class Parts:
    """What a checkpoint holds of a run, and where this rank stands: the model (its chunks of
    interleaved 1F1B included), the optimizer and LR schedule (None where a tool saves weights only),
    the model's config (vocabulary sizes set), the topology and this rank; `sharded`: the ZeRO-3
    ShardedParams holding the layers' weights, None without ZeRO-3."""
    model: Any
    optimizer: Any
    scheduler: Any
    model_config: Any
    topo: Any
    rank: int
    sharded: Any = None


class Format(Protocol):
    """One on-disk format. `save` and `load` are collective (every rank calls them)."""
    name: str

    def holds(self, folder: str) -> bool:
        """Is the iteration folder `folder` in this format? Decided by its file names alone."""

    def save(self, root: str, iteration: int, parts: Parts, args: argparse.Namespace, *, save_optim: bool = True,
             save_rng: bool = True, run_id: Optional[str] = None, saves: Any = None) -> None:
        """Write iteration `iteration` of `parts` under `root` (published atomically); `args` is stored as the
        checkpoint's `args`; `run_id`: the run's identity written into every file; `saves`: an AsyncSaves
        to write in the background (formats that cannot refuse it)."""

    def load(self, root: str, parts: Parts, *, load_optim: bool = True, load_rng: bool = True,
             finetune: bool = False, found: Optional[dict] = None) -> tuple[int, int]:
        """Load the tracker's iteration of `root` into `parts`, every file checked against the identity and
        checksums saved with it -> (iteration, consumed_train_samples); `found` receives {"run_id"}."""


def format_named(name: str) -> Format:
    """The format `--ckpt-format name` writes; ValueError for a name that is not one."""
    if name not in _MODULES:
        raise ValueError(f"checkpoint format {name!r} is not one of {NAMES}")
    return importlib.import_module(f"{__package__}.{_MODULES[name]}").FORMAT


def detect(folder: str) -> Format:
    """The format of the iteration folder `folder`: the first that holds it, else the legacy format (whose
    loader names what is missing). A torch_dist folder that lost some of its files is still torch_dist, so
    it is reported as an incomplete torch_dist checkpoint rather than as a legacy one."""
    for name in _MODULES:
        fmt = format_named(name)
        if fmt.holds(folder):
            return fmt
    return format_named(DEFAULT)
