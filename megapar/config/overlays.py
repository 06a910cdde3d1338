"""Where each setting's value comes from: overlays, merged in a stated order.

An `Overlay` is the settings one source sets, each with its `Origin`. A run's sources, lowest first:

    the field defaults (settings.py)             Origin DEFAULT
    the embedded default (no --data-path)        EMBEDDED: a small run on the embedded corpus
    each --recipe NAME in turn (recipes.py)      Origin("--recipe NAME")
    a --deepspeed-config file                    Origin(key, file) per setting (deepspeed/read.py)
    the command line                             COMMAND_LINE

`merge` lays them over each other: the highest that sets a value wins, and its origin is kept, so
that every value of a Config has one (`Config.origin`) and an error about a value the command line
did not type says who set it (`explain`). A flag set both on the command line and by a DeepSpeed key
must agree (deepspeed/read.py); a recipe's value is overridden by either.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence

from .deepspeed.read import DeepSpeedSettings, apply
from .megatron import NOTED_DEST
from .recipes import recipe, recipe_names
from .settings import (COMMAND_LINE, DEFAULT, DEEPSPEED_DEST, ConfigError, Origin, build_parser, default_of,
                       flag)

if TYPE_CHECKING:
    import argparse


@dataclass(frozen=True)
class Overlay:
    """The settings one source sets: `values` ({dest: value}), each from `origin` unless `origins`
    names another (a DeepSpeed file: the key of each)."""
    origin: Origin
    values: dict[str, Any]
    origins: dict[str, Origin] = field(default_factory=dict)

    def origin_of(self, dest: str) -> Origin:
        return self.origins.get(dest, self.origin)


def merge(*overlays: Overlay) -> tuple[dict[str, Any], dict[str, Origin]]:
    """(values, origin_by_dest) of `overlays` laid lowest first: a later overlay's value wins. The
    origins are ordered by the overlay that set them (a value set again moves to its new setter's
    place), which `explain` reads as precedence."""
    values: dict[str, Any] = {}
    origin_by_dest: dict[str, Origin] = {}
    for overlay in overlays:
        for dest, value in overlay.values.items():
            values[dest] = value
            origin_by_dest.pop(dest, None)
            origin_by_dest[dest] = overlay.origin_of(dest)
    return values, origin_by_dest


@dataclass
class Given:
    """What a run was given: its overlays lowest first (the field defaults are not among them; the
    embedded default is added below the others by the entry point), the Megatron switches megapar
    decides itself ({flag: value}, megatron.py) and the DeepSpeed config's settings, if any."""
    overlays: list[Overlay]
    noted: dict[str, Any] = field(default_factory=dict)
    deepspeed: Optional[DeepSpeedSettings] = None

    def values(self) -> dict[str, Any]:
        """The merged values of the overlays (the settings given; a setting absent takes its default)."""
        return merge(*self.overlays)[0]


def recipe_overlay(name: str) -> Overlay:
    """The values of `--recipe NAME` (ConfigError for an unknown name)."""
    return Overlay(Origin(f"--recipe {name}"), dict(recipe(name).values))


def command_line(argv: Sequence[str], parser: argparse.ArgumentParser) -> tuple[Overlay, dict[str, Any],
                                                                                 Optional[str]]:
    """(the overlay of the flags typed, the Megatron switches noted, the --deepspeed-config path)."""
    own = vars(parser.parse_args(list(argv)))
    own.pop("deepspeed", None)   # DeepSpeed's launch marker
    own.pop("recipe", None)      # (expanded by recipe_names)
    path = own.pop(DEEPSPEED_DEST, None)
    noted = {dest[len(NOTED_DEST):]: own.pop(dest) for dest in [d for d in own if d.startswith(NOTED_DEST)]}
    return Overlay(COMMAND_LINE, own), noted, path


def add_deepspeed(given: Given, path: str, strict: bool = True) -> DeepSpeedSettings:
    """Read the DeepSpeed config at `path` into `given`: its overlay goes just below the command
    line's (the last overlay), above the recipes'. A key and a typed flag must agree; a recipe's
    value yields to a key. `strict`: a config with problems raises one ConfigError."""
    *lower, top = given.overlays
    below, _ = merge(*lower)
    s = apply(path, {**below, **top.values}, strict, below=frozenset(below) - set(top.values))
    overlay = Overlay(Origin("--deepspeed-config", path), dict(s.flags),
                      {dest: Origin(key, path) for dest, key in s.origin.items()})
    given.overlays = [*lower, overlay, top]
    given.deepspeed = s
    return s


def parse_flags(argv: Optional[Sequence[str]], parser: Optional[argparse.ArgumentParser] = None) -> Given:
    """The flags given: each `--recipe` in turn < `--deepspeed-config` < the command line.
    `argv` None means sys.argv[1:]; `parser`: build_parser()'s, renamed for another command."""
    names, typed = recipe_names(list(sys.argv[1:] if argv is None else argv))
    cli, noted, path = command_line(typed, parser or build_parser())
    given = Given([*map(recipe_overlay, names), cli], noted)
    if path is not None:
        add_deepspeed(given, path)
    return given


# ---- the embedded default ------------------------------------------------------------------------
EMBEDDED = Origin("the embedded default (no --data-path)")
EMBEDDED_SAVE = os.path.join("checkpoints", "gpt2_embedded")  # + model shape: embedded_save_dir()


def embedded_save_dir(layers: Optional[int] = None, hidden: Optional[int] = None) -> str:
    """Where a run on the embedded default saves (and resumes from) without --save: one folder per
    model shape, so that a run with other --num-layers/--hidden-size never loads another's."""
    layers, hidden = layers or default_of("num_layers"), hidden or default_of("hidden_size")
    return f"{EMBEDDED_SAVE}_{layers}l_{hidden}h"


def embedded_default(given: Given) -> Overlay:
    """What a run without --data-path fills in below everything given: a few minutes of training on
    the embedded corpus with evaluation, a save folder per model shape that a re-run resumes from
    (never overwrites), and the DeepSpeed batch triple left to a config that has one."""
    values = given.values()
    save_dir = embedded_save_dir(values.get("num_layers"), values.get("hidden_size"))
    chosen: dict[str, Any] = {"eval_interval": 100, "eval_iters": 4, "save": save_dir, "log_interval": 20}
    ds = given.deepspeed
    if ds is None or ds.gradient_accumulation_steps is None:  # else the DeepSpeed batch triple decides
        chosen["global_batch_size"] = 8
    if "train_samples" not in values:
        chosen["train_iters"] = 300
    if "lr_warmup_fraction" not in values:
        chosen["lr_warmup_iters"] = 30
    if values.get("load") is None and values.get("save", save_dir) == save_dir:  # re-running resumes
        chosen["load"] = save_dir
    return Overlay(EMBEDDED, chosen)


# ---- errors --------------------------------------------------------------------------------------
def explain(error: ConfigError, origin_by_dest: dict[str, Origin]) -> ConfigError:
    """`error` with where the values of the settings it concerns came from, when the command line did
    not type them and they are not defaults: `... (--micro-batch-size set by --recipe 124m; set by
    train_batch_size in ds.json)`, the highest overlay first."""
    named = [d for d in error.dests if origin_by_dest.get(d, DEFAULT) not in (COMMAND_LINE, DEFAULT)]
    if not named:
        return error
    rank = {dest: i for i, dest in enumerate(origin_by_dest)}
    groups: dict[Origin, list[str]] = {}
    for dest in dict.fromkeys(named):  # a file's keys name themselves; a recipe's flags are named
        o = origin_by_dest[dest]
        groups.setdefault(_group(o), []).append(o.what if o.where else flag(dest))
    top = {key: max(rank[d] for d in named if _group(origin_by_dest[d]) == key) for key in groups}
    parts = [f"set by {', '.join(dict.fromkeys(names))} in {o.where}" if o.where else
             f"{', '.join(names)} set by {o.what}" for o, names in sorted(groups.items(), key=lambda g: -top[g[0]])]
    return ConfigError(f"{error} ({'; '.join(parts)})", error.dests)


def _group(o: Origin) -> Origin:
    """The origins named together: a file's keys as one, else each origin."""
    return Origin("", o.where) if o.where else o
