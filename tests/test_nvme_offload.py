"""--optimizer-nvme-offload: the master and moment shards in files, stepped a chunk at a time
(megapar/optimizer/nvme.py), give the bits of --optimizer-cpu-offload (losses, saved weights and
optimizer state), checkpoints move between the two, and the state files are gone after the run."""
import os

import pytest
import torch

from distributed import run_distributed
from train_helpers import TINY_TRAIN

ITERS, STOP = 4, 2


CHUNK = 20_000   # elements per streamed chunk in these runs: many chunks per bucket, the embeddings alone


def _body(rank, world_size, argv, cpu_offload):
    """pretrain; CPU offload is refused on a CPU-only run at the command line, so it is switched on
    after validation (as tests/test_zero_stages.py does); NVMe offload comes as its flag, streamed
    in chunks of CHUNK elements (the tiny model would otherwise be one chunk per bucket)."""
    import megapar.optimizer.distrib_optimizer as distrib
    from megapar.pretrain_gpt2 import parse
    from megapar.run.pretrain import pretrain
    distrib.CHUNK_NUMEL = CHUNK
    cfg = parse(argv, world_size)
    cfg.parallel.optimizer_cpu_offload = cpu_offload
    state = pretrain(cfg)
    return {"losses": [loss for _, loss in state.losses], "iteration": state.iteration}


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
    rank folders are removed at the end and the user's file stays."""
    base = TINY_TRAIN + embedded_data + ["--train-iters", str(ITERS), "--zero-stage", str(stage)]
    cpu = train(base + ["--save", str(tmp_path / "cpu")])
    nvme = train(base + ["--save", str(tmp_path / "nvme_ck")], nvme=nvme_dir)
    assert nvme["losses"] == cpu["losses"] and len(cpu["losses"]) == ITERS
    a, b = saved_tensors(tmp_path / "cpu"), saved_tensors(tmp_path / "nvme_ck")
    assert a.keys() == b.keys() and any("exp_avg_sq" in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
    assert sorted(os.listdir(nvme_dir)) == ["users_file"] and (nvme_dir / "users_file").read_text() == "mine"


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
    from megapar.config.arguments import ConfigError
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
    from megapar.config.arguments import TrainConfig
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
    from megapar.config.arguments import ConfigError
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
