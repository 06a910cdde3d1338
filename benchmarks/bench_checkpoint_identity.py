"""What the checkpoint identity check costs: the checksum (SUM64) of every file, computed once the
file is written and checked at load beside the read (megapar/checkpoint/common.py), against the save
and load it guards.

    python benchmarks/bench_checkpoint_identity.py --gib 2 --workdir /tmp/identity

Writes one legacy shard file of --gib GiB of fp32 tensors (the 1.3B shape's layer tensors, repeated
until the size is reached) with StreamingSaver, as training's save does, then loads it cold with
torch.load as training's load does, alone and with the checksum beside it on a thread (as
legacy.load_checkpoint runs it). Prints a table: save, the checksum pass after it, load, load with
the check, and the overhead of the two together; zlib's CRC-32 of the same file for comparison.
"""
from __future__ import annotations

import argparse
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from megapar.checkpoint.common import file_checksum
from megapar.checkpoint.stream import LazyTensor, StreamingSaver

HIDDEN = 2048   # the 1.3B shape (24 layers, hidden 2048)
LAYER = {"qkv": (3 * HIDDEN, HIDDEN), "dense": (HIDDEN, HIDDEN), "h_to_4h": (4 * HIDDEN, HIDDEN),
         "4h_to_h": (HIDDEN, 4 * HIDDEN)}


def tensors(gib: float) -> dict[str, torch.Tensor]:
    out, total, i = {}, 0, 0
    while total < gib * 2**30:
        for name, shape in LAYER.items():
            t = torch.randn(shape)
            out[f"layers.{i}.{name}"] = t
            total += t.numel() * 4
        i += 1
    return out


def cold(path: str) -> None:
    """Drop the file from the page cache: the next read comes from the disk, as a resume's does."""
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def crc32(path: str) -> None:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--workdir", default="/tmp/identity_bench")
    a = p.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    path = os.path.join(a.workdir, "model_optim_rng.pt")
    state = tensors(a.gib)
    nbytes = sum(t.numel() * 4 for t in state.values())

    def save() -> None:
        with StreamingSaver(path, {k: LazyTensor(v.shape, v.dtype) for k, v in state.items()}) as saver:
            for t in state.values():
                saver.write_next(t)
    save_s = timed(save)
    sum_save_s = timed(lambda: file_checksum(path))          # what _write_shard adds (the file in the page cache)
    crc_s = timed(lambda: crc32(path))                        # zlib's CRC-32 of the same bytes, for comparison

    def load() -> None:
        torch.load(path, map_location="cpu", weights_only=False)

    def checked_load() -> None:                               # legacy.load_checkpoint: the check beside the read
        with ThreadPoolExecutor(max_workers=1) as pool:
            done = pool.submit(file_checksum, path)
            load()
            done.result()
    cold(path)
    load_s = timed(load)
    cold(path)
    checked_s = timed(checked_load)
    os.remove(path)

    gib, both = nbytes / 2**30, save_s + load_s
    extra = sum_save_s + max(0.0, checked_s - load_s)
    print("| file | save | checksum after it | load (cold) | load with the check | save + load | the check's cost "
          "| SUM64 | zlib CRC-32 |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {gib:.2f} GiB | {save_s:.2f} s | {sum_save_s:.3f} s ({100 * sum_save_s / save_s:.1f}%) | {load_s:.2f} s "
          f"| {checked_s:.2f} s ({100 * (checked_s - load_s) / load_s:+.1f}%) | {both:.2f} s | {extra:.3f} s "
          f"({100 * extra / both:.1f}%) | {gib / sum_save_s:.1f} GiB/s | {gib / crc_s:.2f} GiB/s |")


if __name__ == "__main__":
    main()
