"""Step 5: merge downloaded documents into one loose-JSON file, one ``{"text": ..., "url": ...}`` per line.

Reads, in sorted path order (for a ``download`` output folder: its ``data/``), every ``*.json`` (one document per
file, e.g. ``download``'s ``data/*/*.json``) and ``*.jsonl`` (one per line) below each input folder. Each line must
be a JSON object with a string ``text`` and a string ``url``; lines that are not are counted ("bad_json",
"missing_field") and skipped. A document whose ``url`` was already merged is dropped ("duplicate_url"), so ``url``
is a unique id for the later dedup steps. Kept lines are re-serialised with ``json.dumps(ensure_ascii=False)`` (keys
``text``, ``url`` first, other keys kept).

Upstream (Megatron merge_jsons.py) quirk decisions:
* unsorted ``glob`` order -> FIXED: sorted, so the merged file is reproducible.
* a last line without ``\\n`` was glued to the next file's first line -> FIXED: every line ends in ``\\n``.
* one bad line aborted the whole merge -> FIXED: counted and skipped.
* lines copied verbatim -> CHANGED: re-serialised (needed to check fields; key order text, url, rest).
* no upstream step turned downloads into ``{"text","url"}`` JSON (spec §4) -> DEFINED here; url is unique.
"""
from __future__ import annotations

import argparse
import hashlib
from collections import Counter
from pathlib import Path
from typing import Iterator

from .io import PipelineError, add_common_args, atomic_write, dump_json_line, iter_jsonl, progress, report


def input_files(folders: list[Path]) -> list[Path]:
    files: list[Path] = []
    for folder in folders:
        if not folder.is_dir():
            raise PipelineError(f"{folder} is not a folder; pass the download output folder")
        if (folder / "data").is_dir() and (folder / "failures.jsonl").is_file():
            folder = folder / "data"  # a download output folder: documents only, not the failure log
        files.extend(sorted(p for p in folder.rglob("*") if p.suffix in (".json", ".jsonl") and p.is_file()
                            and not p.name.startswith(".")))
    return files


def documents(files: list[Path], counts: Counter) -> Iterator[dict]:
    """Every well-formed document of every file, in order."""
    for path in files:
        for doc in iter_jsonl(path, counts):
            if not isinstance(doc.get("text"), str) or not isinstance(doc.get("url"), str):
                counts["removed:missing_field"] += 1
                continue
            yield doc


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", type=Path, nargs="+", help="folder(s) with *.json / *.jsonl documents")
    parser.add_argument("--output", type=Path, required=True, help="merged JSON-lines file")
    add_common_args(parser)
    args = parser.parse_args(argv)
    files = input_files(args.inputs)
    counts: Counter = Counter(files=len(files))
    seen: set[bytes] = set()
    with atomic_write(args.output) as out:
        for doc in progress(documents(files, counts), desc="merge", enabled=not args.no_progress):
            key = hashlib.blake2b(doc["url"].encode("utf-8", "surrogatepass"), digest_size=8).digest()
            if key in seen:
                counts["removed:duplicate_url"] += 1
                continue
            seen.add(key)
            counts["kept"] += 1
            rest = {k: v for k, v in doc.items() if k not in ("text", "url")}
            out.write(dump_json_line({"text": doc["text"], "url": doc["url"], **rest}))
    return report("merge", counts, args.summary)


if __name__ == "__main__":
    main()
