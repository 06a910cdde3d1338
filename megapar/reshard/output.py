"""Where the conversion tools write, and what `--force` may replace.

The tools (tools/checkpoint_util.py, tools/convert_to_hf.py, tools/convert_from_hf.py) never delete
anything they did not write:

* `--save-dir` must not be, contain, or lie inside `--load-dir` (paths resolved: symlinks,
  `..`, relative paths).
* An existing non-empty `--save-dir` is replaced (with `--force`) only when it is recognisably a
  previous output of the same tool (`recognise`):
    megapar checkpoint  latest_checkpointed_iteration.txt + iter_NNNNNNN/ or release/ folders
                        holding only mp_rank_XX[_YYY]/ folders holding only model_optim_rng.pt /
                        distrib_optim.pt  (what checkpoint_util.py and convert_from_hf.py write)
    canonical folder    metadata.pt + tensors/ holding only *.pt files  (checkpoint_util.py --to-full)
    Hugging Face folder config.json (a GPT-2 config) + model.safetensors, and only the tokenizer files
                        an export writes (vocab.json, merges.txt, tokenizer.model, tokenizer_config.json,
                        special_tokens_map.json)  (convert_to_hf.py)
  Anything else (a user's file, a training run's leftovers, another tool's output) is refused.
* The new output is written into a fresh hidden staging folder beside `--save-dir` and renamed
  into place at the end; the previous output (checked again just before) is renamed aside and
  only then removed.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

from ..checkpoint.common import DISTRIB_OPTIM_FILE, MODEL_FILE, TRACKER, CheckpointError, parse_shard_dir

CHECKPOINT, CANONICAL, HF = "megapar checkpoint", "canonical folder", "Hugging Face folder"
_ITER = re.compile(r"^(iter_\d{7}|release)$")


def _entries(path: str) -> set[str]:
    return set(os.listdir(path)) if os.path.isdir(path) and not os.path.islink(path) else set()


def _only_files(path: str, allowed: Callable[[str], bool]) -> bool:
    names = _entries(path)
    return bool(names) and all(allowed(n) and os.path.isfile(os.path.join(path, n)) for n in names)


def _only_dirs(path: str, named: Callable[[str], bool], inner: Callable[[str], bool]) -> bool:
    names = _entries(path)
    return bool(names) and all(named(n) and inner(os.path.join(path, n)) for n in names)


def is_checkpoint_output(path: str) -> bool:
    names = _entries(path)
    if TRACKER not in names or not os.path.isfile(os.path.join(path, TRACKER)) or len(names) < 2:
        return False
    shard_ok = lambda d: _only_files(d, lambda n: n in (MODEL_FILE, DISTRIB_OPTIM_FILE))  # noqa: E731
    is_shard = lambda n: parse_shard_dir(n) is not None  # noqa: E731
    return all(_ITER.match(n) and _only_dirs(os.path.join(path, n), is_shard, shard_ok) for n in names - {TRACKER})


def is_canonical_output(path: str) -> bool:
    return (_entries(path) == {"metadata.pt", "tensors"} and os.path.isfile(os.path.join(path, "metadata.pt"))
            and _only_files(os.path.join(path, "tensors"), lambda n: n.endswith(".pt")))


HF_TOKENIZER_FILES = {"vocab.json", "merges.txt", "tokenizer.model", "tokenizer_config.json",
                      "special_tokens_map.json"}   # megapar/reshard/hf_tokenizer.py


def is_hf_output(path: str) -> bool:
    names = _entries(path)
    if not {"config.json", "model.safetensors"} <= names or not names <= {"config.json", "model.safetensors"} | \
            HF_TOKENIZER_FILES or not _only_files(path, lambda n: True):
        return False
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            return json.load(f).get("model_type") == "gpt2"
    except (OSError, ValueError, AttributeError):
        return False


RECOGNISERS = {CHECKPOINT: is_checkpoint_output, CANONICAL: is_canonical_output, HF: is_hf_output}


def recognise(path: str, kinds: Iterable[str]) -> str | None:
    """The first of `kinds` that the folder `path` is a previous output of, else None."""
    return next((k for k in kinds if RECOGNISERS[k](path)), None)


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(path))


def source_dir(src) -> str:
    """The folder a ShardedCheckpoint (`root`) or CanonicalFolder (`path`) reads."""
    return getattr(src, "root", None) or src.path


def check_not_overlapping(load_dir: str, save_dir: str) -> None:
    """Refuse a --save-dir that is, contains, or lies inside --load-dir (symlinks resolved)."""
    src, dst = _real(load_dir), _real(save_dir)
    if src == dst:
        raise CheckpointError(f"--save-dir {save_dir} is the --load-dir; choose a new directory for the output")
    if os.path.commonpath([src, dst]) == dst:
        raise CheckpointError(f"--save-dir {save_dir} contains the --load-dir {load_dir} (writing there would "
                              f"replace the source); choose a new directory beside it")
    if os.path.commonpath([src, dst]) == src:
        raise CheckpointError(f"--save-dir {save_dir} lies inside the --load-dir {load_dir}; choose a new "
                              f"directory outside the source checkpoint")


def prepare_output(out_dir: str, force: bool, kinds: Iterable[str], load_dir: str | None = None) -> None:
    """Before any work: refuse an output path that overlaps the source, is not a directory, or is
    a non-empty directory that is not a previous output of `kinds` (or is one, without `force`)."""
    kinds = tuple(kinds)
    if load_dir is not None:
        check_not_overlapping(load_dir, out_dir)
    if os.path.islink(out_dir):
        raise CheckpointError(f"output path {out_dir} is a symbolic link; give the directory it points to, "
                              f"or a new directory")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"output path {out_dir} exists and is not a directory; choose a new directory")
    if not _entries(out_dir):
        return
    if recognise(out_dir, kinds) is None:
        raise CheckpointError(f"output directory {out_dir} is not empty and is not a previous output of this tool "
                              f"(a {' or '.join(kinds)}), so --force will not replace it; choose a new directory "
                              f"or empty it yourself")
    if not force:
        raise CheckpointError(f"output directory {out_dir} exists and is not empty; choose a new directory "
                              f"or pass --force to replace it")


def new_staging(out_dir: str) -> str:
    """A fresh, empty hidden folder beside `out_dir` (created with the usual umask)."""
    parent, name = os.path.split(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    while True:
        staging = os.path.join(parent, f".{name}.partial.{secrets.token_hex(4)}")
        try:
            os.mkdir(staging)
            return staging
        except FileExistsError:
            continue


def discard(staging: str) -> None:
    """Remove a staging folder made by new_staging (after a failure)."""
    shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def staged_output(src, out_dir: str, force: bool, kinds: Iterable[str]) -> Iterator[str]:
    """What every writer of a conversion does: check `out_dir` before any work (prepare_output,
    the source's folder included), yield a fresh staging folder to write into, discard it on any
    failure, else release the source and move the staging folder into place (publish_dir)."""
    kinds = tuple(kinds)
    prepare_output(out_dir, force, kinds, load_dir=source_dir(src))
    staging = new_staging(out_dir)
    try:
        yield staging
    except BaseException:
        discard(staging)
        raise
    src.release()
    publish_dir(staging, out_dir, kinds)


def publish_dir(staging: str, out_dir: str, kinds: Iterable[str]) -> None:
    """Move the finished `staging` into place. An existing `out_dir` is checked again (it may have
    changed during the conversion), renamed aside, and removed only after the new one is in place."""
    kinds = tuple(kinds)
    real_dir = os.path.isdir(out_dir) and not os.path.islink(out_dir)
    if os.path.lexists(out_dir) and not real_dir:
        discard(staging)
        raise CheckpointError(f"output path {out_dir} appeared during the conversion and is not a directory; "
                              f"nothing was replaced")
    if not _entries(out_dir):
        if real_dir:
            os.rmdir(out_dir)                     # empty: nothing of anyone's is lost
        os.replace(staging, out_dir)
        return
    if recognise(out_dir, kinds) is None:
        discard(staging)
        raise CheckpointError(f"output directory {out_dir} changed during the conversion and is no longer a "
                              f"previous output of this tool; nothing was replaced")
    parent, name = os.path.split(os.path.abspath(out_dir))
    old = os.path.join(parent, f".{name}.old.{secrets.token_hex(4)}")
    os.replace(out_dir, old)
    os.replace(staging, out_dir)
    shutil.rmtree(old, ignore_errors=True)
