"""What the checkpoint identity check costs: the checksum (SUM64) of every file, taken beside the
save's fsync and checked at load beside the read (megapar/checkpoint/common.py), against the save
and load it guards.

    python benchmarks/bench_checkpoint_identity.py --gib 2 --workdir /tmp/identity

Writes one legacy shard file of --gib GiB of fp32 tensors (the 1.3B shape's layer tensors, repeated
until the size is reached) with StreamingSaver, as training's save does, with its checksum and with
the checksum replaced by nothing; then loads it cold with torch.load as training's load does,
alone and with the checksum beside it on a thread (as legacy.load_checkpoint runs it); each the
best of --rounds, alternating. Prints a table: the four times, the overhead of the sum and the
check together, and the rate of SUM64 and of zlib's CRC-32 over the whole file for comparison.
"""
from __future__ import annotations

import argparse
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable
from unittest import mock

import torch

from megapar.checkpoint import stream
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


def no_sum(path: str) -> tuple[int, int]:
    """The save's checksum replaced by nothing: the save as it is without the check."""
    return 0, 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=2, help="each timing's best of this many (alternating)")
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

    def save_without_sum() -> None:
        with mock.patch.object(stream, "file_checksum", no_sum):
            save()

    def load() -> None:
        torch.load(path, map_location="cpu", weights_only=False)

    def checked_load() -> None:                               # legacy.load_checkpoint: the check beside the read
        with ThreadPoolExecutor(max_workers=1) as pool:
            done = pool.submit(file_checksum, path)
            load()
            done.result()

    def cold_then(fn) -> Callable[[], None]:
        return lambda: (cold(path), fn())[1]

    runs = {"save": save_without_sum, "save with the sum": save, "load": cold_then(load),
            "load with the check": cold_then(checked_load)}
    best = {name: float("inf") for name in runs}
    for _ in range(a.rounds):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    sum_s = timed(lambda: file_checksum(path))                # the whole file summed again (page cache)
    crc_s = timed(lambda: crc32(path))                        # zlib's CRC-32 of the same bytes, for comparison
    os.remove(path)

    gib, both = nbytes / 2**30, best["save"] + best["load"]
    extra = max(0.0, best["save with the sum"] - best["save"]) + max(0.0, best["load with the check"] - best["load"])
    print("| file | save | save with the sum | load (cold) | load with the check | the check's cost (of save + load) "
          "| SUM64 | zlib CRC-32 |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {gib:.2f} GiB | {best['save']:.2f} s | {best['save with the sum']:.2f} s | {best['load']:.2f} s "
          f"| {best['load with the check']:.2f} s | {extra:.3f} s ({100 * extra / both:.1f}%) "
          f"| {gib / sum_s:.1f} GiB/s | {gib / crc_s:.2f} GiB/s |")


if __name__ == "__main__":
    main()
