"""Nothing a user saved is lost or silently replaced by a training run, faulted for real on CPU.

save dir: one job per --save (a live owner refuses a second job, through the launcher on every
rank; a dead owner's lock is taken over; another host's lock says how to clear it; the lock goes
at exit, on an error, Ctrl-C and SIGTERM; the conversion tools never --force over a job's --save);
--finetune never saves into its --load; --save must be writable and have room for a checkpoint.
failed save: a file-system error while saving (disk full as a file size limit, read-only) gives
one line, removes the partial save and leaves the previous checkpoint loadable.
re-save: publishing an iteration that exists, stopped between any two of its steps (kill -9, or
the steps run one by one), always leaves a checkpoint that loads (megapar/checkpoint/publish.py).
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness import ROOT, ROWS, Row, refused, run
from test_faults_checkpoints import (KILL_AT, MODEL, TINY, data, dist_trained, leftovers, losses, reshard,  # noqa: F401
                                    train, trained)

sys.path.insert(0, str(ROOT / "tests"))
from distributed import run_distributed  # noqa: E402

PRETRAIN = ["python", "-m", "megapar.pretrain_gpt2"]
LOCK = "megapar.lock"
TRACKER = "latest_checkpointed_iteration.txt"


def cache_of(trained: Path) -> Path:
    """The data cache the `trained` run built (reusing it writes no index files)."""
    return trained.parent / "cache"


def write_lock(save: Path, host: str, pid: int, started: float | None = None) -> Path:
    """A lock file as a job on `host` with `pid` would have written it."""
    save.mkdir(parents=True, exist_ok=True)
    path = save / LOCK
    path.write_text(json.dumps({"host": host, "pid": pid, "started": started or time.time() - 60,
                                "command": "python -m megapar.pretrain_gpt2 --save " + str(save)}))
    return path


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def held_lock(save: Path):
    """The save-dir lock, held by this (running) test process."""
    from megapar.checkpoint import SaveDirLock
    lock = SaveDirLock(str(save), "pytest: a job that is still running")
    lock.acquire()
    return lock


# ---- one job per --save ---------------------------------------------------------------------------------
def test_second_job_on_the_same_save_is_refused(data, trained, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(trained, ck)
    lock = held_lock(ck)
    try:
        refused([*PRETRAIN, *TINY, *data, "--train-iters", "2", "--load", ck, "--save", ck,
                 "--data-cache-path", cache_of(trained)], fault_class="save dir",
                case="a second job with the same --save (owner alive, same host)",
                expect=[f"--save {ck} is in use by another job", f"host {socket.gethostname()}",
                        f"PID {os.getpid()}", "give another --save"], watch=[ck])
    finally:
        lock.release()
    assert not (ck / LOCK).exists()


def test_second_job_through_the_launcher_fails_on_every_rank(data, trained, tmp_path):
    """tp 2: rank 0 reads the lock, every rank stops with its line (no rank waits for the others)."""
    ck = tmp_path / "ck"
    lock = held_lock(ck)
    try:
        refused(["bash", "scripts/pretrain_gpt2.sh", "--tensor-parallel", "2", *TINY, *data, "--save", ck,
                 "--data-cache-path", cache_of(trained)], fault_class="save dir",
                case="a second job with the same --save through the launcher (tp 2)",
                expect=["is in use by another job", f"PID {os.getpid()}"], watch=[ck], timeout=120)
    finally:
        lock.release()


def test_lock_of_a_dead_owner_is_taken_over(data, trained, tmp_path):
    ck = tmp_path / "ck"
    write_lock(ck, socket.gethostname(), dead_pid())
    out = train(data, "--save", ck, cache=cache_of(trained))
    assert out.rc == 0, out.output[-3000:]
    assert f"> taking over {ck / LOCK}: its owner is no longer running" in out.output
    assert sorted(os.listdir(ck)) == ["iter_0000001", TRACKER]  # released at the normal exit


def test_lock_on_another_host_says_how_to_clear_it(data, tmp_path):
    ck = tmp_path / "ck"
    path = write_lock(ck, "gpu-node-17.example", 4242)
    refused([*PRETRAIN, *TINY, *data, "--save", ck], fault_class="save dir",
            case="a --save locked by a job on another host",
            expect=["in use by another job", "host gpu-node-17.example", "PID 4242",
                    f"if that job is no longer running, delete {path}"], watch=[tmp_path])


@pytest.mark.parametrize("sig,rc", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, 130)])
def test_lock_is_released_when_a_signal_stops_the_run(data, trained, tmp_path, sig, rc):
    """Without --exit-signal-handler: SIGTERM still kills the run (as before), Ctrl-C stops it unsaved."""
    ck = tmp_path / "ck"
    cmd = [sys.executable, "-X", "faulthandler", "-m", "megapar.pretrain_gpt2", *TINY, *data, "--train-iters",
           "100000", "--save", str(ck), "--data-cache-path", str(cache_of(trained))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if " iteration        2/" in line:
            assert (ck / LOCK).is_file()
            proc.send_signal(sig)
            break
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:   # show where it hangs (faulthandler prints every thread's stack)
        proc.send_signal(signal.SIGABRT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == rc, ("".join(seen) + out)[-5000:]
    assert not (ck / LOCK).exists()


def test_conversion_never_replaces_a_running_jobs_save(trained, tmp_path):
    runs = tmp_path / "runs"
    shutil.copytree(trained, runs / "ck")
    shutil.copytree(trained, runs / "job")   # a checkpoint directory a job is saving into right now
    lock = held_lock(runs / "job")
    try:
        refused(reshard(runs / "ck", runs / "job", "--force"), fault_class="save dir",
                case="checkpoint_util --force onto a running training job's --save",
                expect=["is the --save of a training job", f"PID {os.getpid()}"], watch=[runs])
    finally:
        lock.release()


# ---- --finetune, and --save's file system ---------------------------------------------------------------
def test_finetune_into_its_own_load_dir_is_refused(data, tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (tmp_path / "link").symlink_to(ck)
    refused([*PRETRAIN, *TINY, *data, "--load", ck, "--save", tmp_path / "link", "--finetune"],
            fault_class="save dir", case="--finetune with --save = --load (through a symlink)",
            expect=["--finetune with --save", "equal to --load", "give a new --save"], watch=[tmp_path])


def test_save_below_a_file_is_refused_at_start(data, tmp_path):
    (tmp_path / "notes.txt").write_text("the user's notes\n")
    refused([*PRETRAIN, *TINY, *data, "--save", tmp_path / "notes.txt" / "ck"], fault_class="save dir",
            case="--save inside a file", expect=["is not writable", "Not a directory"], watch=[tmp_path])


@pytest.mark.skipif(os.geteuid() == 0, reason="running as root: chmod does not stop root's writes")
def test_read_only_save_dir_is_refused_at_start(data, trained, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(trained, ck)
    ck.chmod(0o555)
    try:
        refused([*PRETRAIN, *TINY, *data, "--train-iters", "2", "--load", ck, "--save", ck,
                 "--data-cache-path", cache_of(trained)], fault_class="save dir",
                case="a read-only --save", expect=["is not writable", "Permission denied"], watch=[ck])
    finally:
        ck.chmod(0o755)


def test_checkpoint_size_is_what_a_save_writes(trained):
    """The disk check's estimate is the tensor bytes of a real checkpoint (model + optimizer)."""
    from megapar.checkpoint.guard import checkpoint_bytes
    from megapar.pretrain_gpt2 import parse
    state = torch.load(trained / MODEL, map_location="cpu", weights_only=False)
    tensors = [t for t in _tensors(state["model"])] + [t for t in _tensors(state["optimizer"]["state"])]
    written = sum(t.numel() * t.element_size() for t in tensors)
    cfg = parse([*TINY, "--data-path", "x"], 1)
    assert checkpoint_bytes(cfg, 265) == written
    cfg.ckpt.no_save_optim = True
    assert checkpoint_bytes(cfg, 265) == sum(t.numel() * t.element_size() for t in _tensors(state["model"]))


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    return [t for v in (tree.values() if isinstance(tree, dict) else ()) for t in _tensors(v)]


def test_not_enough_free_space_is_refused_before_the_model_is_built(data, tmp_path):
    hidden = 8192                                 # 16 B/param (fp32 + optimizer), ~12 h^2 params per layer
    layers = shutil.disk_usage(tmp_path).free // (16 * 12 * hidden * hidden) + 2
    shape = ["--num-layers", str(layers), "--hidden-size", str(hidden)]
    refused([*PRETRAIN, *TINY, *data, *shape, "--save", tmp_path / "ck"], fault_class="save dir",
            case=f"--save without room for one checkpoint ({layers} layers x hidden {hidden})",
            expect=[f"--save {tmp_path / 'ck'} has", "free, but one checkpoint of this model needs",
                    "give another --save", "--no-save-optim"], watch=[tmp_path], timeout=120)


FSIZE = '''import resource, runpy, signal, sys
limit = int(sys.argv[1])
sys.argv = ["megapar.pretrain_gpt2"] + sys.argv[2:]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit then fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
runpy.run_module("megapar.pretrain_gpt2", run_name="__main__")
'''


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(data, trained, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(trained, ck)
    limit = (ck / MODEL).stat().st_size // 2      # no file as large as a model file fits
    flags = [*TINY, *data, "--train-iters", "2", "--load", ck, "--save", ck, "--data-cache-path", cache_of(trained)]
    refused(["python", "-c", FSIZE, str(limit), *flags], fault_class="failed save",
            case="the file system refuses a write mid-save (file size limit: EFBIG)",
            expect=[f"saving iteration 2 to {ck} failed", "File too large (EFBIG)", "partial save was removed",
                    "--no-save-optim"], watch=[ck])
    resumed = run([*PRETRAIN, *flags])
    assert resumed.rc == 0 and f"successfully loaded checkpoint from {ck} at iteration 1" in resumed.output, \
        resumed.output[-3000:]
    assert sorted(os.listdir(ck)) == ["iter_0000001", "iter_0000002", TRACKER]


@pytest.mark.parametrize("previous", [True, False], ids=["over a checkpoint", "first save"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_torch_dist_save_failing_is_one_line(data, dist_trained, tmp_path, previous, mode):
    """A torch_dist save whose data files hit a file size limit: one line naming the cause (not
    DCP's TypeError), the staging folder removed, "unchanged" only when a checkpoint is there."""
    ck = tmp_path / "ck"
    if previous:
        shutil.copytree(dist_trained, ck)
    biggest = max(f.stat().st_size for f in (dist_trained / "iter_0000001").glob("*.distcp"))
    small = max((dist_trained / "iter_0000001" / n).stat().st_size for n in ("common.pt", ".metadata"))
    assert small < biggest // 2 * 3 // 2 < biggest
    flags = [*TINY, *data, "--train-iters", "2", "--save-interval", "2", "--save", ck, "--ckpt-format", "torch_dist",
             "--data-cache-path", cache_of(dist_trained), *(["--load", ck] if previous else []),
             *(["--async-save"] if mode == "async" else [])]
    kept = "the checkpoints already there are unchanged" if previous else "no earlier checkpoint is there"
    refused(["python", "-c", FSIZE, str(biggest // 2 * 3 // 2), *flags], fault_class="failed save",
            case=f"torch_dist {mode} save hits a file size limit ({'over a checkpoint' if previous else 'first'})",
            expect=[f"saving iteration 2 to {ck} failed", "File too large (EFBIG)", "partial save was removed", kept],
            watch=[ck] if previous else [], allow_new=[ck / LOCK])
    if previous:
        assert sorted(os.listdir(ck)) == ["iter_0000001", TRACKER]
    else:                                    # the --save folder this run made, empty again: removed
        assert not ck.exists()


NOFILE = '''import os, resource, runpy, sys
import megapar.checkpoint.dist as d
real = d.save_entries


def limited(*args):   # the open-file limit reached as DCP's writer threads open their files
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 1,
                                                resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    real(*args)


d.save_entries = limited
sys.argv = ["megapar.pretrain_gpt2"] + sys.argv[1:]
runpy.run_module("megapar.pretrain_gpt2", run_name="__main__")
'''


def test_torch_dist_save_out_of_file_descriptors_is_one_line(data, dist_trained, tmp_path):
    """Too many open files (EMFILE) while DCP's writer threads open the data files: the cause and its
    own fix (not 'free space'), the partial save removed, the checkpoint before it kept."""
    ck = tmp_path / "ck"
    shutil.copytree(dist_trained, ck)
    flags = [*TINY, *data, "--train-iters", "2", "--save-interval", "2", "--load", ck, "--save", ck,
             "--ckpt-format", "torch_dist", "--data-cache-path", cache_of(dist_trained)]
    refused(["python", "-c", NOFILE, *flags], fault_class="failed save",
            case="torch_dist save out of file descriptors (EMFILE)",
            expect=[f"saving iteration 2 to {ck} failed writing __0_", "Too many open files (EMFILE)",
                    "partial save was removed and the checkpoints already there are unchanged",
                    "raise the open-file limit (ulimit -n)"], watch=[ck], allow_new=[ck / LOCK])
    assert sorted(os.listdir(ck)) == ["iter_0000001", TRACKER]


def test_torch_dist_save_on_a_full_disk_is_one_line(data, dist_trained, tmp_path):
    """A real full disk (a tmpfs with room for one iteration and a half): the second save fails with
    ENOSPC in one line, its partial files removed, the first checkpoint kept and loadable."""
    from test_faults_machine import _small_disk
    pages = sum(-(-f.stat().st_size // 4096) for f in (dist_trained / "iter_0000001").iterdir())
    with _small_disk(tmp_path / "disk", f"{(pages * 3 // 2 + 4) * 4}k") as disk:
        ck = disk / "ck"
        flags = [*TINY, *data, "--train-iters", "2", "--save-interval", "1", "--save", ck, "--ckpt-format",
                 "torch_dist", "--data-cache-path", cache_of(dist_trained)]
        refused([*PRETRAIN, *flags], fault_class="failed save", case="torch_dist save on a full disk (tmpfs)",
                expect=[f"saving iteration 2 to {ck} failed", "No space left on device (ENOSPC)",
                        "partial save was removed and the checkpoints already there are unchanged", "free space"],
                allow_new=[disk])
        assert sorted(os.listdir(ck)) == ["iter_0000001", TRACKER] and (ck / TRACKER).read_text() == "1"
        out = run([*PRETRAIN, *TINY, *data, "--train-iters", "2", "--load", ck, "--data-cache-path",
                   cache_of(dist_trained)])
        assert out.rc == 0 and f"successfully loaded checkpoint from {ck} at iteration 1" in out.output, \
            out.output[-3000:]


def test_a_rank_frozen_during_a_torch_dist_save_ends_within_the_timeout(data, tmp_path):
    """tp 2 through the launcher: rank 1 is SIGSTOPped the moment the save of iteration 4 begins (its
    staging folder appears). Rank 0's checkpoint collectives honour --distributed-timeout-minutes:
    one line naming rank 1 and the save, in seconds (not torch's 30 minutes); the staging folder
    removed, the checkpoint of iteration 2 kept."""
    from test_faults_launch import LAUNCHER, TINY as LAUNCH_TINY, _popen
    from test_faults_machine import _worker
    ck = tmp_path / "ck"
    proc = _popen([*LAUNCHER, *LAUNCH_TINY, *data, "--train-iters", "1000", "--save", ck, "--save-interval", "2",
                   "--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "0.1",
                   "--data-cache-path", tmp_path / "cache"])
    seen, rank1, stopped_at, waited = [], None, None, float("inf")
    for line in proc.stdout:
        seen.append(line)
        if rank1 is None and " iteration        3/" in line:
            rank1 = _worker(proc.pid, 1)
            deadline = time.monotonic() + 60
            while not (ck / "iter_0000004.partial").exists() and time.monotonic() < deadline:
                time.sleep(0.0005)
            os.kill(rank1, signal.SIGSTOP)
            stopped_at = time.monotonic()
        if line.startswith("error:") and stopped_at is not None:
            waited = time.monotonic() - stopped_at
            os.kill(rank1, signal.SIGCONT)       # so that torchrun's SIGTERM ends it
    rc = proc.wait(timeout=120)
    out = "".join(seen)
    errors = [line for line in seen if line.startswith("error:")]
    ROWS.append(Row("failed save", "rank 1 SIGSTOPped as a torch_dist save begins: rank 0 names it after "
                                   "--distributed-timeout-minutes 0.1", len(errors) == 1 and waited < 60,
                    sorted(os.listdir(ck)) == ["iter_0000002", TRACKER]))
    assert stopped_at is not None and rc != 0 and "Traceback" not in out, out[-3000:]
    assert len(errors) == 1, out[-3000:]
    assert (f"rank 0 waited --distributed-timeout-minutes 0.1 in a collective (saving iteration 4 to {ck}) for "
            f"rank 1") in errors[0] and "stopped answering" in errors[0], errors[0]
    assert waited < 60, f"the error came {waited:.0f} s after the stop"
    assert sorted(os.listdir(ck)) == ["iter_0000002", TRACKER] and (ck / TRACKER).read_text() == "2"


def _rank1_fills_the_disk(rank, world, root):
    """Rank 1's writes fail for real (a file size limit); every rank must raise the same line."""
    import resource
    from megapar.checkpoint import CheckpointError, atomic_torch_save, staged_iteration
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        with staged_iteration(root, 2, rank) as staging:
            if rank == 1:
                resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))
            atomic_torch_save(torch.zeros(10_000), os.path.join(staging, f"rank{rank}.pt"))
    except CheckpointError as e:
        return str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    return None


def test_a_failed_write_on_one_rank_fails_every_rank_alike(trained, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(trained, ck)
    lines = run_distributed(_rank1_fills_the_disk, 2, args=(str(ck),))
    assert lines[0] == lines[1] and lines[0].startswith(f"saving iteration 2 to {ck} failed on rank 1: "
                                                        f"File too large (EFBIG)"), lines
    assert sorted(os.listdir(ck)) == ["iter_0000001", TRACKER] and (ck / TRACKER).read_text() == "1"


@pytest.mark.skipif(os.geteuid() == 0, reason="running as root: chmod does not stop root's writes")
def test_read_only_checkpoint_dir_fails_a_save_in_one_line(trained, tmp_path):
    from megapar.checkpoint import CheckpointError, staged_iteration
    ck = tmp_path / "ck"
    shutil.copytree(trained, ck)
    ck.chmod(0o555)
    try:
        with pytest.raises(CheckpointError, match=r"Permission denied \(EACCES\); fix its permissions"):
            with staged_iteration(str(ck), 2, 0):
                pass
    finally:
        ck.chmod(0o755)
    assert sorted(os.listdir(ck)) == ["iter_0000001", TRACKER]


# ---- re-saving an iteration: stopped at every step ---------------------------------------------------------
class Stopped(BaseException):
    """The process 'dies' here (nothing after it runs, no cleanup of ours)."""


def _mark(folder: Path, stamp: int | None = None) -> int:
    """Tell copies of one iteration apart by their model file's modification time (set it with `stamp`)."""
    path = folder / "mp_rank_00" / "model_optim_rng.pt"
    if stamp is not None:
        os.utime(path, (stamp, stamp))
    return int(path.stat().st_mtime)


def _loads(ck: Path) -> None:
    """Both readers (generation's and resharding's) find a complete iteration 1."""
    from megapar.inference.generation import read_model_state
    from megapar.reshard import ShardedCheckpoint
    saved, flat = read_model_state(str(ck), 1, 1, 0, 0)
    assert flat and saved.model.num_layers == 1
    assert ShardedCheckpoint(str(ck)).iteration == 1


@pytest.mark.parametrize("stop_at", [1, 2, 3])   # before: setting the old copy aside, the new one in, the tracker
def test_resave_stopped_at_every_step_stays_loadable(trained, tmp_path, monkeypatch, stop_at):
    from megapar.checkpoint.publish import publish_iteration, published_dir, staged_iteration, staging_dir
    ck = tmp_path / "ck"
    shutil.copytree(trained, ck)
    new = Path(staging_dir(str(ck), 1))
    shutil.copytree(trained / "iter_0000001", new)
    real, calls = os.replace, [0]
    _mark(new, 1_000_000)

    def replace(src, dst):
        calls[0] += 1
        if calls[0] == stop_at:
            raise Stopped
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Stopped):
        publish_iteration(str(ck), str(new), 1)
    monkeypatch.setattr(os, "replace", real)
    assert (ck / TRACKER).read_text() == "1"
    _loads(ck)
    if stop_at == 2:   # the old copy set aside, the new one not yet in: readers take the old one
        assert not (ck / "iter_0000001").exists() and published_dir(str(ck), 1) == str(ck / "iter_0000001.old")
    with staged_iteration(str(ck), 1, 0) as staging:   # the next save of iteration 1 completes and cleans up
        shutil.copytree(trained / "iter_0000001", staging, dirs_exist_ok=True)
        _mark(Path(staging), 2_000_000)
    assert sorted(os.listdir(ck)) == ["iter_0000001", TRACKER]
    _loads(ck)
    assert _mark(ck / "iter_0000001") == 2_000_000


def test_leftover_copy_beside_a_published_iteration_is_removed(trained, tmp_path):
    """A kill while the replaced copy was being deleted leaves part of it; the next publish drops it."""
    from megapar.checkpoint.publish import publish_iteration, published_dir
    ck = tmp_path / "ck"
    shutil.copytree(trained, ck)
    (ck / "iter_0000001.old" / "mp_rank_00").mkdir(parents=True)   # half deleted
    assert published_dir(str(ck), 1) == str(ck / "iter_0000001")
    shutil.copytree(trained / "iter_0000001", tmp_path / "new")
    publish_iteration(str(ck), str(tmp_path / "new"), 1)
    assert sorted(os.listdir(ck)) == ["iter_0000001", TRACKER]


TRACKER_FAILS = '''import os, resource, signal, sys
from megapar.checkpoint.publish import publish_iteration
ck, staging = sys.argv[1], sys.argv[2]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))   # renames work, no byte can be written
try:
    publish_iteration(ck, staging, 2)
except OSError as e:
    print("raised", e.errno)
'''


def test_tracker_write_failing_puts_the_previous_folder_back(trained, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(trained, ck)
    shutil.copytree(ck / "iter_0000001", ck / "iter_0000002")          # iteration 2 published, unnamed
    shutil.copytree(trained / "iter_0000001", tmp_path / "new")
    _mark(ck / "iter_0000002", 1_000_000)
    _mark(tmp_path / "new", 2_000_000)
    out = run(["python", "-c", TRACKER_FAILS, ck, tmp_path / "new"])
    assert out.rc == 0 and f"raised {errno.EFBIG}" in out.stdout, out.output[-3000:]
    assert (ck / TRACKER).read_text() == "1" and _mark(ck / "iter_0000002") == 1_000_000
    assert _mark(tmp_path / "new") == 2_000_000 and not leftovers(ck)
    assert sorted(os.listdir(ck)) == ["iter_0000001", "iter_0000002", TRACKER]


def test_kill_between_the_renames_of_a_resave_resumes(data, trained, tmp_path):
    """The tracker rolled back to iteration 1 beside a saved iteration 2: the resume re-saves 2 and is
    killed (-9) after setting the old iteration 2 aside and before renaming its own in. The tracker
    still names 1; the next run takes over the dead run's lock, puts the copy set aside back before
    its own publish, and trains on to the same iteration 2."""
    ck = tmp_path / "ck"
    shutil.copytree(trained, ck)
    flags = [*TINY, *data, "--data-cache-path", cache_of(trained), "--train-iters", "2", "--load", ck, "--save", ck]
    assert run([*PRETRAIN, *flags]).rc == 0
    (ck / TRACKER).write_text("1")
    killed = run(["python", "-c", KILL_AT, "iter_0000002", "1", *flags])
    assert killed.rc == -9, killed.output[-3000:]
    assert not (ck / "iter_0000002").exists() and (ck / "iter_0000002.old").is_dir()
    assert (ck / TRACKER).read_text() == "1"
    resumed = run([*PRETRAIN, *flags])
    assert resumed.rc == 0, resumed.output[-3000:]
    assert "taking over" in resumed.output
    assert f"successfully loaded checkpoint from {ck} at iteration 1" in resumed.output
    assert 2 in losses(resumed.output)
    assert sorted(os.listdir(ck)) == ["iter_0000001", "iter_0000002", TRACKER] and (ck / TRACKER).read_text() == "2"


# ---- what --force may replace: the torch_dist layout --------------------------------------------------------
def test_torch_dist_checkpoint_is_a_previous_output(tmp_path):
    import torch.distributed.checkpoint as dcp
    from megapar.checkpoint import CheckpointError
    from megapar.checkpoint.publish import CHECKPOINT, is_checkpoint_output, prepare_output
    ck = tmp_path / "ck"
    it = ck / "iter_0000003"
    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(it))   # one process: .metadata + __0_0.distcp
    torch.save({"args": None}, it / "common.pt")
    (ck / TRACKER).write_text("3")
    assert {".metadata", "__0_0.distcp", "common.pt"} <= set(os.listdir(it)) and is_checkpoint_output(str(ck))
    prepare_output(str(ck), True, (CHECKPOINT,))
    (it / "notes.txt").write_text("mine")
    assert not is_checkpoint_output(str(ck))
    (it / "notes.txt").unlink()
    write_lock(ck, socket.gethostname(), os.getpid())
    with pytest.raises(CheckpointError, match="is the --save of a training job"):
        prepare_output(str(ck), True, (CHECKPOINT,))
