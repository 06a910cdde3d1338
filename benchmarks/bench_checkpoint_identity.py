"""What the checkpoint identity check costs: the CRC-32 of every file, computed while it is written
and checked at load (megapar/checkpoint/common.py), against the save and load it guards.

    python benchmarks/bench_checkpoint_identity.py --gib 2 --workdir /tmp/identity

Writes one legacy shard file of --gib GiB of fp32 tensors (the 1.3B shape's layer tensors, repeated
until the size is reached) with StreamingSaver, as training's save does, then loads it with
torch.load as training's load does. Prints a table: save, load, the checksum's share of each (its
time measured alone on the same bytes), and the overhead of the two together.
"""
from __future__ import annotations

import argparse
import os
import time
import zlib

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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--workdir", default="/tmp/identity_bench")
    a = p.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    path = os.path.join(a.workdir, "model_optim_rng.pt")
    state = tensors(a.gib)
    nbytes = sum(t.numel() * 4 for t in state.values())

    start = time.perf_counter()
    with StreamingSaver(path, {k: LazyTensor(v.shape, v.dtype) for k, v in state.items()}) as saver:
        for t in state.values():
            saver.write_next(t)
    save_s = time.perf_counter() - start
    start = time.perf_counter()
    crc = 0
    for t in state.values():                                  # what the save's sink adds, measured alone
        crc = zlib.crc32(memoryview(t.numpy()).cast("B"), crc)
    crc_save_s = time.perf_counter() - start

    os.posix_fadvise(os.open(path, os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)   # a cold read, as a resume's
    start = time.perf_counter()
    torch.load(path, map_location="cpu", weights_only=False)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    file_checksum(path)                                       # the load's check (the file now in the page cache)
    crc_load_s = time.perf_counter() - start
    os.remove(path)

    print(f"| {nbytes / 2**30:.2f} GiB | save {save_s:.2f} s | CRC at save {crc_save_s:.2f} s "
          f"({100 * crc_save_s / save_s:.1f}%) | load {load_s:.2f} s | CRC at load {crc_load_s:.2f} s "
          f"({100 * crc_load_s / load_s:.1f}%) | save + load {save_s + load_s:.2f} s, "
          f"CRC {crc_save_s + crc_load_s:.2f} s "
          f"({100 * (crc_save_s + crc_load_s) / (save_s + load_s):.1f}%) | {nbytes / 2**30 / (crc_save_s or 1e-9):.2f} "
          f"GiB/s CRC |")


if __name__ == "__main__":
    main()
