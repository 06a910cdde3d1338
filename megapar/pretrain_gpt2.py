"""GPT-2 pretraining entry point: `python -m megapar.pretrain_gpt2 [Megatron flags]`
(usually through `bash scripts/pretrain_gpt2.sh`, which starts torchrun).

With no --data-path it runs the embedded default: real English text from the Python standard
library's docstrings, a tokenizer (GPT-2 BPE if --vocab-file/--merge-file exist, else a
SentencePiece model trained on the spot), a small GPT-2 trained for a few minutes, evaluation,
a checkpoint, and what to run next. No downloads, no network.

This module parses and checks the flags; the run itself is megapar/run/pretrain.py, imported
only once the flags passed, so that a refused command (and the launcher's check of the flags) does
not first load the model, torch.compile's machinery and distributed checkpointing.
"""
from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Optional, Sequence

import torch.distributed as dist

from .config.build import build_config
from .config.overlays import Overlay, embedded_default, parse_flags
from .config.settings import DEFAULT, Config, ConfigError, default_of
from .errors import USER_ERROR_EXIT, MegaparError, die_with_parent
from .checkpoint import check_load_dir, check_save_dirs

if TYPE_CHECKING:
    from .run.training import TrainState

def parse(argv: Optional[Sequence[str]], world_size: int) -> Config:
    """The Config of a training command line: the flags given over the embedded default when there
    is no --data-path (overlays.embedded_default), checked, with the checkpoint folders."""
    given = parse_flags(argv)
    eval_iters_given = "eval_iters" in given.values()
    if not given.values().get("data_path"):
        given.overlays.insert(0, embedded_default(given))
    values = given.values()
    if values.get("train_iters") is None and values.get("train_samples") is None:
        raise ConfigError("give --train-iters or --train-samples (how long to train)")
    if not eval_iters_given and values.get("train_iters"):  # a default that fits a short run
        eval_iters = fitting_eval_iters(values.get("eval_iters", default_of("eval_iters")), values["train_iters"])
        given.overlays.append(Overlay(DEFAULT, {"eval_iters": eval_iters}))
    cfg = build_config(given, world_size)
    check_load_dir(cfg.ckpt.load, cfg.ckpt.save)  # a --load that names no checkpoint stops here
    if cfg.data.data_path:  # blend weights: before any process starts
        from .data.gpt_dataset import DatasetError, parse_data_path
        try:
            parse_data_path(cfg.data.data_path)
        except DatasetError as e:
            raise ConfigError(str(e)) from None
    check_save_dirs(cfg.ckpt)                      # never from scratch over saved iterations
    return cfg


def fitting_eval_iters(eval_iters: int, train_iters: int) -> int:
    """The evaluation size of a run not given --eval-iters: `eval_iters` batches, but no more than a
    tenth of its training iterations (at least 1), so that evaluating a short run does not take longer
    than training it. A given --eval-iters is used as it is."""
    return max(1, min(eval_iters, train_iters // 10))


def _leave(code: int, world: int, line: Optional[str] = None) -> None:
    """Print `line` (if any; an `error:` line once per host, say_once) and exit with `code`, without a
    traceback. With several processes a rank may stop where its peers wait in a collective it will
    never join: destroying the process group or running interpreter shutdown could then hang, so
    such a rank leaves through os._exit right after flushing. torchrun sees the exit status and
    stops the other ranks; scripts/pretrain_gpt2.sh (megapar.launch) shows only the first `error:`
    line and drops what follows from the other ranks and from torchrun."""
    if line:
        say_once(line) if line.startswith("error:") else print(line, file=sys.stderr, flush=True)
    if world > 1:
        sys.stdout.flush()
        os._exit(code)
    if dist.is_initialized():
        dist.destroy_process_group()
    raise SystemExit(code)


PRINTED = b"printed"
WAIT_FOR_PRINT_S = 10.0


def say_once(line: str) -> None:
    """Print the `error:` line that every failing rank of this host would print, once per host, before
    any of them exits. Under plain torchrun the first rank to exit makes torchrun kill the others
    (SIGTERM, which ends a rank before its next line), and nothing is written for a killed rank: so
    no rank may exit counting on another to print. The ranks of one torchrun agent share a marker
    file (named by the agent's pid and start time, so a later job never finds it): the first local
    rank prints (the rank `torchrun --local-ranks-filter 0` shows), flushes and marks the file
    printed; another rank waits for that mark before it exits, and where it does not come (the first
    local rank did not fail, or died on the way) the first to take the marker (O_EXCL) prints."""
    marker = _error_marker()
    if marker is None:
        print(line, file=sys.stderr, flush=True)
        return
    if int(os.environ.get("LOCAL_RANK", "0")) != 0 and _printed(marker):
        return
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:  # another rank took it: its line is on the way
        if not _printed(marker):
            print(line, file=sys.stderr, flush=True)
        return
    except OSError:  # no writable temporary folder: every rank prints
        print(line, file=sys.stderr, flush=True)
        return
    print(line, file=sys.stderr, flush=True)
    os.write(fd, PRINTED)
    os.close(fd)


def _error_marker() -> Optional[str]:
    """The marker file the failing ranks of this torchrun agent share, or None when this process is
    alone on its host (or not started by torchrun, or /proc cannot tell the agent's start time)."""
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= 1:
        return None
    agent = os.getppid()
    try:
        with open(f"/proc/{agent}/stat") as f:
            started = f.read().rsplit(")", 1)[1].split()[19]  # field 22: start time after boot
    except (OSError, IndexError):
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return os.path.join(tempfile.gettempdir(), f"megapar-error-{agent}-{started}-{attempt}")


def _printed(marker: str) -> bool:
    """Wait (WAIT_FOR_PRINT_S at most) until a rank has printed the line and marked `marker` so."""
    deadline = time.monotonic() + WAIT_FOR_PRINT_S
    while time.monotonic() < deadline:
        try:
            with open(marker, "rb") as f:
                if f.read() == PRINTED:
                    return True
        except OSError:
            pass
        time.sleep(0.01)
    return False


def main(argv: Optional[Sequence[str]] = None) -> TrainState:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun killed outright must not leave this rank training
        die_with_parent(signal.SIGKILL)
    try:
        cfg = parse(argv, world)  # all validation before any process group exists
    except ConfigError as e:
        _leave(USER_ERROR_EXIT, 1, f"error: {e}")  # on every rank: the first to exit may be any
    from .run.initialize import init_distributed  # the training modules: only once the flags passed
    from .run.pretrain import pretrain
    from .run.training import TrainState
    state = TrainState()  # filled in by pretrain: what a Ctrl-C or a failure leaves behind
    try:
        init_distributed(cfg.parallel.distributed_backend, cfg.parallel.distributed_timeout_minutes)
        pretrain(cfg, sys.argv[1:] if argv is None else list(argv), state)
        if dist.is_initialized():
            dist.destroy_process_group()
        return state
    except MegaparError as e:  # a bad checkpoint, tokenizer file, dataset, a NaN loss: one line, no traceback
        _leave(USER_ERROR_EXIT, world, f"error: {e}")
    except KeyboardInterrupt:  # Ctrl-C without --exit-signal-handler, or a second one with it
        _leave(130, world, interrupted_line(cfg, state))
    except (MemoryError, RuntimeError) as e:
        line = out_of_memory_line(e)
        if line is None:
            raise
        _leave(USER_ERROR_EXIT, world, line)


def interrupted_line(cfg: Config, state: TrainState) -> str:
    """What a Ctrl-C that stops the run at once says: whether the run's closing checkpoint (after
    --exit-signal-handler's first signal) was saved before it came."""
    if cfg.ckpt.save and state.exit_reason is not None:  # the loop saves before it records why it stopped
        return (f"> interrupted (SIGINT) after the checkpoint at iteration {state.iteration} was saved to "
                f"{cfg.ckpt.save}; nothing was lost")
    return ("> interrupted (SIGINT): stopped without saving; the last saved checkpoint is intact "
            "(with --exit-signal-handler a first Ctrl-C finishes the iteration and saves)")


def out_of_memory_line(e: BaseException) -> Optional[str]:
    """The one line for an allocation that failed -- host memory (MemoryError; torch's CPU allocator)
    or GPU memory (torch.OutOfMemoryError) -- or None for any other error."""
    import torch

    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, torch.OutOfMemoryError):
        return (f"error: GPU out of memory ({first[:300]}); lower --micro-batch-size, add --recompute-granularity "
                f"full, shard more (--zero-stage, tensor or pipeline parallelism): tools/estimate_memory.py "
                f"predicts the peak per GPU from these flags")
    if isinstance(e, MemoryError) or "can't allocate memory" in first:
        return (f"error: the host ran out of memory ({type(e).__name__}: {first[:300]}); lower what needs it "
                f"(--train-iters/--train-samples size the dataset indices; the model, --micro-batch-size and "
                f"the processes per node size the rest), or run on a host with more memory")
    return None


if __name__ == "__main__":
    main()
