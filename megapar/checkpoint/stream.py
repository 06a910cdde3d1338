"""torch.save for a dict whose tensors are produced one at a time while the file is written.

`StreamingSaver` writes the same zip format as torch.save (torch.load, with or without
mmap, reads it back unchanged): the pickle of the structure first, then one record per tensor.
Tensors are `LazyTensor` placeholders (shape, dtype) in the structure; `write_next(tensor)` is
called once per placeholder, in order, so only one tensor needs to be in memory at a time.
Several savers can be open at once (one per target TP rank) and fed interleaved.
"""
from __future__ import annotations

import io
import os
import pickle
import sys
import warnings
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from typing import Optional

import torch
import torch.serialization as ser

from .common import file_checksum


def exact_storage(t: torch.Tensor) -> torch.Tensor:
    """`t` (contiguous, on the host) itself, or an alias of its memory whose storage holds exactly
    its elements: writers that take whole storages (torch.save, DCP's) then write `t` without
    copying a view into a larger storage (a ZeRO shard, a parameter inside a flat buffer)."""
    es = t.element_size()
    start, nbytes = t.storage_offset() * es, t.numel() * es
    if not start and t.untyped_storage().nbytes() == nbytes:
        return t
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage()[start:start + nbytes], 0, t.shape, t.stride())


class LazyTensor:
    """Placeholder for a contiguous CPU tensor written later by StreamingSaver.write_next."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, tag=None):
        self.shape, self.dtype = tuple(shape), dtype
        self.key: str | None = None
        self.tag = tag                       # caller's label (e.g. (name, kind))
        self.value: torch.Tensor | None = None  # set for real tensors found in the structure

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class _StorageRef:
    def __init__(self, lazy: LazyTensor):
        self.lazy = lazy


def _rebuild_args(lazy: LazyTensor):
    stride, acc = [], 1
    for s in reversed(lazy.shape):
        stride.append(acc)
        acc *= s
    return (_StorageRef(lazy), 0, lazy.shape, tuple(reversed(stride)), False, OrderedDict())


class _Pickler(pickle.Pickler):
    def __init__(self, buf, order: list[LazyTensor]):
        super().__init__(buf, protocol=2)
        self.order = order

    def reducer_override(self, obj):
        if isinstance(obj, LazyTensor):
            return torch._utils._rebuild_tensor_v2, _rebuild_args(obj)
        if type(obj) is torch.Tensor:         # small real tensors (RNG states): written as soon as reached
            lazy = LazyTensor(obj.shape, obj.dtype)
            lazy.value = obj.detach().cpu().contiguous().clone()
            return torch._utils._rebuild_tensor_v2, _rebuild_args(lazy)
        return NotImplemented

    def persistent_id(self, obj):
        if isinstance(obj, _StorageRef):
            lazy = obj.lazy
            lazy.key = str(len(self.order))
            self.order.append(lazy)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                storage_type = getattr(torch, torch.TypedStorage(dtype=lazy.dtype)._pickle_storage_type())
            return ("storage", storage_type, lazy.key, "cpu", lazy.numel())
        if torch.is_storage(obj):
            raise TypeError("StreamingSaver: storages cannot be streamed; use tensors or LazyTensor placeholders")
        return None


class _Sink:
    """The file a StreamingSaver writes. torch's zip writer writes again from its destructor (the end
    of the archive), where a failing write aborts the whole process; so the first failed write (disk
    full, a file size limit, ...) is kept to be raised by the saver, and every later write is a no-op."""

    def __init__(self, path: str):
        self.file = open(path, "wb")
        self.error: Optional[OSError] = None

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        if self.error is None:
            try:
                self.file.write(data)
            except OSError as e:
                self.error = e
        return n

    def flush(self) -> None:
        if self.error is None:
            try:
                self.file.flush()
            except OSError as e:
                self.error = e

    def close(self) -> None:
        try:
            self.file.close()
        except OSError as e:
            self.error = self.error or e


class StreamingSaver:
    """with StreamingSaver(path, obj) as s: for t in tensors: s.write_next(t)
    Writes to `path.tmp.<pid>` and renames onto `path` only when every tensor was written; then
    `checksum` is the file's (bytes, SUM64) (common.file_checksum), taken from the page cache while
    fsync writes the file to the disk, so that it costs the save next to nothing."""

    def __init__(self, path: str, obj):
        self.path, self.tmp = path, f"{path}.tmp.{os.getpid()}"
        self.order: list[LazyTensor] = []
        buf = io.BytesIO()
        _Pickler(buf, self.order).dump(obj)
        self.sink = _Sink(self.tmp)
        self.writer = torch._C.PyTorchFileWriter(self.sink, ser.get_crc32_options(), ser._get_storage_alignment())
        data = buf.getvalue()
        self._record("data.pkl", data, len(data))
        self._record(".format_version", "1", 1)
        align = str(ser._get_storage_alignment())
        self._record(".storage_alignment", align, len(align))
        self._record("byteorder", sys.byteorder, len(sys.byteorder))
        self.next = 0
        self._flush_ready()

    def _record(self, name: str, data, nbytes: int) -> None:
        self.writer.write_record(name, data, nbytes)
        if self.sink.error is not None:
            raise self.sink.error

    def pending(self) -> list[LazyTensor]:
        """Placeholders still to be written, in order (real tensors are written automatically)."""
        return [t for t in self.order[self.next:] if t.value is None]

    def _flush_ready(self) -> None:
        while self.next < len(self.order) and self.order[self.next].value is not None:
            lazy = self.order[self.next]
            self._write(lazy, lazy.value)
            lazy.value = None

    def remaining(self) -> int:
        return len(self.order) - self.next

    def write_next(self, t: torch.Tensor) -> None:
        lazy = self.order[self.next]
        if tuple(t.shape) != lazy.shape or t.dtype != lazy.dtype:
            raise ValueError(f"{self.path}: tensor {self.next} should be {lazy.shape} {lazy.dtype}, "
                             f"got {tuple(t.shape)} {t.dtype}")
        self._write(lazy, t)
        self._flush_ready()

    def _write(self, lazy: LazyTensor, t: torch.Tensor) -> None:
        """One record from `t`'s elements (a view is written in place: nothing is copied)."""
        t = exact_storage(t.detach().cpu().contiguous())
        self._record(f"data/{lazy.key}", t.untyped_storage(), t.numel() * t.element_size())
        self.next += 1

    def close(self) -> None:
        if self.remaining():
            raise RuntimeError(f"{self.path}: {self.remaining()} tensors were never written")
        self.writer.write_end_of_file()
        del self.writer
        self.sink.flush()
        if self.sink.error is None:
            with ThreadPoolExecutor(max_workers=1) as pool:
                checksum = pool.submit(file_checksum, self.tmp)       # beside the fsync
                try:
                    os.fsync(self.sink.file.fileno())
                except OSError as e:
                    self.sink.error = e
                self.checksum = checksum.result()
        self.sink.close()
        if self.sink.error is not None:
            os.remove(self.tmp)
            raise self.sink.error
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        try:
            del self.writer      # writes the archive's end into the sink (a no-op after a failed write)
        except AttributeError:
            pass
        self.sink.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)

    def __enter__(self) -> "StreamingSaver":
        return self

    def __exit__(self, exc_type, *_):
        self.abort() if exc_type else self.close()
