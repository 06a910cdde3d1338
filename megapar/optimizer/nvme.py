"""`--optimizer-nvme-offload PATH`: the offloaded optimizer state (fp32 master shard and the two Adam
moment shards) in files instead of host memory, streamed through two small host buffers around the
CPU AdamW step, as DeepSpeed ZeRO-Infinity's `offload_optimizer.device: nvme`.

Storage. Each rank owns a folder PATH/rank_NNNNN/ (its global rank), made by the run with
os.mkdir, so nothing the user had is ever written into; in it one flat fp32 file per kind
(master_param.bin, exp_avg.bin, exp_avg_sq.bin), laid out like the CPU-offload shard buffers (the
concatenation of this rank's owned shard of every bucket), allocated in full when made
(posix_fallocate), so the disk cannot run out under a step. `close()` deletes those files and the
folder (only if nothing else appeared in it) at the end of the run, or when the process exits.

Two ways in:
  * `stream(ranges, update)`: the step. For each range in turn (the optimizer's chunks: whole
    parameter parts of one bucket, up to CHUNK_NUMEL elements), its three kinds are read
    (os.preadv) into one of two host slots, `update` runs on them, and they are written back
    (os.pwritev). One I/O thread works through the reads and writes in order, the next range's
    read queued before this range's update, so the disk works while the CPU steps; a slot is
    read into only after its previous range's write-back (the queue is FIFO). At most two
    ranges' state is in host buffers at once.
  * `mapped[kind]`: the whole file as a tensor (np.memmap, MAP_SHARED): the checkpoint paths
    (saving, loading in place, the name-keyed state) read and write it as they read the
    CPU-offload buffers; the kernel pages it in and out. It and the preadv/pwritev of the step see
    one page cache, so they stay coherent.
The files go through the page cache (no O_DIRECT: shard offsets are not block-aligned), so
recently touched pages may stay cached; the kernel reclaims them as memory is needed.
"""
from __future__ import annotations

import errno
import os
import shutil
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from ..pinned import host_buffer
from ..topology import ConfigError

KINDS = ("master_param", "exp_avg", "exp_avg_sq")
BYTES_PER_PARAM = 4 * len(KINDS)                 # fp32 master + two fp32 moments per owned parameter
# Elements of state in one chunk of the offloaded step (CPU or NVMe), unless one parameter's owned
# part alone is larger: NVMe's two host slots of three kinds hold 6 x 4 B x this (192 MiB).
CHUNK_NUMEL = 2**23


def rank_folder(root: str, rank: int) -> str:
    return os.path.join(root, f"rank_{rank:05d}")


def check_folder(root: str, rank: int, need: int, ranks_on_host: int) -> None:
    """Before the model is built: this rank's folder is free to make, and `root`'s file system has
    room for `need` bytes of state for each of the `ranks_on_host` ranks sharing it."""
    folder = rank_folder(root, rank)
    if os.path.lexists(folder):
        raise ConfigError(f"--optimizer-nvme-offload {root}: {folder} already exists (an earlier run's "
                          f"optimizer state, never a checkpoint, or your files); remove it or give another folder")
    total, free = need * ranks_on_host, shutil.disk_usage(root).free
    if total > free:
        raise ConfigError(f"--optimizer-nvme-offload {root} has {free / 2**30:.1f} GiB free, but the optimizer "
                          f"state of the {ranks_on_host} rank(s) on this host needs {total / 2**30:.1f} GiB "
                          f"({BYTES_PER_PARAM} B per owned parameter); free space there or give a folder on a "
                          f"larger disk")


def state_bytes_per_rank(cfg, vocab_size: int) -> int:
    """The largest rank's state file bytes: BYTES_PER_PARAM x its owned share (1/dp) of the
    parameters of the fullest pipeline stage, from the flags (no model built)."""
    import copy
    import dataclasses

    from ..planner.memory_estimate import stage_params
    from ..topology import padded_vocab_size
    p, sized = cfg.parallel, copy.copy(cfg)
    sized.model = dataclasses.replace(cfg.model, padded_vocab_size=padded_vocab_size(
        vocab_size, cfg.model.make_vocab_size_divisible_by, p.tensor_model_parallel_size))
    most = max(stage_params(sized, s) for s in range(p.pipeline_model_parallel_size))
    return BYTES_PER_PARAM * -(-most // p.data_parallel_size)


def check_nvme_offload(cfg, vocab_size: int, rank: int) -> None:
    """check_folder for this rank of a run with --optimizer-nvme-offload (torchrun's LOCAL_WORLD_SIZE
    ranks on this host; all of them without torchrun)."""
    p = cfg.parallel
    world = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.data_parallel_size
    on_host = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    check_folder(p.optimizer_nvme_offload, rank, state_bytes_per_rank(cfg, vocab_size), on_host)


def _io(op: Callable, fd: int, buf: torch.Tensor, offset: int) -> None:
    """All of `buf`'s bytes through os.preadv / os.pwritev at byte `offset` (they may do less per call)."""
    view = memoryview(buf.numpy()).cast("B")
    done = 0
    while done < len(view):
        n = op(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"short {'read' if op is os.preadv else 'write'} at byte {offset + done}")
        done += n


def _reserve(fd: int, size: int, root: str) -> None:
    """Give the file `size` bytes of zeros, allocated now where the file system can (so a disk that
    fills up during the run cannot fail a step's write), else sparse."""
    if size == 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ConfigError(f"--optimizer-nvme-offload {root}: the disk filled up while this rank's optimizer "
                              f"state files were made ({size / 2**30:.1f} GiB each); free space there or give a "
                              f"folder on a larger disk") from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)


def _remove(folder: str, paths: list[str], fds: list[int]) -> None:
    """Close `fds`, delete `paths` and then `folder` if nothing else is in it."""
    for fd in fds:
        os.close(fd)
    for path in paths:
        if os.path.exists(path):
            os.unlink(path)
    if os.path.isdir(folder) and not os.listdir(folder):
        os.rmdir(folder)


class NvmeState:
    """This rank's master and moment shards (`numel` fp32 each) in files under rank_folder(root,
    rank); two host slots as large as the largest range streamed (pinned with `pin`)."""

    def __init__(self, root: str, rank: int, numel: int, pin: bool = False):
        self.folder = rank_folder(root, rank)
        os.mkdir(self.folder)
        self.paths = [os.path.join(self.folder, f"{k}.bin") for k in KINDS]
        self.fds: list[int] = []
        self._cleanup = weakref.finalize(self, _remove, self.folder, self.paths, self.fds)
        try:
            for path in self.paths:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                self.fds.append(fd)
                _reserve(fd, 4 * numel, root)             # reads as zeros: the moments' initial value
        except BaseException:
            self._cleanup()
            raise
        self.mapped = {k: self._map(path, numel) for k, path in zip(KINDS, self.paths)}
        self.pin, self.slots = pin, []
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvme-offload")

    @staticmethod
    def _map(path: str, numel: int) -> torch.Tensor:
        if numel == 0:
            return torch.zeros(0)
        return torch.from_numpy(np.memmap(path, dtype=np.float32, mode="r+", shape=(numel,)))

    def _read(self, slot: int, off: int, n: int) -> None:
        for fd, k in zip(self.fds, KINDS):
            _io(os.preadv, fd, self.slots[slot][k][:n], 4 * off)

    def _write(self, slot: int, off: int, n: int) -> None:
        for fd, k in zip(self.fds, KINDS):
            _io(os.pwritev, fd, self.slots[slot][k][:n], 4 * off)

    def stream(self, ranges: list[tuple[int, int]], update: Callable[[int, dict[str, torch.Tensor]], None]) -> None:
        """For each (offset, numel) of `ranges`, in order: update(i, {kind: the range's state in a
        host slot}), which changes it in place; the state is read before and written back after,
        overlapped with the neighbouring ranges' updates. Returns when every write is done."""
        if not ranges:
            return
        largest = max(n for _, n in ranges)
        if not self.slots or self.slots[0][KINDS[0]].numel() < largest:
            self.slots = [{k: host_buffer(largest, torch.float32, pinned=self.pin) for k in KINDS}
                          for _ in range(2)]
        reads: list[Future] = [self.io.submit(self._read, 0, *ranges[0])]
        writes: list[Future] = []
        for i, (off, n) in enumerate(ranges):
            reads[i].result()
            if i + 1 < len(ranges):                 # behind write i - 1, which frees that slot
                reads.append(self.io.submit(self._read, (i + 1) % 2, *ranges[i + 1]))
            update(i, {k: t[:n] for k, t in self.slots[i % 2].items()})
            writes.append(self.io.submit(self._write, i % 2, off, n))
        for w in writes:
            w.result()

    def close(self) -> None:
        """Delete the files and the folder (an unexpected file in it keeps the folder). Idempotent."""
        self.io.shutdown(wait=True)
        self.mapped = {}
        self._cleanup()
