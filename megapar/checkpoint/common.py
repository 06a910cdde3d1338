"""What every checkpoint format shares (docs/design.md#checkpoint-format): the folder names and
the tracker, the typed record of the run that saved (`SavedConfig`), the model-state nesting of
Megatron's files, RNG state, and the checks a load makes against the run that loads.

    DIR/latest_checkpointed_iteration.txt     written last: the iteration a resume loads
    DIR/iter_0000600/ | DIR/release/          one saved iteration (its files: legacy.py, dist.py)
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import re
import secrets
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any, Optional

import numpy as np
import torch

from ..config.settings import Config, ConfigError, DataConfig, ModelConfig, ParallelConfig, flag, section_from_args
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
ASIDE, STAGING = ".old", ".partial"    # suffixes of an iteration folder a re-save set aside, and of a save under way
# An iteration folder's name: iter_NNNNNNN or release, with no suffix (published), ASIDE or STAGING
_ITERATION_NAME = re.compile(r"^(?:iter_(\d{7})|release)(\.old|\.partial)?$")


def iteration_name(name: str) -> Optional[tuple[Optional[int], str]]:
    """(the iteration, None for release; its suffix: "", ASIDE or STAGING) of an iteration folder's name
    (the inverse of iter_dir's name plus a suffix); None for any other name."""
    m = _ITERATION_NAME.match(name)
    return None if m is None else (None if m.group(1) is None else int(m.group(1)), m.group(2) or "")


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
        saved = [n for n in saved_iterations(root) if not n.endswith(ASIDE)]
        fix = (f"write the iteration to resume from into it (saved: {', '.join(saved[-3:])})" if saved
               else "it names no saved iteration: remove it, or load another checkpoint")
        raise CheckpointError(f"{path} should hold an iteration number or 'release', found {text[:40]!r}; {fix}")
    return int(text)


# ---- identity: whose files these are ------------------------------------------------------------
# Every checkpoint file carries its identity -- the run id (drawn at a run's first save, kept across
# resumes) and the iteration -- and a manifest beside the files (a legacy shard's identity.json, a
# torch_dist iteration's common.pt) holds the identity and each file's size and checksum (SUM64,
# file_checksum), computed once the file is written. A load checks every file against it before using
# it: a file of another run or iteration, a truncated one and changed bytes are refused, naming the
# file. Checkpoints saved before identities load unchecked.
IDENTITY_FILE = "identity.json"
CHECKSUM = "sum64"          # the manifest's key; manifests of the first identities hold "crc32" (zlib's)
_BLOCK_BYTES = 4 << 20      # mapped per thread at a time: 16 MiB of the file in memory, whatever its size
_CHECKSUM_THREADS = 4


def new_run_id() -> str:
    return secrets.token_hex(8)


def identity(run_id: Optional[str], iteration: int | str) -> dict:
    return {"run_id": run_id, "iteration": iteration}


def file_checksum(path: str) -> tuple[int, int]:
    """(bytes, SUM64) of the file at `path`. SUM64: the file read as little-endian 64-bit words (the
    last ones zero-padded), summed per 4 MiB block, block i's sum weighted by 2i + 1, all mod 2^64.
    An odd weight is invertible mod 2^64, so a change confined to one block always changes the sum,
    and a block moved elsewhere changes it too; unrelated bytes (another run's file) match by chance
    once in 2^64. Not a cryptographic hash: it tells a changed, truncated or foreign file from the
    one saved, at the speed of memory: blocks mapped a few at a time and summed by numpy on
    _CHECKSUM_THREADS threads (it releases the GIL), several times faster than zlib's CRC-32 (a
    byte-at-a-time table walk), so the check costs a small part of the save and load it guards."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        blocks = range(-(-size // _BLOCK_BYTES))
        with ThreadPoolExecutor(max_workers=_CHECKSUM_THREADS) as pool:
            sums = list(pool.map(lambda i: _block_sum(fd, i * _BLOCK_BYTES, min(_BLOCK_BYTES, size - i * _BLOCK_BYTES)),
                                 blocks))
    finally:
        os.close(fd)
    return size, sum((2 * i + 1) * s for i, s in enumerate(sums)) % 2**64


def _block_sum(fd: int, offset: int, length: int) -> int:
    """The sum mod 2^64 of the `length` bytes at `offset` of the file `fd` as 64-bit words."""
    with mmap.mmap(fd, length, offset=offset, access=mmap.ACCESS_READ) as m:
        words = np.frombuffer(m, dtype="<u8", count=length // 8)
        total = int(words.sum(dtype=np.uint64))
        del words                                   # the map closes only once no array holds it
        tail = int.from_bytes(m[length // 8 * 8:], "little")
    return (total + tail) % 2**64


def _crc32(path: str) -> int:
    """zlib's CRC-32 of the file, for the manifests of the first identities."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(folder: str, ident: dict, files: dict[str, tuple[int, int]]) -> None:
    """`folder`/identity.json: the identity of the files written there and each one's (bytes, checksum)."""
    record = {**ident, "files": {name: {"bytes": n, CHECKSUM: s} for name, (n, s) in files.items()}}
    with atomic_write(os.path.join(folder, IDENTITY_FILE), "w") as f:
        f.write(json.dumps(record, indent=1))


def read_manifest(folder: str) -> Optional[dict]:
    """`folder`'s identity.json, or None for a checkpoint saved before identities."""
    path = os.path.join(folder, IDENTITY_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        assert isinstance(record.get("files"), dict) and "run_id" in record and "iteration" in record
        return record
    except (OSError, ValueError, AssertionError, AttributeError):
        raise CheckpointError(f"checkpoint file {path} is corrupt (it should hold the identity and checksums of "
                              f"the files beside it); load an earlier iteration") from None


def check_file(folder: str, name: str, saved: Optional[dict], verify: bool = True) -> None:
    """The file `name` of `folder` is the one the manifest entry `saved` ({bytes, sum64}) describes:
    its size always, its checksum when `verify` (a pass over its bytes)."""
    path = os.path.join(folder, name)
    if saved is None:
        raise CheckpointError(f"checkpoint file {path} is not one of the files saved with this checkpoint; remove "
                              f"it, or load an earlier iteration")
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is incomplete: load an earlier "
                              f"iteration")
    size = os.path.getsize(path)
    if size < saved["bytes"]:
        raise CheckpointError(f"checkpoint file {path} is truncated ({size} of {saved['bytes']} bytes); the "
                              f"checkpoint is incomplete: load an earlier iteration")
    if size != saved["bytes"]:
        raise CheckpointError(f"checkpoint file {path} is not the file saved with this checkpoint ({size} bytes, "
                              f"saved: {saved['bytes']}; truncated, or copied from another checkpoint); put back "
                              f"the file saved with it, or load an earlier iteration")
    if verify:
        check_checksum(path, saved)


def check_checksum(path: str, saved: dict) -> None:
    """The file's checksum is the one its manifest entry `saved` holds (a pass over its bytes;
    callers run it beside the read that needs the file, on a thread)."""
    same = file_checksum(path)[1] == saved[CHECKSUM] if CHECKSUM in saved else _crc32(path) == saved["crc32"]
    if not same:
        raise CheckpointError(f"checkpoint file {path} is corrupt or not the file saved with this checkpoint (its "
                              f"checksum differs from the one saved with it); put back the file saved with it, or "
                              f"load an earlier iteration")


def check_identity(path: str, found: Optional[dict], expected: dict) -> None:
    """A loaded file's own identity (`found`) must be the checkpoint's (`expected`)."""
    if found == expected:
        return
    whose = (f"run {found.get('run_id')}, iteration {found.get('iteration')}" if isinstance(found, dict)
             else "a checkpoint without identities")
    raise CheckpointError(f"checkpoint file {path} belongs to another checkpoint ({whose}; this one: run "
                          f"{expected['run_id']}, iteration {expected['iteration']}); put back the file saved "
                          f"with it, or load an earlier iteration")


# ---- what a checkpoint says about its run --------------------------------------------------------
def megatron_args(cfg: Config, consumed_samples: int = 0) -> argparse.Namespace:
    """The `args` stored in checkpoints: every setting (Megatron's names), the sizes derived from the
    tokenizer and topology, and what Megatron-format readers look for (docs/design.md)."""
    ns = cfg.megatron_args()
    ns.consumed_train_samples = consumed_samples
    ns.openai_gelu, ns.bias_gelu_fusion = True, False
    return ns


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


# A key of a model chunk under interleaved 1F1B: "model{j}." + the chunk's own key (Megatron's model0, model1, ...)
CHUNK_KEY = re.compile(r"^model(\d+)\.(.+)$")


def nest_model_states(flat: dict[str, torch.Tensor]) -> dict[str, dict]:
    """A model's flat state dict -> the checkpoint's model entries: {"model": nested} for one
    stage, or Megatron's {"model0": nested, "model1": ...} for the model chunks of interleaved 1F1B
    (keys "model{j}." + the chunk's key, layer indices local to the chunk)."""
    chunks: dict[Optional[int], dict] = {}
    for key, t in flat.items():
        m = CHUNK_KEY.match(key)
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
    (the first run of a resumable job, which starts from scratch -- never over saved iterations
    that lost their tracker). Raises ConfigError."""
    if not load:
        return
    if os.path.isdir(load) and not os.path.isfile(os.path.join(load, TRACKER)):
        line = untracked_line(load, "--load")
        if line:
            raise ConfigError(line)
    if save and same_dir(load, save):
        return
    fix = (f"give the directory a run saved into (the one holding {TRACKER}), the same directory as --save "
           f"for a job that resumes itself, or drop --load to start from scratch")
    if not os.path.exists(load):
        raise ConfigError(f"--load {load} does not exist; {fix}")
    if not os.path.isdir(load):
        raise ConfigError(f"--load {load} is not a directory; {fix}")
    if not os.path.isfile(os.path.join(load, TRACKER)):
        if os.path.isfile(os.path.join(load, "config.json")):
            raise ConfigError(f"--load {load} is a Hugging Face model folder, not a megapar checkpoint; convert it "
                              f"first: python tools/convert_from_hf.py --load-dir {load} --save-dir <ckpt>, then "
                              f"--load <ckpt> (with --finetune to start a new run from it)")
        raise ConfigError(f"--load {load} holds no checkpoint (no {TRACKER}); {fix}")


def saved_iterations(root: str) -> list[str]:
    """The published iteration folders of `root` (iter_NNNNNNN, release, and copies a re-save set
    aside), sorted; staging folders (.partial) are not saved iterations."""
    names = os.listdir(root) if os.path.isdir(root) else []
    parsed = {n: iteration_name(n) for n in names}
    return sorted(n for n, p in parsed.items() if p is not None and p[1] != STAGING
                  and os.path.isdir(os.path.join(root, n)))


def shown_iterations(saved: list[str]) -> str:
    """The last three of `saved` (folder names), and how many there are when more."""
    return ", ".join(saved[-3:]) + (f" ({len(saved)} in all)" if len(saved) > 3 else "")


def untracked_line(root: str, what: str) -> Optional[str]:
    """The refusal for a checkpoint directory that holds saved iterations but no tracker (a resume
    would otherwise start from scratch over them), or None when it holds none."""
    saved = saved_iterations(root)
    if not saved:
        return None
    numbers = [it for it, _ in map(iteration_name, saved) if it is not None]
    latest = str(max(numbers)) if numbers else "release"
    return (f"{what} {root} holds saved iterations ({shown_iterations(saved)}) but no {TRACKER}, so a resume "
            f"would start from scratch over them; name the one to resume from (echo {latest} > "
            f"{os.path.join(root, TRACKER)}), or give a new directory")


def check_tracked_iteration(root: str, iteration: int | str, published: str) -> None:
    """The tracker's iteration must have its folder (`published`); else name the saved ones."""
    if os.path.isdir(published):
        return
    saved = [n for n in saved_iterations(root) if not n.endswith(ASIDE)]
    others = f"saved iterations: {', '.join(saved[-3:])}" if saved else "no iteration folder is there"
    raise CheckpointError(f"{os.path.join(root, TRACKER)} names iteration {iteration}, but {published} is missing "
                          f"({others}); write the iteration to resume from into {TRACKER}, or load another "
                          f"checkpoint")


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


