"""Optional step: task decontamination -- cut the 13-gram overlaps with evaluation sets out of the documents.

The evaluation texts come from JSON-lines files (``--decontaminate-with eval.jsonl [...]``, one object per line
with the text under ``--eval-key``, default ``text``: LAMBADA's ``lambada_test.jsonl`` as it is, or any other
task's texts written that way). Words are the lower-cased ``\\w+`` runs of a text. From each evaluation text
every ``--max-ngram-size`` (13) consecutive words form an n-gram; a text of ``--min-ngram-size`` (8) to 12 words
is one n-gram of its own length; shorter texts are ignored.

Pass 1 counts in how many training documents each n-gram occurs; one found in ``--key-threshold`` (10) or more
documents is common phrasing rather than a leaked test passage and is not cut. Pass 2 walks each document: at
the first word where an n-gram matches (the longest n-gram length first), the document is cut into the part
before the match and the part after it, each cut ``--remove-char-each-side`` (200) characters away from the match
and widened to the nearest sentence end (``.``, ``!``, ``?``) outside that margin; the part before is kept if it
is longer than ``--filter-text-char-len`` (200) characters, the part after is searched again. A document left in
more than ``--splits-count`` (10) pieces is dropped; so is one left with none. Each kept piece is written as a
document of its own (all other keys kept) with ``"split_id": "<prefix>-<document n:010d>-<piece:04d>"``;
documents without any match are written unchanged. Counts: documents, kept (untouched), trimmed (one shorter
piece), split (several pieces), pieces, removed:no_piece_left, removed:too_many_splits, eval_ngrams,
eval_ngrams_too_common, bad_json / missing_text lines (skipped).

Upstream (Megatron tools/openwebtext/filter_ngrams.py) decisions:
* 13-grams, 8-word minimum, 200-character margin and piece minimum, threshold 10, at most 10 splits -> KEPT.
* tasks other than LAMBADA were downloaded from the Hugging Face hub -> REPLACED: evaluation texts from local
  JSON-lines files (offline); ``--lambada-path`` is accepted as an alias of ``--decontaminate-with``.
* word positions taken in ``text.lower()``, whose length can differ from ``text`` (e.g. ``İ``) -> FIXED: positions in
  the text itself.
* the cut after a match started ``len(" ".join(words))`` characters after its first word, short of the match's
  end when words are separated by more than one character -> FIXED: cut from the matched text's real end.
* the frequency pass counted only the first match of each remaining piece -> FIXED: every n-gram a document holds.
* every output document got a ``split_id``, even untouched ones -> CHANGED: untouched documents are written as
  they came; pieces of cut documents get ``split_id``.
* unparseable lines printed an error and vanished -> counted ("bad_json", "missing_text").
* a bad evaluation line printed an error and was skipped -> FIXED: an error naming the file and line number.
* 40 worker processes -> one process (set lookups dominate; docs/s in docs/benchmarks/data_cpu_20261124.md).
"""
from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path
from typing import Iterator

from .io import PipelineError, add_common_args, atomic_write, dump_json_line, open_text, progress, report

WORD = re.compile(r"\w+")
SENTENCE_END = ".!?"


class Settings(argparse.Namespace):
    max_ngram_size: int = 13
    min_ngram_size: int = 8
    filter_text_char_len: int = 200
    remove_char_each_side: int = 200
    key_threshold: int = 10
    splits_count: int = 10


def words_of(text: str) -> tuple[list[str], list[tuple[int, int]]]:
    """The lower-cased words of `text` and their (start, end) character spans in `text`."""
    matches = list(WORD.finditer(text))
    return [m.group(0).lower() for m in matches], [m.span() for m in matches]


def eval_ngrams(words: list[str], s: Settings) -> Iterator[str]:
    """The n-grams one evaluation text contributes (see the module docstring)."""
    if len(words) < s.min_ngram_size:
        return
    if len(words) < s.max_ngram_size:
        yield " ".join(words)
    for i in range(len(words) - s.max_ngram_size + 1):
        yield " ".join(words[i:i + s.max_ngram_size])


def load_eval_ngrams(paths: list[Path], key: str, s: Settings) -> set[str]:
    """Every n-gram of the evaluation files; a line that is not a JSON object with a string `key` stops here."""
    ngrams: set[str] = set()
    for path in paths:
        if not path.is_file():
            raise PipelineError(f"--decontaminate-with {path}: no such file; give the evaluation set as JSON lines "
                                f'({{"{key}": ...}} per line)')
        with open_text(path) as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                except json.JSONDecodeError as e:
                    raise PipelineError(f"{path}:{number}: not a JSON line ({e.msg}); each line of an evaluation "
                                        f'file must be a JSON object such as {{"{key}": "..."}}') from None
                if not isinstance(doc, dict) or not isinstance(doc.get(key), str):
                    raise PipelineError(f'{path}:{number}: no string "{key}" in this line; each line of an '
                                        f'evaluation file must be a JSON object with its text under "{key}" '
                                        f"(--eval-key)")
                ngrams.update(eval_ngrams(words_of(doc[key])[0], s))
    if not ngrams:
        raise PipelineError(f"no evaluation text in {', '.join(map(str, paths))} has {s.min_ngram_size} or more "
                            f"words: nothing to decontaminate against")
    return ngrams


def check_eval_files(paths: list[str], key: str = "text") -> None:
    """Read the evaluation files as the step will, so that a driver can stop at a bad one before any work."""
    load_eval_ngrams([Path(p) for p in paths], key, Settings())


class Matcher:
    """Finds n-grams of a set in a list of words, trying the longest length first at each position."""

    def __init__(self, ngrams: set[str]):
        self.ngrams = ngrams
        self.lengths = sorted({k.count(" ") + 1 for k in ngrams}, reverse=True)
        self.first_words = {k.split(" ", 1)[0] for k in ngrams}  # most positions stop at this lookup

    def at(self, words: list[str], i: int) -> int:
        """The length of the n-gram starting at word `i`, or 0."""
        if words[i] not in self.first_words:
            return 0
        for n in self.lengths:
            if i + n <= len(words) and " ".join(words[i:i + n]) in self.ngrams:
                return n
        return 0

    def first(self, words: list[str]) -> tuple[int, int] | None:
        """(start word, length) of the first match, or None."""
        for i in range(len(words)):
            n = self.at(words, i)
            if n:
                return i, n
        return None

    def all_in(self, words: list[str]) -> set[str]:
        """Every n-gram of the set that occurs in `words`."""
        found = set()
        for i in range(len(words)):
            if words[i] not in self.first_words:
                continue
            for n in self.lengths:
                seq = " ".join(words[i:i + n])
                if i + n <= len(words) and seq in self.ngrams:
                    found.add(seq)
        return found


def cut_around(text: str, start: int, end: int, margin: int) -> tuple[str, str]:
    """The text before `start - margin` and after `end + margin`, each widened to the nearest sentence end."""
    pos = start - margin
    while pos > 0 and text[pos] not in SENTENCE_END:
        pos -= 1
    before = text[:pos + 1] if pos > 0 else ""
    pos = end + margin
    while pos < len(text) and text[pos] not in SENTENCE_END:
        pos += 1
    after = text[pos + 1:] if pos + 1 < len(text) else ""
    return before, after


def pieces_of(text: str, matcher: Matcher, s: Settings) -> list[str]:
    """The parts of `text` left after cutting out every match (unchanged `[text]` when nothing matches)."""
    kept, rest = [], text
    while rest:
        words, spans = words_of(rest)
        match = matcher.first(words)
        if match is None:
            kept.append(rest)
            break
        i, n = match
        before, after = cut_around(rest, spans[i][0], spans[i + n - 1][1], s.remove_char_each_side)
        if len(before) > s.filter_text_char_len:
            kept.append(before)
        rest = after if len(after) > s.filter_text_char_len else ""
    return kept


def documents(path: Path, key: str, counts: Counter | None, show: bool, desc: str) -> Iterator[tuple[str, dict | None]]:
    """(line, parsed document or None when it has no string `key`) for each non-blank line."""
    with open_text(path) as lines:
        for line in progress(lines, desc=desc, enabled=show):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                doc = None
                if counts is not None:
                    counts["removed:bad_json"] += 1
            else:
                if not isinstance(doc, dict) or not isinstance(doc.get(key), str):
                    doc = None
                    if counts is not None:
                        counts["removed:missing_text"] += 1
            yield line, doc


def rare_ngrams(path: Path, key: str, ngrams: set[str], s: Settings, show: bool, counts: Counter) -> set[str]:
    """Pass 1: the n-grams found in fewer than --key-threshold documents (the ones to cut)."""
    matcher, docs_with = Matcher(ngrams), Counter()
    for _, doc in documents(path, key, None, show, "filter_ngrams: count"):
        if doc is not None:
            docs_with.update(matcher.all_in(words_of(doc[key])[0]))
    common = {k for k, c in docs_with.items() if c >= s.key_threshold}
    counts.update(eval_ngrams=len(ngrams), eval_ngrams_too_common=len(common))
    return ngrams - common


def filter_file(path: Path, output: Path, key: str, ngrams: set[str], s: Settings, prefix: str, show: bool,
                counts: Counter) -> None:
    """Pass 2: write every document with the matches cut out (see the module docstring)."""
    matcher = Matcher(ngrams)
    with atomic_write(output) as out:
        for line, doc in documents(path, key, counts, show, "filter_ngrams: cut"):
            if doc is None:
                continue
            counts["documents"] += 1
            pieces = pieces_of(doc[key], matcher, s)
            if pieces == [doc[key]]:
                counts["kept"] += 1
                out.write(line if line.endswith("\n") else line + "\n")
                continue
            if not pieces:
                counts["removed:no_piece_left"] += 1
                continue
            if len(pieces) > s.splits_count:
                counts["removed:too_many_splits"] += 1
                continue
            counts["trimmed" if len(pieces) == 1 else "split"] += 1
            for i, piece in enumerate(pieces):
                counts["pieces"] += 1
                out.write(dump_json_line({**doc, key: piece,
                                          "split_id": f"{prefix}-{counts['documents']:010d}-{i:04d}"}))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", type=Path, help="JSON lines to decontaminate (e.g. remove_duplicates output)")
    parser.add_argument("output", type=Path, help="decontaminated JSON lines")
    parser.add_argument("--decontaminate-with", "--lambada-path", dest="eval_files", type=Path, nargs="+",
                        required=True, metavar="EVAL.jsonl", help="evaluation sets as JSON lines (text under "
                        "--eval-key)")
    parser.add_argument("--eval-key", default="text", help="the text's key in the evaluation files")
    parser.add_argument("--key", default="text", help="the text's key in the input documents")
    parser.add_argument("--id-prefix", default=None, help="split_id prefix (default: the evaluation file names)")
    parser.add_argument("--max-ngram-size", type=int, default=13)
    parser.add_argument("--min-ngram-size", type=int, default=8)
    parser.add_argument("--filter-text-char-len", type=int, default=200, help="drop pieces this short or shorter")
    parser.add_argument("--remove-char-each-side", type=int, default=200, help="characters cut on each side of a match")
    parser.add_argument("--key-threshold", type=int, default=10, help="n-grams in this many documents are not cut")
    parser.add_argument("--splits-count", type=int, default=10, help="drop documents cut into more pieces")
    add_common_args(parser)
    args = parser.parse_args(argv, namespace=Settings())
    check_settings(args)
    counts: Counter = Counter()
    ngrams = load_eval_ngrams(args.eval_files, args.eval_key, args)
    show = not args.no_progress
    prefix = args.id_prefix or "-".join(p.stem for p in args.eval_files)
    rare = rare_ngrams(args.input, args.key, ngrams, args, show, counts)
    filter_file(args.input, args.output, args.key, rare, args, prefix, show, counts)
    return report("filter_ngrams", counts, args.summary)


def check_settings(args: Settings) -> None:
    """Sizes that cannot work, and a missing input, stop before any reading."""
    for flag, value, low in (("--max-ngram-size", args.max_ngram_size, 1), ("--min-ngram-size", args.min_ngram_size, 1),
                             ("--filter-text-char-len", args.filter_text_char_len, 0),
                             ("--remove-char-each-side", args.remove_char_each_side, 0),
                             ("--key-threshold", args.key_threshold, 1), ("--splits-count", args.splits_count, 1)):
        if value < low:
            raise PipelineError(f"{flag} {value} must be >= {low}")
    if args.min_ngram_size > args.max_ngram_size:
        raise PipelineError(f"--min-ngram-size {args.min_ngram_size} is larger than --max-ngram-size "
                            f"{args.max_ngram_size}; the defaults are 8 and 13")
    if not args.input.is_file():
        raise PipelineError(f"input {args.input} not found; run remove_duplicates first (or give a JSON-lines file)")


if __name__ == "__main__":
    main()
