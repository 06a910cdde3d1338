"""MMIDIDX writer -> reader round trip, the worked example of docs/design.md, validator and merge."""
import os
import struct

import numpy as np
import pytest

from megapar.data import indexed_dataset as idx_mod
from megapar.data.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError,
                                          merge, validate)


def write(prefix, docs, dtype=np.uint16):
    b = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for d in docs:
        b.add_document(d)
    b.finalize(f"{prefix}.idx")
    return str(prefix)


def test_spec_worked_example(tmp_path):
    p = write(tmp_path / "ex", [[1, 2, 3], [4, 5, 6, 7, 8]])
    idx = open(p + ".idx", "rb").read()
    assert len(idx) == 82 and os.path.getsize(p + ".bin") == 16
    assert idx[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<QBQQ", idx[9:34]) == (1, 8, 2, 3)
    assert np.frombuffer(idx, "<i4", 2, 34).tolist() == [3, 5]
    assert np.frombuffer(idx, "<i8", 2, 42).tolist() == [0, 6]
    assert np.frombuffer(idx, "<i8", 3, 58).tolist() == [0, 1, 2]
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_round_trip_with_empty_documents(tmp_path, dtype):
    rng = np.random.RandomState(0)
    docs = [rng.randint(0, 50000, size=n).tolist() for n in (5, 0, 17, 1, 0, 0, 300)]
    p = write(tmp_path / "rt", docs, dtype)
    ds = IndexedDataset(p)
    assert ds.dtype == np.dtype(dtype) and len(ds) == 4
    assert ds.document_indices.tolist() == [0, 1, 1, 2, 3, 3, 3, 4]
    assert [x.tolist() for x in ds] == [d for d in docs if d]
    assert ds.get(3, offset=10, length=5).tolist() == docs[6][10:15]
    assert not ds[0].flags.owndata  # zero-copy view of the memory map
    assert validate(p) == {"dtype": np.dtype(dtype).name, "num_sequences": 4, "num_documents": 7,
                           "num_tokens": 323}


def test_empty_dataset(tmp_path):
    p = write(tmp_path / "empty", [])
    ds = IndexedDataset(p)
    assert len(ds) == 0 and ds.document_indices.tolist() == [0]
    validate(p)


def _corrupt(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


CORRUPTIONS = {
    "magic": (lambda p: _corrupt(p + ".idx", 0, b"XXXX"), "bad magic"),
    "version": (lambda p: _corrupt(p + ".idx", 9, struct.pack("<Q", 2)), "version"),
    "dtype": (lambda p: _corrupt(p + ".idx", 17, b"\x09"), "dtype code"),
    "truncated_idx": (lambda p: os.truncate(p + ".idx", 60), "truncated"),
    "truncated_header": (lambda p: os.truncate(p + ".idx", 20), "truncated header"),
    "trailing_idx": (lambda p: open(p + ".idx", "ab").write(b"\0" * 8), "trailing bytes"),
    "truncated_bin": (lambda p: os.truncate(p + ".bin", 10), "truncated"),
    "long_bin": (lambda p: open(p + ".bin", "ab").write(b"\0\0"), "longer"),
    "negative_length": (lambda p: _corrupt(p + ".idx", 34, struct.pack("<i", -1)), "negative length"),
    "pointer": (lambda p: _corrupt(p + ".idx", 34 + 12 + 8, struct.pack("<q", 2)), "pointer"),
    "doc_decreasing": (lambda p: _corrupt(p + ".idx", 34 + 36 + 8, struct.pack("<q", 3)), "decreases"),
    "doc_start": (lambda p: _corrupt(p + ".idx", 34 + 36, struct.pack("<q", 1)), "starts at 1"),
    "doc_end": (lambda p: _corrupt(p + ".idx", 34 + 36 + 24, struct.pack("<q", 2)), "ends at 2"),
    "missing_bin": (lambda p: os.remove(p + ".bin"), "not found"),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_validator_names_each_corruption(tmp_path, kind):
    p = write(tmp_path / kind, [[1, 2, 3], [4, 5], [6, 7, 8, 9]])  # N=3, D=4
    validate(p)
    corrupt, message = CORRUPTIONS[kind]
    corrupt(p)
    with pytest.raises(IndexedDatasetError, match=message):
        validate(p)


def test_reader_rejects_truncated_index(tmp_path):
    p = write(tmp_path / "t", [[1, 2, 3]])
    os.truncate(p + ".idx", 40)
    with pytest.raises(IndexedDatasetError, match="truncated or corrupt"):
        IndexedDataset(p)
    with pytest.raises(IndexedDatasetError, match="not found"):
        IndexedDataset(str(tmp_path / "nothing"))


def test_merge_streams_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(idx_mod, "_COPY_CHUNK", 3)  # force many chunks
    rng = np.random.RandomState(1)
    parts, all_docs = [], []
    for k in range(3):
        docs = [rng.randint(0, 1000, size=rng.randint(0, 9)).tolist() for _ in range(7)]
        parts.append(write(tmp_path / f"part{k}", docs))
        all_docs += docs
    merge(parts, str(tmp_path / "merged"))
    expected = write(tmp_path / "expected", all_docs)
    for ext in (".bin", ".idx"):
        assert open(str(tmp_path / "merged") + ext, "rb").read() == open(expected + ext, "rb").read()
    validate(str(tmp_path / "merged"))
    b = IndexedDatasetBuilder(str(tmp_path / "added.bin"), np.uint16)
    for p in parts:
        b.add_index(p)
    b.finalize(str(tmp_path / "added.idx"))
    assert open(str(tmp_path / "added.idx"), "rb").read() == open(expected + ".idx", "rb").read()


def test_merge_rejects_mixed_dtypes(tmp_path):
    a = write(tmp_path / "a", [[1]], np.uint16)
    b = write(tmp_path / "b", [[1]], np.int32)
    with pytest.raises(IndexedDatasetError, match="dtype"):
        merge([a, b], str(tmp_path / "m"))
