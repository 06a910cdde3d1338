"""Validator for MMIDIDX .bin/.idx pairs.

    python -m megapar.data.validate PREFIX [PREFIX ...]     # e.g. my-gpt2_text_document
    python -m megapar.data.validate PREFIX --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt
    python -m megapar.data.validate PREFIX --vocab-size 50257 [--sample-tokens 1000000]

`validate(prefix)` checks magic, version, dtype code, the .idx size against its counts, sequence
lengths, pointer monotonicity and consistency, document indices and the .bin size. It raises
`IndexedDatasetError` naming the file and the first problem found, or returns a summary dict.
`check_token_ids(prefix, vocab_size)` also reads the tokens: every id must be below the
tokenizer's vocabulary size (all of them, or with `sample_tokens` about that many in evenly spaced
windows, the first and last tokens included). Arrays are checked in bounded chunks, so memory stays
flat for any dataset size. The command prints one `PREFIX: OK {summary}` line per good pair and one
`error: ...` line per bad one (a missing pair names the prefix that exists, if any); it exits 2 when
any is bad, as every megapar tool does for a user's mistake.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import numpy as np

from ..errors import USER_ERROR_EXIT, MegaparError, OneLineErrorParser
from .indexed_dataset import (HEADER_SIZE, IndexedDatasetError, _read_header, data_file_path, existing_pair,
                              index_file_path)

_CHUNK = 1 << 22


def _fail(path: str, msg: str) -> None:
    raise IndexedDatasetError(f"{path}: {msg}")


def _check_lengths_pointers(idx_path: str, lengths: np.ndarray, pointers: np.ndarray, itemsize: int) -> int:
    """Check lengths >= 0 and pointers == running byte sum; return the expected .bin size."""
    expected = 0
    for s in range(0, lengths.size, _CHUNK):
        ln = lengths[s:s + _CHUNK].astype(np.int64)
        if (ln < 0).any():
            i = s + int(np.argmax(ln < 0))
            _fail(idx_path, f"sequence {i} has negative length {int(lengths[i])}")
        want = expected + np.concatenate(([0], np.cumsum(ln[:-1] * itemsize)))
        got = pointers[s:s + _CHUNK]
        bad = got != want
        if bad.any():
            i = int(np.argmax(bad))
            kind = "not monotonic" if i + s > 0 and got[i] < pointers[s + i - 1] else "inconsistent with lengths"
            _fail(idx_path, f"byte pointer of sequence {s + i} is {int(got[i])}, expected {int(want[i])} "
                            f"(pointers {kind})")
        expected = int(want[-1] + ln[-1] * itemsize)
    return expected


def _check_documents(idx_path: str, docs: np.ndarray, n: int) -> None:
    """Document indices start at 0, never decrease and end at the sequence count n."""
    if docs.size == 0:
        _fail(idx_path, "document index is empty (needs at least the leading 0)")
    if docs[0] != 0:
        _fail(idx_path, f"document index starts at {int(docs[0])}, expected 0")
    if docs[-1] != n:
        _fail(idx_path, f"document index ends at {int(docs[-1])}, expected the sequence count {n}")
    for s in range(0, docs.size, _CHUNK):
        part = docs[max(s - 1, 0):s + _CHUNK]
        dec = np.diff(part) < 0
        if dec.any():
            i = max(s - 1, 0) + int(np.argmax(dec)) + 1
            _fail(idx_path, f"document index decreases at entry {i} ({int(docs[i - 1])} -> {int(docs[i])})")


def validate(prefix: str) -> dict:
    """Validate PREFIX.bin/.idx; return {"dtype", "num_sequences", "num_documents", "num_tokens"}."""
    idx_path, bin_path = existing_pair(prefix)
    size = os.path.getsize(idx_path)
    buf = np.memmap(idx_path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    dtype, n, d = _read_header(idx_path, memoryview(buf))
    expected = HEADER_SIZE + 12 * n + 8 * d
    if size < expected:
        _fail(idx_path, f"truncated: {size} bytes, header says {n} sequences and {d} document entries "
                        f"= {expected} bytes")
    if size > expected:
        _fail(idx_path, f"{size - expected} unexpected trailing bytes after the document index "
                        f"({size} bytes, expected {expected})")
    lengths = np.frombuffer(buf, np.int32, n, HEADER_SIZE)
    pointers = np.frombuffer(buf, np.int64, n, HEADER_SIZE + 4 * n)
    docs = np.frombuffer(buf, np.int64, d, HEADER_SIZE + 12 * n)
    bin_expected = _check_lengths_pointers(idx_path, lengths, pointers, dtype.itemsize)
    _check_documents(idx_path, docs, n)
    bin_size = os.path.getsize(bin_path)
    if bin_size != bin_expected:
        what = "truncated" if bin_size < bin_expected else "longer than the index says"
        _fail(bin_path, f"{what}: {bin_size} bytes, index says {bin_expected} bytes")
    return {"dtype": str(dtype), "num_sequences": int(n), "num_documents": int(d - 1),
            "num_tokens": bin_expected // dtype.itemsize}


SAMPLE_WINDOWS = 64  # sampled check: this many evenly spaced windows of the .bin


def _windows(total: int, sample_tokens: Optional[int]) -> list[tuple[int, int]]:
    """[start, end) token ranges to read: the whole file in chunks, or SAMPLE_WINDOWS evenly spaced
    windows of about sample_tokens in all (the first and the last window at the file's ends)."""
    if sample_tokens is None or total <= sample_tokens:
        return [(s, min(s + _CHUNK, total)) for s in range(0, total, _CHUNK)]
    width = max(1, sample_tokens // SAMPLE_WINDOWS)
    starts = np.linspace(0, total - width, SAMPLE_WINDOWS).astype(np.int64)
    return [(int(s), int(s) + width) for s in starts]


def check_token_ids(prefix: str, vocab_size: int, sample_tokens: Optional[int] = None) -> dict:
    """Every token id in PREFIX.bin (or, with `sample_tokens`, a sample of about that many) is in
    [0, vocab_size); a larger one would index past the model's embedding table mid-run. Call after
    `validate(prefix)`. Raises IndexedDatasetError naming the .bin, the first bad id and where it is;
    returns {"checked": tokens read, "tokens": tokens in the file, "mode": "full" | "sampled"}."""
    idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
    with open(idx_path, "rb") as f:
        dtype, _, _ = _read_header(idx_path, memoryview(f.read(HEADER_SIZE)))
    total = os.path.getsize(bin_path) // dtype.itemsize
    tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(total,)) if total else np.zeros(0, dtype)
    windows, checked = _windows(total, sample_tokens), 0
    for start, end in windows:
        part = tokens[start:end]
        bad = part >= vocab_size
        if np.issubdtype(dtype, np.signedinteger):
            bad |= part < 0
        if bad.any():
            i = start + int(np.argmax(bad))
            _fail(bin_path, f"token id {int(tokens[i])} at token {i} is outside the tokenizer's vocabulary of "
                            f"{vocab_size} ids: this .bin was made with another tokenizer; re-run "
                            f"tools/preprocess_data.py with this run's tokenizer files, or train with the "
                            f"tokenizer that made it")
        checked += end - start
    mode = "full" if checked == total else "sampled"
    return {"checked": checked, "tokens": total, "mode": mode}


def _vocab_size(a: argparse.Namespace) -> Optional[int]:
    """The vocabulary size the flags name (--vocab-size, or the tokenizer's), or None."""
    if a.vocab_size is not None:
        if a.vocab_size < 1:
            raise IndexedDatasetError(f"--vocab-size {a.vocab_size} must be >= 1")
        return a.vocab_size
    if not (a.vocab_file or a.tokenizer_model):
        return None
    from .tokenizer import build_tokenizer
    return build_tokenizer(a.tokenizer_type, vocab_file=a.vocab_file, merge_file=a.merge_file,
                           tokenizer_model=a.tokenizer_model).vocab_size


def get_args(argv: Optional[list[str]]) -> argparse.Namespace:
    from .tokenizer import TOKENIZER_TYPES

    p = OneLineErrorParser(prog="python -m megapar.data.validate",
                           description="Check .bin/.idx pairs; with a tokenizer (or --vocab-size) also that every "
                                       "token id is in its vocabulary. Exit 0 when every pair is good, 2 otherwise.")
    p.add_argument("prefixes", nargs="+", metavar="PREFIX",
                   help="a dataset prefix: PREFIX.bin and PREFIX.idx (what --data-path takes)")
    p.add_argument("--vocab-size", type=int, default=None, help="check every token id is below this")
    p.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=TOKENIZER_TYPES,
                   help="with --vocab-file/--tokenizer-model: the tokenizer whose vocabulary bounds the ids "
                        "(default GPT2BPETokenizer)")
    p.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocabulary")
    p.add_argument("--merge-file", default=None, help="GPT-2 BPE merges")
    p.add_argument("--tokenizer-model", default=None, help="SentencePiece / tiktoken model file")
    p.add_argument("--sample-tokens", type=int, default=None,
                   help="check about this many tokens in evenly spaced windows instead of all of them")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    a = get_args(argv)
    try:
        vocab_size = _vocab_size(a)
    except MegaparError as e:
        print(f"error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT
    rc = 0
    for prefix in a.prefixes:
        try:
            summary = validate(prefix)
            if vocab_size is not None:
                ids = check_token_ids(prefix, vocab_size, a.sample_tokens)
                summary["token_ids"] = (f"all < {vocab_size} ({ids['mode']}: {ids['checked']} of {ids['tokens']} "
                                        f"tokens read)")
            else:
                summary["token_ids"] = "not checked (give the tokenizer's files or --vocab-size)"
            print(f"{prefix}: OK {summary}")
        except IndexedDatasetError as e:
            print(f"error: {e}", file=sys.stderr)
            rc = USER_ERROR_EXIT
    return rc


if __name__ == "__main__":
    sys.exit(main())
