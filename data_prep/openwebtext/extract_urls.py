"""Step 1: extract Reddit submission URLs with karma >= 3 from Pushshift dumps.

Reads monthly dumps ``RS_*.bz2|.xz|.zst`` (JSON lines) one line at a time and writes, per dump,
``<outdir>/<dump name>.goodlinks.txt``: the raw ``url`` field of every kept submission, in dump order.
A submission is kept iff its JSON parses, it has a string ``url`` and a numeric ``score``,
``score >= --min-karma`` (default 3), it is not ``over_18``, and jcpeterson's ``is_bad_url`` is false
(domain list, file extension, ``len(url) < 10``). A dump whose output already exists is skipped (resume).

Upstream (jcpeterson extract_urls.py) quirk decisions:
* ``.zst`` dumps were unsupported (exit) -> FIXED: read with ``zstandard`` (all 2018+ Pushshift dumps are .zst).
* ``score > min_karma - 1`` -> KEPT (same as ``score >= min_karma`` for integer scores).
* ``is_self`` not checked -> KEPT (self posts point at reddit.com, which the domain list drops anyway).
* duplicates kept within a dump -> KEPT (step 2 deduplicates across months).
* extension test on ``url.split('?')[0]`` (host and fragment included, so ``https://x.ai`` is "bad")
  -> FIXED: tested on the URL path only.
* URLs holding whitespace/newlines would corrupt the one-per-line output -> FIXED: dropped ("whitespace").
* year-range file selection (``--year_start/--year_end``) -> KEPT as optional ``--years 2005-2018``;
  default is every ``RS_*`` file in the folder, sorted by name.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from .io import PipelineError, add_common_args, atomic_write, open_text, progress, report
from .url_rules import jcp_bad_reason

DUMP_SUFFIXES = (".bz2", ".xz", ".zst")


def classify(line: str, min_karma: int) -> tuple[str | None, str | None]:
    """Return (url, None) when the submission is kept, else (None, removal reason)."""
    try:
        sub = json.loads(line)
    except json.JSONDecodeError:
        return None, "bad_json"
    if not isinstance(sub, dict):
        return None, "bad_json"
    url, score = sub.get("url"), sub.get("score")
    if not isinstance(url, str) or not isinstance(score, (int, float)):
        return None, "missing_field"
    if score < min_karma:
        return None, "low_karma"
    if sub.get("over_18"):
        return None, "over_18"
    if not url or any(ch.isspace() for ch in url):
        return None, "whitespace"
    reason = jcp_bad_reason(url)
    return (None, reason) if reason else (url, None)


def select_dumps(psdir: Path, years: str | None) -> list[Path]:
    """Every ``RS_*`` dump in ``psdir`` (sorted by name), optionally only those naming a year in range."""
    if not psdir.is_dir():
        raise PipelineError(f"dump folder {psdir} does not exist; pass --psdir with your Pushshift RS_* files")
    dumps = sorted(p for p in psdir.iterdir() if p.name.startswith("RS_") and p.suffix in DUMP_SUFFIXES)
    if years:
        lo, _, hi = years.partition("-")
        wanted = [str(y) for y in range(int(lo), int(hi or lo) + 1)]
        dumps = [p for p in dumps if any(y in p.name for y in wanted)]
    if not dumps:
        raise PipelineError(f"no RS_*.bz2/.xz/.zst dumps in {psdir}; download Pushshift submission dumps there")
    return dumps


def extract_one(dump: Path, out_path: Path, min_karma: int, counts: Counter, show: bool) -> None:
    """Stream one dump into its goodlinks file (atomic)."""
    with open_text(dump) as src, atomic_write(out_path) as out:
        for line in progress(src, desc=dump.name, unit="sub", enabled=show):
            if not line.strip():
                continue
            counts["submissions"] += 1
            url, reason = classify(line, min_karma)
            if url is None:
                counts[f"removed:{reason}"] += 1
            else:
                counts["kept"] += 1
                out.write(url + "\n")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--psdir", type=Path, help="folder of Pushshift RS_* dumps")
    src.add_argument("--single-file", type=Path, help="process only this dump")
    parser.add_argument("--outdir", type=Path, required=True, help="where <dump>.goodlinks.txt files go")
    parser.add_argument("--min-karma", type=int, default=3, help="keep submissions with score >= this")
    parser.add_argument("--years", default=None, help="only dumps naming a year in this range, e.g. 2005-2018")
    add_common_args(parser)
    args = parser.parse_args(argv)
    dumps = [args.single_file] if args.single_file else select_dumps(args.psdir, args.years)
    counts: Counter = Counter()
    for dump in dumps:
        out_path = args.outdir / f"{dump.name}.goodlinks.txt"
        if out_path.exists():
            counts["dumps_skipped_done"] += 1
            continue
        extract_one(dump, out_path, args.min_karma, counts, not args.no_progress)
        counts["dumps_done"] += 1
    return report("extract_urls", counts, args.summary)


if __name__ == "__main__":
    main()
