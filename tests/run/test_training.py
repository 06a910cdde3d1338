"""Training loop: layout invariance, exact resume, SIGTERM, evaluation, iteration times, errors."""
import math
import os
import re
import signal
import subprocess
import sys

import pytest

from megapar.checkpoint import TRACKER
from train_helpers import TINY_TRAIN, run_training

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def losses(result):
    return [l for _, l in result["losses"]]


@pytest.mark.slow  # --quick skips it; the layout-invariance representative there: test_uneven_pipeline_stages_...
def test_tp2_dp2_matches_serial(embedded_data):
    base = TINY_TRAIN + embedded_data + ["--train-iters", "8"]
    serial = losses(run_training(base, 1))
    parallel = losses(run_training(base + ["--tensor-parallel", "2"], 4))   # tp 2 x dp 2
    assert serial[-1] < serial[0] - 0.05, serial                             # it learns
    assert parallel == pytest.approx(serial, rel=2e-5), (serial, parallel)
    # sequence parallelism with ZeRO-1: its LayerNorm/bias gradients are summed over TP after the
    # data-parallel reduce-scatter
    sp = losses(run_training(base + ["--tensor-parallel", "2", "--sequence-parallel", "--use-distributed-optimizer"],
                             4))
    assert sp == pytest.approx(serial, rel=2e-5), (serial, sp)


@pytest.mark.slow
def test_sequence_parallel_pipeline_matches_serial(embedded_data):
    """tp 2 x pp 2 with --sequence-parallel (stages exchange [s/tp, b, h]) and full recompute."""
    base = TINY_TRAIN + embedded_data + ["--train-iters", "4"]
    serial = losses(run_training(base, 1))
    sp = losses(run_training(base + ["--tensor-parallel", "2", "--pipeline-parallel", "2", "--sequence-parallel",
                                     "--recompute-granularity", "full"], 4))
    assert sp == pytest.approx(serial, rel=2e-5), (serial, sp)


@pytest.mark.slow  # --quick skips it; test_gpt2.py's recompute/RNG-restore tests check the replay in-process
def test_sequence_parallel_dropout_is_replayed_by_recompute(embedded_data):
    """With dropout each TP rank draws its tokens' masks from its own RNG stream; recompute must
    replay them exactly, so checkpointed and plain runs give the same losses."""
    base = TINY_TRAIN + embedded_data + ["--train-iters", "4", "--hidden-dropout", "0.2", "--tensor-parallel", "2",
                                         "--sequence-parallel"]
    plain = losses(run_training(base, 2))
    recomputed = losses(run_training(base + ["--recompute-granularity", "full"], 2))
    assert recomputed == pytest.approx(plain, rel=1e-6), (plain, recomputed)


def test_exact_resume(embedded_data, tmp_path):
    base = TINY_TRAIN + embedded_data
    full = losses(run_training(base + ["--train-iters", "6"]))
    first = run_training(base + ["--train-iters", "6", "--exit-interval", "3", "--save", str(tmp_path)])
    assert first["iteration"] == 3 and open(tmp_path / TRACKER).read() == "3"
    second = run_training(base + ["--train-iters", "6", "--load", str(tmp_path), "--save", str(tmp_path)])
    assert second["consumed"] == 6 * 8
    assert losses(first) + losses(second) == full                            # bitwise on CPU


def test_sigterm_leaves_loadable_checkpoint(embedded_data, tmp_path):
    cmd = [sys.executable, "-m", "megapar.pretrain_gpt2", *TINY_TRAIN, *embedded_data, "--train-iters", "100000",
           "--log-interval", "1", "--exit-signal-handler", "--save", str(tmp_path / "ck")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    for line in proc.stdout:
        if " iteration        2/" in line:
            proc.send_signal(signal.SIGTERM)
            break
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    assert "exiting after SIGTERM" in out
    it = int(open(tmp_path / "ck" / TRACKER).read())
    # --use-checkpoint-opt_param-scheduler: the saved scheduler's (--train-iters 100000)
    resumed = run_training(TINY_TRAIN + embedded_data + ["--train-iters", str(it + 1), "--load", str(tmp_path / "ck"),
                                                         "--use-checkpoint-opt_param-scheduler"])
    assert resumed["iteration"] == it + 1


def _cli(args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "megapar.pretrain_gpt2", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_invalid_layout_fails_with_message():
    r = _cli(["--tensor-parallel", "3", "--train-iters", "1"])
    assert r.returncode == 2 and "world size 1 is not divisible by --tensor-model-parallel-size 3" in r.stderr


def test_mismatched_and_corrupt_checkpoints(embedded_data, tmp_path):
    ck = tmp_path / "ck"
    run_training(TINY_TRAIN + embedded_data + ["--train-iters", "2", "--save", str(ck), "--save-interval", "1"])
    with pytest.raises(Exception, match="--hidden-size 32 \\(checkpoint\\) vs 64 \\(run\\)"):
        run_training(TINY_TRAIN + embedded_data + ["--train-iters", "3", "--load", str(ck), "--hidden-size", "64"])
    with pytest.raises(Exception, match="reshard it first: python tools/checkpoint_util.py"):
        run_training(TINY_TRAIN + embedded_data + ["--train-iters", "3", "--load", str(ck),
                                                   "--tensor-parallel", "2"], world_size=2)
    model_file = ck / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    earlier = ck / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    before = earlier.read_bytes()
    model_file.write_bytes(model_file.read_bytes()[:1000])                   # truncate the latest
    with pytest.raises(Exception, match="iter_0000002/mp_rank_00/model_optim_rng.pt is truncated"):
        run_training(TINY_TRAIN + embedded_data + ["--train-iters", "3", "--load", str(ck)])
    assert earlier.read_bytes() == before                                    # the others are untouched


@pytest.mark.slow
def test_3d_tp2_pp2_dp2_with_zero1_and_recompute_matches_serial(embedded_data):
    """8 gloo processes: (tp, pp, dp) = (2, 2, 2), ZeRO-1, activation checkpointing == (1, 1, 1)."""
    base = TINY_TRAIN + embedded_data + ["--train-iters", "10", "--recompute-granularity", "full",
                                         "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    serial = losses(run_training(base, 1))
    three_d = losses(run_training(base + ["--tensor-parallel", "2", "--pipeline-parallel", "2",
                                          "--use-distributed-optimizer"], 8))
    assert three_d == pytest.approx(serial, rel=2e-5), (serial, three_d)


def test_uneven_pipeline_stages_match_serial(embedded_data):
    base = TINY_TRAIN + embedded_data + ["--train-iters", "4"]
    serial = losses(run_training(base, 1))
    uneven = losses(run_training(base + ["--pipeline-parallel", "2", "--decoder-last-pipeline-num-layers", "1"], 2))
    assert uneven == pytest.approx(serial, rel=2e-5), (serial, uneven)


def test_nan_stops_training_naming_the_iteration(embedded_data, tmp_path):
    """Steps are read back one behind the queue; a non-finite loss still stops the run with the
    iteration that produced it, before any checkpoint of the broken weights is written."""
    cmd = [sys.executable, "-m", "megapar.pretrain_gpt2", *TINY_TRAIN, *embedded_data, "--train-iters", "6",
           "--lr", "1e30", "--lr-warmup-iters", "0", "--clip-grad", "0", "--save", str(tmp_path / "ck"),
           "--save-interval", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "error: NaN/Inf at iteration 2: lm loss" in out and "Traceback" not in out, out[-2000:]
    assert not (tmp_path / "ck").exists()   # taken (and locked) at start; nothing saved, so released and removed


def _iteration_times_body(rank, world_size, argv, workdir, slow):
    """Train with slow host-side work between steps (each `slow` thing takes 3 s more: "export",
    the profile's trace export, written to workdir; "evaluate"; "save"); return the printed
    iteration times."""
    import contextlib
    import io
    import re
    import time
    from torch.profiler import profile

    import megapar.run.training as training
    from megapar.pretrain_gpt2 import parse
    from megapar.run.pretrain import pretrain

    def slowed(fn):
        return lambda *a, **k: (time.sleep(3.0), fn(*a, **k))[1]
    if "export" in slow:
        profile.export_chrome_trace = slowed(profile.export_chrome_trace)
    if "evaluate" in slow:
        training.evaluate = slowed(training.evaluate)
    if "save" in slow:
        from megapar.checkpoint.checkpointer import Checkpointer
        Checkpointer.save = slowed(Checkpointer.save)
    out = io.StringIO()
    os.chdir(workdir)
    with contextlib.redirect_stdout(out):
        pretrain(parse(argv, world_size))
    return [float(t) for t in re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)", out.getvalue())]


@pytest.mark.serial  # wall-clock iteration times: no other test may share the cores meanwhile
def test_writing_a_profile_is_left_out_of_iteration_times(embedded_data, tmp_path):
    from distributed import run_distributed
    argv = TINY_TRAIN + embedded_data + ["--train-iters", "4", "--log-interval", "4", "--profile",
                                         "--profile-step-start", "1", "--profile-step-end", "2"]
    times = run_distributed(_iteration_times_body, 1, args=(argv, str(tmp_path), ["export"]))[0]
    assert (tmp_path / "megapar_trace_rank0.json").exists()
    assert len(times) == 1 and times[0] < 500, times  # with the 3 s export inside: >= 750 ms per iteration


@pytest.mark.slow  # --quick skips it; 15 s of it are sleeps; the profile case above is the quick representative
@pytest.mark.serial  # wall-clock iteration times
def test_evaluation_and_saving_are_left_out_of_iteration_times(embedded_data, tmp_path):
    """Each logged time is its own step's: none holds a 3 s evaluation or save, none is ~0 (steps
    are read back one behind; on the CPU a step is timed when it returns, not when it is read)."""
    from distributed import run_distributed
    argv = TINY_TRAIN + embedded_data + ["--train-iters", "6", "--log-interval", "1", "--eval-interval", "2",
                                         "--eval-iters", "1", "--save", str(tmp_path / "ck"), "--save-interval", "3"]
    times = run_distributed(_iteration_times_body, 1, args=(argv, str(tmp_path), ["evaluate", "save"]))[0]
    assert len(times) == 6 and max(times) < 1500 and min(times) > max(times) / 20, times


def _eval_lines_body(rank, world_size, argv, workdir):
    import contextlib
    import io
    from megapar.pretrain_gpt2 import parse
    from megapar.run.pretrain import pretrain
    out = io.StringIO()
    os.chdir(workdir)
    with contextlib.redirect_stdout(out):
        pretrain(parse(argv, world_size))
    return [line.strip() for line in out.getvalue().splitlines() if "Evaluating iter" in line]


@pytest.mark.slow  # --quick skips it (a training process); the evaluation-size tests below are quick
def test_evaluation_prints_progress_lines(embedded_data, tmp_path):
    """Megatron's `Evaluating iter i/N` after the first batch, every --log-interval batches and the last."""
    from distributed import run_distributed
    argv = TINY_TRAIN + embedded_data + ["--train-iters", "2", "--eval-iters", "5", "--log-interval", "2"]
    lines = run_distributed(_eval_lines_body, 1, args=(argv, str(tmp_path)))[0]
    assert [line.split(" |")[0] for line in lines] == [f"Evaluating iter {i}/5 (val data)" for i in (1, 2, 4, 5)]
    assert all(float(line.rsplit(": ", 1)[1]) > 0 for line in lines)


@pytest.mark.parametrize("flags,eval_iters", [(["--train-iters", "20"], 2),       # a tenth of a short run
                                              (["--train-iters", "5000"], 10),    # the default for a long one
                                              (["--train-iters", "5"], 1),        # at least one batch
                                              (["--train-iters", "20", "--eval-iters", "7"], 7),  # as given
                                              (["--train-samples", "800"], 10)])
def test_evaluation_size_fits_the_run_unless_given(flags, eval_iters):
    from megapar.pretrain_gpt2 import parse
    assert parse(["--data-path", "d_text_document", *flags], 1).log.eval_iters == eval_iters


def test_embedded_default_evaluation_size(tmp_path, monkeypatch):
    from megapar.pretrain_gpt2 import parse
    monkeypatch.chdir(tmp_path)
    assert parse([], 1).log.eval_iters == 4                        # its own size at 300 iterations
    assert parse(["--train-iters", "20"], 1).log.eval_iters == 2   # a tenth of a shorter run


@pytest.mark.parametrize("level, emptied_at", [(0, []), (1, [1]), (2, [1, 2])])
def test_empty_unused_memory_level_picks_megatrons_places(monkeypatch, level, emptied_at):
    """--empty-unused-memory-level: the cache goes back after forward-backward and each evaluation
    batch (place 1) from level 1, after the optimizer too (place 2) at level 2; on GPUs only, and
    never inside a CUDA graph capture."""
    from types import SimpleNamespace

    import torch

    from megapar.config.build import parse_config
    from megapar.run.training import empty_unused_memory
    cfg = parse_config(["--empty-unused-memory-level", str(level)], world_size=1)
    assert cfg.train.empty_unused_memory_level == level
    emptied, capturing = [], [False]
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(place))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    gpu, cpu = (SimpleNamespace(cfg=cfg, device=torch.device(d)) for d in ("cuda", "cpu"))
    for place in (1, 2):
        empty_unused_memory(gpu, place)
        empty_unused_memory(cpu, place)
    assert emptied == emptied_at
    capturing[0] = True
    empty_unused_memory(gpu, 1)
    assert emptied == emptied_at


# Megatron's batch ramp-up over --train-samples: 4 up to 16 in steps of 4 over the first 24 samples
# (one increment per 8 samples consumed), the LR schedule in samples (warmup 16, cosine to 80).
RAMP = ["--train-samples", "80", "--global-batch-size", "16", "--rampup-batch-size", "4", "4", "24",
        "--lr-warmup-samples", "16", "--log-interval", "1"]
TINY_SAMPLES = [f for i, f in enumerate(TINY_TRAIN) if "--lr-warmup-iters" not in TINY_TRAIN[max(0, i - 1):i + 1]]


def _logged(out: str, field: str) -> list[float]:
    return [float(line.split(f"{field}: ")[1].split(" |")[0]) for line in out.splitlines()
            if line.startswith(" iteration") and "consumed samples" in line]


def test_batch_rampup_takes_megatrons_steps_and_schedule(embedded_data):
    """Megatron's calculator: batches 4, 4, 8, 12 while at most 24 samples are consumed, then 16 x 3
    (the partial rest of the 80 dropped): 7 steps, 76 samples. The LR counts samples: warmup
    0, 4/16, 8/16, 16/16 of --lr, then cosine from sample 16 to 80. The first step is a batch-4 run's
    first step."""
    run = subprocess.run([sys.executable, "-m", "megapar.pretrain_gpt2", *TINY_SAMPLES, *embedded_data, *RAMP],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    out = run.stdout
    assert run.returncode == 0, out[-3000:] + run.stderr[-3000:]
    assert _logged(out, "global batch size") == [4, 4, 8, 12, 16, 16, 16]
    assert _logged(out, "consumed samples") == [4, 8, 16, 28, 44, 60, 76]
    cosine = [0.5 * (math.cos(math.pi * (n - 16) / 64) + 1) * 1e-3 for n in (28, 44, 60)]
    assert _logged(out, "learning rate") == pytest.approx([0, 2.5e-4, 5e-4, 1e-3, *cosine], rel=1e-3)
    plain = run_training(TINY_SAMPLES + embedded_data + ["--train-iters", "1", "--global-batch-size", "4"])
    assert _logged(out, "lm loss")[0] == pytest.approx(losses(plain)[0], rel=1e-6)


@pytest.mark.slow
def test_batch_rampup_is_layout_invariant_and_resumes_exactly(embedded_data, tmp_path):
    """dp 2 gives dp 1's losses along the ramp; stopped inside the ramp and resumed, the run takes
    the same batches and LR (both follow the consumed samples in the checkpoint)."""
    base = TINY_SAMPLES + embedded_data + RAMP
    full = run_training(base)
    assert losses(run_training(base, 2)) == pytest.approx(losses(full), rel=2e-5)
    first = run_training(base + ["--exit-interval", "3", "--save", str(tmp_path)])
    assert first["iteration"] == 3 and first["consumed"] == 16
    second = run_training(base + ["--load", str(tmp_path), "--save", str(tmp_path)])
    assert second["consumed"] == 76
    assert losses(first) + losses(second) == losses(full)                    # bitwise on CPU


@pytest.mark.parametrize("min_lr, expect", [("1e-5", "--train-samples 160 --lr-decay-samples 80"),
                                            ("0", "--train-samples 160 --override-opt_param-scheduler")])
def test_train_longer_command_of_a_schedule_in_samples(min_lr, expect):
    """The printed "train longer" command of a sample-based run doubles --train-samples and keeps the
    saved horizon as --lr-decay-samples (or stretches a schedule that ended at LR 0), never mixing in
    the iteration flags that sample-based flags refuse."""
    from types import SimpleNamespace

    from megapar.config.build import parse_config
    from megapar.run.initialize import build_scheduler
    from megapar.run.pretrain import train_longer_command
    argv = [*RAMP, "--min-lr", min_lr, "--save", "ck"]
    cfg = parse_config(argv, world_size=1)
    scheduler = build_scheduler(cfg, SimpleNamespace(param_groups=[{"lr": 0.0, "weight_decay": 0.0}]))
    command = train_longer_command(cfg, scheduler, argv)
    assert expect in command and "--lr-decay-iters" not in command and "--train-iters" not in command
    parse_config(command.split("pretrain_gpt2.sh", 1)[1].split("#")[0].split()[2:], world_size=1)  # it parses


def test_weight_decay_increment_reaches_adamw(embedded_data):
    """The scheduler's weight decay is what AdamW applies: a linear increment from 0.05 to 0.05
    trains as a constant --weight-decay 0.05, bitwise; one from 0 to 2 parts from a constant 0 once
    the decay is above 0 (step 2 on: the first step decays with 0)."""
    base = TINY_TRAIN + embedded_data + ["--train-iters", "4"]
    constant = losses(run_training(base + ["--weight-decay", "0.05"]))
    flat = losses(run_training(base + ["--weight-decay-incr-style", "linear", "--start-weight-decay", "0.05",
                                       "--end-weight-decay", "0.05"]))
    assert flat == constant
    none = losses(run_training(base + ["--weight-decay", "0"]))
    rising = losses(run_training(base + ["--weight-decay-incr-style", "linear", "--start-weight-decay", "0",
                                         "--end-weight-decay", "2"]))
    assert rising[:2] == none[:2] and rising[2] != none[2]


@pytest.mark.slow
def test_params_norm_is_layout_invariant(embedded_data):
    """--log-params-norm (Megatron's): the weights' norm on each iteration line counts every distinct
    weight once, whether it is whole on one rank, split over tp 2 (its replicated LayerNorms and
    biases counted on one rank), split over two pipeline stages (the tied embedding counted on the
    first), or sharded over dp 2 by ZeRO-3. Vocabulary padding held equal (divisible by 128 in all)."""
    base = [*TINY_TRAIN, *embedded_data, "--train-iters", "3", "--log-interval", "1", "--log-params-norm"]

    def norms(procs: int, *flags: str) -> list[float]:
        # unbuffered: the ranks share the pipe, and block-buffered writes would cut each other's lines
        run = subprocess.run(["bash", "scripts/pretrain_gpt2.sh", "--nproc-per-node", str(procs), *base, *flags],
                             capture_output=True, text=True, cwd=ROOT, timeout=600,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        return [float(v) for v in re.findall(r"params norm: ([\d.]+) \|", run.stdout)]  # only iteration lines

    serial = norms(1)
    assert len(serial) == 3 and serial[0] > 0 and len(set(serial)) == 3   # a value per step; the weights move
    for procs, flags in ((2, ["--tensor-parallel", "2", "--make-vocab-size-divisible-by", "64"]),
                         (2, ["--pipeline-parallel", "2"]), (2, ["--zero-stage", "3"])):
        assert norms(procs, *flags) == pytest.approx(serial, rel=1e-5), flags


def _count_evaluations(rank, world_size, argv):
    import megapar.run.pretrain as pretrain_module
    import megapar.run.training as training_module
    from megapar.pretrain_gpt2 import parse
    calls = []
    real = training_module.evaluate

    def counted(run, dataset, iters, split="val"):
        calls.append(split)
        return real(run, dataset, iters, split)
    training_module.evaluate = pretrain_module.evaluate = counted
    state = pretrain_module.pretrain(parse(argv, world_size))
    return calls, state.valid_losses


def test_last_validation_is_not_run_twice(embedded_data):
    """--train-iters a multiple of --eval-interval: the validation at the last iteration is the end-of-training
    one too (evaluated once, logged under both names); the test split is still evaluated."""
    from distributed import run_distributed
    argv = TINY_TRAIN + embedded_data + ["--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1",
                                         "--split", "90,5,5"]
    calls, valid = run_distributed(_count_evaluations, 1, args=(argv,))[0]
    assert [it for it, _ in valid] == [2, 4]
    assert calls == ["val", "val", "test"], calls
