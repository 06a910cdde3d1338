"""Shared helpers: streaming readers for compressed dumps, atomic writes, progress bars, summaries."""
from __future__ import annotations

import bz2
import io
import json
import lzma
import os
import sys
from collections import Counter
from pathlib import Path
from typing import IO, Iterator

from tqdm import tqdm

from megapar.atomic import atomic_write  # noqa: F401 (re-exported to the steps)


class PipelineError(SystemExit):
    """A user-facing error: one message naming the problem and the fix; exits with status 2."""

    def __init__(self, message: str) -> None:
        print(f"error: {message}", file=sys.stderr)
        super().__init__(2)


def open_text(path: str | os.PathLike) -> IO[str]:
    """Open a plain, .bz2, .xz or .zst file for streaming UTF-8 text reads (never loads it whole)."""
    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"input file {path} does not exist; check the path")
    suffix = path.suffix.lower()
    if suffix == ".bz2":
        return bz2.open(path, "rt", encoding="utf-8", errors="replace")
    if suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8", errors="replace")
    if suffix == ".zst":
        import zstandard  # Pushshift switched to .zst in 2018; upstream could not read it

        raw = open(path, "rb")
        # Pushshift .zst files use a long window; max_window_size lets them decode.
        reader = zstandard.ZstdDecompressor(max_window_size=2**31).stream_reader(raw, closefd=True)
        return io.TextIOWrapper(reader, encoding="utf-8", errors="replace")
    return open(path, "r", encoding="utf-8", errors="replace", newline="")


def progress(iterable=None, desc: str = "", total: int | None = None, unit: str = "doc", enabled: bool = True):
    """A tqdm progress bar on stderr; ``enabled=False`` (``--no-progress``) silences it."""
    return tqdm(iterable, desc=desc, total=total, unit=unit, disable=not enabled,
                mininterval=1.0, dynamic_ncols=True, file=sys.stderr)


def iter_jsonl(path: str | os.PathLike, counts: Counter | None = None) -> Iterator[dict]:
    """Yield one dict per JSON line; unparseable or non-object lines are counted as ``bad_json``."""
    with open_text(path) as handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                doc = None
            if not isinstance(doc, dict):
                if counts is not None:
                    counts["removed:bad_json"] += 1
                continue
            yield doc


def dump_json_line(doc: dict) -> str:
    """Upstream's serialisation: ``json.dumps(doc, ensure_ascii=False)`` plus a newline."""
    return json.dumps(doc, ensure_ascii=False) + "\n"


def report(step: str, counts: Counter, summary_path: str | os.PathLike | None = None) -> dict:
    """Print the kept/removed-by-reason summary and optionally write it as JSON (atomically)."""
    summary = {"step": step, "counts": dict(sorted(counts.items()))}
    width = max([len(k) for k in counts] + [10])
    print(f"[{step}] summary", file=sys.stderr)
    for key, value in sorted(counts.items()):
        print(f"  {key:<{width}} {value:>12,}", file=sys.stderr)
    if summary_path:
        with atomic_write(summary_path) as out:
            json.dump(summary, out, indent=1, sort_keys=True)
            out.write("\n")
    return summary


def add_common_args(parser) -> None:
    """Flags every step shares: ``--summary`` JSON path and ``--no-progress``."""
    parser.add_argument("--summary", default=None,
                        help="also write the kept/removed counts as JSON to this path")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
