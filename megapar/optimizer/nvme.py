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
    parameter parts of one bucket, up to CHUNK_NUMEL elements), its three kinds are read into one
    of two host slots, `update` runs on them, and they are written back. One coordinator thread
    works through the reads and writes in order, the next range's read queued before this range's
    update, so the disk works while the CPU steps; a slot is read into only after its previous
    range's write-back (the queue is FIFO). Each read or write fans its three kinds out in pieces
    of up to PIECE_BYTES to IO_THREADS threads (os.preadv / os.pwritev, which release the GIL), so
    several I/Os are in flight, and waits for them. At most two ranges' state is in host buffers
    at once. `last_stats` counts the bytes and seconds of the last stream's transfers.
  * `mapped[kind]`: the whole file as a tensor (np.memmap, MAP_SHARED): the checkpoint paths
    (saving, loading in place, the name-keyed state) read and write it as they read the
    CPU-offload buffers; the kernel pages it in and out.

Direct I/O. Where the file system accepts O_DIRECT (probed once, when the files are made), the
step bypasses the page cache, so it moves the state to and from the disk itself rather than
filling host memory with a cached copy. O_DIRECT needs file offsets, lengths and memory addresses
aligned to ALIGN, but a range's bytes [a, b) are not: its aligned interior goes through an
O_DIRECT descriptor, and its unaligned head and tail (within one block each, possibly shared with
the neighbouring range) through a buffered one, each touching only the range's own bytes (a
read-modify-write of a shared block would undo the neighbour's write-back, queued after this
range's read). A host slot holds the range at element offset (a % ALIGN) / 4 of a page-aligned
buffer, so the interior's memory is aligned with its file offset. Where O_DIRECT is refused
(EINVAL), every transfer is buffered and the run's optimizer log line says so.

Coherence relied on (Linux): direct and buffered I/O of one file, and its shared mappings, see
the same bytes when they do not run at once: a direct read or write first writes back the cached
dirty pages of its range (including pages dirtied through `mapped`), and a direct write then
invalidates them (unmapping them from `mapped`, which faults the new bytes back in). Interior
blocks are only ever moved directly by the step and edge blocks only buffered; the checkpoint
code uses `mapped` between steps.
"""
from __future__ import annotations

import errno
import os
import shutil
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from time import perf_counter
from typing import Callable, NamedTuple, Optional

import numpy as np
import torch

from ..errors import size_text
from ..pinned import host_buffer
from ..topology import ConfigError

KINDS = ("master_param", "exp_avg", "exp_avg_sq")
BYTES_PER_PARAM = 4 * len(KINDS)                 # fp32 master + two fp32 moments per owned parameter
# Elements of state in one chunk of the offloaded step (CPU or NVMe), unless one parameter's owned
# part alone is larger: NVMe's two host slots of three kinds hold 6 x 4 B x this (192 MiB).
CHUNK_NUMEL = 2**23
# O_DIRECT's alignment of file offsets, lengths and memory addresses: a page, and a multiple of the
# logical block size of common disks (512 B or 4 KiB).
ALIGN = 4096
SLACK = ALIGN // 4                               # fp32 elements a host slot holds beyond its range
# I/Os in flight: DeepSpeed's aio defaults to one thread keeping a queue of 8 libaio requests of
# 1 MiB (queue_depth, block_size); pread/pwrite block, so megapar keeps 8 requests of that size in
# flight with 8 threads, each moving one piece at a time.
IO_THREADS = 8
PIECE_BYTES = 2**20


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
        raise ConfigError(f"--optimizer-nvme-offload {root} has {size_text(free)} free, but the optimizer "
                          f"state of the {ranks_on_host} rank(s) on this host needs {size_text(total)} "
                          f"({BYTES_PER_PARAM} B per owned parameter); free space there or give a folder on a "
                          f"larger disk")


def state_bytes_per_rank(cfg, vocab_size: int) -> int:
    """The largest rank's state file bytes: BYTES_PER_PARAM x its owned share (1/dp) of the
    parameters of the fullest pipeline stage, from the flags (no model built)."""
    import copy
    import dataclasses

    from ..model.sizes import stage_params
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


class StreamStats(NamedTuple):
    """One `stream`'s disk transfers: nbytes, read plus written; busy_s, seconds some transfer was in
    flight; wall_s, from the first transfer's start to the last's end."""
    nbytes: int = 0
    busy_s: float = 0.0
    wall_s: float = 0.0

    @property
    def gb_per_s(self) -> float:
        """The rate while transferring (0 before any)."""
        return self.nbytes / self.busy_s / 1e9 if self.busy_s else 0.0


def _pieces(a: int, b: int, direct: bool) -> list[tuple[bool, int, int]]:
    """Bytes [a, b) of a file as (through O_DIRECT, start, end) pieces of at most PIECE_BYTES: with
    `direct`, the ALIGN-aligned interior directly and the unaligned head and tail buffered; else all
    buffered. Together exactly [a, b)."""
    lo, hi = -(-a // ALIGN) * ALIGN, b // ALIGN * ALIGN
    spans = [(False, a, lo), (True, lo, hi), (False, hi, b)] if direct and lo < hi else [(False, a, b)]
    return [(d, s, min(s + PIECE_BYTES, e)) for d, x, e in spans for s in range(x, e, PIECE_BYTES)]


def _open_direct(path: str) -> Optional[int]:
    """An O_DIRECT descriptor of `path`, or None where its file system refuses O_DIRECT: at open, or
    (some take the flag and refuse the transfers) at a first aligned read."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return None
    try:
        os.preadv(fd, [host_buffer(ALIGN, torch.uint8, pinned=False, page_aligned=True).numpy()], 0)
    except OSError as e:
        os.close(fd)
        if e.errno != errno.EINVAL:
            raise
        return None
    return fd


def _io(op: Callable, fd: int, view: memoryview, offset: int) -> None:
    """All of `view`'s bytes through os.preadv / os.pwritev at byte `offset` (they may do less per call)."""
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
                              f"state files were made ({size_text(size)} each); free space there or give a "
                              f"folder on a larger disk") from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)


def _remove(folder: str, paths: list[str], *fd_lists: list[int]) -> None:
    """Close the descriptors, delete `paths` and then `folder` if nothing else is in it."""
    for fd in (fd for fds in fd_lists for fd in fds):
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
        self.fds: list[int] = []           # buffered, per kind
        self.direct_fds: list[int] = []    # O_DIRECT, per kind; empty where the file system refuses it
        self._cleanup = weakref.finalize(self, _remove, self.folder, self.paths, self.fds, self.direct_fds)
        try:
            for path in self.paths:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                self.fds.append(fd)
                _reserve(fd, 4 * numel, root)             # reads as zeros: the moments' initial value
            direct = _open_direct(self.paths[0])          # probed once: the three share a file system
            if direct is not None:
                self.direct_fds.append(direct)
                for path in self.paths[1:]:
                    self.direct_fds.append(os.open(path, os.O_RDWR | os.O_DIRECT))
        except BaseException:
            self._cleanup()
            raise
        self.mapped = {k: self._map(path, numel) for k, path in zip(KINDS, self.paths)}
        self.pin, self.slots = pin, []
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvme-offload")
        self.pool = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="nvme-io")
        self.last_stats = StreamStats()

    @property
    def io_mode(self) -> str:
        """How the step moves the state, for the run's log."""
        if self.direct_fds:
            return f"O_DIRECT with {IO_THREADS} I/O threads"
        return "buffered I/O (the file system refuses O_DIRECT)"

    @staticmethod
    def _map(path: str, numel: int) -> torch.Tensor:
        if numel == 0:
            return torch.zeros(0)
        return torch.from_numpy(np.memmap(path, dtype=np.float32, mode="r+", shape=(numel,)))

    def _transfer(self, op: Callable, slot: int, off: int, n: int, spans: list) -> None:
        """Range (off, n)'s three kinds between host slot `slot` (from element off % SLACK, so its
        addresses agree with the file offsets modulo ALIGN) and the files, in pieces over the I/O
        threads; appends (start, end, bytes) to `spans`."""
        start, a, b = perf_counter(), 4 * off, 4 * (off + n)
        base = a - a % ALIGN                       # the file byte at the slot's first byte
        pieces = _pieces(a, b, bool(self.direct_fds))
        views = [memoryview(self.slots[slot][k].numpy()).cast("B") for k in KINDS]
        jobs = [self.pool.submit(_io, op, (self.direct_fds if direct else self.fds)[j], view[lo - base:hi - base], lo)
                for j, view in enumerate(views) for direct, lo, hi in pieces]
        for job in jobs:
            job.result()
        spans.append((start, perf_counter(), len(KINDS) * (b - a)))

    def stream(self, ranges: list[tuple[int, int]], update: Callable[[int, dict[str, torch.Tensor]], None]) -> None:
        """For each (offset, numel) of `ranges`, in order: update(i, {kind: the range's state in a
        host slot}), which changes it in place; the state is read before and written back after,
        overlapped with the neighbouring ranges' updates. Returns when every write is done."""
        if not ranges:
            return
        size = max(n for _, n in ranges) + SLACK
        if not self.slots or self.slots[0][KINDS[0]].numel() < size:
            self.slots = [{k: host_buffer(size, torch.float32, pinned=self.pin, page_aligned=True) for k in KINDS}
                          for _ in range(2)]
        spans: list[tuple[float, float, int]] = []
        reads: list[Future] = [self.io.submit(self._transfer, os.preadv, 0, *ranges[0], spans)]
        writes: list[Future] = []
        for i, (off, n) in enumerate(ranges):
            reads[i].result()
            if i + 1 < len(ranges):                 # behind write i - 1, which frees that slot
                reads.append(self.io.submit(self._transfer, os.preadv, (i + 1) % 2, *ranges[i + 1], spans))
            first = off % SLACK
            update(i, {k: t[first:first + n] for k, t in self.slots[i % 2].items()})
            writes.append(self.io.submit(self._transfer, os.pwritev, i % 2, off, n, spans))
        for w in writes:
            w.result()
        self.last_stats = StreamStats(sum(s[2] for s in spans), sum(e - s for s, e, _ in spans),
                                      max(s[1] for s in spans) - min(s[0] for s in spans))

    def close(self) -> None:
        """Delete the files and the folder (an unexpected file in it keeps the folder). Idempotent."""
        self.io.shutdown(wait=True)
        self.pool.shutdown(wait=True)
        self.mapped = {}
        self._cleanup()
