"""Step 2: cross-month URL dedup (the ``RS_<yyyy-mm>.*.deduped.txt`` lists).

Reads every ``*.goodlinks.txt`` in ``--input-dir`` in chronological order (year-month = first 7 chars of the
last ``_`` field of the file stem, e.g. ``RS_2011-01.bz2.goodlinks`` -> ``2011-01``; ties by name) and writes,
for each, ``<output-dir>/<name with goodlinks.txt -> deduped.txt>`` holding the URLs not seen before, in
first-seen order, ``html.unescape``d. Two URLs are duplicates iff their normalised forms are equal:
(lower-cased scheme, lower-cased host, ``unquote_plus(path)``, params, ``frozenset(parse_qsl(query))``, fragment).
The first occurrence (earliest month, then line order) wins. The whole output folder is written under a temp
name and renamed at the end, so an interrupted run leaves nothing that looks finished.

Memory: one 64-bit blake2b hash per distinct URL (~100 bytes each in a Python set; 23M URLs ~ 2.3 GB).
The chance of any false duplicate among 23M URLs is ~1e-5.

Upstream (jcpeterson deduplicate_urls.py) quirk decisions:
* lines were not stripped, and a last line without ``\\n`` was glued to the next URL written -> FIXED:
  each URL is stripped and written with its own newline; blank lines are dropped ("blank").
* host compared case-sensitively -> FIXED: hosts are case-insensitive (RFC 3986), compared lower-cased.
* ``parse_qsl`` drops blank-valued parameters and the frozenset ignores parameter order/repeats -> KEPT
  (``?a=1&b=2`` == ``?b=2&a=1``, ``?a=1&x=`` == ``?a=1``).
* the kept URL is the ``html.unescape``d line (``&amp;`` -> ``&``) -> KEPT: Reddit stored URLs HTML-escaped.
"""
from __future__ import annotations

import argparse
import hashlib
import html
import os
import shutil
from collections import Counter
from pathlib import Path
from urllib.parse import parse_qsl, unquote_plus, urlparse

from .io import PipelineError, add_common_args, open_text, progress, report


def month_key(path: Path) -> tuple[str, str]:
    """Sort key: (year-month from the last ``_`` field of the stem, file name)."""
    stem = path.name[: -len(".txt")] if path.name.endswith(".txt") else path.stem
    return stem.split("_")[-1][:7], path.name


def url_key(url: str) -> int:
    """64-bit hash of the normalised URL tuple (see module docstring)."""
    try:
        p = urlparse(url)
        parts = (p.scheme, p.netloc.lower(), unquote_plus(p.path), p.params,
                 repr(sorted(set(parse_qsl(p.query)))), p.fragment)
    except ValueError:  # unparsable (e.g. bad IPv6 literal): compare the raw string
        parts = ("raw", url)
    digest = hashlib.blake2b("\x00".join(parts).encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def dedup_file(src: Path, dst: Path, seen: set[int], counts: Counter, show: bool) -> None:
    """Write the URLs of ``src`` not in ``seen`` (and add them to it)."""
    with open_text(src) as lines, open(dst, "w", encoding="utf-8", newline="\n") as out:
        for line in progress(lines, desc=src.name, unit="url", enabled=show):
            url = html.unescape(line.strip())
            counts["urls"] += 1
            if not url:
                counts["removed:blank"] += 1
                continue
            key = url_key(url)
            if key in seen:
                counts["removed:duplicate"] += 1
                continue
            seen.add(key)
            counts["kept"] += 1
            out.write(url + "\n")


def output_name(src: Path) -> str:
    name = src.name
    return name.replace("goodlinks.txt", "deduped.txt") if "goodlinks.txt" in name else name + ".deduped.txt"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-dir", type=Path, required=True, help="folder of *.goodlinks.txt (step 1)")
    parser.add_argument("--input-glob", default="*.goodlinks.txt", help="which files to read")
    parser.add_argument("--output-dir", type=Path, required=True, help="folder for *.deduped.txt")
    add_common_args(parser)
    args = parser.parse_args(argv)
    inputs = sorted(args.input_dir.glob(args.input_glob), key=month_key) if args.input_dir.is_dir() else []
    if not inputs:
        raise PipelineError(f"no {args.input_glob} files in {args.input_dir}; run extract_urls first")
    counts: Counter = Counter()
    if args.output_dir.exists():
        counts["skipped_already_done"] = 1
        return report("dedup_urls", counts, args.summary)
    tmp = args.output_dir.with_name(args.output_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    seen: set[int] = set()
    for src in inputs:
        dedup_file(src, tmp / output_name(src), seen, counts, not args.no_progress)
    os.replace(tmp, args.output_dir)
    return report("dedup_urls", counts, args.summary)


if __name__ == "__main__":
    main()
