"""How every checkpoint writer makes its output appear only when it is complete: one staging
folder per output, renamed into place at the end (docs/design.md#checkpoint-format).

Training (every `--ckpt-format`), into a checkpoint directory DIR:

    DIR/iter_0000600.partial/   staging_dir(): every rank writes its files here (staged_iteration)
    DIR/iter_0000600/           publish_iteration(): renamed into place when every rank is done ...
    DIR/latest_checkpointed_iteration.txt   ... then the tracker is written (last)

  Re-saving an iteration that is already published (a run restarted from scratch into the same
  --save, or a resume that saves at the iteration it loaded) sets the published copy aside as
  `iter_0000600.old` before renaming the new one in, and removes it only after the tracker is
  written. A kill between those two renames leaves no `iter_0000600`: readers then take the copy
  set aside (`published_dir`), and the next publish (of any iteration) puts it back first, so at
  every moment the tracker names a complete folder. A failed save (disk full, read-only, a quota) removes its
  staging folder and raises one CheckpointError on every rank; the published checkpoints stay.

Conversion tools (tools/checkpoint_util.py, convert_to_hf.py, convert_from_hf.py) never delete
anything they did not write:

* `--save-dir` must not be, contain, or lie inside `--load-dir` (paths resolved: symlinks,
  `..`, relative paths).
* An existing non-empty `--save-dir` is replaced (with `--force`) only when it is recognisably a
  previous output of the same tool (`recognise`):
    megapar checkpoint  latest_checkpointed_iteration.txt + iter_NNNNNNN/ or release/ folders, each
                        holding only mp_rank_XX[_YYY]/ folders of model_optim_rng.pt / distrib_optim.pt / identity.json
                        (legacy layout), or only the files of torch.distributed.checkpoint (.metadata,
                        __R_I.distcp, common.pt, metadata.json: --ckpt-format torch_dist)
    canonical folder    metadata.pt + tensors/ holding only *.pt files  (checkpoint_util.py --to-full)
    Hugging Face folder config.json (a GPT-2 config) + model.safetensors, and only the tokenizer files
                        an export writes (vocab.json, merges.txt, tokenizer.model, tokenizer_config.json,
                        special_tokens_map.json)  (convert_to_hf.py)
  Anything else (a user's file, a training run's leftovers, a running job's lock file, another
  tool's output) is refused.
* The new output is written into a fresh hidden staging folder beside `--save-dir` and renamed
  into place at the end; the previous output (checked again just before) is renamed aside and
  only then removed.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Optional

import torch.distributed as dist

from ..atomic import atomic_write_text
from ..errors import MegaparError
from .common import (ASIDE, DISTRIB_OPTIM_FILE, IDENTITY_FILE, MODEL_FILE, STAGING, TRACKER, CheckpointError, iter_dir,
                     iteration_name, parse_shard_dir, read_tracker)
from .guard import LOCK_FILE, lock_note


def _suffix(name: str) -> Optional[str]:
    """The suffix of an iteration folder's name ("", ASIDE or STAGING); None for any other name."""
    parsed = iteration_name(name)
    return None if parsed is None else parsed[1]


def discard(staging: str) -> None:
    """Remove a staging folder (after a failure, or a leftover of a killed save). shutil.rmtree holds
    two descriptors per folder level; a process out of them (EMFILE: the very failure being cleaned
    up) still removes it one name at a time."""
    shutil.rmtree(staging, ignore_errors=True)
    if not os.path.isdir(staging):
        return
    for folder, dirs, files in os.walk(staging, topdown=False):
        for name in files:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def _swap_in(staging: str, final: str, aside: str) -> bool:
    """Rename `final` (if present) to `aside`, then `staging` to `final`. True if there was a `final`."""
    had = os.path.lexists(final)
    if had:
        os.replace(final, aside)
    os.replace(staging, final)
    return had


# ---- training: one iteration into a checkpoint directory ---------------------------------------------
def staging_dir(root: str, iteration: int | str) -> str:
    """The folder every rank writes iteration `iteration`'s files into, whatever the format."""
    return iter_dir(root, iteration) + STAGING


def aside_dir(root: str, iteration: int | str) -> str:
    """Where a re-save sets the published copy of `iteration` aside until the tracker is written."""
    return iter_dir(root, iteration) + ASIDE


def published_dir(root: str, iteration: int | str) -> str:
    """The folder to read iteration `iteration` from: `iter_dir`, or the copy set aside when a
    re-save of it stopped between its two renames (what every reader of a checkpoint calls)."""
    final, aside = iter_dir(root, iteration), aside_dir(root, iteration)
    return aside if not os.path.exists(final) and os.path.isdir(aside) else final


def restore_asides(root: str) -> None:
    """Undo every re-save that stopped between its renames: put each copy set aside back in place.
    A copy set aside beside a published folder is a leftover (its removal was cut short)."""
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if _suffix(name) != ASIDE:
            continue
        aside, final = os.path.join(root, name), os.path.join(root, name[:-len(ASIDE)])
        if os.path.exists(final):
            discard(aside)
        else:
            os.replace(aside, final)


def publish_iteration(root: str, staging: str, iteration: int | str) -> None:
    """Rank 0, once every rank's files are in `staging`: rename it into place as the iteration's
    folder, write the tracker, then drop the copy it replaced. A failing tracker write puts the
    previous folder back and leaves the new one in `staging` (the caller removes it)."""
    restore_asides(root)
    final, aside = iter_dir(root, iteration), aside_dir(root, iteration)
    replaced = _swap_in(staging, final, aside)
    try:
        atomic_write_text(os.path.join(root, TRACKER), str(iteration))
    except OSError:
        os.replace(final, staging)
        if replaced:
            os.replace(aside, final)
        raise
    discard(aside)


@contextmanager
def staged_iteration(root: str, iteration: int | str, rank: int, group=None) -> Iterator[str]:
    """`with staged_iteration(root, iteration, rank) as staging:` write this rank's files there.

    Collective: every rank enters and leaves it. Rank 0 makes a fresh staging folder first;
    after the block has ended on every rank it publishes the folder (publish_iteration). If the
    block fails on any rank or the publish fails -- the disk full, read-only, over a quota or a
    file size limit -- rank 0 removes the staging folder and every rank raises the same one-line
    CheckpointError (a rank whose block raised something other than a file-system error
    re-raises it, so a bug keeps its traceback); the checkpoints published before stay as they
    were. A peer that stops answering (the group's timeout) ends the save as well: rank 0 removes
    the staging folder and the timeout propagates. The block must finish its collectives on every
    rank (raise after the last one). `group`: the process group the ranks agree over (None: the world)."""
    staging = staging_dir(root, iteration)
    _agree(_attempt(lambda: _fresh(root, staging), rank == 0), root, iteration, staging, rank, group)
    failure = None
    try:
        yield staging
    except Exception as e:  # agreed on below: every rank must know before anyone leaves
        failure = e
    _agree(failure, root, iteration, staging, rank, group)
    _agree(_attempt(lambda: publish_iteration(root, staging, iteration), rank == 0), root, iteration, staging, rank,
           group)


def _fresh(root: str, staging: str) -> None:
    """An empty `staging`, after removing every staging folder a killed save left in `root` (only
    this job writes there: it holds the directory's lock)."""
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if _suffix(name) == STAGING:
            discard(os.path.join(root, name))
    os.makedirs(staging)


def _attempt(step: Callable[[], None], mine: bool) -> Optional[Exception]:
    if not mine:
        return None
    try:
        step()
    except Exception as e:
        return e
    return None


def _agree(failure: Optional[Exception], root: str, iteration: int | str, staging: str, rank: int,
           group=None) -> None:
    """Share every rank's failure (a barrier when there is none); on any, rank 0 removes the
    staging folder and every rank raises the first failure's line."""
    line = None if failure is None else _failure_line(failure, root, iteration, rank)
    lines = [line]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        lines = [None] * dist.get_world_size(group)
        try:
            dist.all_gather_object(lines, line, group=group)
        except BaseException:   # a peer gone or frozen (the group's timeout): this save is over
            if rank == 0:
                discard(staging)
            raise
    first = next((x for x in lines if x is not None), None)
    if first is None:
        return
    if rank == 0:
        discard(staging)
    if failure is not None and _file_system_error(failure) is None and not isinstance(failure, MegaparError):
        raise failure
    raise CheckpointError(first) from None


def _file_system_error(e: BaseException) -> Optional[OSError]:
    """The OSError with an errno behind `e` (torch's writer wraps the one its file object raised)."""
    while e is not None:
        if isinstance(e, OSError) and e.errno is not None:
            return e
        e = e.__cause__ or e.__context__
    return None


_FIXES = {errno.EROFS: "make it writable or give another --save",
          errno.EACCES: "fix its permissions or give another --save",
          errno.EPERM: "fix its permissions or give another --save",
          errno.EFBIG: "raise the file size limit (ulimit -f), give another --save, or save less with --no-save-optim",
          errno.EMFILE: "raise the open-file limit (ulimit -n)",
          errno.ENFILE: "the system's open-file table is full: close other programs' files or raise fs.file-max"}
_SPACE = "free space there, give another --save, or save less with --no-save-optim"


def _failure_line(e: Exception, root: str, iteration: int | str, rank: int) -> str:
    if isinstance(e, MegaparError):
        return str(e)
    several = dist.is_initialized() and dist.get_world_size() > 1
    where = f"saving iteration {iteration} to {root} failed" + (f" on rank {rank}" if several else "")
    os_error = _file_system_error(e)
    if os_error is None:
        return f"{where} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); see that rank's traceback"
    cause = f"{os_error.strerror} ({errno.errorcode.get(os_error.errno, os_error.errno)})"
    file = f" writing {os.path.basename(str(os_error.filename))}" if os_error.filename else ""
    kept = ("the checkpoints already there are unchanged" if _has_checkpoint(root)
            else "no earlier checkpoint is there")
    return f"{where}{file}: {cause}; the partial save was removed and {kept}; {_FIXES.get(os_error.errno, _SPACE)}"


def _has_checkpoint(root: str) -> bool:
    try:
        return read_tracker(root) is not None
    except CheckpointError:
        return True             # a tracker is there, unreadable: what it names was not touched either
    except OSError:             # it cannot be opened now (out of file descriptors): is it there?
        return os.path.isfile(os.path.join(root, TRACKER))


# ---- conversion tools: what --force may replace ----------------------------------------------------
CHECKPOINT, CANONICAL, HF = "megapar checkpoint", "canonical folder", "Hugging Face folder"
_DCP = re.compile(r"^(\.metadata|common\.pt|metadata\.json|__\d+_\d+\.distcp)$")


def _entries(path: str) -> set[str]:
    return set(os.listdir(path)) if os.path.isdir(path) and not os.path.islink(path) else set()


def _only_files(path: str, allowed: Callable[[str], bool]) -> bool:
    names = _entries(path)
    return bool(names) and all(allowed(n) and os.path.isfile(os.path.join(path, n)) for n in names)


def _only_dirs(path: str, named: Callable[[str], bool], inner: Callable[[str], bool]) -> bool:
    names = _entries(path)
    return bool(names) and all(named(n) and inner(os.path.join(path, n)) for n in names)


def _is_iteration(path: str) -> bool:
    """An iteration folder of either layout: legacy shard folders, or torch.distributed.checkpoint files."""
    legacy = _only_dirs(path, lambda n: parse_shard_dir(n) is not None,
                        lambda d: _only_files(d, lambda n: n in (MODEL_FILE, DISTRIB_OPTIM_FILE, IDENTITY_FILE)))
    return legacy or (".metadata" in _entries(path) and _only_files(path, lambda n: bool(_DCP.match(n))))


def is_checkpoint_output(path: str) -> bool:
    names = _entries(path)
    if TRACKER not in names or not os.path.isfile(os.path.join(path, TRACKER)) or len(names) < 2:
        return False
    # GPT-2 BPE files beside the iterations: an import's tokenizer (convert_from_hf from a tokenizer.json)
    return all(_suffix(n) == "" and _is_iteration(os.path.join(path, n)) for n in names - {TRACKER, *GPT2_FILES})


def is_canonical_output(path: str) -> bool:
    return (_entries(path) == {"metadata.pt", "tensors"} and os.path.isfile(os.path.join(path, "metadata.pt"))
            and _only_files(os.path.join(path, "tensors"), lambda n: n.endswith(".pt")))


# The tokenizer files an HF export may hold beside the model (megapar/reshard/hf_tokenizer.py writes them).
GPT2_FILES = ("vocab.json", "merges.txt")
SP_FILE = "tokenizer.model"
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def is_hf_output(path: str) -> bool:
    names = _entries(path)
    if not {"config.json", "model.safetensors"} <= names or not names <= {"config.json", "model.safetensors"} | \
            {*GPT2_FILES, SP_FILE, *CONFIG_FILES} or not _only_files(path, lambda n: True):
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


def _check_not_in_use(out_dir: str) -> None:
    """A training job's --save (its lock file) is never an output to replace, whatever else it holds."""
    owner = lock_note(out_dir)
    if owner is not None:
        lock = os.path.join(out_dir, LOCK_FILE)
        raise CheckpointError(f"output directory {out_dir} is the --save of a training job ({owner}); choose a new "
                              f"directory (if that job is no longer running, delete {lock})")


def prepare_output(out_dir: str, force: bool, kinds: Iterable[str], load_dir: str | None = None) -> None:
    """Before any work: refuse an output path that overlaps the source, is not a directory, is a
    training job's --save, or is a non-empty directory that is not a previous output of `kinds`
    (or is one, without `force`)."""
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
    _check_not_in_use(out_dir)
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
    try:
        _check_not_in_use(out_dir)
    except CheckpointError:
        discard(staging)
        raise
    if recognise(out_dir, kinds) is None:
        discard(staging)
        raise CheckpointError(f"output directory {out_dir} changed during the conversion and is no longer a "
                              f"previous output of this tool; nothing was replaced")
    parent, name = os.path.split(os.path.abspath(out_dir))
    old = os.path.join(parent, f".{name}.old.{secrets.token_hex(4)}")
    _swap_in(staging, out_dir, old)
    discard(old)
