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


class MegaparError(Exception):
    """A user-caused failure with a one-line message (what is wrong and how to fix it)."""


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
