"""torch_dist checkpoints: saved at one layout, resumed at another, with the losses of an
uninterrupted run (float32 rounding on CPU/gloo); async saves; the common record."""
import os

import pytest

from megapar.checkpoint import TRACKER, iter_dir
from megapar.checkpoint.dist import COMMON_FILE, WRITE_THREADS, read_common
from data_dirs import ROOT
from distributed import run_distributed
from train_helpers import TINY_TRAIN

ITERS, STOP = 6, 3


def losses(result):
    return [l for _, l in result["losses"]]


def _body(rank, world_size, argv, offload):
    """pretrain; `offload` switches the optimizer (and at ZeRO-3 parameter) offload code paths on
    after validation, which refuses them on a CPU-only run (test_zero_stages.py does the same)."""
    from megapar.pretrain_gpt2 import parse
    from megapar.run.pretrain import pretrain
    cfg = parse(argv, world_size)
    if offload:
        cfg.parallel.optimizer_cpu_offload = True
        cfg.parallel.param_cpu_offload = cfg.parallel.zero_stage == 3
    state = pretrain(cfg)
    return {"losses": state.losses, "iteration": state.iteration, "consumed": state.consumed_samples}


def run_training(argv, world_size=1, offload=False):
    return run_distributed(_body, world_size, args=(list(argv), offload))[0]


def layout(tp=1, pp=1, dp=1, zero=0, virtual=None, offload=False):
    """(flags, world size, offload) of a layout."""
    flags = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    if zero:
        flags += ["--zero-stage", str(zero)]
    if virtual:
        flags += ["--virtual-pipeline-model-parallel-size", str(virtual)]
    return flags, tp * pp * dp, offload


def resume_across(data, tmp_path, save_at, load_at, extra=()):
    """(uninterrupted losses at the save layout, first half + resumed half at the load layout)."""
    (save_flags, save_world, save_offload), (load_flags, load_world, load_offload) = save_at, load_at
    base = TINY_TRAIN + data + ["--train-iters", str(ITERS)] + list(extra)
    full = losses(run_training(base + save_flags, save_world, save_offload))
    ck = str(tmp_path / "ck")
    first = run_training(base + save_flags + ["--exit-interval", str(STOP), "--save", ck, "--ckpt-format",
                                              "torch_dist"], save_world, save_offload)
    assert open(os.path.join(ck, TRACKER)).read() == str(STOP)
    second = run_training(base + load_flags + ["--load", ck], load_world, load_offload)
    assert second["iteration"] == ITERS and second["consumed"] == ITERS * 8
    return full, losses(first) + losses(second)


def test_same_layout_resume_is_exact(embedded_data, tmp_path):
    full, resumed = resume_across(embedded_data, tmp_path, layout(), layout())
    assert resumed == full                                                       # bitwise on CPU
    common = read_common(iter_dir(str(tmp_path / "ck"), STOP))
    assert common["iteration"] == STOP and common["layout"]["tp"] == 1 and common["optimizer"]["step"] == STOP
    files = set(os.listdir(iter_dir(str(tmp_path / "ck"), STOP)))
    data = {f"__0_{i}.distcp" for i in range(WRITE_THREADS)}             # one rank, its writer threads' files
    assert files == {".metadata", COMMON_FILE} | data


@pytest.mark.parametrize("save_at,load_at", [
    pytest.param(layout(tp=2, dp=2, zero=3), layout(pp=2, dp=2, zero=1), marks=pytest.mark.slow),
    pytest.param(layout(pp=2, virtual=2), layout(), marks=pytest.mark.slow),
    pytest.param(layout(dp=2, zero=1, offload=True), layout(tp=2), marks=pytest.mark.slow),
    (layout(tp=2), layout(dp=2, zero=3, offload=True)),
], ids=["tp2-dp2-zero3_to_pp2-dp2-zero1", "pp2-v2_to_serial", "dp2-zero1-offload_to_tp2",
        "tp2_to_dp2-zero3-offload"])
def test_resume_at_another_layout(embedded_data, tmp_path, save_at, load_at):
    full, resumed = resume_across(embedded_data, tmp_path, save_at, load_at)
    assert resumed == pytest.approx(full, rel=1e-5)


def test_convert_between_formats_and_read_for_generation(embedded_data, tmp_path):
    """torch_dist (tp 2) -> legacy (pp 2) -> torch_dist with tools/checkpoint_util.py, resumed at
    tp 1 with the uninterrupted losses; generation reads both formats alike."""
    import torch
    from megapar.cli.checkpoint_util import main as checkpoint_util
    from megapar.inference.generation import read_model_state

    base = TINY_TRAIN + embedded_data + ["--train-iters", str(ITERS)]
    full = losses(run_training(base, 1))
    a, b, c = (str(tmp_path / n) for n in "abc")
    first = run_training(base + ["--tensor-model-parallel-size", "2", "--exit-interval", str(STOP), "--save", a,
                                 "--ckpt-format", "torch_dist"], 2)
    assert checkpoint_util(["--load-dir", a, "--save-dir", b, "--target-tensor-parallel-size", "1",
                            "--target-pipeline-parallel-size", "2"]) == 0
    assert os.path.isfile(os.path.join(iter_dir(b, STOP), "mp_rank_00_001", "model_optim_rng.pt"))
    assert checkpoint_util(["--load-dir", b, "--save-dir", c, "--target-ckpt-format", "torch_dist"]) == 0
    second = run_training(base + ["--load", c], 1)
    assert losses(first) + losses(second) == pytest.approx(full, rel=1e-5)
    (_, from_dist), (_, from_legacy) = read_model_state(a, 1, 1, 0, 0), read_model_state(b, 1, 1, 0, 0)
    assert from_dist.keys() == from_legacy.keys()
    assert all(torch.equal(from_dist[k], from_legacy[k]) for k in from_dist)


def test_torch_dist_refusals(tmp_path, capsys):
    """Layout flags mean nothing for a torch_dist target; --async-save needs torch_dist."""
    from megapar.config.build import build_config
    from megapar.config.overlays import parse_flags
    from megapar.config.settings import ConfigError
    from megapar.cli.checkpoint_util import main as checkpoint_util

    assert checkpoint_util(["--load-dir", str(tmp_path), "--save-dir", str(tmp_path / "o"), "--target-ckpt-format",
                            "torch_dist", "--target-tensor-parallel-size", "2"]) == 2
    assert "has no layout" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--async-save needs --ckpt-format torch_dist"):
        build_config(parse_flags(TINY_TRAIN + ["--train-iters", "1", "--async-save", "--ckpt-format",
                                                        "torch"]), 1)


KILLED_MID_WRITE = """
import os, sys
import megapar.checkpoint.dist as d
from megapar.pretrain_gpt2 import main
calls = {"n": 0}
real = d.save_entries
def save_entries(*args):
    calls["n"] += 1
    if calls["n"] == 2:            # the second save dies in the middle of writing its data file
        os.fsync = lambda fd: os._exit(9)
    real(*args)
d.save_entries = save_entries
sys.exit(main(sys.argv[1:]))
"""


def test_async_save_killed_mid_write_resumes_from_the_previous_one(embedded_data, tmp_path):
    """--async-save every 2 iterations; the process is killed while the background thread writes the
    iteration-4 save: the tracker still names iteration 2, whose checkpoint resumes exactly."""
    import subprocess
    import sys

    base = TINY_TRAIN + embedded_data + ["--train-iters", str(ITERS)]
    full = losses(run_training(base, 1))
    ck = str(tmp_path / "ck")
    proc = subprocess.run([sys.executable, "-c", KILLED_MID_WRITE, *base, "--save", ck, "--save-interval", "2",
                           "--ckpt-format", "torch_dist", "--async-save", "--log-interval", "1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 9, proc.stdout + proc.stderr
    assert "successfully saved checkpoint at iteration       2" in proc.stdout
    assert open(os.path.join(ck, TRACKER)).read() == "2"
    assert os.path.isdir(iter_dir(ck, 4) + ".partial") and not os.path.exists(iter_dir(ck, 4))
    resumed = run_training(base + ["--load", ck, "--save", ck, "--save-interval", "2", "--ckpt-format", "torch_dist",
                                   "--async-save"], 1)
    assert losses(resumed) == pytest.approx(full[2:], rel=1e-6) and resumed["iteration"] == ITERS
    assert open(os.path.join(ck, TRACKER)).read() == str(ITERS)
    assert not os.path.exists(iter_dir(ck, 4) + ".partial")


def _slow_writer_body(rank, world_size, argv):
    """pretrain with every background write slowed down, so that each save starts while the
    previous one is still being written."""
    import time
    import megapar.checkpoint.dist as d
    from megapar.pretrain_gpt2 import parse
    from megapar.run.pretrain import pretrain
    real = d.save_entries

    def slow(*args):
        time.sleep(1.0)
        real(*args)
    d.save_entries = slow
    state = pretrain(parse(argv, world_size))
    return {"losses": state.losses, "iteration": state.iteration}


def test_async_saves_that_overlap_wait_for_each_other(embedded_data, tmp_path):
    """A save every iteration at dp 2 while each write takes longer than a step: each save waits for
    the one in flight (the writer thread owns the checkpoint group meanwhile), every one is published,
    and the last resumes."""
    ck = str(tmp_path / "ck")
    argv = TINY_TRAIN + embedded_data + ["--train-iters", "4", "--save", ck, "--save-interval", "1",
                                          "--ckpt-format", "torch_dist", "--async-save"]
    run_distributed(_slow_writer_body, 2, args=(argv,))
    assert open(os.path.join(ck, TRACKER)).read() == "4"
    assert sorted(n for n in os.listdir(ck) if n.startswith("iter_")) == [f"iter_000000{i}" for i in (1, 2, 3, 4)]
    resumed = run_training(TINY_TRAIN + embedded_data + ["--train-iters", "5", "--load", ck,
                                                         "--use-checkpoint-opt_param-scheduler"], 2)
    assert resumed["iteration"] == 5


def _frozen_rank_during_a_save(rank, world, root):
    """Rank 1 freezes inside a save (a hung file system); rank 0's checkpoint collective must end
    within the groups' timeout (--distributed-timeout-minutes), not torch's 30-minute default."""
    import time
    from datetime import timedelta
    from megapar.checkpoint import staged_iteration
    from megapar.topology import Topology
    topo = Topology(tp=1, pp=1, dp=world)
    groups = topo.create_groups(rank, timeout=timedelta(seconds=3))
    start = time.monotonic()
    try:
        with staged_iteration(root, 1, rank, groups.ckpt):
            if rank == 1:
                time.sleep(15)
    except Exception as e:   # rank 0: the timeout; rank 1: its peer gone
        return time.monotonic() - start, type(e).__name__
    return time.monotonic() - start, None


def test_a_rank_frozen_during_a_save_ends_within_the_timeout(tmp_path):
    (waited, error), _ = run_distributed(_frozen_rank_during_a_save, 2, args=(str(tmp_path / "ck"),))
    assert error is not None and waited < 12, (waited, error)
