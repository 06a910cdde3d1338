"""Atomic file writes: write a temp file beside the target, fsync, rename into place.

A crash or an exception never leaves a partial target behind (the temp file is removed on
failure; a killed process may leave a `.NAME.XXXXXXXX.tmp` file, which is never a valid output).
The target gets the permissions of any file the user creates (0o666 less the umask, and any
default ACL): the temp file is created with os.open(..., 0o666), which the kernel masks, not with
tempfile.mkstemp, which makes it 0o600. No torch import, so data tools can use it cheaply.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path
from typing import IO, Iterator


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """`with atomic_write(path, "w" | "wb") as f:` -> `path` appears only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temp(path)
    kwargs = {} if "b" in mode else {"encoding": "utf-8", "newline": "\n"}
    try:
        with os.fdopen(fd, mode, **kwargs) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _create_temp(path: Path) -> tuple[int, Path]:
    """A new file `.NAME.XXXXXXXX.tmp` beside `path`, opened for writing, mode 0o666 & ~umask."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue


def give_user_file_mode(path: str | os.PathLike) -> None:
    """Give `path` the permission bits of a file the user creates in its folder (0o666 less the umask):
    for writers that create their files 0o600 themselves (safetensors' save_file)."""
    fd, probe = _create_temp(Path(path))
    os.close(fd)
    try:
        os.chmod(path, stat.S_IMODE(os.stat(probe).st_mode))
    finally:
        os.unlink(probe)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_write(path) as f:
        f.write(text)
