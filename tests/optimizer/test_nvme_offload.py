"""--optimizer-nvme-offload: the master and moment shards in files, stepped a chunk at a time
(megapar/optimizer/nvme.py), give the bits of --optimizer-cpu-offload (losses, saved weights and
optimizer state), checkpoints move between the two, and the state files are gone after the run."""
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from distributed import run_distributed
from train_helpers import TINY_TRAIN

ITERS, STOP = 4, 2


CHUNK = 20_000   # elements per streamed chunk in these runs: many chunks per bucket, the embeddings alone


def _body(rank, world_size, argv, cpu_offload):
    """pretrain; CPU offload is refused on a CPU-only run at the command line, so it is switched on
    after validation (as tests/optimizer/test_zero_stages.py does); NVMe offload comes as its flag, streamed
    in chunks of CHUNK elements (the tiny model would otherwise be one chunk per bucket). Returns
    the losses, the last iteration and the (rank 0) log."""
    import contextlib
    import io
    import megapar.optimizer.distrib_optimizer as distrib
    from megapar.pretrain_gpt2 import parse
    from megapar.run.pretrain import pretrain
    distrib.CHUNK_NUMEL = CHUNK
    cfg = parse(argv, world_size)
    cfg.parallel.optimizer_cpu_offload = cpu_offload
    with contextlib.redirect_stdout(io.StringIO()) as log:
        state = pretrain(cfg)
    return {"losses": [loss for _, loss in state.losses], "iteration": state.iteration, "log": log.getvalue()}


def train(argv, nvme=None, world=2):
    """Rank 0's result of a dp-`world` run, with CPU offload or (given `nvme`, a folder) NVMe offload."""
    argv = list(argv) + (["--optimizer-nvme-offload", str(nvme)] if nvme is not None else [])
    return run_distributed(_body, world, args=(argv, nvme is None))[0]


def saved_tensors(ck) -> dict:
    """Every tensor of a legacy checkpoint's files, keyed by file and path in the state."""
    out = {}
    for root, _, files in os.walk(ck):
        for f in files:
            if f.endswith(".pt"):
                flat(torch.load(os.path.join(root, f), map_location="cpu", weights_only=False),
                     os.path.relpath(os.path.join(root, f), ck), out)
    return out


def flat(tree, key, out):
    if isinstance(tree, torch.Tensor):
        out[key] = tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            flat(v, f"{key}/{k}", out)


@pytest.fixture
def nvme_dir(tmp_path):
    """A folder with a file of the user's that the runs must leave alone."""
    d = tmp_path / "nvme"
    d.mkdir()
    (d / "users_file").write_text("mine")
    return d


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_nvme_offload_is_bit_identical_to_cpu_offload(embedded_data, tmp_path, nvme_dir, stage):
    """dp 2: the same losses and the same saved weights, masters and moments, bit for bit; the
    rank folders are removed at the end and the user's file stays. The log names the I/O (once)
    and each iteration line the step's NVMe transfer rate."""
    base = TINY_TRAIN + embedded_data + ["--train-iters", str(ITERS), "--zero-stage", str(stage)]
    cpu = train(base + ["--save", str(tmp_path / "cpu")])
    nvme = train(base + ["--save", str(tmp_path / "nvme_ck")], nvme=nvme_dir)
    assert nvme["losses"] == cpu["losses"] and len(cpu["losses"]) == ITERS
    a, b = saved_tensors(tmp_path / "cpu"), saved_tensors(tmp_path / "nvme_ck")
    assert a.keys() == b.keys() and any("exp_avg_sq" in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
    assert sorted(os.listdir(nvme_dir)) == ["users_file"] and (nvme_dir / "users_file").read_text() == "mine"
    assert len(re.findall(r"NVMe offload to \S+ via (O_DIRECT|buffered I/O)", nvme["log"])) == 1
    rates = [float(r) for r in re.findall(r"nvme I/O \(GB/s\): ([0-9.]+) \|", nvme["log"])]
    assert rates and all(r > 0 for r in rates) and "nvme I/O" not in cpu["log"]


@pytest.fixture(scope="module")
def uninterrupted(embedded_data):
    base = TINY_TRAIN + embedded_data + ["--train-iters", str(ITERS), "--zero-stage", "1"]
    return base, train(base)["losses"]


@pytest.mark.parametrize("fmt,save_nvme", [("torch_dist", True), pytest.param("torch", False, marks=pytest.mark.slow),
                                           pytest.param("torch_dist", False, marks=pytest.mark.slow),
                                           pytest.param("torch", True, marks=pytest.mark.slow)])
def test_resume_between_nvme_and_cpu_offload(uninterrupted, tmp_path, nvme_dir, fmt, save_nvme):
    """Saved with one offload at iteration STOP, resumed with the other: the uninterrupted losses."""
    base, full = uninterrupted
    ck = str(tmp_path / "ck")
    first = train(base + ["--exit-interval", str(STOP), "--save", ck, "--ckpt-format", fmt],
                  nvme=nvme_dir if save_nvme else None)
    second = train(base + ["--load", ck], nvme=None if save_nvme else nvme_dir)
    assert second["iteration"] == ITERS
    assert first["losses"] + second["losses"] == full
    assert sorted(os.listdir(nvme_dir)) == ["users_file"]


# ---- the storage object alone -------------------------------------------------------------------
def test_stream_reads_updates_and_writes_each_range(tmp_path):
    """Each range's three kinds come in host slots, are changed in place and land in the files (seen
    through the memory maps); two slots serve any number of ranges; close() removes only its files."""
    from megapar.optimizer.nvme import KINDS, NvmeState
    state = NvmeState(str(tmp_path), 3, numel=10)
    folder = tmp_path / "rank_00003"
    assert sorted(os.listdir(folder)) == sorted(f"{k}.bin" for k in KINDS)
    state.mapped["master_param"].copy_(torch.arange(10, dtype=torch.float32))
    assert all(state.mapped[k].eq(0).all() for k in KINDS[1:])       # moments start at zero
    seen = []

    def update(i, s):
        seen.append((i, s["master_param"].clone()))
        s["master_param"].mul_(2)
        s["exp_avg"].fill_(i + 1)
        s["exp_avg_sq"].add_(s["master_param"])

    ranges = [(0, 4), (4, 3), (7, 3)]
    state.stream(ranges, update)
    assert [i for i, _ in seen] == [0, 1, 2] and torch.equal(seen[1][1], torch.tensor([4., 5., 6.]))
    assert torch.equal(state.mapped["master_param"], 2 * torch.arange(10, dtype=torch.float32))
    assert state.mapped["exp_avg"].tolist() == [1.] * 4 + [2.] * 3 + [3.] * 3
    assert torch.equal(state.mapped["exp_avg_sq"], state.mapped["master_param"])
    state.close()
    assert not folder.exists() and os.listdir(tmp_path) == []


def test_folder_checks(tmp_path):
    """An existing rank folder (never reused) and a disk without room are refused by name."""
    from megapar.config.settings import ConfigError
    from megapar.optimizer.nvme import check_folder
    check_folder(str(tmp_path), 0, need=1000, ranks_on_host=2)
    (tmp_path / "rank_00001").mkdir()
    with pytest.raises(ConfigError, match="rank_00001 already exists.*remove it or give another folder"):
        check_folder(str(tmp_path), 1, need=1000, ranks_on_host=2)
    with pytest.raises(ConfigError, match="GiB free, but the optimizer state of the 8 rank.*larger disk"):
        check_folder(str(tmp_path), 0, need=2**62, ranks_on_host=8)


def test_chunked_stream_steps_like_cpu_offload_in_process(tmp_path):
    """dp 1 in this process, several buckets, chunks of whole parts no larger than the limit (or one
    part) within a bucket: three steps give CPU offload's masters, moments and weights bit for bit."""
    from gpt_helpers import batch
    from test_distrib_optimizer import TRAIN, _model
    from megapar.config.settings import TrainConfig
    from megapar.optimizer.distrib_optimizer import DistributedOptimizer
    from megapar.optimizer.grad_buffer import GradBuffer
    from megapar.optimizer.grad_scaler import ConstantGradScaler

    def build(**offload):
        model = _model()
        buf = GradBuffer(model.parameters(), None, mode="reduce_scatter", bucket_numel=3000)
        return model, buf, DistributedOptimizer(model, buf, TrainConfig(**TRAIN), ConstantGradScaler(), tp_rank=0,
                                                dp_group=None, **offload)

    runs = [build(offload=True), build(nvme_root=str(tmp_path))]
    nvme = runs[1][2]
    nvme.chunks = nvme._plan_chunks(1000)
    sizes = [c.hi - c.lo for c in nvme.chunks]
    assert len(nvme.chunks) > len(nvme.shards) and max(sizes) > 1000          # cut, and a big part alone
    assert all(s <= 1000 or len(c.members) == 1 for s, c in zip(sizes, nvme.chunks))
    assert sorted(j for c in nvme.chunks for j, _ in c.members) == list(range(len(nvme.parts)))
    for it in range(3):
        ids, labels = batch(b=2, seed=it)
        for model, buf, opt in runs:
            buf.start_step()
            model(ids, labels=labels).mean().backward()
            buf.finish()
            assert opt.step()[0]
    (cpu_model, _, cpu), (nvme_model, _, _) = runs
    for a, b in ((cpu.master_shard, nvme.master_shard), (cpu.exp_avg, nvme.exp_avg), (cpu.exp_avg_sq, nvme.exp_avg_sq)):
        assert torch.equal(a, b)
    assert all(torch.equal(p, q) for p, q in zip(cpu_model.parameters(), nvme_model.parameters()))
    assert nvme._step_count() == 3
    nvme.close()
    assert os.listdir(tmp_path) == []


def test_files_are_allocated_and_a_full_disk_while_making_them_is_one_line(tmp_path, monkeypatch):
    """The state files hold their blocks from the start (no sparse file to fail a later write); a
    disk that fills up while they are made (injected ENOSPC) is a ConfigError, and nothing is left."""
    import errno
    from megapar.config.settings import ConfigError
    from megapar.optimizer.nvme import NvmeState
    state = NvmeState(str(tmp_path), 0, numel=300_000)
    assert all(os.stat(p).st_blocks * 512 >= 4 * 300_000 for p in state.paths)
    state.close()

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ConfigError, match="the disk filled up while this rank's optimizer state files were made"):
        NvmeState(str(tmp_path), 0, numel=10)
    assert os.listdir(tmp_path) == []


# ---- direct I/O: unaligned ranges, shared edge blocks, the buffered fallback --------------------
NUMEL = 12_500   # a little over 12 blocks of fp32
# Element ranges (1024 elements per block): from a block's start to mid-block; within one block, sharing
# it with both neighbours; across several blocks (several pieces with PIECE_BYTES at two blocks);
# another shared edge; after an untouched gap, smaller than a block; ending at a block boundary.
RANGES = [(0, 1500), (1500, 10), (1510, 6000), (7510, 500), (8200, 300), (8500, 3788)]


def _stream_matches_reference(state, monkeypatch) -> None:
    """Random state, then a stream adding (range index + 1) to each kind of each range: the files
    and `mapped` equal the same update done in memory (untouched bytes included)."""
    import megapar.optimizer.nvme as nvme
    monkeypatch.setattr(nvme, "PIECE_BYTES", 2 * nvme.ALIGN)
    g = torch.Generator().manual_seed(0)
    expected = {k: torch.randn(NUMEL, generator=g) for k in nvme.KINDS}
    for k in nvme.KINDS:
        state.mapped[k].copy_(expected[k])
    seen = []

    def update(i, s):
        off, n = RANGES[i]
        seen.append(all(torch.equal(s[k], expected[k][off:off + n]) for k in nvme.KINDS))
        for t in s.values():
            t.add_(i + 1)
    state.stream(RANGES, update)
    for i, (off, n) in enumerate(RANGES):
        for t in expected.values():
            t[off:off + n] += i + 1
    assert seen == [True] * len(RANGES)
    for k, path in zip(nvme.KINDS, state.paths):
        assert torch.equal(torch.from_numpy(np.fromfile(path, dtype=np.float32)), expected[k]), k
        assert torch.equal(state.mapped[k], expected[k]), k
    state.close()


def test_unaligned_ranges_stream_through_direct_io(tmp_path, monkeypatch):
    """Where the file system takes O_DIRECT, the aligned interiors go through it (the kernel refuses
    unaligned offsets or addresses, so a misplaced slot fails here) and the edges are buffered."""
    from megapar.optimizer.nvme import NvmeState
    state = NvmeState(str(tmp_path), 0, numel=NUMEL)
    if not state.direct_fds:
        state.close()
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT")
    assert state.io_mode.startswith("O_DIRECT")
    _stream_matches_reference(state, monkeypatch)


def test_a_file_system_refusing_o_direct_streams_buffered(tmp_path, monkeypatch):
    """O_DIRECT refused at open (EINVAL, as tmpfs or some network file systems): every transfer is
    buffered, the log text says so, and the same streams give the same bytes."""
    import errno
    from megapar.optimizer.nvme import NvmeState
    real_open = os.open

    def no_direct(path, flags, *mode):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *mode)
    monkeypatch.setattr(os, "open", no_direct)
    state = NvmeState(str(tmp_path), 0, numel=NUMEL)
    assert state.direct_fds == [] and "refuses O_DIRECT" in state.io_mode
    _stream_matches_reference(state, monkeypatch)


def test_pieces_cover_the_range_exactly_with_aligned_direct_ones():
    """In order, contiguous, no longer than PIECE_BYTES; every aligned byte inside goes directly."""
    from megapar.optimizer.nvme import ALIGN, PIECE_BYTES, _pieces
    for a, b in [(0, 4), (100, 200), (100, 3 * ALIGN + 8), (ALIGN, 5 * ALIGN), (10, 2 * PIECE_BYTES + ALIGN + 3)]:
        pieces = _pieces(a, b, direct=True)
        assert [p[1] for p in pieces] == [a] + [p[2] for p in pieces[:-1]] and pieces[-1][2] == b
        assert all(lo % ALIGN == 0 and hi % ALIGN == 0 for d, lo, hi in pieces if d)
        assert all(hi - lo <= PIECE_BYTES for _, lo, hi in pieces)
        interior = b // ALIGN * ALIGN - -(-a // ALIGN) * ALIGN         # the aligned bytes inside [a, b)
        assert sum(hi - lo for d, lo, hi in pieces if d) == max(interior, 0)
    assert _pieces(100, 3 * ALIGN + 8, direct=False) == [(False, 100, 3 * ALIGN + 8)]
    assert _pieces(100, 200, direct=True) == [(False, 100, 200)]


def test_stream_stats_count_the_bytes_moved(tmp_path):
    """last_stats: 3 kinds x 4 B x each range's elements, read and written, over positive seconds."""
    from megapar.optimizer.nvme import NvmeState
    state = NvmeState(str(tmp_path), 0, numel=NUMEL)
    assert state.last_stats.nbytes == 0 and state.last_stats.gb_per_s == 0
    state.stream(RANGES, lambda i, s: None)
    stats = state.last_stats
    assert stats.nbytes == 2 * 3 * 4 * sum(n for _, n in RANGES)
    assert 0 < stats.busy_s <= stats.wall_s and stats.gb_per_s > 0
    state.close()


def test_page_aligned_host_buffers():
    """O_DIRECT's memory alignment: anonymous pages, zero-filled, at any size (megapar/pinned.py)."""
    from megapar.pinned import host_buffer
    for numel in (1, 1000, 5000):
        t = host_buffer(numel, torch.float32, pinned=False, page_aligned=True)
        assert t.data_ptr() % 4096 == 0 and t.numel() == numel and t.eq(0).all()


def test_the_benchmark_measures_the_disk_through_o_direct(tmp_path, monkeypatch):
    """benchmarks/bench_nvme_offload.py's O_DIRECT measurement: two positive rates (or None where
    refused), and its file is gone after."""
    import importlib
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    bench = importlib.import_module("bench_nvme_offload")
    rates = bench.direct_speed(str(tmp_path), mib=8)
    assert rates is None or (len(rates) == 2 and min(rates) > 0)
    assert os.listdir(tmp_path) == []


def test_a_file_system_refusing_direct_transfers_after_open_is_probed(tmp_path, monkeypatch):
    """Some file systems take O_DIRECT at open and refuse the transfers (EINVAL): the probe's first
    aligned read finds it, closes the descriptor, and the state falls back to buffered I/O."""
    import errno
    from megapar.optimizer import nvme
    closed = []
    real_close = os.close

    def refuse(fd, buffers, offset):
        raise OSError(errno.EINVAL, "Invalid argument")
    monkeypatch.setattr(os, "preadv", refuse)
    monkeypatch.setattr(os, "close", lambda fd: (closed.append(fd), real_close(fd)))
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(2 * nvme.ALIGN))
    assert nvme._open_direct(str(path)) is None and len(closed) == 1
