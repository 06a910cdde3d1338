"""Optional step after cleanup: the fix-up pass (Megatron's cleanup_fix_dataset.py).

    python -m data_prep.openwebtext.cleanup_fix_dataset --input-files F... --tasks T... --output-path DIR

For each input ``F`` = ``stem.ext`` it writes ``DIR/stem_cleaned.ext`` (the documents kept, possibly fixed) and
``DIR/stem_filtered.ext`` (the documents filtered out), JSON lines in input order (``json.dumps(doc,
ensure_ascii=False)``, all other keys kept; ``--workers`` processes, the output is the same for any count). The
tasks run in this fixed order whatever the order given, and the first filter that applies decides:

* ``remove_512``: fewer than 512 characters -> filtered;
* ``remove_256_javascript``: fewer than 256 characters and ``javascript`` in the lower-cased text -> filtered;
* ``remove_512_non_english``: fewer than 512 characters and not English -> filtered;
* ``ftfy_fix_text``: ``ftfy.fix_text`` (default config) -> kept, fixed;
* ``general_cleaning``: the regex ``  +|\\b\\n+ |\\b\\n+`` -> one space (runs of 2+ spaces, and newline runs after a
  word character together with one following space; newlines after punctuation stay) -> kept, cleaned.

A line that is not a JSON object with a string ``text`` is filtered (written verbatim to the filtered file).
Counts: documents, kept, fixed_text, cleaned_text, filtered:<task>, filtered:bad_json, filtered:missing_text.
The cleaned file is written last: its presence marks the step done (the driver then skips it).

Upstream quirk decisions:
* ``ftfy_fix_text`` returned at once, so ``general_cleaning`` never ran when both were asked for -> FIXED: both run
  (ftfy first).
* langdetect -> REPLACED by py3langid restricted to langdetect's languages, as in the cleanup step; the language
  of the first ``--lang-chars`` characters is judged.
* any exception -> filtered, uncounted -> every filtered document is counted by reason.
* 40 worker processes -> ``--workers`` (default: the CPU count).
"""
from __future__ import annotations

import argparse
import json
import os
import re
from collections import Counter
from multiprocessing import Pool
from pathlib import Path

from .io import PipelineError, add_common_args, atomic_write, dump_json_line, open_text, progress, report

TASKS = ("remove_512", "remove_256_javascript", "remove_512_non_english", "ftfy_fix_text", "general_cleaning")
SPACES = re.compile(r"  +|\b\n+ |\b\n+")
_STATE: dict = {}


def init_worker(tasks: tuple[str, ...], lang: str, lang_chars: int) -> None:
    """Per-process settings, ftfy and the language identifier (loaded only when a task needs them)."""
    _STATE.update(tasks=set(tasks), lang=lang, lang_chars=lang_chars)
    if "ftfy_fix_text" in tasks:
        import ftfy
        _STATE["fix"] = ftfy.fix_text
    if "remove_512_non_english" in tasks:
        from .cleanup import language_identifier
        _STATE["langid"] = language_identifier().classify


def filter_reason(text: str) -> str | None:
    """The first requested filter task that removes `text`, or None."""
    tasks = _STATE["tasks"]
    if "remove_512" in tasks and len(text) < 512:
        return "remove_512"
    if "remove_256_javascript" in tasks and len(text) < 256 and "javascript" in text.lower():
        return "remove_256_javascript"
    if ("remove_512_non_english" in tasks and len(text) < 512
            and _STATE["langid"](text[:_STATE["lang_chars"]])[0] != _STATE["lang"]):
        return "remove_512_non_english"
    return None


def fix_line(line: str) -> tuple[bool, str, list[str]]:
    """(kept?, output line, counter keys) for one input line."""
    try:
        doc = json.loads(line)
    except json.JSONDecodeError:
        return False, line, ["filtered:bad_json"]
    if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
        return False, line, ["filtered:missing_text"]
    text = doc["text"]
    reason = filter_reason(text)
    if reason:
        return False, dump_json_line(doc), [f"filtered:{reason}"]
    keys = ["kept"]
    if "ftfy_fix_text" in _STATE["tasks"]:
        fixed = _STATE["fix"](text)
        keys += ["fixed_text"] if fixed != text else []
        text = fixed
    if "general_cleaning" in _STATE["tasks"]:
        cleaned = SPACES.sub(" ", text)
        keys += ["cleaned_text"] if cleaned != text else []
        text = cleaned
    doc["text"] = text
    return True, dump_json_line(doc), keys


def outputs(path: Path, out_dir: Path) -> tuple[Path, Path]:
    """(cleaned, filtered) output paths of one input, named as upstream names them."""
    return out_dir / f"{path.stem}_cleaned{path.suffix}", out_dir / f"{path.stem}_filtered{path.suffix}"


def nonblank_lines(path: Path, counts: Counter):
    with open_text(path) as lines:
        for line in lines:
            if line.strip():
                counts["documents"] += 1
                yield line if line.endswith("\n") else line + "\n"


def fix_file(path: Path, args, counts: Counter) -> None:
    cleaned, filtered = outputs(path, args.output_path)
    init_args = (tuple(args.tasks), args.lang, args.lang_chars)
    lines = nonblank_lines(path, counts)
    with atomic_write(cleaned) as keep, atomic_write(filtered) as drop:  # filtered is renamed first
        if args.workers <= 1:
            init_worker(*init_args)
            results = map(fix_line, lines)
            _write(results, keep, drop, counts, args, path)
        else:
            with Pool(args.workers, initializer=init_worker, initargs=init_args) as pool:
                _write(pool.imap(fix_line, lines, chunksize=64), keep, drop, counts, args, path)


def _write(results, keep, drop, counts: Counter, args, path: Path) -> None:
    for kept, line, keys in progress(results, desc=f"cleanup_fix_dataset {path.name}", enabled=not args.no_progress):
        counts.update(keys)
        (keep if kept else drop).write(line)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-files", type=Path, nargs="+", required=True, help="JSON lines (cleanup output)")
    parser.add_argument("--tasks", nargs="+", required=True, choices=TASKS, metavar="TASK",
                        help=f"one or more of {', '.join(TASKS)} (they run in this order)")
    parser.add_argument("--output-path", type=Path, required=True, help="folder for the _cleaned/_filtered files")
    parser.add_argument("--log-interval", type=int, default=100, help="accepted for compatibility (progress bar)")
    parser.add_argument("--lang", default="en", help="remove_512_non_english keeps this language (ISO 639-1)")
    parser.add_argument("--lang-chars", type=int, default=2_000, help="characters given to the identifier")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="worker processes")
    add_common_args(parser)
    args = parser.parse_args(argv)
    for path in args.input_files:
        if not path.is_file():
            raise PipelineError(f"--input-files {path}: no such file; run the cleanup step first")
    if args.output_path.exists() and not args.output_path.is_dir():
        raise PipelineError(f"--output-path {args.output_path} is a file; give a folder")
    counts: Counter = Counter()
    for path in args.input_files:
        fix_file(path, args, counts)
    return report("cleanup_fix_dataset", counts, args.summary)


if __name__ == "__main__":
    main()
