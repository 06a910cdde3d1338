"""Megatron "MMIDIDX" indexed dataset: `PREFIX.bin` (token ids) + `PREFIX.idx` (index).

    ds = IndexedDataset("owt_text_document")   # memory-mapped, zero-copy
    ds[3]                      # np.ndarray view of sequence 3
    ds.get(3, offset=10, length=5)
    ds.document_indices        # [0, ..., len(ds)]: sequence count after each document

    b = IndexedDatasetBuilder("out.bin", dtype=np.uint16)
    b.add_document([1, 2, 3]); b.add_document([]); b.finalize("out.idx")

`.idx` layout (little-endian): magic b"MMIDIDX\\x00\\x00" | uint64 version=1 | uint8 dtype code |
uint64 N sequences | uint64 D document-index entries | int32 lengths[N] | int64 byte pointers[N] |
int64 document indices[D]. Size 34 + 12N + 8D. `.bin` is the headerless concatenation.
"""
from __future__ import annotations

import glob
import os
import struct
from typing import Iterable, Optional, Sequence

import numpy as np

from ..errors import MegaparError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 34
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
          6: np.float64, 7: np.float32, 8: np.uint16}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}
_COPY_CHUNK = 1 << 22  # elements per streamed chunk in merge()


class IndexedDatasetError(MegaparError, ValueError):
    """A .bin/.idx pair is missing, truncated or corrupt; the message says which file and what."""


class DatasetNotFoundError(IndexedDatasetError):
    """PREFIX.bin or PREFIX.idx does not exist."""


def existing_pair(prefix: str) -> tuple[str, str]:
    """(PREFIX.idx, PREFIX.bin), both existing; DatasetNotFoundError (with a hint, missing_pair) otherwise."""
    idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
    for p in (idx_path, bin_path):
        if not os.path.isfile(p):
            raise missing_pair(prefix, p)
    return idx_path, bin_path


def missing_pair(prefix: str, path: str) -> DatasetNotFoundError:
    """The error for `path`, a missing .bin/.idx of `prefix`, with the prefix the user likely meant:
    tools/preprocess_data.py writes OUTPUT_PREFIX_<json key>_document.bin/.idx, and a prefix is given
    without .bin/.idx."""
    def pair(p: str) -> bool:
        return os.path.isfile(index_file_path(p)) and os.path.isfile(data_file_path(p))

    if prefix.endswith((".bin", ".idx")) and pair(prefix[:-4]):
        return DatasetNotFoundError(f"{path} not found; did you mean {prefix[:-4]}? (the prefix, without .bin/.idx)")
    near = sorted(p[:-len(".idx")] for p in glob.glob(glob.escape(prefix) + "_*_document.idx") if pair(p[:-4]))
    if near:
        hint = (f"did you mean {' or '.join(near)}? (tools/preprocess_data.py adds _<json key>_document to its "
                f"--output-prefix)")
    else:
        hint = "a dataset is named by its prefix, without .bin/.idx (tools/preprocess_data.py writes e.g. " \
               "my-gpt2_text_document.bin/.idx)"
    return DatasetNotFoundError(f"{path} not found; {hint}")


def best_dtype(vocab_size: int) -> np.dtype:
    """uint16 when the vocabulary is below 65500 (Megatron's rule), else int32."""
    return np.dtype(np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32)


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def _read_header(idx_path: str, buf: memoryview) -> tuple[np.dtype, int, int]:
    """Parse and check the 34-byte header; return (dtype, N, D)."""
    if len(buf) < HEADER_SIZE:
        raise IndexedDatasetError(f"{idx_path}: truncated header ({len(buf)} bytes, need {HEADER_SIZE})")
    if bytes(buf[:9]) != MAGIC:
        raise IndexedDatasetError(f"{idx_path}: bad magic {bytes(buf[:9])!r}, expected {MAGIC!r} "
                                  "(not a Megatron mmap indexed dataset)")
    (version,) = struct.unpack("<Q", buf[9:17])
    if version != VERSION:
        raise IndexedDatasetError(f"{idx_path}: unsupported version {version}, expected {VERSION}")
    code = buf[17]
    if code not in DTYPES:
        raise IndexedDatasetError(f"{idx_path}: unknown dtype code {code}, expected one of {sorted(DTYPES)}")
    n, d = struct.unpack("<QQ", buf[18:34])
    return np.dtype(DTYPES[code]), n, d


class IndexedDataset:
    """Read-only, memory-mapped view of PREFIX.bin/.idx. Slices are zero-copy numpy views."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_path, bin_path = existing_pair(prefix)
        self._idx = np.memmap(idx_path, dtype=np.uint8, mode="r")
        self.dtype, n, d = _read_header(idx_path, memoryview(self._idx))
        expected = HEADER_SIZE + 12 * n + 8 * d
        if self._idx.size != expected:
            raise IndexedDatasetError(f"{idx_path}: size {self._idx.size} bytes, expected {expected} for "
                                      f"{n} sequences and {d} document entries (truncated or corrupt)")
        buf = self._idx
        self.sequence_lengths = np.frombuffer(buf, np.int32, n, HEADER_SIZE)
        self.sequence_pointers = np.frombuffer(buf, np.int64, n, HEADER_SIZE + 4 * n)
        self.document_indices = np.frombuffer(buf, np.int64, d, HEADER_SIZE + 12 * n)
        if os.path.getsize(bin_path) == 0:
            self._bin = np.zeros(0, dtype=self.dtype)
        else:
            self._bin = np.memmap(bin_path, dtype=np.uint8, mode="r")

    def __len__(self) -> int:
        return int(self.sequence_lengths.shape[0])

    @property
    def sizes(self) -> np.ndarray:
        """Sequence lengths in tokens (Megatron's name)."""
        return self.sequence_lengths

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens [offset, offset+length) of sequence i, as a zero-copy view."""
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, length, start) if length else np.zeros(0, self.dtype)

    def __getitem__(self, i: int) -> np.ndarray:
        if isinstance(i, slice):
            return [self.get(j) for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        return self.get(i)

    def __iter__(self):
        return (self.get(i) for i in range(len(self)))


class IndexedDatasetBuilder:
    """Stream sequences into `bin_path` (written as bin_path + ".tmp"); `finalize(idx_path)`
    writes the index and renames both files into place, so readers never see partial output."""

    def __init__(self, bin_path: str, dtype=np.uint16):
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODES:
            raise ValueError(f"dtype {self.dtype} is not storable in .idx; use one of {list(CODES)}")
        self._tmp_bin = bin_path + f".tmp{os.getpid()}"
        self._bin = open(self._tmp_bin, "wb")
        self._lengths: list[np.ndarray] = []
        self._doc_idx: list[int] = [0]
        self._n = 0

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one sequence (does not end the document)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes())
        self._lengths.append(np.array([arr.size], dtype=np.int32))
        self._n += 1

    def end_document(self) -> None:
        """Close the current document (possibly with zero sequences)."""
        self._doc_idx.append(self._n)

    def add_document(self, tokens: Sequence[int] | np.ndarray, lengths: Optional[Sequence[int]] = None) -> None:
        """Append one document: `tokens` split into sequences of `lengths` (default: one sequence;
        an empty document adds no sequence but still a document boundary, like Megatron)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        if lengths is None:
            lengths = [arr.size] if arr.size else []
        self.add_documents(arr, np.asarray(lengths, dtype=np.int32), np.array([len(lengths)], dtype=np.int64))

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray, seqs_per_doc: np.ndarray) -> None:
        """Bulk append: flat `tokens`, per-sequence `lengths`, per-document sequence counts."""
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._lengths.append(np.asarray(lengths, dtype=np.int32))
        self._doc_idx.extend((self._n + np.cumsum(seqs_per_doc)).tolist())
        self._n += int(np.sum(seqs_per_doc))

    def add_index(self, prefix: str) -> None:
        """Append every sequence and document of the dataset at `prefix` (dtypes must match)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(f"{prefix}: dtype {other.dtype} differs from the builder's {self.dtype}")
        with open(data_file_path(prefix), "rb") as f:
            while chunk := f.read(1 << 24):
                self._bin.write(chunk)
        self._lengths.append(np.array(other.sequence_lengths))
        self._doc_idx.extend((self._n + other.document_indices[1:]).tolist())
        self._n += len(other)

    def finalize(self, idx_path: str) -> None:
        """Write the .idx and atomically move .bin and .idx into place (.idx last)."""
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        if self._doc_idx[-1] != self._n:
            self._doc_idx.append(self._n)  # close a trailing unfinished document
        tmp_idx = idx_path + f".tmp{os.getpid()}"
        with open(tmp_idx, "wb") as f:
            write_index_header(f, self.dtype, lengths.size, len(self._doc_idx))
            f.write(lengths.astype("<i4").tobytes())
            f.write(_pointers(lengths, self.dtype.itemsize, 0).tobytes())
            f.write(np.asarray(self._doc_idx, dtype="<i8").tobytes())
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(tmp_idx, idx_path)

    def abort(self) -> None:
        """Discard the partial output (temp files)."""
        self._bin.close()
        if os.path.exists(self._tmp_bin):
            os.remove(self._tmp_bin)


def write_index_header(f, dtype: np.dtype, n: int, d: int) -> None:
    f.write(MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", CODES[np.dtype(dtype)])
            + struct.pack("<QQ", n, d))


def _pointers(lengths: np.ndarray, itemsize: int, start: int) -> np.ndarray:
    """Byte pointers of consecutive sequences, starting at byte `start`."""
    p = np.empty(lengths.size, dtype="<i8")
    if lengths.size:
        p[0] = 0
        np.cumsum(lengths[:-1], dtype=np.int64, out=p[1:])
        p *= itemsize
        p += start
    return p


def merge(prefixes: Iterable[str], output_prefix: str) -> None:
    """Concatenate datasets into `output_prefix` (.bin/.idx) streaming in bounded-size chunks,
    so memory does not grow with the data. All inputs must share one dtype."""
    from .validate import validate
    prefixes = list(prefixes)  # read twice below: a generator would skip validation
    sets = [IndexedDataset(p) for p in prefixes]
    if not sets:
        raise ValueError("merge needs at least one input prefix")
    for p in prefixes:
        validate(p)
    dtype = sets[0].dtype
    for ds in sets:
        if ds.dtype != dtype:
            raise IndexedDatasetError(f"{ds.prefix}: dtype {ds.dtype} differs from {sets[0].prefix}'s {dtype}")
    n = sum(len(ds) for ds in sets)
    d = 1 + sum(ds.document_indices.size - 1 for ds in sets)
    tmp_bin, tmp_idx = output_prefix + ".bin.tmp", output_prefix + ".idx.tmp"
    with open(tmp_bin, "wb") as fb:
        for ds in sets:
            with open(data_file_path(ds.prefix), "rb") as f:
                while chunk := f.read(1 << 24):
                    fb.write(chunk)
    with open(tmp_idx, "wb") as f:
        write_index_header(f, dtype, n, d)
        for ds in sets:
            _stream(f, ds.sequence_lengths, lambda a: a)
        byte_off = 0
        for ds in sets:
            for s in range(0, len(ds), _COPY_CHUNK):
                part = ds.sequence_pointers[s:s + _COPY_CHUNK]
                f.write((part + byte_off).astype("<i8").tobytes())
            byte_off += os.path.getsize(data_file_path(ds.prefix))
        f.write(np.zeros(1, "<i8").tobytes())
        seq_off = 0
        for ds in sets:
            _stream(f, ds.document_indices[1:], lambda a, o=seq_off: (a + o).astype("<i8"))
            seq_off += len(ds)
    os.replace(tmp_bin, data_file_path(output_prefix))
    os.replace(tmp_idx, index_file_path(output_prefix))


def _stream(f, arr: np.ndarray, fn) -> None:
    for s in range(0, arr.size, _COPY_CHUNK):
        f.write(fn(arr[s:s + _COPY_CHUNK]).tobytes())


def validate(prefix: str) -> dict:
    """Check PREFIX.bin/.idx; raise IndexedDatasetError naming what is wrong; return a summary."""
    from .validate import validate as _validate
    return _validate(prefix)
