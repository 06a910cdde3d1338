"""Step 6: clean documents: fix unicode (ftfy), keep English, keep documents of >= 128 GPT-2 tokens.

Streams JSON lines; per document, in order: unparseable line -> "bad_json"; no string ``text`` -> "missing_text";
``text = ftfy.fix_text(text)`` (default config; counter "fixed_text" when it changed); blank -> "empty";
language of the first ``--lang-chars`` characters by py3langid != ``--lang`` (default en) -> "non_english";
fewer than ``--min-tokens`` (128) GPT-2 tokens (EOD not counted) -> "too_short". Kept documents keep all their
keys, with the fixed text, written as ``json.dumps(doc, ensure_ascii=False)``, in input order (``--workers``
processes, ordered ``imap``: the output is identical for any worker count).

The token count is exact where it matters: texts under 128 UTF-8 bytes cannot have 128 tokens (a token is
>= 1 byte) and are not tokenised; otherwise the first 8,192 characters are tokenised, and only if that gives
fewer than 128 + 64 tokens (a margin for the cut) is the whole text tokenised.

Upstream (Megatron cleanup_dataset.py) quirk decisions:
* ftfy unpinned, results differ across releases -> FIXED: requirements pin ftfy==6.3.1.
* ftfy's line-by-line HTML-entity rule (no unescaping from the first line holding ``<``) -> KEPT (ftfy default).
* langdetect (random unless seeded; no wheel installs today) -> REPLACED by py3langid (deterministic),
  restricted to langdetect's language set; on webtext_gpt2_trunc63 it flags 16+6 documents (langdetect: 12+5).
* letterless texts raised in langdetect and were skipped uncounted -> FIXED: "empty"/"non_english" counted.
* length test only for ``len(text) < 1024`` chars and EOD counted (kept at >= 127 BPE tokens) -> FIXED:
  every document needs >= 128 real GPT-2 tokens.
* any exception -> "skipping" with no count -> FIXED: every drop is counted by reason.
* output ``json.dumps(doc, ensure_ascii=False)``, other keys kept -> KEPT.
"""
from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from multiprocessing import Pool
from pathlib import Path

from .io import PipelineError, add_common_args, atomic_write, dump_json_line, open_text, progress, report

PREFIX_CHARS, MARGIN = 8192, 64
LANGDETECT_LANGS = ("af ar bg bn ca cs cy da de el en es et fa fi fr gu he hi hr hu id it ja kn ko lt lv mk ml mr "
                    "ne nl no pa pl pt ro ru sk sl so sq sv sw ta te th tl tr uk ur vi zh").split()
_STATE: dict = {}


def init_worker(vocab_file: str, merge_file: str, lang: str, lang_chars: int, min_tokens: int) -> None:
    """Per-process tokenizer, language identifier and settings."""
    import ftfy
    from megapar.data.tokenizer import build_tokenizer

    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    _STATE.update(fix=ftfy.fix_text, langid=language_identifier().classify, tokenize=tok.tokenize,
                  lang=lang, lang_chars=lang_chars, min_tokens=min_tokens)


def language_identifier():
    """py3langid restricted to langdetect's 55 languages (drops look-alikes such as Nigerian Pidgin or Latin
    that the full 97-language model picks for lists, code and tables of English text)."""
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    ident = LanguageIdentifier.from_model_file(MODEL_FILE)
    ident.set_languages([code for code in LANGDETECT_LANGS if code in ident.nb_classes])
    return ident


def enough_tokens(text: str, tokenize, min_tokens: int) -> bool:
    """Whether ``text`` has >= ``min_tokens`` GPT-2 tokens (see module docstring for the shortcut)."""
    if len(text.encode("utf-8", "surrogatepass")) < min_tokens:
        return False
    if len(text) > PREFIX_CHARS and len(tokenize(text[:PREFIX_CHARS])) >= min_tokens + MARGIN:
        return True
    return len(tokenize(text)) >= min_tokens


def clean_line(line: str) -> tuple[str | None, list[str]]:
    """(output line or None, counter keys) for one input line."""
    try:
        doc = json.loads(line)
    except json.JSONDecodeError:
        return None, ["removed:bad_json"]
    if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
        return None, ["removed:missing_text"]
    text = _STATE["fix"](doc["text"])
    keys = ["fixed_text"] if text != doc["text"] else []
    if not text.strip():
        return None, keys + ["removed:empty"]
    if _STATE["langid"](text[: _STATE["lang_chars"]])[0] != _STATE["lang"]:
        return None, keys + ["removed:non_english"]
    try:
        long_enough = enough_tokens(text, _STATE["tokenize"], _STATE["min_tokens"])
    except UnicodeEncodeError:  # lone surrogates: the binariser would fail on them too
        return None, keys + ["removed:bad_unicode"]
    if not long_enough:
        return None, keys + ["removed:too_short"]
    doc["text"] = text
    return dump_json_line(doc), keys + ["kept"]


def nonblank_lines(path: Path, counts: Counter):
    with open_text(path) as lines:
        for line in lines:
            if line.strip():
                counts["documents"] += 1
                yield line


def run(args, counts: Counter) -> None:
    init_args = (args.vocab_file, args.merge_file, args.lang, args.lang_chars, args.min_tokens)
    lines = nonblank_lines(args.input, counts)
    with atomic_write(args.output) as out:
        if args.workers <= 1:
            init_worker(*init_args)
            results = map(clean_line, lines)
            _consume(results, out, counts, args)
        else:
            with Pool(args.workers, initializer=init_worker, initargs=init_args) as pool:
                _consume(pool.imap(clean_line, lines, chunksize=64), out, counts, args)


def _consume(results, out, counts: Counter, args) -> None:
    for line, keys in progress(results, desc="cleanup", enabled=not args.no_progress):
        counts.update(keys)
        if line is not None:
            out.write(line)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", type=Path, help="merged JSON lines (merge output)")
    parser.add_argument("output", type=Path, help="cleaned JSON lines")
    parser.add_argument("--vocab-file", required=True, help="GPT-2 encoder.json (never downloaded)")
    parser.add_argument("--merge-file", required=True, help="GPT-2 vocab.bpe (never downloaded)")
    parser.add_argument("--min-tokens", type=int, default=128, help="drop documents with fewer GPT-2 tokens")
    parser.add_argument("--lang", default="en", help="keep documents in this language (ISO 639-1)")
    parser.add_argument("--lang-chars", type=int, default=2_000, help="characters given to the identifier")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="worker processes")
    add_common_args(parser)
    args = parser.parse_args(argv)
    for flag, path in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
        if not os.path.isfile(path):
            raise PipelineError(f"{flag} {path} not found; pass the local GPT-2 BPE file (e.g. tests/data/gpt2)")
    counts: Counter = Counter()
    run(args, counts)
    return report("cleanup", counts, args.summary)


if __name__ == "__main__":
    main()
