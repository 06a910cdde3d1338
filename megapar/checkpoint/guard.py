"""What keeps a training run from costing a user a saved checkpoint, checked before any work
(docs/guide.md#your-work-is-safe):

    SaveDirLock         one job per --save directory: DIR/megapar.lock, created with O_EXCL by rank 0,
                        holding the owner (host, PID, start time, command); removed at exit
    check_save_dirs     a run from iteration 0 never saves over saved iterations, a --finetune
                        never into the directory it loads (parse time)
    check_save_space    --save has room for one more checkpoint of this model

A lock whose owner is gone (same host, no such process, or the PID now belongs to a younger
process) is taken over with a note. On another host megapar cannot tell whether the owner runs,
so it refuses and says how to clear the lock. Taking the lock is also the check that --save is
writable: it creates the folder and a file in it.
"""
from __future__ import annotations

import copy
import dataclasses
import contextlib
import json
import os
import shutil
import signal
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

from ..config.settings import CheckpointConfig, Config, ConfigError
from ..topology import padded_vocab_size
from ..errors import size_text
from .common import CheckpointError, same_dir, saved_iterations, shown_iterations

LOCK_FILE = "megapar.lock"
OPTIMIZER_BYTES_PER_PARAM = 12   # fp32 master weight + Adam's two moments, when optimizer state is saved


# ---- the lock ----------------------------------------------------------------------------------
@dataclass
class LockOwner:
    """The job that holds a --save directory (the lock file's JSON)."""
    host: str
    pid: int
    started: float     # time.time() when the lock was taken
    command: str

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"host {self.host}, PID {self.pid}, since {when}: {self.command[:160]}"

    def is_gone(self) -> Optional[bool]:
        """True: the owner is certainly not running; False: it may be; None: on another host, unknown."""
        if self.host != socket.gethostname():
            return None
        if self.pid == os.getpid():  # not us (we have not taken it): the PID was reused, e.g. a restarted container
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:      # another user's process: running
            pass
        started = _process_start(self.pid)
        return started is not None and started > self.started + 2.0  # the PID now names a younger process


def _process_start(pid: int) -> Optional[float]:
    """The wall-clock start time of process `pid` (Linux /proc; None elsewhere or if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])   # field 22, counted after the command name
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def read_lock(path: str) -> Optional[LockOwner | str]:
    """The owner recorded in a lock file; the raw text when it cannot be read as one (being
    written, or damaged); None when there is no lock file."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(65536)
    except FileNotFoundError:
        return None
    try:
        return LockOwner(**json.loads(text))
    except (ValueError, TypeError):
        return text


def lock_note(save_dir: str) -> Optional[str]:
    """Who holds `save_dir` (its lock file's owner), or None if nobody does."""
    path = os.path.join(save_dir, LOCK_FILE)
    owner = read_lock(path)
    if owner is None:
        return None
    return owner.describe() if isinstance(owner, LockOwner) else f"unreadable lock file {path}"


class SaveDirLock:
    """`lock.acquire()` ... `lock.release()`: the one job allowed to save into `save_dir`."""

    def __init__(self, save_dir: str, command: str):
        self.save_dir, self.path = save_dir, os.path.join(save_dir, LOCK_FILE)
        self.owner = LockOwner(socket.gethostname(), os.getpid(), time.time(), command)
        self.held = False
        self.created = False   # whether acquire made save_dir (release removes it again if nothing was saved)

    def acquire(self) -> None:
        """Take the lock, or raise CheckpointError naming the directory and its owner."""
        self.created = not os.path.isdir(self.save_dir)
        try:
            os.makedirs(self.save_dir, exist_ok=True)
        except OSError as e:
            raise self._not_writable(e) from None
        for _ in range(5):  # each turn: create it, or find an owner (gone: take over and try again)
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                self._take_over_or_refuse()
                continue
            except OSError as e:
                raise self._not_writable(e) from None
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(asdict(self.owner)))
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            return
        raise CheckpointError(f"--save {self.save_dir}: could not take {self.path} (other jobs are starting on "
                              f"the same directory); give each job its own --save")

    def _take_over_or_refuse(self) -> None:
        owner = read_lock(self.path)
        if owner is None:        # released meanwhile: try again
            return
        if not isinstance(owner, LockOwner):
            raise CheckpointError(f"--save {self.save_dir} holds an unreadable lock file {self.path}; if no job is "
                                  f"saving there, delete that file, or give another --save")
        gone = owner.is_gone()
        if not gone:
            clear = "" if gone is False else f"; if that job is no longer running, delete {self.path}"
            raise CheckpointError(f"--save {self.save_dir} is in use by another job ({owner.describe()}); wait for "
                                  f"it to finish or give another --save{clear}")
        aside = f"{self.path}.stale.{os.getpid()}"
        try:
            os.replace(self.path, aside)   # one contender wins this rename ...
        except FileNotFoundError:
            return
        if read_lock(aside) != owner:      # ... but it may have moved a lock someone just took: put it back
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
        else:
            print(f"> taking over {self.path}: its owner is no longer running ({owner.describe()})", flush=True)
        os.unlink(aside)

    def _not_writable(self, e: OSError) -> CheckpointError:
        return CheckpointError(f"--save {self.save_dir} is not writable ({e.strerror}); fix its permissions or "
                               f"give another --save")

    def release_on_sigterm(self) -> Callable[[], None]:
        """Until the returned function is called, SIGTERM first removes the lock, then ends the
        process as it would have (its previous handler, or the default: killed by the signal).
        Python runs the handler between bytecodes, so a process blocked in native code (a
        collective) handles it when that returns. No-op outside the main thread."""
        previous = signal.getsignal(signal.SIGTERM)
        if threading.current_thread() is not threading.main_thread() or previous == signal.SIG_IGN:
            return lambda: None

        def handler(signum, frame) -> None:
            self.release()
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        signal.signal(signal.SIGTERM, handler)
        return lambda: signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)

    def release(self) -> None:
        """Remove the lock file if it is still ours (never another job's), and the directory if acquire made it
        and it is empty (a run that failed before its first save leaves no empty --save behind)."""
        try:
            ours = self.held and read_lock(self.path) == self.owner
        except OSError:     # cannot open it (out of file descriptors): a live owner's lock is never taken over
            ours = self.held
        if ours:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            if self.created:
                with contextlib.suppress(OSError):   # not empty (or gone): leave it
                    os.rmdir(self.save_dir)
        self.held = False


# ---- fine-tuning and disk space ------------------------------------------------------------------
def check_save_dirs(ckpt: CheckpointConfig) -> None:
    """What a run's --save may write over, at parse time. A run that starts at iteration 0 (no
    --load, or --finetune) never saves into a directory holding saved iterations: it would replace
    them (and a fine-tune into its own --load, the checkpoint it starts from)."""
    if not ckpt.save:
        return
    if ckpt.finetune and ckpt.load and same_dir(ckpt.load, ckpt.save):
        raise ConfigError(f"--finetune with --save {ckpt.save} equal to --load: a fine-tune would overwrite the "
                          f"checkpoint it starts from; give a new --save directory")
    saved = saved_iterations(ckpt.save)
    if not saved or (ckpt.load and not ckpt.finetune):
        return
    held = f"--save {ckpt.save} holds saved iterations ({shown_iterations(saved)})"
    if ckpt.finetune:
        raise ConfigError(f"{held}; a --finetune starts at iteration 0 and would replace them; give a new --save "
                          f"(to continue that fine-tune: --load {ckpt.save} without --finetune)")
    raise ConfigError(f"{held} and this run has no --load, so it would start from scratch and replace them; add "
                      f"--load {ckpt.save} to resume from them, or give a new --save")


def checkpoint_bytes(cfg: Config, vocab_size: int) -> int:
    """The size of one checkpoint of this run with a tokenizer of `vocab_size` tokens: every
    (tp, pp) rank's parameters in the model's dtype, plus the fp32 master weights and Adam moments
    when optimizer state is saved. Computed from the flags, before any model is built."""
    from ..model.sizes import stage_params
    p, t = cfg.parallel, cfg.train
    sized = copy.copy(cfg)
    sized.model = dataclasses.replace(cfg.model, padded_vocab_size=padded_vocab_size(
        vocab_size, cfg.model.make_vocab_size_divisible_by, p.tensor_model_parallel_size))
    params = p.tensor_model_parallel_size * sum(stage_params(sized, s) for s in range(p.pipeline_model_parallel_size))
    per_param = (2 if t.bf16 or t.fp16 else 4) + (0 if cfg.ckpt.no_save_optim else OPTIMIZER_BYTES_PER_PARAM)
    return params * per_param


def check_save_space(cfg: Config, vocab_size: int) -> None:
    """Refuse to start when --save's file system cannot hold one more checkpoint."""
    need, free = checkpoint_bytes(cfg, vocab_size), shutil.disk_usage(cfg.ckpt.save).free
    if need > free:
        optim = "" if cfg.ckpt.no_save_optim else ", or --no-save-optim (saves the weights only)"
        raise CheckpointError(f"--save {cfg.ckpt.save} has {size_text(free)} free, but one checkpoint of this model "
                              f"needs {size_text(need)}; free space there, give another --save{optim}")
