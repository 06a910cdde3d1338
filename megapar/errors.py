"""The common base of megapar's user-error types.

Every mistake a user can make -- a bad flag (ConfigError), a truncated or incompatible checkpoint
(CheckpointError), a broken tokenizer file (TokenizerError), a damaged dataset
(IndexedDatasetError), bad generation input (GenerationError), ... -- raises a subclass of
`MegaparError` whose message is one line that names the flag or file and the fix. Entry points
catch `MegaparError` and print `error: <message>` instead of a traceback. Each subclass keeps its
own name and its old builtin base (ValueError, RuntimeError), so existing `except` clauses still work.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn, Sequence


class MegaparError(Exception):
    """A user-caused failure with a one-line message (what is wrong and how to fix it)."""


class ConfigError(MegaparError, ValueError):
    """A bad flag or flag combination; the message says which flags and how to fix it. `dests`: the
    settings it concerns (e.g. ("global_batch_size", "micro_batch_size")), in the order it names them,
    so that config/overlays.explain can say where their values came from."""

    def __init__(self, message: str, dests: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.dests = tuple(dests)


def fail(message: str, *dests: str) -> NoReturn:
    """Raise ConfigError(message) about the settings `dests`."""
    raise ConfigError(message, dests)


class NonFiniteLossError(MegaparError, FloatingPointError):
    """The loss or gradient norm became NaN/Inf (a too large --lr, fp16 without loss scaling, bad data),
    fp16 steps kept overflowing at the minimum loss scale, or the weights hold NaN/Inf at a save;
    raised on every rank at the same iteration, before any checkpoint of the broken weights."""


# Exit status of a run stopped by a user error (argparse's usage-error status).
USER_ERROR_EXIT = 2


def size_text(n: float) -> str:
    """A byte count as messages print it: `512 B`, `3.4 MiB`, `1.2 GiB` (the largest unit under 1024)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class OneLineErrorParser(argparse.ArgumentParser):
    """The command-line parser of megapar's tools: an unknown flag, a missing argument or a value of
    the wrong type ends in one line `error: ...` and USER_ERROR_EXIT, not the usage text followed by
    `prog: error: ...`."""

    def error(self, message: str):
        self.exit(USER_ERROR_EXIT, f"error: {message}; see --help for the flags\n")


# ---- processes that must not outlive their parent ------------------------------------------------
PR_SET_PDEATHSIG = 1  # prctl(2)


def die_with_parent(sig: int) -> None:
    """Have the kernel send this process `sig` when its parent dies (Linux prctl PR_SET_PDEATHSIG;
    a no-op elsewhere): a launcher or torchrun killed with SIGKILL, which no handler sees, then
    takes its processes with it instead of leaving them training (and holding GPUs) unseen. The
    parent that died before the call counts too (this process is then a child of init or a subreaper)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent or parent == 1:
        os.kill(os.getpid(), sig)
