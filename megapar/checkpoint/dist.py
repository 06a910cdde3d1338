"""Distributed checkpoints (`--ckpt-format torch_dist`) through torch.distributed.checkpoint (DCP).

    DIR/latest_checkpointed_iteration.txt       written last, once every rank's files are complete
    DIR/iter_0000600/common.pt                  the small common record (rank 0): iteration, args, model
                                                config, LR scheduler, optimizer step / loss scaler, RNG per rank
    DIR/iter_0000600/.metadata                  DCP's index: every tensor's global shape and stored chunks
    DIR/iter_0000600/__{rank}_{i}.distcp        what rank `rank` owned, written by that rank alone, in up
                                                to WRITE_THREADS files written at once (i < WRITE_THREADS)

Every tensor is stored under its canonical name (the tp = pp = 1 model's key, checkpoint/layout.py) at its
global shape, with the true vocabulary rows only (no padding): `model.<name>` in the model dtype, and
`optim.<name>.{master_param,exp_avg,exp_avg_sq}` in fp32. A rank describes what it holds as chunks of
those global tensors -- rectangles with global offsets, each a view of its own memory (a tensor-parallel
shard, a ZeRO range of a flattened parameter: at most three rectangles) -- and DCP writes each chunk from
that view and, on load, reads into each view exactly the overlapping parts of the stored chunks. So a
checkpoint saved at any (tp, pp, virtual stages, dp, ZeRO stage, offload) loads at any other, and no rank
ever holds more than its own shard (plus one chunk being written). Replicas write once: tensor-parallel
duplicates from tp rank 0, data-parallel duplicates from dp rank 0, the last stage's head copy of the word
embeddings never (it loads from the word embeddings).

DCP's collectives run over the topology's checkpoint group (gloo), so an asynchronous save
(`AsyncSaves`) can write from a background thread while training uses the other groups.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import errno
import os
import threading
import traceback
import warnings
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException as DCPException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, \
    WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..config.settings import ModelConfig
from ..model.sharding import is_vocab_parallel, tp_partition_dim
from ..pinned import host_buffer
from .layout import HEAD, WORD, canonical_key, chunk_layout
from .common import (CHECKPOINT_VERSION, CHECKSUM, CheckpointError, atomic_torch_save, check_checksum, check_file,
                     check_same_model, file_checksum, get_rng_state, identity, load_file, loaded_line,
                     read_saved_config, read_tracker, restore_scheduler, set_rng_state)
from .formats import Parts
from .publish import published_dir, staged_iteration
from .stream import exact_storage

COMMON_FILE = "common.pt"
NAME = "torch_dist"     # common.pt's "format"


# ---- a rank's pieces of the global tensors -------------------------------------------------------
@dataclass
class Deferred:
    """A chunk's tensor made only when DCP writes it (conversions read one source tensor at a time)."""
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]


@dataclass
class Chunk:
    offsets: tuple[int, ...]      # where the chunk starts in the global tensor
    tensor: torch.Tensor | Deferred  # a view of this rank's memory; its shape is the chunk's size


@dataclass
class Entry:
    """This rank's part of one global tensor: zero or more disjoint chunks."""
    size: tuple[int, ...]
    dtype: torch.dtype
    chunks: list[Chunk]


def _rectangles(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The flattened range [lo, hi) of a row-major tensor of `shape` (1-D or 2-D) as rectangles:
    (offsets, sizes, start in the range). A 2-D range is a partial first row, whole rows, a partial
    last row."""
    if len(shape) == 1:
        return [((lo,), (hi - lo,), 0)] if hi > lo else []
    if len(shape) != 2:
        raise ValueError(f"torch_dist checkpoints hold 1-D and 2-D tensors, not shape {shape}")
    cols, out, pos = shape[1], [], lo
    while pos < hi:
        r, c = divmod(pos, cols)
        if c or hi - pos < cols:                       # a partial row
            n = min(cols - c, hi - pos)
            out.append(((r, c), (1, n), pos - lo))
        else:                                          # whole rows
            n = (hi - pos) // cols * cols
            out.append(((r, 0), (n // cols, cols), pos - lo))
        pos += n
    return out


class Placement:
    """Where this rank's shard of a parameter sits in the global tensor (tensor parallelism and the
    padded vocabulary), from its local key."""

    def __init__(self, local_key: str, local_shape: tuple[int, ...], tp: int, tp_rank: int, vocab_size: int):
        self.dim = tp_partition_dim(local_key)
        self.shape, self.vocab = tuple(local_shape), vocab_size if is_vocab_parallel(local_key) else None
        size = list(local_shape)
        if self.dim is not None:
            size[self.dim] *= tp
        if self.vocab is not None:
            size[0] = self.vocab
        self.size = tuple(size)
        self.shift = tp_rank * local_shape[self.dim] if self.dim is not None else 0

    def chunks(self, flat: torch.Tensor, lo: int, hi: int) -> list[Chunk]:
        """`flat` (a 1-D view) holds elements [lo, hi) of the flattened local shard: its chunks."""
        out = []
        for offsets, sizes, start in _rectangles(self.shape, lo, hi):
            view = flat[start:start + _numel(sizes)].view(sizes)
            glob = list(offsets)
            if self.dim is not None:
                glob[self.dim] += self.shift
            if self.vocab is not None:                 # drop the padded rows
                keep = min(sizes[0], self.vocab - glob[0])
                if keep <= 0:
                    continue
                view = view[:keep]
            out.append(Chunk(tuple(glob), view))
        return out


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


@dataclass
class Piece:
    """Elements [lo, hi) of the flattened local parameter `key`, held by this rank in `views`
    (1-D tensors of hi - lo elements; one per stored kind)."""
    key: str
    param: torch.nn.Parameter
    lo: int
    hi: int
    views: dict[str, torch.Tensor]


def model_pieces(model, sharded=None) -> list[Piece]:
    """This rank's model weights: every parameter whole, except ZeRO-3 layers' (`sharded`: the
    ShardedParams holding them; the owned range of each parameter in its unit's shard)."""
    units = sharded.unit_of() if sharded is not None else {}
    out = []
    for key, p in model.named_parameters():
        unit = units.get(id(p))
        if unit is None:
            out.append(Piece(key, p, 0, p.numel(), {"param": p.data.view(-1)}))
            continue
        off = unit.offsets[[id(q) for q in unit.params].index(id(p))]   # not list.index: == on tensors
        size = unit.numel // unit.dp
        a, z = max(off, unit.dp_rank * size), min(off + p.numel(), (unit.dp_rank + 1) * size)
        if a < z:
            s = unit.dp_rank * size
            out.append(Piece(key, p, a - off, z - off, {"param": unit.shard[a - s:z - s]}))
    return out


def optimizer_pieces(optimizer) -> list[Piece]:
    return [Piece(key, p, lo, hi, views) for key, p, lo, hi, views in optimizer.owned_state()]


class StateMap:
    """The global tensors of one rank's model (and optimizer) as DCP entries, by canonical name."""

    def __init__(self, model, optimizer, model_config: ModelConfig, topo, rank: int, sharded=None):
        c = topo.coord(rank)
        self.c, self.tp = c, topo.tp
        self.chunks = chunk_layout(model_config, topo.pp)[c.pp]
        self.vocab = model_config.vocab_size
        self.model, self.optimizer, self.sharded = model, optimizer, sharded
        self.units = sharded.unit_of() if sharded is not None else {}

    def canonical(self, key: str) -> str:
        if key == HEAD or key.endswith("." + HEAD):
            return WORD
        return canonical_key(key, self.chunks)

    def entries(self, for_save: bool, with_optim: bool) -> dict[str, Entry]:
        """{fqn: Entry}. For a save, each stored element comes from one rank only (replicas skip)."""
        out: dict[str, Entry] = {}
        groups = [(model_pieces(self.model, self.sharded), True)]   # replicated over dp but for ZeRO-3 layers' shards
        if with_optim:
            groups.append((optimizer_pieces(self.optimizer), not self.optimizer.is_distributed))
        for pieces, dp_replicated in groups:
            for pc in pieces:
                if for_save and self._replica(pc.key, dp_replicated, pc.param):
                    continue
                name = self.canonical(pc.key)
                place = Placement(pc.key, tuple(pc.param.shape), self.tp, self.c.tp, self.vocab)
                for kind, view in pc.views.items():
                    e = out.setdefault(fqn(name, kind), Entry(place.size, view.dtype, []))
                    e.chunks.extend(place.chunks(view, pc.lo, pc.hi))
        return out

    def _replica(self, key: str, dp_replicated: bool, param) -> bool:
        """Does another rank store the same elements (so this one skips them on save)?"""
        if key == HEAD or key.endswith("." + HEAD):
            return True
        if tp_partition_dim(key) is None and self.c.tp != 0:
            return True
        return dp_replicated and self.c.dp != 0 and id(param) not in self.units


# ---- DCP planners over Entries ---------------------------------------------------------------------
class _SavePlanner(DefaultSavePlanner):
    """Writes each Entry's chunks (a Deferred chunk is made when DCP writes it)."""

    def __init__(self, entries: dict[str, Entry]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.entries = entries

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, e in self.entries.items():
            props = TensorProperties(dtype=e.dtype)
            for ch in e.chunks:
                md = ChunkStorageMetadata(offsets=torch.Size(ch.offsets), sizes=torch.Size(ch.tensor.shape))
                items.append(WriteItem(index=MetadataIndex(key, torch.Size(ch.offsets)), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk=md, properties=props,
                                                                   size=torch.Size(e.size))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        for ch in self.entries[write_item.index.fqn].chunks:
            if tuple(ch.offsets) == tuple(write_item.index.offset):
                t = ch.tensor.make() if isinstance(ch.tensor, Deferred) else ch.tensor
                # DCP's writer clones a host view into a larger storage and keeps what it wrote
                # until the file ends: an alias of the view's memory costs nothing
                return exact_storage(t) if t.is_cpu and t.is_contiguous() else t
        raise KeyError(write_item.index)


class _LoadPlanner(DefaultLoadPlanner):
    """Reads into each Entry's chunk views whatever overlaps them in the stored chunks."""

    def __init__(self, entries: dict[str, Entry]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.entries = entries

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata
        items = []
        for key, e in self.entries.items():
            md = stored.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"torch_dist checkpoint lacks tensor {key}; it was saved from another model "
                                      f"(or without optimizer state: load with --no-load-optim)")
            if tuple(md.size) != tuple(e.size):
                raise CheckpointError(f"torch_dist checkpoint holds {key} at shape {tuple(md.size)}, this model "
                                      f"{tuple(e.size)}; use the checkpoint's model flags")
            local = [ChunkStorageMetadata(offsets=torch.Size(ch.offsets), sizes=ch.tensor.shape) for ch in e.chunks]
            items += create_read_items_for_chunk_list(key, md, local)
        self.plan = LoadPlan(items)
        return self.plan

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        for ch in self.entries[read_item.dest_index.fqn].chunks:
            if tuple(ch.offsets) == tuple(read_item.dest_index.offset):
                t = ch.tensor
                for dim, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                    t = t.narrow(dim, o, n)
                return t
        raise KeyError(read_item.dest_index)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass                                            # the views were written in place


# ---- save ---------------------------------------------------------------------------------------
def fqn(name: str, kind: str = "param") -> str:
    """The stored key of canonical tensor `name`: `model.<name>`, or `optim.<name>.<kind>`."""
    return f"model.{name}" if kind == "param" else f"optim.{name}.{kind}"


def common_record(args: argparse.Namespace, model_config: ModelConfig, iteration: int | str, layout: dict,
                  scheduler_state: Optional[dict], optim: Optional[dict], rng: Optional[list]) -> dict:
    """common.pt: `layout` {tp, pp, dp, virtual} of the saving run, `optim` {step, grad_scaler,
    param_groups} (None: no optimizer state), `rng` every rank's RNG state in rank order (or None)."""
    return {"format": NAME, "args": args, "model_config": asdict(model_config),
            "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration, "layout": layout,
            "opt_param_scheduler": scheduler_state, "optimizer": optim, "rng_state": rng}


def _gather_rng(group, save_rng: bool) -> Optional[list]:
    """Every rank's RNG state, in rank order, on every rank (small: a few KB each)."""
    if not save_rng:
        return None
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, get_rng_state(), group=group)
    return out


# Files each rank writes in parallel (DCP's thread_count): one writer thread, serialising and writing
# one tensor at a time, leaves a fast disk idle part of the time; several keep more I/O in flight.
WRITE_THREADS = 4


def save_entries(entries: dict[str, Entry], folder: str, process_group) -> None:
    """DCP-save `entries` (this rank's chunks) into `folder`, collectively over `process_group`
    (None: this process alone), in up to WRITE_THREADS files per rank written by as many threads.
    Each file is synced before DCP writes its .metadata."""
    writer = dcp.FileSystemWriter(folder, sync_files=True, thread_count=WRITE_THREADS)
    with _quiet(process_group), _writer_thread_errors() as thread_errors:
        try:
            dcp.save({}, storage_writer=writer, planner=_SavePlanner(entries),
                     process_group=process_group, no_dist=process_group is None)
        except DCPException as e:   # a BaseException: hand the rank's own error (ENOSPC, ...) to the publisher
            cause = _full_disk(_cause(e), folder)
            raise cause if isinstance(cause, Exception) else RuntimeError(str(cause)) from None
    if thread_errors:               # a file of DCP's extra writer threads failed: the save is incomplete
        raise _full_disk(thread_errors[0], folder)


def _full_disk(error: BaseException, folder: str, slack: int = 1 << 20) -> BaseException:
    """`error`, or ENOSPC when it carries no errno and the file system of `folder` has less than
    `slack` bytes left: torch's zip writer reports a short write on a full disk as "unexpected pos"."""
    if isinstance(error, OSError):
        return error
    try:
        st = os.statvfs(folder)
    except OSError:
        return error
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if st.f_bavail * st.f_frsize < slack else error


@contextlib.contextmanager
def _writer_thread_errors() -> Iterator[list[BaseException]]:
    """The errors of DCP's extra writer threads (they write files beside the calling thread and
    end on an uncaught exception: Python would print its traceback, and DCP would go on to write an
    index of an incomplete save). Collected here instead; other threads' errors go to the hook
    they had."""
    errors: list[BaseException] = []
    previous = threading.excepthook

    def hook(args) -> None:
        frames = traceback.extract_tb(args.exc_traceback) if args.exc_traceback else []
        if any(f.name == "_write_files_from_queue" for f in frames) and args.exc_value is not None:
            errors.append(args.exc_value)
        else:
            previous(args)

    threading.excepthook = hook
    try:
        yield errors
    finally:
        # a failed save returns while writer threads may still be writing: they end (and fail) here
        for t in threading.enumerate():
            if t is not threading.current_thread() and "_write_files_from_queue" in t.name:
                t.join(timeout=60)
        threading.excepthook = previous


@contextlib.contextmanager
def _quiet(process_group) -> Iterator[None]:
    """DCP logs each failure with its traceback (load_entries turns it into one line instead) and
    warns on every single-process call that it assumes one process (that is the intent)."""
    from torch.distributed.checkpoint import logger as dcp_logging
    log = getattr(dcp_logging, "_dcp_logger", None)
    level = log.level if log is not None else None
    root = logging.getLogger()      # DCP's loader logs its fallbacks, with tracebacks, on the root logger
    with warnings.catch_warnings():
        if process_group is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        if log is not None:
            log.setLevel(logging.CRITICAL)
        root.addFilter(_not_dcp)
        try:
            yield
        finally:
            root.removeFilter(_not_dcp)
            if log is not None:
                log.setLevel(level)


def _not_dcp(record: logging.LogRecord) -> bool:
    return "distributed/checkpoint" not in record.pathname.replace(os.sep, "/")


def load_entries(entries: dict[str, Entry], folder: str, process_group) -> None:
    """Fill every chunk view of `entries` from the checkpoint in `folder` (collective over
    `process_group`; None: this process alone). One CheckpointError line for a missing tensor, a
    shape that differs, or unreadable files."""
    try:
        with _quiet(process_group):
            dcp.load({}, storage_reader=dcp.FileSystemReader(folder), planner=_LoadPlanner(entries),
                     process_group=process_group, no_dist=process_group is None)
    except CheckpointError:
        raise
    except (Exception, DCPException) as e:  # DCP wraps each rank's failure (not an Exception): one line
        cause = _cause(e)
        if isinstance(cause, CheckpointError):
            raise cause from None
        lines = [line for line in str(cause).strip().splitlines() if line.strip()]
        why = f"{type(cause).__name__}: {lines[-1][:200] if lines else ''}"
        bad = damaged_file(folder)
        what = bad or f"checkpoint {folder} could not be read ({why})"
        raise CheckpointError(f"torch_dist {what}; the checkpoint is incomplete or corrupt: load an earlier "
                              f"iteration") from None


def damaged_file(folder: str) -> Optional[str]:
    """What is wrong with the first damaged file of the torch_dist checkpoint in `folder` -- "file
    PATH is missing", "... is truncated (N of M bytes)", or its index unreadable -- or None when
    every file is there at the size its .metadata says."""
    meta = os.path.join(folder, ".metadata")
    if not os.path.isfile(meta):
        return f"file {meta} is missing"
    try:
        storage = dcp.FileSystemReader(folder).read_metadata().storage_data or {}
    except Exception as e:  # truncated or not DCP's
        return f"file {meta} could not be read ({type(e).__name__})"
    need: dict[str, int] = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name in sorted(need):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"file {path} is missing"
        if os.path.getsize(path) < need[name]:
            return f"file {path} is truncated ({os.path.getsize(path)} of {need[name]} bytes)"
    return None


def _cause(e: BaseException) -> BaseException:
    """The underlying error of a DCP failure. DCP wraps each rank's failure in CheckpointException:
    {rank: (exception, its frames)} (torch 2.4+), or {rank: exception} (older)."""
    failures = getattr(e, "failures", None)
    if not failures:
        return e
    first = next(iter(failures.values()))
    return first[0] if isinstance(first, tuple) and first and isinstance(first[0], BaseException) else first


def _write(root: str, iteration: int, entries: dict[str, Entry], common: dict, group, rank: int,
           announce: bool = False) -> None:
    """Collective over `group`: every rank's chunks into the staging folder, then common.pt (rank 0)
    with each file's size and checksum (every rank sums its own files); published by rank 0 (folder,
    then tracker) once every rank's files are complete and synced (publish.py)."""
    with staged_iteration(root, iteration, rank, group) as staging:
        error, sums = None, {}
        try:
            save_entries(entries, staging, group)
            sums = _own_files(staging, dist.get_rank(group))
        except Exception as e:  # raised after the gather below, which every rank must join
            error = e
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, sums, group=group)
        if error is not None:
            raise error
        if rank == 0:
            files = {name: n_sum for mine in every for name, n_sum in mine.items()}
            atomic_torch_save({**common, "files": files, "checksum": CHECKSUM}, os.path.join(staging, COMMON_FILE))
    if rank == 0 and announce:
        print(f"  successfully saved checkpoint at iteration {iteration:7d} to {root} (in the background)", flush=True)


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, args: argparse.Namespace,
                    model_config: ModelConfig, topo, rank: int, save_optim: bool = True, save_rng: bool = True,
                    saves: Optional["AsyncSaves"] = None, sharded=None, run_id: Optional[str] = None) -> None:
    """Collective: every rank writes what it owns. With `saves` (--async-save) the state is copied to
    host memory and written in the background; the call returns once the copy is made. `sharded`:
    the ZeRO-3 ShardedParams holding the layers' weights."""
    group = topo.groups.ckpt
    if saves is not None:
        saves.wait()        # the writer thread uses `group`: no collective on it until that save is done
    with_optim = save_optim and optimizer is not None
    entries = StateMap(model, optimizer, model_config, topo, rank, sharded).entries(for_save=True,
                                                                                    with_optim=with_optim)
    optim = {"step": optimizer.step_count(), "grad_scaler": optimizer.scaler.state_dict(),
             "param_groups": optimizer.saved_param_groups()} if with_optim else None
    layout = {"tp": topo.tp, "pp": topo.pp, "dp": topo.dp, "virtual": model_config.virtual_pipeline_model_parallel_size}
    common = common_record(args, model_config, iteration, layout, scheduler.state_dict() if scheduler else None,
                           optim, _gather_rng(group, save_rng))
    common["identity"] = identity(run_id, iteration)
    if saves is None:
        _write(root, iteration, entries, common, group, rank)
    else:
        saves.submit(lambda staged: _write(root, iteration, staged, common, group, rank, announce=True), entries)


def reserve_async_buffers(saves: "AsyncSaves", model, optimizer, model_config: ModelConfig, topo, rank: int,
                          save_optim: bool, sharded=None) -> float:
    """Allocate `saves`' host buffers for what this rank will save; returns their GiB."""
    with_optim = save_optim and optimizer is not None
    return saves.reserve(StateMap(model, optimizer, model_config, topo, rank, sharded).entries(True, with_optim))


class AsyncSaves:
    """--async-save: at most one save in flight. `submit` copies the chunks into host buffers (pinned
    on GPU machines; one allocation at the first save, reused by every later save: the chunks of a
    run never change) and starts the writer thread;
    `wait` joins it and raises its error, if any, on the calling thread."""

    def __init__(self, device: torch.device):
        self.pin = device.type == "cuda"
        self.buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None

    def reserve(self, entries: dict[str, Entry]) -> float:
        """Allocate the host buffers now (before training: pinning takes seconds). Returns GiB."""
        if not self.buffers:
            self._allocate(entries)
        return sum(b.numel() * b.element_size() for b in self.buffers.values()) / 2**30

    def submit(self, write: Callable[[dict[str, Entry]], None], entries: dict[str, Entry]) -> None:
        self.wait()                                  # the previous save must be complete first
        if not self.buffers:
            self._allocate(entries)
        staged = {name: Entry(e.size, e.dtype, [Chunk(ch.offsets, self._copy(name, ch)) for ch in e.chunks])
                  for name, e in entries.items()}
        if self.pin:
            torch.cuda.synchronize()                 # the copies are complete before training goes on

        def run() -> None:
            try:
                write(staged)
            except BaseException as e:  # reported by wait() on the training thread
                self.error = e

        self.thread = threading.Thread(target=run, name="megapar-async-save", daemon=True)
        self.thread.start()

    def _allocate(self, entries: dict[str, Entry]) -> None:
        """One host allocation for every chunk (pinning is paid once, not per tensor)."""
        chunks = [(name, ch) for name, e in entries.items() for ch in e.chunks]
        sizes = [-(-ch.tensor.numel() * ch.tensor.element_size() // 64) * 64 for _, ch in chunks]   # 64-B aligned
        flat = host_buffer(sum(sizes), torch.uint8, pinned=self.pin)                              # [bytes]
        pos = 0
        for (name, ch), size in zip(chunks, sizes):
            n = ch.tensor.numel() * ch.tensor.element_size()
            self.buffers[(name, ch.offsets)] = flat[pos:pos + n].view(ch.tensor.dtype).view(ch.tensor.shape)
            pos += size

    def _copy(self, name: str, ch: Chunk) -> torch.Tensor:
        buf = self.buffers[(name, ch.offsets)]
        buf.copy_(ch.tensor, non_blocking=self.pin)
        return buf

    @property
    def in_flight(self) -> bool:
        return self.thread is not None

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            e, self.error = self.error, None
            if isinstance(e, CheckpointError):
                raise e
            raise CheckpointError(f"the background checkpoint save failed ({type(e).__name__}: {e})") from e


def _own_files(folder: str, group_rank: int) -> dict[str, tuple[int, int]]:
    """(bytes, checksum) of the files this rank wrote into `folder`: DCP's __{rank}_{i}.distcp, and
    its .metadata on the coordinator (group rank 0). Read back once they are synced (from the page
    cache; file_checksum runs its own threads)."""
    names = [n for n in os.listdir(folder) if n.startswith(f"__{group_rank}_") and n.endswith(".distcp")]
    names = sorted(names + ([".metadata"] if group_rank == 0 else []))
    return {name: file_checksum(os.path.join(folder, name)) for name in names}


def check_files(folder: str, common: dict, iteration, group, rank: int) -> None:
    """Collective over `group`: every file of the torch_dist checkpoint in `folder` is the one saved
    with its common.pt -- the identity of this iteration, each file's size (every rank), each file's
    checksum (the files split among the ranks: one pass over each) -- or every rank raises the first
    problem's line. Checkpoints saved before identities are not checked."""
    ident, files = common.get("identity"), common.get("files")
    if ident is None or files is None:
        return
    path = os.path.join(folder, COMMON_FILE)
    line = None
    world, me = (dist.get_world_size(group), dist.get_rank(group)) if dist.is_initialized() else (1, 0)
    try:
        if iteration != "release" and (ident["iteration"], common["iteration"]) != (iteration, iteration):
            raise CheckpointError(f"checkpoint file {path} is of iteration {ident['iteration']}, its folder of "
                                  f"{iteration}: it was copied from another iteration; put back the file saved "
                                  f"with it, or load an earlier iteration")
        present = {n for n in os.listdir(folder) if n == ".metadata" or n.endswith(".distcp")}
        kind, mine = common.get("checksum", "crc32"), []     # crc32: the first identities' common.pt
        for i, name in enumerate(sorted(set(files) | present)):
            saved = None if name not in files else {"bytes": files[name][0], kind: files[name][1]}
            check_file(folder, name, saved, verify=False)
            if i % world == me:
                mine.append((os.path.join(folder, name), saved))
        for file, saved in mine:
            check_checksum(file, saved)
    except CheckpointError as e:
        line = str(e)
    lines = [line]
    if world > 1:
        lines = [None] * world
        dist.all_gather_object(lines, line, group=group)
    first = next((x for x in lines if x is not None), None)
    if first is not None:
        raise CheckpointError(first)


# ---- load ---------------------------------------------------------------------------------------
def read_common(folder: str) -> dict:
    path = os.path.join(folder, COMMON_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"torch_dist checkpoint file {path} is missing; the checkpoint is incomplete: "
                              f"load an earlier iteration")
    common = load_file(path)
    if common.get("format") != NAME:
        raise CheckpointError(f"{path} is not a megapar torch_dist record (format={common.get('format')!r})")
    return common


def load_checkpoint(root: str, model, optimizer, scheduler, model_config: ModelConfig, topo, rank: int,
                    load_optim: bool = True, load_rng: bool = True, finetune: bool = False,
                    sharded=None, found: Optional[dict] = None) -> tuple[int, int]:
    """Collective: every rank reads what it owns at this run's layout, whatever the saved layout,
    once every file is checked against common.pt (check_files). Returns (iteration,
    consumed_train_samples); (0, 0) with `finetune`. `sharded`: as for a save; `found`: as legacy's."""
    iteration = read_tracker(root)
    folder = published_dir(root, iteration)
    common = read_common(folder)
    saved = read_saved_config(common, os.path.join(folder, COMMON_FILE))
    check_same_model(saved, model_config, folder)
    restore_optim = load_optim and not finetune and optimizer is not None
    if restore_optim and common["optimizer"] is None:
        raise CheckpointError(f"checkpoint {folder} has no optimizer state (saved with --no-save-optim); "
                              f"load it with --no-load-optim or --finetune")
    entries = StateMap(model, optimizer, model_config, topo, rank, sharded).entries(for_save=False,
                                                                                    with_optim=restore_optim)
    check_files(folder, common, iteration, topo.groups.ckpt, rank)
    load_entries(entries, folder, topo.groups.ckpt)
    if found is not None and common.get("identity") is not None:
        found["run_id"] = common["identity"]["run_id"]
    if restore_optim:
        optimizer.finish_load(int(common["optimizer"]["step"]), common["optimizer"]["grad_scaler"])
        if scheduler is not None and common["opt_param_scheduler"] is not None:
            restore_scheduler(scheduler, common["opt_param_scheduler"], folder, rank)
    _restore_rng(common, topo, rank, load_rng and not finetune)
    if rank == 0:
        print(loaded_line(root, common['iteration'], finetune), flush=True)
    if finetune:
        return 0, 0
    return int(common["iteration"]), int(getattr(common["args"], "consumed_train_samples", 0))


def _restore_rng(common: dict, topo, rank: int, wanted: bool) -> None:
    """Each rank's RNG state, when the checkpoint was saved at this very layout (elsewhere the ranks
    do not correspond; dropout then draws new masks, as after a legacy reshard)."""
    layout = common["layout"]
    if wanted and common["rng_state"] is not None and (layout["tp"], layout["pp"], layout["dp"]) == \
            (topo.tp, topo.pp, topo.dp):
        set_rng_state(common["rng_state"][rank])


class DistFormat:
    """`--ckpt-format torch_dist` (formats.Format): every rank writes what it owns, loadable at any layout;
    the one format that saves in the background (`saves`)."""
    name = NAME

    def holds(self, folder: str) -> bool:
        """Any of its files says so (common.pt, DCP's .metadata or a .distcp data file), so a torch_dist
        folder that lost one of them is reported as an incomplete torch_dist checkpoint, not as a legacy one."""
        names = os.listdir(folder) if os.path.isdir(folder) else []
        return any(n in (COMMON_FILE, ".metadata") or n.endswith(".distcp") for n in names)

    def save(self, root: str, iteration: int, parts: Parts, args: argparse.Namespace, *, save_optim: bool = True,
             save_rng: bool = True, run_id: Optional[str] = None, saves: Optional[AsyncSaves] = None) -> None:
        save_checkpoint(root, iteration, parts.model, parts.optimizer, parts.scheduler, args, parts.model_config,
                        parts.topo, parts.rank, save_optim, save_rng, saves, parts.sharded, run_id)

    def load(self, root: str, parts: Parts, *, load_optim: bool = True, load_rng: bool = True,
             finetune: bool = False, found: Optional[dict] = None) -> tuple[int, int]:
        return load_checkpoint(root, parts.model, parts.optimizer, parts.scheduler, parts.model_config, parts.topo,
                               parts.rank, load_optim, load_rng, finetune, parts.sharded, found)


FORMAT = DistFormat()


__all__ = ["AsyncSaves", "COMMON_FILE", "Chunk", "Deferred", "DistFormat", "Entry", "FORMAT", "common_record", "fqn",
           "load_checkpoint", "load_entries", "read_common", "reserve_async_buffers", "save_checkpoint",
           "save_entries"]
