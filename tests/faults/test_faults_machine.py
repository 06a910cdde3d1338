"""A failing machine under a training run: a rank that stops answering (SIGSTOP: a frozen process,
a host gone from the network) and a host out of memory.

frozen rank: with --distributed-timeout-minutes, every collective of every process group (tensor,
data, pipeline, ...) gives up after that long; the rank that waited ends the job with one `error:`
line naming the timeout and the rank it waited for (found by its heartbeat), not 30 minutes of
silence (torch's default for groups) and not a traceback.
out of memory: a MemoryError (here: the dataset indices of an absurd --train-samples under a
limit on the address space) ends in one line that names it and the fix.
full disk (a small tmpfs; skipped where mounting one is not allowed): the dataset indices under
--data-cache-path and the NVMe optimizer state are refused in one line naming the folder, with sizes
in the unit that shows them (MiB below a GiB, never "0.0 GiB").
"""
from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import signal
import sys
import time
from pathlib import Path

import pytest

from harness import ROWS, Row, refused
from test_faults_launch import LAUNCHER, PYTHON, _descendants, _popen, data  # noqa: F401 (data: the fixture)

TIMEOUT_MINUTES = "0.1"  # 6 s: long enough for a loaded 2-core machine to start the run


def _worker(launcher_pid: int, rank: int) -> int:
    """The pid of the training process of `rank` that torchrun (under the launcher) started."""
    for pid in _descendants(launcher_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and any(e.startswith(b"TORCHELASTIC_RUN_ID=") for e in env):
            return pid
    raise AssertionError(f"no training process of rank {rank} under {launcher_pid}")


def test_a_stopped_rank_ends_the_job_with_one_line_naming_it(data, tmp_path):  # noqa: F811
    """tp 2 through scripts/pretrain_gpt2.sh: rank 1 is SIGSTOPped after iteration 2; rank 0 waits
    in a tensor-parallel all-reduce (a group that, before, ignored the flag and waited 30 minutes),
    then names rank 1 and its group. The operator then ends the frozen rank (SIGCONT lets torchrun's
    SIGTERM land)."""
    proc = _popen([*LAUNCHER, *data, "--train-iters", "1000", "--distributed-timeout-minutes", TIMEOUT_MINUTES])
    seen, stopped, waited = [], None, None
    for line in proc.stdout:
        seen.append(line)
        if stopped is None and " iteration        2/" in line:
            stopped = _worker(proc.pid, 1)
            os.kill(stopped, signal.SIGSTOP)
            t0 = time.monotonic()
        if line.startswith("error:") and stopped is not None:
            waited = time.monotonic() - t0
            os.kill(stopped, signal.SIGCONT)
    rc = proc.wait(timeout=120)
    out = "".join(seen)
    errors = [line for line in seen if line.startswith("error:")]
    ok = (rc != 0 and len(errors) == 1 and "Traceback" not in out and "--distributed-timeout-minutes 0.1" in out
          and "for rank 1 (this rank's tensor-parallel group [0, 1])" in out)
    ROWS.append(Row("failing machine", "rank 1 of a tp 2 run SIGSTOPped: rank 0 names it after "
                                       "--distributed-timeout-minutes 0.1", ok, True))
    assert stopped is not None, out[-3000:]
    assert rc != 0 and "Traceback" not in out, out[-3000:]
    assert len(errors) == 1, out[-3000:]
    assert "rank 0 waited --distributed-timeout-minutes 0.1" in errors[0]
    assert "for rank 1 (this rank's tensor-parallel group [0, 1]), which stopped answering" in errors[0]
    assert waited < 60, f"the error came {waited:.0f} s after the stop"


def test_host_out_of_memory_is_one_line(data, tmp_path):  # noqa: F811
    """--train-samples 10^13: the dataset indices alone would need terabytes (numpy's MemoryError)."""
    (tmp_path / "keep.txt").write_text("user data")
    refused([*PYTHON, *data, "--train-samples", str(10**13), "--save", tmp_path / "ck"],
            fault_class="failing machine", case="host out of memory while building the dataset indices",
            expect=["the host ran out of memory (", "MemoryError"], watch=[tmp_path])


def test_model_larger_than_host_memory_is_one_line(data, tmp_path):  # noqa: F811
    """Hidden size 8192 under a 4 GB address-space limit: torch's CPU allocator fails building the
    model (a RuntimeError, not a MemoryError)."""
    (tmp_path / "keep.txt").write_text("user data")
    flags = [str(f) for f in data]
    flags[flags.index("--hidden-size") + 1] = "8192"
    train = " ".join(map(shlex.quote, [sys.executable, "-m", "megapar.pretrain_gpt2", *flags, "--train-iters", "1",
                                       "--save", str(tmp_path / "ck")]))
    refused(["bash", "-c", f"ulimit -v 4000000 && exec {train}"], fault_class="failing machine",
            case="host out of memory building the model (4 GB address space, torch's CPU allocator)",
            expect=["the host ran out of memory (", "can't allocate memory"], watch=[tmp_path])


@contextlib.contextmanager
def _small_disk(folder: Path, size: str):
    """A tmpfs of `size` mounted at `folder` (a disk that fills up); skips where that is not allowed."""
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True).returncode == 0
    if not mounted:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_data_cache_path_on_a_full_disk_is_one_line(data, tmp_path):  # noqa: F811
    """Before: a raw OSError from numpy. The indices of 40000 samples do not fit in 64 KiB."""
    flags = [*data[:-2], "--train-iters", "20000"]  # data's own --data-cache-path replaced below
    with _small_disk(tmp_path / "disk", "64k") as disk:
        (disk / "keep.txt").write_text("user data")
        refused([*PYTHON, *flags, "--data-cache-path", disk], fault_class="machine",
                case="--data-cache-path on a disk that fills up while the indices are written",
                expect=[f"cannot write the dataset indices into {disk}", "give --data-cache-path a folder with room"],
                watch=[disk])


def test_nvme_space_below_a_gib_is_shown_in_mib(data, tmp_path):  # noqa: F811
    """Before: "0.0 GiB free, but ... needs 0.0 GiB"."""
    with _small_disk(tmp_path / "disk", "1m") as disk:
        refused([*PYTHON, *data, "--train-iters", "5", "--hidden-size", "256", "--zero-stage", "1",
                 "--optimizer-nvme-offload", disk], fault_class="machine",
                case="--optimizer-nvme-offload on a disk of 1 MiB: sizes in MiB",
                expect=[f"--optimizer-nvme-offload {disk} has 1.0 MiB free", "MiB (", "larger disk"], watch=[disk])


def test_sizes_are_printed_in_the_unit_that_shows_them():
    from megapar.errors import size_text
    assert [size_text(n) for n in (0, 1000, 1536, 3 * 2**20 // 2, 5 * 2**30, 2**41)] == \
        ["0 B", "1000 B", "1.5 KiB", "1.5 MiB", "5.0 GiB", "2.0 TiB"]
