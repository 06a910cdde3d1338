"""--optimizer-nvme-offload against --optimizer-cpu-offload: the disk's sequential speed, and the
optimizer step of a GPT-2 model with its state in files (streamed in chunks) or in host memory.

    python benchmarks/bench_nvme_offload.py --dir /local_nvme [--disk-mib 1024] [--layers 12 --hidden 768] [--steps 5]

Prints two tables. Disk: sequential write (pwrite in 8 MiB blocks, then fsync) and read (after
posix_fadvise DONTNEED drops the file's cached pages, so it comes from the device) of a
`--disk-mib` file in `--dir`. Step: one process (dp 1, ZeRO-1) on the CPU, the time of
`optimizer.step()` alone (random gradients, no forward or backward) with each offload, averaged
over `--steps` after one warm-up step. The NVMe step reads and writes 24 B per parameter through
the page cache, so a step is disk-bound only once the state outgrows the memory the kernel can
spare for caching it.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

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


def step_seconds(layers: int, hidden: int, steps: int, nvme_root: str | None) -> tuple[int, float]:
    """(parameters, seconds per optimizer.step()) of a GPT-2 model with CPU or NVMe offload."""
    from megapar.config.arguments import TrainConfig, parse_flags, config_from_namespace
    from megapar.model import GPT2Model, Stage, set_vocab
    from megapar.optimizer.distrib_optimizer import DistributedOptimizer
    from megapar.optimizer.grad_buffer import GradBuffer
    from megapar.optimizer.grad_scaler import ConstantGradScaler

    cfg = config_from_namespace(parse_flags(["--num-layers", str(layers), "--hidden-size", str(hidden),
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
        return sum(p.numel() for p in model.parameters()), (time.perf_counter() - start) / steps
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
    print(f"| disk ({a.dir}, {a.disk_mib} MiB file) | GB/s |\n|---|---|\n| sequential write + fsync | {write:.2f} |\n"
          f"| sequential read (uncached) | {read:.2f} |\n")
    print(f"| optimizer step ({torch.get_num_threads()} threads) | params | s/step | state GiB |\n|---|---|---|---|")
    for name, root in (("CPU offload", None), ("NVMe offload", a.dir)):
        n, s = step_seconds(a.layers, a.hidden, a.steps, root)
        print(f"| {name} | {n / 1e6:.0f}M | {s:.3f} | {12 * n / 2**30:.2f} |", flush=True)


if __name__ == "__main__":
    main()
