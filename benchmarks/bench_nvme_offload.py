"""--optimizer-nvme-offload against --optimizer-cpu-offload: the disk's sequential speed, and the
optimizer step of a GPT-2 model with its state in files (streamed in chunks) or in host memory.

    python benchmarks/bench_nvme_offload.py --dir /local_nvme [--disk-mib 1024] [--layers 12 --hidden 768] [--steps 5]

Prints two tables. Disk, of a `--disk-mib` file in `--dir`: sequential write (pwrite in 8 MiB
blocks from one thread, then fsync) and read (after posix_fadvise DONTNEED drops the file's cached
pages, so it comes from the device), then the same through O_DIRECT as the NVMe step does it
(pieces of nvme.PIECE_BYTES over nvme.IO_THREADS threads; n/a where the file system refuses it).
Step: one process (dp 1, ZeRO-1) on the CPU, the time of `optimizer.step()` alone (random
gradients, no forward or backward) with each offload, averaged over `--steps` after one warm-up
step, and the NVMe step's transfer rate (24 B per parameter read and written, over the seconds a
transfer was in flight: NvmeState.last_stats of the last step). Where O_DIRECT is refused the
step goes through the page cache and is disk-bound only once the state outgrows the memory the
kernel can spare for caching it.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from megapar.optimizer.nvme import IO_THREADS, PIECE_BYTES, _io, _open_direct
from megapar.pinned import host_buffer

BLOCK = 8 * 2**20


def disk_speed(folder: str, mib: int) -> tuple[float, float]:
    """(write GB/s, read GB/s) of one `mib` MiB file in `folder` (removed after)."""
    data = os.urandom(BLOCK)
    blocks = mib * 2**20 // BLOCK
    fd, path = tempfile.mkstemp(dir=folder, prefix="bench_nvme_")
    try:
        start = time.perf_counter()
        for i in range(blocks):
            os.pwrite(fd, data, i * BLOCK)
        os.fsync(fd)
        write = blocks * BLOCK / (time.perf_counter() - start) / 1e9
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        for i in range(blocks):
            os.pread(fd, BLOCK, i * BLOCK)
        read = blocks * BLOCK / (time.perf_counter() - start) / 1e9
    finally:
        os.close(fd)
        os.unlink(path)
    return write, read


def direct_speed(folder: str, mib: int) -> Optional[tuple[float, float]]:
    """(write GB/s, read GB/s) of one `mib` MiB file in `folder` through O_DIRECT, IO_THREADS pieces
    of PIECE_BYTES in flight (every piece from or into one page-aligned buffer: the bytes do not
    matter); None where the file system refuses O_DIRECT."""
    fd, path = tempfile.mkstemp(dir=folder, prefix="bench_nvme_")
    direct = _open_direct(path)
    try:
        if direct is None:
            return None
        buf = host_buffer(PIECE_BYTES, torch.uint8, pinned=False, page_aligned=True)
        buf.copy_(torch.randint(0, 256, (PIECE_BYTES,), dtype=torch.uint8))
        view = memoryview(buf.numpy())
        offsets = range(0, mib * 2**20 // PIECE_BYTES * PIECE_BYTES, PIECE_BYTES)
        rates = []
        with ThreadPoolExecutor(IO_THREADS) as pool:
            for op in (os.pwritev, os.preadv):
                start = time.perf_counter()
                list(pool.map(lambda off: _io(op, direct, view, off), offsets))
                os.fsync(direct)
                rates.append(len(offsets) * PIECE_BYTES / (time.perf_counter() - start) / 1e9)
        return rates[0], rates[1]
    finally:
        if direct is not None:
            os.close(direct)
        os.close(fd)
        os.unlink(path)


def step_seconds(layers: int, hidden: int, steps: int, nvme_root: str | None) -> tuple[int, float, float]:
    """(parameters, seconds per optimizer.step(), the last NVMe step's transfer GB/s or 0) of a
    GPT-2 model with CPU or NVMe offload."""
    from megapar.config.build import build_config
    from megapar.config.overlays import parse_flags
    from megapar.config.settings import TrainConfig
    from megapar.model import GPT2Model, Stage, set_vocab
    from megapar.optimizer.distrib_optimizer import DistributedOptimizer
    from megapar.optimizer.grad_buffer import GradBuffer
    from megapar.optimizer.grad_scaler import ConstantGradScaler

    cfg = build_config(parse_flags(["--num-layers", str(layers), "--hidden-size", str(hidden),
                                             "--num-attention-heads", str(hidden // 64), "--seq-length", "1024"]), 1)
    set_vocab(cfg.model, 50257, 1, log=lambda *_: None)
    model = GPT2Model(cfg.model, Stage.of(layers, 1, 0), seed=1)
    buf = GradBuffer(model.parameters(), None, mode="reduce_scatter")
    opt = DistributedOptimizer(model, buf, TrainConfig(), ConstantGradScaler(), tp_rank=0, dp_group=None,
                               offload=nvme_root is None, nvme_root=nvme_root)
    try:
        g = torch.Generator().manual_seed(0)
        buf.data.copy_(torch.randn(buf.data.numel(), generator=g) * 1e-3)
        opt.step()                                          # warm-up: first-touch of the buffers and files
        start = time.perf_counter()
        for _ in range(steps):
            opt.step()
        seconds = (time.perf_counter() - start) / steps
        io = opt.nvme.last_stats.gb_per_s if opt.nvme is not None else 0.0
        return sum(p.numel() for p in model.parameters()), seconds, io
    finally:
        opt.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="a folder on the disk to measure (files are removed after)")
    p.add_argument("--disk-mib", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()
    write, read = disk_speed(a.dir, a.disk_mib)
    direct = direct_speed(a.dir, a.disk_mib)
    dw, dr = ("n/a", "n/a") if direct is None else (f"{direct[0]:.2f}", f"{direct[1]:.2f}")
    print(f"| disk ({a.dir}, {a.disk_mib} MiB file) | GB/s |\n|---|---|\n| sequential write + fsync | {write:.2f} |\n"
          f"| sequential read (uncached) | {read:.2f} |\n| O_DIRECT write + fsync ({IO_THREADS} threads) | {dw} |\n"
          f"| O_DIRECT read ({IO_THREADS} threads) | {dr} |\n")
    print(f"| optimizer step ({torch.get_num_threads()} threads) | params | s/step | state GiB | NVMe I/O GB/s |\n"
          f"|---|---|---|---|---|")
    for name, root in (("CPU offload", None), ("NVMe offload", a.dir)):
        n, s, io = step_seconds(a.layers, a.hidden, a.steps, root)
        print(f"| {name} | {n / 1e6:.0f}M | {s:.3f} | {12 * n / 2**30:.2f} | {f'{io:.2f}' if root else '-'} |",
              flush=True)


if __name__ == "__main__":
    main()
