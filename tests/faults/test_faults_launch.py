"""Training started the way users start it -- `bash scripts/pretrain_gpt2.sh` (torchrun, 2 CPU
processes at --tensor-parallel 2) and `python -m megapar.pretrain_gpt2` -- faulted for real.

flags: a negative or zero size or count, a non-finite or negative rate, a dropout or Adam beta
outside [0, 1) is refused before any process starts or any file is written: one `error:` line
naming the flag and the range, exit 2, no traceback (through the launcher: no torchrun report).
checkpoint file: a truncated shard or a tracker file that is not text is refused with one line
naming the file; the checkpoint folder is byte-identical afterwards.
signals: with --exit-signal-handler, SIGTERM to the launcher or a first Ctrl-C (SIGINT) finishes
the iteration, saves, names the signal and exits 0; a second Ctrl-C aborts (exit 130, no
traceback) and leaves the last saved checkpoint intact. The launcher or torchrun killed outright
(SIGKILL) leaves no training process behind.
plain torchrun (as Megatron and DeepSpeed users start it): a refusal every rank finds prints its
`error:` line once, whichever rank exits first.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import ROOT, ROWS, Row, refused, run

sys.path.insert(0, str(ROOT / "tests"))
from synthetic_data import byte_gpt2_files, random_corpus  # noqa: E402

TRACKER = "latest_checkpointed_iteration.txt"
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--make-vocab-size-divisible-by", "32",
        "--eval-iters", "0", "--eval-interval", "0", "--log-interval", "1", "--attention-backend", "torch",
        "--split", "90,10,0", "--hidden-dropout", "0", "--attention-dropout", "0"]
LAUNCHER = ["bash", "scripts/pretrain_gpt2.sh", "--tensor-parallel", "2"]
PYTHON = ["python", "-m", "megapar.pretrain_gpt2"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    """Flags for a tiny offline corpus with a byte-level GPT-2 vocabulary."""
    d = tmp_path_factory.mktemp("data")
    vocab, merge = byte_gpt2_files(str(d))
    random_corpus(str(d / "corpus"), docs=200)
    return [*TINY, "--data-path", str(d / "corpus"), "--vocab-file", vocab, "--merge-file", merge,
            "--data-cache-path", str(d / "cache")]


def _popen(cmd: list[str]) -> subprocess.Popen:
    """A session of its own, as a terminal's foreground job: `_signal_after(..., group=True)` signals
    all of it, as Ctrl-C in a terminal does."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable if c == "python" else str(c) for c in cmd]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
                            start_new_session=True)


def _signal_after(proc: subprocess.Popen, iteration: int, signals: list[int], group: bool = False) -> tuple[int, str]:
    """Send the first of `signals` once the log shows `iteration`, each next one once the run has
    said it received the previous (to the process, or its whole group); (exit status, whole output)."""
    seen, pending = [], list(signals)
    for line in proc.stdout:
        seen.append(line)
        if f" iteration {iteration:8d}/" in line or (len(pending) < len(signals) and "received" in line):
            sig = pending.pop(0)
            os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
            if not pending:
                break
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, "".join(seen) + out


def _record(fault_class: str, case: str, ok: bool, nothing_lost: bool) -> None:
    ROWS.append(Row(fault_class, case, ok, nothing_lost))


# ---- signals (the SIGTERM run's checkpoint is reused by the checkpoint-file cases) ------------------
@pytest.fixture(scope="module")
def sigterm_run(data, tmp_path_factory):
    """scripts/pretrain_gpt2.sh at tp 2 with --exit-signal-handler, SIGTERM after iteration 2."""
    ck = tmp_path_factory.mktemp("sigterm") / "ck"
    proc = _popen([*LAUNCHER, *data, "--train-iters", "100000", "--exit-signal-handler", "--save", ck])
    rc, out = _signal_after(proc, 2, [signal.SIGTERM])
    return rc, out, ck


def test_sigterm_through_the_launcher_saves_and_exits_0(sigterm_run):
    rc, out, ck = sigterm_run
    saved = (ck / TRACKER).is_file()
    ok = rc == 0 and "exiting after SIGTERM" in out and "Traceback" not in out and "ChildFailedError" not in out
    _record("signals", "SIGTERM to scripts/pretrain_gpt2.sh --exit-signal-handler (tp 2): saves, exit 0",
            ok, saved)
    assert rc == 0, out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
    assert "exiting after SIGTERM" in out, out[-3000:]
    it = int((ck / TRACKER).read_text())
    assert it >= 2 and f"successfully saved checkpoint at iteration {it:7d}" in out
    assert sorted(p.name for p in (ck / f"iter_{it:07d}").iterdir()) == ["mp_rank_00", "mp_rank_01"]


def test_first_ctrl_c_finishes_the_step_saves_and_exits_0(data, tmp_path):
    """Ctrl-C as a terminal sends it: SIGINT to the launcher's whole process group."""
    ck = tmp_path / "ck"
    proc = _popen([*LAUNCHER, *data, "--train-iters", "100000", "--exit-signal-handler", "--save", ck])
    rc, out = _signal_after(proc, 2, [signal.SIGINT], group=True)
    saved = (ck / TRACKER).is_file()
    ok = rc == 0 and "exiting after SIGINT" in out and "Traceback" not in out
    _record("signals", "one Ctrl-C to scripts/pretrain_gpt2.sh --exit-signal-handler (tp 2): saves, exit 0", ok,
            saved)
    assert rc == 0 and "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
    assert "exiting after SIGINT" in out and "Ctrl-C again aborts" in out, out[-3000:]
    it = int((ck / TRACKER).read_text())
    assert f"successfully saved checkpoint at iteration {it:7d}" in out


def test_second_ctrl_c_aborts_and_keeps_the_saved_checkpoint(data, tmp_path):
    """--save-interval 1 keeps saving; a second Ctrl-C during the step the first one lets finish
    stops at once: exit 130, no traceback, and the checkpoint the tracker names is complete and
    loadable (saves are atomic). 64 microbatches a step: time for the second Ctrl-C to land."""
    ck = tmp_path / "ck"
    proc = _popen([*PYTHON, *data, "--train-iters", "20", "--global-batch-size", "128", "--exit-signal-handler",
                   "--save", ck, "--save-interval", "1"])
    rc, out = _signal_after(proc, 2, [signal.SIGINT, signal.SIGINT])
    ok = rc == 130 and "Traceback" not in out and "interrupted (SIGINT)" in out
    assert (ck / TRACKER).is_file(), out[-3000:]  # iteration 1 was saved before the first Ctrl-C
    it = int((ck / TRACKER).read_text())
    import torch
    intact = all(torch.load(f, map_location="cpu", weights_only=False) is not None
                 for f in (ck / f"iter_{it:07d}").rglob("*.pt"))
    _record("signals", "two Ctrl-C: abort, exit 130, last checkpoint intact", ok, intact)
    assert rc == 130 and "Traceback" not in out, out[-3000:]
    assert "interrupted (SIGINT)" in out


def test_two_ctrl_c_0_3_s_apart_after_the_save_say_it_was_saved(data, tmp_path):
    """The first Ctrl-C finishes the iteration and saves; a second 0.3 s later lands after the save
    (or, on a slow machine, during it). The last line must say what happened: with a checkpoint
    written after the first Ctrl-C it names it, never "without saving"."""
    ck = tmp_path / "ck"
    proc = _popen([*LAUNCHER, *data, "--train-iters", "1000", "--exit-signal-handler", "--save", ck])
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if " iteration        2/" in line:
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(0.3)
            os.killpg(proc.pid, signal.SIGINT)
            break
    out = "".join(seen) + proc.communicate(timeout=120)[0]
    last = out.strip().splitlines()[-1]
    saved = (ck / TRACKER).is_file()
    it = int((ck / TRACKER).read_text()) if saved else None
    truthful = (f"after the checkpoint at iteration {it} was saved" in last or proc.returncode == 0) if saved \
        else "without saving" in last
    _record("signals", "two Ctrl-C 0.3 s apart (tp 2): the last line says whether the checkpoint was saved",
            truthful and "Traceback" not in out, saved)
    assert "Traceback" not in out, out[-3000:]
    assert truthful, (saved, last)
    assert saved, "the checkpoint was not saved within 0.3 s: the case the fix is for did not happen"


# ---- checkpoint file -----------------------------------------------------------------------------
@pytest.fixture
def saved(sigterm_run, tmp_path) -> Path:
    """A copy of the SIGTERM run's tp 2 checkpoint."""
    ck = tmp_path / "ck"
    shutil.copytree(sigterm_run[2], ck)
    return ck


def test_truncated_checkpoint_file_through_the_launcher(data, saved):
    it = int((saved / TRACKER).read_text())
    shard = saved / f"iter_{it:07d}" / "mp_rank_01" / "model_optim_rng.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    # the run's own --train-iters: the resume keeps the checkpoint's LR schedule; rank 1 meets the bad file
    refused([*LAUNCHER, *data, "--train-iters", "100000", "--load", saved, "--save", saved],
            fault_class="checkpoint file", case="truncated shard of rank 1, --load through scripts/pretrain_gpt2.sh "
                                                "(tp 2)",
            expect=[str(shard), "is truncated"], watch=[saved])


def test_tracker_that_is_not_text(data, saved):
    (saved / TRACKER).write_bytes(b"\xff\xfe\x00\x81garbage")
    refused([*PYTHON, *data, "--train-iters", "100000", "--load", saved, "--save", saved],
            fault_class="checkpoint file", case="non-UTF-8 tracker file (python -m megapar.pretrain_gpt2)",
            expect=[TRACKER, "not text"], watch=[saved])


# ---- flags ---------------------------------------------------------------------------------------
LAUNCHER_FLAG_CASES = [  # through torchrun: refused before any process starts
    (["--train-iters", "-5"], "--train-iters -5 must be >= 0"),
    (["--train-iters", "5", "--lr", "nan"], "--lr nan is out of range"),
]
PYTHON_FLAG_CASES = [  # one process each (about 3 s): a case per class of bad number
    (["--train-iters", "5", "--micro-batch-size", "0"], "--micro-batch-size 0 must be >= 1"),
    (["--train-iters", "5", "--eval-iters", "-1"], "--eval-iters -1 must be >= 0"),
    (["--train-iters", "5", "--lr", "inf"], "--lr inf is out of range"),
    (["--train-iters", "5", "--hidden-dropout", "1.0"], "--hidden-dropout 1.0 is out of range"),
    (["--train-iters", "5", "--clip-grad", "-1"], "--clip-grad -1.0 is out of range"),
    (["--train-iters", "5", "--adam-beta2", "1"], "--adam-beta2 1.0 is out of range"),
    (["--train-iters", "5", "--recipe", "6.7b-offload"], "(--optimizer-cpu-offload set by --recipe 6.7b-offload)"),
    (["--train-iters", "5", "--distributed-timeout-minutes", "1e12"],  # overflowed c10d's timeout
     "--distributed-timeout-minutes 1000000000000.0 is out of range: it must be a number in [0.05, 525600]"),
]
ARGPARSE_CASES = [  # argparse's refusals, not ConfigError: through python only (not in-process below)
    (["--train-iters", "five"], "invalid int value"),
    (["--train-iters", "5", "--data-impl", "lazy"], "--data-impl: invalid choice: 'lazy'"),  # a Megatron switch
    (["--train-iters", "5", "--empty-unused-memory-level", "3"], "--empty-unused-memory-level: invalid choice: 3"),
]
IN_PROCESS_CASES = [  # the rest, checked without a process each
    (["--train-iters", "5", "--global-batch-size", "0"], "--global-batch-size 0 must be >= 1"),
    (["--train-iters", "5", "--distributed-timeout-minutes", "1e-9"],  # a crash connecting to the store
     "--distributed-timeout-minutes 1e-09 is out of range: it must be a number in [0.05, 525600]"),
    (["--train-iters", "5", "--log-interval", "0"], "--log-interval 0 must be >= 1"),
    (["--train-iters", "5", "--save-interval", "0"], "--save-interval 0 must be >= 1"),
    (["--train-iters", "5", "--lr", "-0.001"], "--lr -0.001 is out of range"),
    (["--train-samples", "-1"], "--train-samples -1 must be >= 0"),
    (["--train-iters", "5", "--attention-dropout", "-0.1"], "--attention-dropout -0.1 is out of range"),
    (["--train-iters", "5", "--adam-beta1", "1.5"], "--adam-beta1 1.5 is out of range"),
    (["--train-iters", "5", "--adam-eps", "0"], "--adam-eps 0.0 is out of range"),
    (["--train-iters", "5", "--num-attention-heads", "0"], "--num-attention-heads 0 must be >= 1"),
    (["--train-iters", "5", "--ddp-bucket-size", "0"], "--ddp-bucket-size 0 must be >= 1"),
    (["--train-iters", "5", "--seed", "-1"], "--seed -1 must be in"),
    (["--train-iters", "5", "--lr", "1e-4", "--lr-warmup-init", "1e-3"], "--lr-warmup-init 0.001 is above --lr 0.0001"),
    # Megatron's sample-based training: the ramp-up and the schedule in samples
    (["--train-iters", "5", "--rampup-batch-size", "4", "4", "100"],
     "--rampup-batch-size counts in samples: it needs sample-based training; give --train-samples"),
    (["--train-samples", "80", "--rampup-batch-size", "4", "4"], "give three numbers >= 1, START INCREMENT SAMPLES"),
    (["--train-samples", "80", "--global-batch-size", "16", "--rampup-batch-size", "6", "4", "100"],
     "must end at --global-batch-size 16"),
    (["--train-samples", "80", "--global-batch-size", "16", "--micro-batch-size", "4", "--rampup-batch-size", "2",
      "2", "100"], "START and INCREMENT must be multiples of --micro-batch-size 4 x data-parallel size 1 = 4"),
    (["--train-samples", "80", "--lr-decay-samples", "0"], "--lr-decay-samples 0 must be >= 1"),
    (["--train-samples", "80", "--lr-warmup-samples", "8", "--lr-warmup-iters", "2"],
     "--lr-warmup-iters counts the LR schedule in iterations, --lr-warmup-samples in samples"),
    (["--train-iters", "5", "--lr-decay-samples", "100"], "--lr-decay-samples counts in samples"),
    # Megatron's weight-decay increment
    (["--train-iters", "5", "--start-weight-decay", "0.1"], "add --weight-decay-incr-style linear or cosine"),
    (["--train-iters", "5", "--weight-decay-incr-style", "cosine", "--end-weight-decay", "0.1"],
     "from --start-weight-decay to --end-weight-decay; give both"),
    (["--train-iters", "5", "--weight-decay-incr-style", "linear", "--start-weight-decay", "-0.1",
      "--end-weight-decay", "0.1"], "--start-weight-decay -0.1 is out of range"),
]


@pytest.mark.parametrize("flags,expect", LAUNCHER_FLAG_CASES, ids=[" ".join(f) for f, _ in LAUNCHER_FLAG_CASES])
def test_bad_number_through_the_launcher(data, tmp_path, flags, expect):
    (tmp_path / "keep.txt").write_text("user data")
    out = refused([*LAUNCHER, *data, *flags, "--save", tmp_path / "ck"], fault_class="flags",
                  case=f"{' '.join(flags)} (scripts/pretrain_gpt2.sh, tp 2)", expect=expect, watch=[tmp_path])
    assert out.rc == 2 and "torch.distributed" not in out.output


def test_bad_numbers_through_python(data, tmp_path):
    """One process per case (each is a real start of the entry point)."""
    (tmp_path / "keep.txt").write_text("user data")
    for flags, expect in PYTHON_FLAG_CASES + ARGPARSE_CASES:
        out = refused([*PYTHON, *data, *flags, "--save", tmp_path / "ck"], fault_class="flags",
                      case=f"{' '.join(flags)} (python -m megapar.pretrain_gpt2)", expect=expect, watch=[tmp_path])
        assert out.rc == 2


def test_every_range_check_in_process():
    """The same checks without a process each: every range class, and the edge values that stay legal."""
    from megapar.config.build import parse_config
    from megapar.config.settings import ConfigError
    for flags, expect in LAUNCHER_FLAG_CASES + PYTHON_FLAG_CASES + IN_PROCESS_CASES:
        with pytest.raises(ConfigError) as e:
            parse_config(flags, 1)
        assert expect in str(e.value)
    for extra in (["--lr", "1e-30", "--min-lr", "0"], ["--hidden-dropout", "0", "--attention-dropout", "0.99"],
                  ["--clip-grad", "0"], ["--adam-beta1", "0", "--adam-beta2", "0.9999"],
                  ["--eval-interval", "0", "--eval-iters", "0"], ["--train-iters", "0"]):
        parse_config(["--train-iters", "5", *extra], 1)


# ---- several nodes: the rendezvous flags, refused before torchrun starts ---------------------------
RENDEZVOUS_CASES = [
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1"], "--node-rank 2 must be less than --nnodes 2"),
    (["--nnodes", "2", "--node-rank", "1"], "--nnodes 2 needs --master-addr"),
    (["--nnodes", "2", "--master-addr", "127.0.0.1"], "--nnodes 2 needs --node-rank"),
    (["--nnodes", "1:2", "--node-rank", "0", "--master-addr", "127.0.0.1"], "--nnodes 1:2 must be a whole number"),
    (["--nnodes", "2", "--node-rank", "-1", "--master-addr", "127.0.0.1"], "--node-rank -1 must be a whole number"),
    (["--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", "70000"],
     "--master-port 70000 must be a whole number in [1, 65535]"),
    (["--nproc-per-node", "0"], "--nproc-per-node 0 must be a whole number >= 1"),
    (["--tensor-parallel", "0"], "--tensor-model-parallel-size (or --tensor-parallel) 0 must be >= 1"),
    (["--pipeline-parallel", "-1"], "--pipeline-model-parallel-size (or --pipeline-parallel) -1 must be >= 1"),
]


@pytest.mark.parametrize("flags,expect", RENDEZVOUS_CASES, ids=[" ".join(f) for f, _ in RENDEZVOUS_CASES])
def test_bad_rendezvous_flags(tmp_path, flags, expect):
    (tmp_path / "keep.txt").write_text("user data")
    out = refused(["bash", "scripts/pretrain_gpt2.sh", *flags, "--train-iters", "1", "--save", tmp_path / "ck"],
                  fault_class="several nodes", case=f"{' '.join(flags)} (scripts/pretrain_gpt2.sh)", expect=expect,
                  watch=[tmp_path])
    assert out.rc == 2 and "torch.distributed" not in out.output


@pytest.mark.parametrize("flags,size", [(["--recipe", "345m-tp2"], 2), (["--deepspeed_config", "DS"], 2)],
                         ids=["recipe", "deepspeed batch triple"])
def test_process_count_the_flags_imply_is_named(tmp_path, flags, size):
    """The script counts tensor x pipeline from the command line on a CPU; a recipe or a DeepSpeed config whose
    batch triple needs another count gets it named as the flag to add."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                              "gradient_accumulation_steps": 2}))
    case = f"{' '.join(flags).replace('DS', 'ds.json')} without --nproc-per-node (CPU)"
    flags = [str(ds) if f == "DS" else f for f in flags]
    refused(["bash", "scripts/pretrain_gpt2.sh", *flags, "--train-iters", "1", "--save", tmp_path / "ck"],
            fault_class="several nodes", case=case,
            expect=f"add --nproc-per-node {size}", watch=[tmp_path], env={"CUDA_VISIBLE_DEVICES": ""})


def test_an_error_no_process_count_fixes_names_none(tmp_path):
    out = refused(["bash", "scripts/pretrain_gpt2.sh", "--lr", "nan", "--train-iters", "1", "--save", tmp_path / "ck"],
                  fault_class="flags", case="--lr nan without --nproc-per-node (CPU)",
                  expect="--lr nan is out of range",
                  watch=[tmp_path], env={"CUDA_VISIBLE_DEVICES": ""})
    assert "--nproc-per-node" not in out.output


def test_sbatch_script_outside_a_slurm_job(tmp_path):
    refused(["bash", "scripts/slurm_pretrain_gpt2.sbatch", "--train-iters", "1"], fault_class="several nodes",
            case="scripts/slurm_pretrain_gpt2.sbatch run outside a SLURM job", expect="not inside a SLURM job",
            watch=[tmp_path])


# ---- experiment tracking: --wandb-*, --tensorboard-dir, --csv-log-dir --------------------------------------
LOGGER_CASES = [
    (["--train-iters", "5", "--wandb-exp-name", "run1"], "--wandb-exp-name is a setting of the W&B run"),
    (["--train-iters", "5", "--wandb-save-dir", "wb"], "--wandb-save-dir is a setting of the W&B run"),
    (["--train-iters", "5", "--wandb-project", " "], "--wandb-project is empty"),
    (["--train-iters", "5", "--wandb-project", "p", "--wandb-save-dir", "setup.py"], "is a file, not a folder"),
    (["--train-iters", "5", "--csv-log-dir", "setup.py"], "--csv-log-dir setup.py is a file, not a folder"),
]
# The entry point as `python -m megapar.pretrain_gpt2` runs it, with the named packages hidden (as if
# not installed) whether or not this machine has them.
WITHOUT_PACKAGES = ("import runpy, sys; hidden = sys.argv.pop(1).split(','); "
                    "sys.modules.update(dict.fromkeys(hidden)); "
                    "runpy.run_module('megapar.pretrain_gpt2', run_name='__main__')")


def test_bad_logger_flags_in_process():
    from megapar.config.build import parse_config
    from megapar.config.settings import ConfigError
    for flags, expect in LOGGER_CASES:
        with pytest.raises(ConfigError) as e:
            parse_config(flags, 1)
        assert expect in str(e.value)
        _record("flags", f"{' '.join(flags)} (parsed in process)", True, True)


@pytest.mark.parametrize("flag,package", [("--wandb-project", "wandb"), ("--tensorboard-dir", "tensorboard")])
def test_logger_package_missing_is_refused_before_any_work(data, tmp_path, flag, package):
    (tmp_path / "keep.txt").write_text("user data")
    refused(["python", "-c", WITHOUT_PACKAGES, package, *data, "--train-iters", "5", flag, str(tmp_path / "logs"),
             "--save", tmp_path / "ck"], fault_class="flags",
            case=f"{flag} without the {package} package installed (python -m megapar.pretrain_gpt2)",
            expect=[flag, f"needs the {package} package", f"pip install {package}"], watch=[tmp_path])


# ---- plain torchrun, and processes left behind ---------------------------------------------------
TORCHRUN = ["python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "megapar.pretrain_gpt2"]


SLOW_RANK = """import os, runpy, sys, time
if os.environ["LOCAL_RANK"] == os.environ["SLOW_RANK"]:
    time.sleep(3)  # this rank meets the refusal 3 s after the other, which has exited by then
sys.argv[0] = "megapar.pretrain_gpt2"
runpy.run_module("megapar.pretrain_gpt2", run_name="__main__")
"""


@pytest.mark.parametrize("slow", [None, "0", "1"], ids=["as it comes", "rank 0 slower", "rank 1 slower"])
def test_refusal_every_rank_finds_prints_once_under_plain_torchrun(data, tmp_path, slow):
    """Every rank refuses the DeepSpeed config, and the first to exit makes torchrun kill the other:
    the line must come out once whichever rank is first (before: only rank 0 printed it, so a rank 0
    slower than rank 1 was killed before it printed anything). Either rank is made the slower by a
    wrapper that sleeps 3 s before it runs the entry point; "as it comes" runs the entry point itself."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2,
                              "gradient_accumulation_steps": 2}))
    cmd = TORCHRUN
    if slow is not None:
        (tmp_path / "slow_rank.py").write_text(SLOW_RANK)
        cmd = [*TORCHRUN[:-2], tmp_path / "slow_rank.py"]
    counts = []
    for _ in range(3):
        out = run([*cmd, *data, "--train-iters", "5", "--deepspeed_config", ds], timeout=300,
                  env={"SLOW_RANK": slow or "", "PYTHONPATH": str(ROOT)})
        lines = [x for x in out.output.splitlines() if x.startswith("error:")]
        counts.append(len(lines))
        assert out.rc != 0 and all("train_batch_size" in x and str(ds) in x for x in lines), out.output[-3000:]
    how = f"rank {slow} slower" if slow else "as it comes"
    _record("launch", f"a refusal on every rank under plain torchrun (2 processes, {how}, 3 runs): one error line "
            f"each", counts == [1] * 3, True)
    assert counts == [1] * 3, counts


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        children.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _kill_outright_once_training(cmd: list, sig: int = signal.SIGKILL) -> tuple[list[int], list[int]]:
    """Start `cmd` (a run that logs nothing while it trains, as a frozen one: no broken pipe ends it),
    send it `sig` once the run has started; (the processes below it then, those still alive 60 s later)."""
    proc = _popen([*cmd, "--log-interval", "1000000"])
    for line in proc.stdout:
        if "> megapar: world size" in line:
            break
    time.sleep(3)
    below = _descendants(proc.pid)
    os.kill(proc.pid, sig)
    deadline = time.time() + 60
    while time.time() < deadline and any(map(_alive, below)):
        time.sleep(0.5)
    left = [p for p in below if _alive(p)]
    for p in left:  # never leave them to the next test
        os.kill(p, signal.SIGKILL)
    proc.stdout.close()
    proc.wait(timeout=30)
    return below, left


def test_launcher_killed_outright_leaves_no_worker(data, tmp_path):
    """kill -9 of scripts/pretrain_gpt2.sh (a batch system's last resort, a user's): torchrun and both
    training processes end too instead of training on unseen."""
    below, left = _kill_outright_once_training(
        [*LAUNCHER, *data, "--train-iters", "100000", "--save", tmp_path / "ck"])
    _record("signals", "launcher killed with SIGKILL (tp 2): torchrun and the workers end", not left, True)
    assert len(below) >= 3, below  # torchrun and two workers
    assert not left, left


def test_torchrun_killed_outright_leaves_no_worker(data, tmp_path):
    """kill -9 of plain torchrun: its two training processes end too."""
    below, left = _kill_outright_once_training([*TORCHRUN, *data, "--tensor-parallel", "2", "--train-iters",
                                                    "100000"])
    _record("signals", "plain torchrun killed with SIGKILL (tp 2): the workers end", not left, True)
    assert len(below) >= 2, below
    assert not left, left


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP (a closed terminal)"])
def test_launcher_signalled_without_the_handler_leaves_no_worker(data, tmp_path, sig):
    """Without --exit-signal-handler a SIGTERM or SIGHUP to scripts/pretrain_gpt2.sh stops the run:
    forwarded to both training processes, none is left."""
    below, left = _kill_outright_once_training([*LAUNCHER, *data, "--train-iters", "100000"], sig)
    _record("signals", f"{signal.Signals(sig).name} to the launcher without --exit-signal-handler (tp 2): "
            f"every process ends", not left, True)
    assert len(below) >= 3, below
    assert not left, left
