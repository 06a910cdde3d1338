"""Step 3: URL blacklist (Megatron ``blacklist_urls.py``): one clean, exactly-deduplicated URL file.

Reads ``<dir>/*.txt`` (sorted by name) or the given files, one URL per line (stripped), and applies, in order,
first hit wins: **domain** (tldextract registrable label, e.g. ``google`` for ``maps.google.co.uk``, in the
111-label list), **extension** (the URL path ends with a media/archive/code suffix), **short**
(``len <= 8``, incl. blank lines), **malformed** (fails the Django URL regex: http(s), dotted host or IPv4,
optional port), **duplicate** (exact string already kept). Kept URLs are written in first-seen order.

Upstream quirk decisions:
* missing comma fused ``'.7z' '.ai'`` into ``.7z.ai`` (so neither was blocked) -> FIXED: both blocked.
* extension test on ``url.split('?')[0]``, fragment not stripped (``x.pdf#page=2`` passed) -> FIXED: the URL
  path is tested (host, query and fragment excluded, so the ``.ai`` fix cannot block ``https://x.ai/``).
* output in Python set order (run-dependent) -> FIXED: first-seen order, deterministic.
* unsorted ``glob`` input order -> FIXED: sorted by file name.
* domain test on the registrable label only (every TLD blocked, private PSL suffixes ignored, e.g.
  ``foo.blogspot.com`` -> ``blogspot``) -> KEPT; the bundled tldextract snapshot is used (offline, reproducible).
* duplicate = exact string (no normalisation) -> KEPT: step 2 already normalised across months.
"""
from __future__ import annotations

import argparse
import hashlib
from collections import Counter
from pathlib import Path

from .io import PipelineError, add_common_args, atomic_write, open_text, progress, report
from .url_rules import megatron_bad_reason


def input_files(paths: list[Path]) -> list[Path]:
    """Expand folders to their sorted ``*.txt`` files."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files.extend(sorted(path.glob("*.txt")))
        elif path.is_file():
            files.append(path)
        else:
            raise PipelineError(f"{path} does not exist; pass the deduped URL folder from dedup_urls")
    if not files:
        raise PipelineError(f"no *.txt URL files in {', '.join(map(str, paths))}; run dedup_urls first")
    return files


def blacklist(files: list[Path], output: Path, counts: Counter, show: bool) -> None:
    """Stream every URL through the rules and write the kept ones atomically."""
    seen: set[bytes] = set()
    with atomic_write(output) as out:
        for path in files:
            with open_text(path) as lines:
                for line in progress(lines, desc=path.name, unit="url", enabled=show):
                    url = line.strip()
                    counts["urls"] += 1
                    reason = megatron_bad_reason(url)
                    if reason is None:
                        key = hashlib.blake2b(url.encode("utf-8", "surrogatepass"), digest_size=8).digest()
                        reason = "duplicate" if key in seen else None
                        seen.add(key)
                    if reason:
                        counts[f"removed:{reason}"] += 1
                    else:
                        counts["kept"] += 1
                        out.write(url + "\n")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", type=Path, nargs="+", help="folder(s) of *.txt URL lists, or files")
    parser.add_argument("--output", type=Path, required=True, help="clean URL list to write")
    add_common_args(parser)
    args = parser.parse_args(argv)
    counts: Counter = Counter()
    blacklist(input_files(args.inputs), args.output, counts, not args.no_progress)
    return report("blacklist_urls", counts, args.summary)


if __name__ == "__main__":
    main()
