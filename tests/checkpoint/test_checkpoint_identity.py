"""The per-file checksum of checkpoint manifests (megapar/checkpoint/common.py: file_checksum, SUM64)
against its definition computed serially in numpy, and the changes it must tell apart: a flipped
bit anywhere (the top bit of a word in an even-weighted position included), the tail of a size that
is not a multiple of 8, two blocks swapped, one byte cut off."""
import os

import numpy as np
import pytest

from megapar.checkpoint import common
from megapar.checkpoint.common import CheckpointError, check_checksum, file_checksum

BLOCK = 64 << 10     # small blocks (the mapping granularity's multiple) so that a test file spans many


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(common, "_BLOCK_BYTES", BLOCK)


def reference(raw: bytes) -> int:
    """SUM64 by its definition: little-endian 64-bit words (zero-padded), summed per block, block i
    weighted by 2i + 1, mod 2^64."""
    total = 0
    for i in range(0, len(raw), BLOCK):
        block = raw[i:i + BLOCK]
        block += b"\0" * (-len(block) % 8)
        total += (2 * (i // BLOCK) + 1) * sum(int(w) for w in np.frombuffer(block, dtype="<u8"))
    return total % 2**64


def write(path, raw: bytes) -> str:
    path.write_bytes(raw)
    return str(path)


@pytest.mark.parametrize("size", [0, 5, 8, BLOCK, BLOCK + 3, 5 * BLOCK + 12345])
def test_sum64_is_its_definition(tmp_path, size):
    raw = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert file_checksum(write(tmp_path / "f", raw)) == (size, reference(raw))


def test_a_streamed_save_records_the_files_checksum(tmp_path):
    import torch
    from megapar.checkpoint.stream import LazyTensor, StreamingSaver
    tensors = [torch.randn(n) for n in (3, BLOCK // 4 + 1, 5 * BLOCK // 4)]
    path = str(tmp_path / "model_optim_rng.pt")
    with StreamingSaver(path, {"t": [LazyTensor(tuple(t.shape), t.dtype) for t in tensors]}) as saver:
        for t in tensors:
            saver.write_next(t)
    assert saver.checksum == file_checksum(path)


def test_every_change_is_told_apart(tmp_path):
    raw = np.random.default_rng(0).integers(0, 256, 4 * BLOCK + 5, dtype=np.uint8).tobytes()
    saved = {"bytes": len(raw), common.CHECKSUM: file_checksum(write(tmp_path / "f", raw))[1]}
    check_checksum(str(tmp_path / "f"), saved)
    top_bit_of_block_1 = BLOCK + 7                       # weight 3 -- and bit 63 of a word
    changes = {"a flipped bit": (100, 0x01), "the top bit of a word": (top_bit_of_block_1, 0x80),
               "the tail": (len(raw) - 1, 0x10)}
    for what, (at, bit) in changes.items():
        bad = bytearray(raw)
        bad[at] ^= bit
        with pytest.raises(CheckpointError, match="checksum differs"):
            check_checksum(write(tmp_path / "f", bytes(bad)), saved)
    swapped = raw[BLOCK:2 * BLOCK] + raw[:BLOCK] + raw[2 * BLOCK:]
    assert file_checksum(write(tmp_path / "f", swapped))[1] != saved[common.CHECKSUM]
    assert file_checksum(write(tmp_path / "f", raw[:-1])) != (saved["bytes"], saved[common.CHECKSUM])


def test_a_manifest_of_the_first_identities_is_checked_with_crc32(tmp_path):
    import zlib
    raw = os.urandom(3 * BLOCK)
    path = write(tmp_path / "f", raw)
    check_checksum(path, {"bytes": len(raw), "crc32": zlib.crc32(raw)})
    with pytest.raises(CheckpointError, match="checksum differs"):
        check_checksum(path, {"bytes": len(raw), "crc32": zlib.crc32(raw) ^ 1})
