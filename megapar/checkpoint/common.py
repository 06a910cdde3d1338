"""What every checkpoint format shares (docs/design.md#checkpoint-format): the folder names and
the tracker, the typed record of the run that saved (`SavedConfig`), the model-state nesting of
Megatron's files, RNG state, and the checks a load makes against the run that loads.

    DIR/latest_checkpointed_iteration.txt     written last: the iteration a resume loads
    DIR/iter_0000600/ | DIR/release/          one saved iteration (its files: legacy.py, dist.py)
"""
from __future__ import annotations

import argparse
import os
import random
import re
from dataclasses import dataclass, fields
from typing import Any, Optional

import numpy as np
import torch

from ..config.arguments import ConfigError, DataConfig, ModelConfig, ParallelConfig, flag, section_from_args
from ..topology import layer_counts
from ..atomic import atomic_write
from ..errors import MegaparError
from ..tensor_parallel.random import get_rng_tracker

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
DISTRIB_OPTIM_FILE = "distrib_optim.pt"
CHECKPOINT_VERSION = 3.0
# ModelConfig fields that must match between a checkpoint and the run that loads it.
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
                "vocab_size")


class CheckpointError(MegaparError, RuntimeError):
    """A missing, truncated, corrupt or incompatible checkpoint; the message names the file."""


# ---- names and small atomic helpers ------------------------------------------------------
def iter_dir(root: str, iteration: int | str) -> str:
    name = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
    return os.path.join(root, name)


def shard_dir_name(tp_rank: int, pp_rank: int, pp: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


_SHARD_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


def parse_shard_dir(name: str) -> Optional[tuple[int, Optional[int]]]:
    """The inverse of `shard_dir_name`: (tp rank, pp rank, or None for a pp == 1 name) of an
    mp_rank_TT[_PPP] folder name; None for any other name."""
    m = _SHARD_DIR.match(name)
    return None if m is None else (int(m.group(1)), None if m.group(2) is None else int(m.group(2)))


def shard_dirs(step_dir: str) -> list[str]:
    """The mp_rank_* folder names of an iteration folder, sorted (other entries are ignored)."""
    names = os.listdir(step_dir) if os.path.isdir(step_dir) else []
    return sorted(n for n in names if parse_shard_dir(n) is not None and os.path.isdir(os.path.join(step_dir, n)))


def atomic_torch_save(obj: Any, path: str) -> None:
    with atomic_write(path, "wb") as f:
        torch.save(obj, f)


def load_file(path: str, mmap: bool = False) -> dict:
    """torch.load onto the CPU with one clear error for a missing, truncated or corrupt file.
    mmap: map the file instead of reading it (its tensors are paged in when touched), so a reader
    that needs a part of a large file never holds the rest."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is incomplete "
                              f"(was it saved with a different parallel layout?)")
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:  # zip/pickle errors have many types
        why = str(e).strip().split("\n")[0].split(". ")[0].rstrip(".")  # torch adds sentences of advice
        raise CheckpointError(f"checkpoint file {path} is truncated or corrupt ({type(e).__name__}: {why}); "
                              f"load an earlier iteration or re-save it") from None


def read_tracker(root: str) -> Optional[int | str]:
    """The iteration named by DIR/latest_checkpointed_iteration.txt, or None if absent."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        raw = f.read(4096)
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not text (should hold an iteration number or 'release'); it is corrupt: "
                              f"write the iteration of a complete iter_* folder into it, or load another "
                              f"checkpoint") from None
    if text == "release":
        return "release"
    if not text.isdigit():
        raise CheckpointError(f"{path} should hold an iteration number or 'release', found {text[:40]!r}")
    return int(text)


# ---- what a checkpoint says about its run --------------------------------------------------------
@dataclass
class SavedConfig:
    """The run that wrote a checkpoint file, typed. `read_saved_config` is the one reader
    (training, generation, resharding and export all use it)."""
    args: argparse.Namespace      # Megatron's flat `args`, as saved (Megatron-format readers need it)
    model: ModelConfig            # the file's `model_config`, or derived from `args` (Megatron's checkpoints)
    parallel: ParallelConfig      # the layout it was saved at
    data: DataConfig              # its tokenizer (and data) settings


def read_saved_config(state: dict, path: str = "checkpoint") -> SavedConfig:
    """The SavedConfig of a loaded checkpoint file (or a canonical folder's metadata)."""
    args = state.get("args")
    if args is None:
        raise CheckpointError(f"{path} has no 'args'; it is not a megapar/Megatron checkpoint")
    saved = state.get("model_config")
    names = {f.name for f in fields(ModelConfig)}
    model = ModelConfig(**{k: v for k, v in saved.items() if k in names}) if saved is not None \
        else section_from_args(ModelConfig, args)
    return SavedConfig(args, model, section_from_args(ParallelConfig, args), section_from_args(DataConfig, args))


# ---- model state nesting (docs/design.md) ----------------------------------------------------
def nest_model_state(flat: dict[str, torch.Tensor]) -> dict:
    """Flat GPT2Model keys -> Megatron's nested `model` dict."""
    lm: dict = {}
    out: dict = {"language_model": lm}
    for key, t in flat.items():
        if key.startswith("language_model.embedding."):
            name, leaf = key[len("language_model.embedding."):].rsplit(".", 1)
            lm.setdefault("embedding", {}).setdefault(name, {})[leaf] = t
        elif key.startswith("language_model.encoder."):
            lm.setdefault("encoder", {})[key[len("language_model.encoder."):]] = t
        elif key.startswith("word_embeddings_for_head."):
            out.setdefault("word_embeddings_for_head", {})[key.split(".", 1)[1]] = t
        else:
            raise KeyError(f"unexpected model key {key}")
    return out


def flatten_model_state(nested: dict) -> dict[str, torch.Tensor]:
    flat = {}
    lm = nested.get("language_model", {})
    for name, leaves in lm.get("embedding", {}).items():
        for leaf, t in leaves.items():
            flat[f"language_model.embedding.{name}.{leaf}"] = t
    for key, t in lm.get("encoder", {}).items():
        flat[f"language_model.encoder.{key}"] = t
    for leaf, t in nested.get("word_embeddings_for_head", {}).items():
        flat[f"word_embeddings_for_head.{leaf}"] = t
    return flat


_CHUNK_KEY = re.compile(r"^model(\d+)\.(.+)$")


def nest_model_states(flat: dict[str, torch.Tensor]) -> dict[str, dict]:
    """A model's flat state dict -> the checkpoint's model entries: {"model": nested} for one
    stage, or Megatron's {"model0": nested, "model1": ...} for the model chunks of interleaved 1F1B
    (keys "model{j}." + the chunk's key, layer indices local to the chunk)."""
    chunks: dict[Optional[int], dict] = {}
    for key, t in flat.items():
        m = _CHUNK_KEY.match(key)
        j, local = (int(m.group(1)), m.group(2)) if m else (None, key)
        chunks.setdefault(j, {})[local] = t
    if None in chunks:
        if len(chunks) > 1:
            raise KeyError(f"model keys mix model chunks and a plain stage: {sorted(flat)[:3]}")
        return {"model": nest_model_state(chunks[None])}
    return {f"model{j}": nest_model_state(chunks[j]) for j in sorted(chunks)}


def flatten_model_states(state: dict) -> dict[str, torch.Tensor]:
    """The inverse of `nest_model_states` on a checkpoint file's dict ("model" or model0, model1, ...)."""
    if "model" in state:
        return flatten_model_state(state["model"])
    flat, j = {}, 0
    while f"model{j}" in state:
        flat.update({f"model{j}.{k}": t for k, t in flatten_model_state(state[f"model{j}"]).items()})
        j += 1
    return flat


def has_model_state(state: dict) -> bool:
    return "model" in state or "model0" in state


# ---- RNG ------------------------------------------------------------------------------------
def get_rng_state() -> dict:
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "rng_tracker_states": get_rng_tracker().get_states()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if state.get("cuda_rng_state") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    get_rng_tracker().set_states(state["rng_tracker_states"])


def same_dir(a: str, b: str) -> bool:
    """Do two paths name the same directory (relative paths, `..` and symlinks resolved)?"""
    return os.path.realpath(os.path.abspath(a)) == os.path.realpath(os.path.abspath(b))


def check_load_dir(load: Optional[str], save: Optional[str]) -> None:
    """Before any work: `--load` must name a checkpoint directory, unless it is also `--save`
    (the first run of a resumable job, which starts from scratch). Raises ConfigError."""
    if not load or (save and same_dir(load, save)):
        return
    fix = (f"give the directory a run saved into (the one holding {TRACKER}), the same directory as --save "
           f"for a job that resumes itself, or drop --load to start from scratch")
    if not os.path.exists(load):
        raise ConfigError(f"--load {load} does not exist; {fix}")
    if not os.path.isdir(load):
        raise ConfigError(f"--load {load} is not a directory; {fix}")
    if not os.path.isfile(os.path.join(load, TRACKER)):
        raise ConfigError(f"--load {load} holds no checkpoint (no {TRACKER}); {fix}")


def loaded_line(root: str, iteration: int | str, finetune: bool) -> str:
    """What rank 0 prints once a checkpoint is loaded: Megatron's line, and for a --finetune what
    was taken from it (the weights) and what starts afresh."""
    line = f"  successfully loaded checkpoint from {root} at iteration {iteration}"
    if finetune:
        line += " (--finetune: the model weights only; a fresh optimizer and LR schedule, starting at iteration 0)"
    return line


def saved_layout_flags(saved: SavedConfig) -> str:
    """The layout flags of the run that wrote a checkpoint (what a resume at that layout passes)."""
    flags = [f"--tensor-model-parallel-size {saved.parallel.tensor_model_parallel_size}",
             f"--pipeline-model-parallel-size {saved.parallel.pipeline_model_parallel_size}"]
    for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                 "virtual_pipeline_model_parallel_size"):
        if getattr(saved.model, name, None) is not None:
            flags.append(f"{flag(name)} {getattr(saved.model, name)}")
    return " ".join(flags)


def check_compatible(saved: SavedConfig, model: ModelConfig, topo, path: str) -> None:
    """Explain every incompatibility between the checkpoint's run and this one (`model` at `topo`)."""
    s_tp, s_pp = saved.parallel.tensor_model_parallel_size, saved.parallel.pipeline_model_parallel_size
    if (s_tp, s_pp) == (topo.tp, topo.pp) and s_pp > 1 and layer_counts(saved.model, s_pp) != layer_counts(model, s_pp):
        raise CheckpointError(
            f"checkpoint {path} holds {layer_counts(saved.model, s_pp)} layers per pipeline stage, but this run "
            f"splits them {layer_counts(model, s_pp)}; set --decoder-first/last-pipeline-num-layers as the "
            f"checkpoint did (its layout: {saved_layout_flags(saved)}), or reshard it with tools/checkpoint_util.py")
    s_v, v = saved.model.virtual_pipeline_model_parallel_size, model.virtual_pipeline_model_parallel_size
    if (s_tp, s_pp) == (topo.tp, topo.pp) and (s_v or 1) != (v or 1):
        raise CheckpointError(
            f"checkpoint {path} holds {s_v or 1} model chunk(s) per pipeline rank (--virtual-pipeline-model-parallel-"
            f"size), this run {v or 1}; resume with its layout ({saved_layout_flags(saved)}), or convert it: python "
            f"tools/checkpoint_util.py --load-dir <ckpt> --save-dir <new> --target-virtual-pipeline-parallel-size "
            f"{v or 1}")
    if (s_tp, s_pp) != (topo.tp, topo.pp):
        raise CheckpointError(
            f"checkpoint {path} was saved with tensor-parallel {s_tp} x pipeline-parallel {s_pp}, but this run "
            f"uses {topo.tp} x {topo.pp}; resume with the layout it was saved with ({saved_layout_flags(saved)}, "
            f"on a multiple of {s_tp * s_pp} processes), or reshard it first: python tools/checkpoint_util.py "
            f"--load-dir <ckpt> --save-dir <new> --target-tensor-parallel-size {topo.tp} "
            f"--target-pipeline-parallel-size {topo.pp}"
            + (f" --target-virtual-pipeline-parallel-size {v}" if v else ""))
    check_same_model(saved, model, path)


def check_same_model(saved: SavedConfig, model: ModelConfig, path: str) -> None:
    """The checkpoint's model must have this run's shape (the layout may differ)."""
    diffs = [f"{flag(a)} {getattr(saved.model, a)} (checkpoint) vs {getattr(model, a)} (run)"
             for a in SHAPE_FIELDS if getattr(saved.model, a) != getattr(model, a)]
    if diffs:
        raise CheckpointError(f"checkpoint {path} does not match this model: " + "; ".join(diffs) +
                              "; use the checkpoint's model flags (or a matching tokenizer)")


def restore_scheduler(scheduler, saved: dict, path: str, rank: int) -> None:
    """Resume the LR schedule as Megatron does: its step count always; its settings (--lr, --min-lr,
    warmup, decay iterations and style, --weight-decay) must match this run's flags unless
    --override-opt_param-scheduler (the flags win) or --use-checkpoint-opt_param-scheduler (the
    checkpoint wins) is given -- a silently re-stretched schedule is refused."""
    diffs = scheduler.differences(saved)
    override, keep = scheduler.override_opt_param_scheduler, scheduler.use_checkpoint_opt_param_scheduler
    if diffs and not (override or keep):
        raise CheckpointError(
            f"checkpoint {path} was saved with another LR schedule: {'; '.join(diffs)}"
            f"{' (--lr-decay-iters defaults to --train-iters)' if any('--lr-decay-iters' in d for d in diffs) else ''}"
            f"; pass --use-checkpoint-opt_param-scheduler to keep the checkpoint's "
            f"schedule, or --override-opt_param-scheduler to take this run's flags")
    scheduler.load_state_dict(saved, use_checkpoint_settings=not override)
    if diffs and rank == 0:
        print(f"> LR schedule: {'this run' if override else 'the checkpoint'}'s settings "
              f"({'; '.join(diffs)}), from step {scheduler.num_steps}", flush=True)


