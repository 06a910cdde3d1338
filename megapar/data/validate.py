"""Validator for MMIDIDX .bin/.idx pairs.

    python -m megapar.data.validate PREFIX [PREFIX ...]

`validate(prefix)` checks magic, version, dtype code, the .idx size against its counts, sequence
lengths, pointer monotonicity and consistency, document indices and the .bin size. It raises
`IndexedDatasetError` naming the file and the first problem found, or returns a summary dict.
Arrays are checked in bounded chunks, so memory stays flat for any dataset size.
"""
from __future__ import annotations

import os
import sys

import numpy as np

from .indexed_dataset import (HEADER_SIZE, IndexedDatasetError, _read_header, data_file_path,
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
    idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
    for p in (idx_path, bin_path):
        if not os.path.isfile(p):
            _fail(p, "file not found")
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


def main(argv: list[str]) -> int:
    rc = 0
    for prefix in argv:
        try:
            print(f"{prefix}: OK {validate(prefix)}")
        except IndexedDatasetError as e:
            print(f"ERROR {e}", file=sys.stderr)
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
