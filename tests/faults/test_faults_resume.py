"""Resuming a training run: the LR schedule it was saved with is kept (a changed one is refused
unless --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler says whose settings
win), a resume at another layout names the flags of the saved layout, the printed "train longer"
command runs (keeping the run's processes; a fine-tune's continues it), a resume with nothing left
to train exits 0 without writing, and the first log line comes after the first iteration, with an
ETA. Tiny real runs (CPU) on an offline byte-level GPT-2 vocabulary and a random corpus."""
from __future__ import annotations

import re
import shlex
import shutil
import sys
import types
from pathlib import Path

import pytest

from harness import ROOT, refused, run, snapshot

sys.path.insert(0, str(ROOT / "tests"))
from synthetic_data import byte_gpt2_files, random_corpus  # noqa: E402

TRAIN = ["python", "-m", "megapar.pretrain_gpt2"]
LR, MIN_LR, WARMUP, ITERS = 1e-3, 1e-4, 1, 4


def _tiny(data: Path) -> list[str]:
    return ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", str(LR), "--min-lr", str(MIN_LR),
            "--lr-warmup-iters", str(WARMUP), "--eval-interval", "0", "--eval-iters", "0", "--split", "98,2,0",
            "--make-vocab-size-divisible-by", "32", "--data-path", str(data / "corpus"),
            "--vocab-file", str(data / "vocab.json"), "--merge-file", str(data / "merges.txt")]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 4-iteration run saved to ck/ (cosine from 1e-3 to 1e-4 over 4 iterations), its flags and output."""
    d = tmp_path_factory.mktemp("resume")
    byte_gpt2_files(str(d))
    random_corpus(str(d / "corpus"))
    base = _tiny(d)
    out = run(TRAIN + base + ["--train-iters", str(ITERS), "--log-interval", "3", "--save", d / "ck"])
    assert out.rc == 0, out.output[-3000:]
    return types.SimpleNamespace(dir=d, ck=d / "ck", base=base, output=out.output)


def _lrs(output: str) -> dict[int, str]:
    """{iteration: learning rate as logged} of Megatron's iteration lines."""
    return {int(m[1]): m[2] for m in re.finditer(r"^ iteration +(\d+)/ *\d+ \| consumed samples:.*?"
                                                 r"learning rate: ([\d.E+-]+)", output, re.M)}


def _expected_lrs(first: int, last: int, decay: int) -> dict[int, str]:
    """The LR logged at iterations first..last by the schedule (LR, MIN_LR, WARMUP, `decay`)."""
    from megapar.optimizer.lr_schedule import OptimizerParamScheduler
    sched = OptimizerParamScheduler(types.SimpleNamespace(param_groups=[{"lr": 0.0}]), LR, MIN_LR, WARMUP, decay)
    sched.step(first - 1)
    out = {}
    for it in range(first, last + 1):
        out[it] = f"{sched.get_lr():.3E}"
        sched.step()
    return out


def test_first_line_after_iteration_one_and_an_eta_on_every_line(trained):
    first = [line for line in trained.output.splitlines() if line.startswith(" iteration        1/")]
    assert len(first) == 1 and "first iteration (ms): " in first[0] and re.search(r"\| ETA: \d+s \|", first[0]), first
    assert "next line at iteration 3 (--log-interval 3)" in first[0]
    lines = [line for line in trained.output.splitlines() if "elapsed time per iteration (ms)" in line]
    assert len(lines) == 2 and all(re.search(r"\| ETA: (\d+h\d\dm|\d+m\d\ds|\d+s) \|$", line) for line in lines), lines
    from megapar.run.training import eta
    assert (eta(1.0, 3725), eta(0.5, 490), eta(2.0, 21), eta(1.0, 0)) == ("1h02m", "4m05s", "42s", "0s")


def test_resume_with_another_schedule_is_refused(trained):
    refused(TRAIN + trained.base + ["--train-iters", "8", "--load", trained.ck, "--save", trained.ck],
            fault_class="resume", case="resume with another --train-iters (LR decay horizon)",
            expect=["--lr-decay-iters 4 (checkpoint) vs 8 (run)", "--use-checkpoint-opt_param-scheduler",
                    "--override-opt_param-scheduler"], watch=[trained.ck])
    refused(TRAIN + trained.base + ["--train-iters", str(ITERS + 1), "--lr", "2e-3", "--weight-decay", "0.1",
                                    "--load", trained.ck, "--save", trained.ck],
            fault_class="resume", case="resume with another --lr and --weight-decay",
            expect=["--lr 0.001 (checkpoint) vs 0.002 (run)", "--weight-decay 0.01 (checkpoint) vs 0.1 (run)"],
            watch=[trained.ck])


def test_both_schedule_flags_are_refused(trained):
    refused(TRAIN + trained.base + ["--train-iters", "8", "--load", trained.ck, "--override-opt_param-scheduler",
                                    "--use-checkpoint-opt_param-scheduler"],
            fault_class="resume", case="--override- and --use-checkpoint-opt_param-scheduler together",
            expect="choose one", watch=[trained.ck])


@pytest.mark.parametrize("flag, decay", [("--use-checkpoint-opt_param-scheduler", ITERS),
                                         ("--override-opt_param-scheduler", 8)])
def test_a_schedule_flag_says_whose_schedule_continues(trained, flag, decay):
    """Without --save nothing is written: the checkpoint stays byte-identical."""
    before = snapshot([trained.ck])
    out = run(TRAIN + trained.base + ["--train-iters", "8", "--log-interval", "1", "--load", trained.ck, flag])
    assert out.rc == 0, out.output[-3000:]
    assert _lrs(out.output) == _expected_lrs(ITERS + 1, 8, decay)
    if decay == ITERS:
        assert set(_lrs(out.output).values()) == {f"{MIN_LR:.3E}"}      # past the saved horizon: --min-lr
    assert snapshot([trained.ck]) == before


def _printed(output: str, comment: str, ck: Path, copy: Path) -> list[str]:
    """The printed command whose comment starts `comment`, as given (the launcher and its process
    count included), on `copy` instead of `ck`."""
    line = next(line for line in output.splitlines() if f"# {comment}" in line)
    cmd = shlex.split(line.replace(str(ck), str(copy)), comments=True)
    assert cmd[:2] == ["bash", "scripts/pretrain_gpt2.sh"], line
    return cmd


def _train_longer(output: str, ck: Path, copy: Path, as_printed: bool = False) -> list[str]:
    """The printed "train longer" command on `copy`: as printed, or (cheaper: no torchrun) the training
    flags it gives to one process, run with python after checking that it asks for one."""
    cmd = _printed(output, "train longer", ck, copy) + ["--log-interval", "1"]
    if as_printed:
        return cmd
    assert cmd[2:4] == ["--nproc-per-node", "1"], cmd
    return TRAIN + cmd[4:]


def test_printed_train_longer_command_continues_the_schedule(trained, tmp_path):
    copy = tmp_path / "ck"
    shutil.copytree(trained.ck, copy)
    out = run(_train_longer(trained.output, trained.ck, copy))
    assert out.rc == 0, out.output[-3000:]
    assert "training 8 iterations from iteration 4" in out.output
    assert _lrs(out.output) == _expected_lrs(ITERS + 1, 8, ITERS)    # the saved horizon: --min-lr from here on
    assert (copy / "latest_checkpointed_iteration.txt").read_text() == "8"
    again = run(_train_longer(out.output, copy, copy))                   # and its own hint runs too
    assert again.rc == 0 and "training 16 iterations from iteration 8" in again.output, again.output[-3000:]


def test_printed_train_longer_command_when_the_schedule_ends_at_zero(trained, tmp_path):
    """A schedule that decays to LR 0 would train nothing more: the hint stretches it (the LR rises)."""
    flags = [a if a != str(MIN_LR) else "0" for a in trained.base]
    first = run(TRAIN + flags + ["--train-iters", "2", "--save", tmp_path / "ck"])
    assert first.rc == 0, first.output[-3000:]
    out = run(_train_longer(first.output, tmp_path / "ck", tmp_path / "ck"))
    assert out.rc == 0, out.output[-3000:]
    train_longer = next(line for line in first.output.splitlines() if "# train longer" in line)
    assert "--override-opt_param-scheduler" in train_longer
    lrs = _lrs(out.output)
    assert sorted(lrs) == [3, 4] and all(float(v) > 0 for v in lrs.values()), lrs


def test_resume_at_another_layout_names_the_saved_layout(trained, tmp_path):
    tp2 = tmp_path / "ck_tp2"
    conv = run(["python", "tools/checkpoint_util.py", "--load-dir", trained.ck, "--save-dir", tp2,
                "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "1"])
    assert conv.rc == 0, conv.output[-3000:]
    refused(TRAIN + trained.base + ["--train-iters", str(ITERS + 2), "--load", tp2, "--save", tp2],
            fault_class="resume", case="resume a tp 2 checkpoint at tp 1",
            expect=["saved with tensor-parallel 2 x pipeline-parallel 1",
                    "(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1, on a multiple of 2 processes)",
                    "python tools/checkpoint_util.py"], watch=[tp2])


def test_another_pipeline_split_names_the_saved_split():
    import argparse

    from megapar.config.settings import ModelConfig
    from megapar.checkpoint import CheckpointError, check_compatible, read_saved_config
    from megapar.topology import Topology
    saved = read_saved_config({"args": argparse.Namespace(num_layers=4, tensor_model_parallel_size=1,
                                                          pipeline_model_parallel_size=2,
                                                          decoder_first_pipeline_num_layers=3)})
    with pytest.raises(CheckpointError,
                       match=r"its layout: --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 "
                             r"--decoder-first-pipeline-num-layers 3"):
        check_compatible(saved, ModelConfig(num_layers=4), Topology(1, 2, 1), "ck")
    with pytest.raises(CheckpointError, match=r"\(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 "
                                              r"--decoder-first-pipeline-num-layers 3, on a multiple of 2 processes\)"):
        check_compatible(saved, ModelConfig(num_layers=4), Topology(1, 1, 1), "ck")


def test_nothing_left_to_do_exits_0_without_writing(trained):
    before = snapshot([trained.ck])
    out = run(TRAIN + trained.base + ["--train-iters", str(ITERS), "--load", trained.ck, "--save", trained.ck])
    assert out.rc == 0, out.output[-3000:]
    assert "> nothing to do: the checkpoint in" in out.output and "at iteration 4 and this run ends at iteration 4" \
        in out.output
    assert "training 4 iterations" not in out.output and "saving checkpoint" not in out.output
    assert snapshot([trained.ck]) == before                                  # nothing changed, nothing new


def test_rerun_after_train_longer_exits_0_with_nothing_to_do(trained, tmp_path):
    """The first command run again after its own train-longer command (a longer LR schedule in the checkpoint):
    nothing to do, exit 0, not an LR-schedule refusal."""
    import shutil
    ck = str(tmp_path / "ck")
    shutil.copytree(trained.ck, ck)
    longer = run(TRAIN + trained.base + ["--train-iters", str(ITERS + 2), "--load", ck, "--save", ck,
                                         "--override-opt_param-scheduler"])
    assert longer.rc == 0, longer.output[-3000:]
    before = snapshot([ck])
    out = run(TRAIN + trained.base + ["--train-iters", str(ITERS), "--load", ck, "--save", ck])
    assert out.rc == 0 and "error" not in out.output, out.output[-3000:]
    assert f"> nothing to do: the checkpoint in {ck} is at iteration {ITERS + 2} and this run ends at iteration " \
           f"{ITERS}" in out.output
    assert snapshot([ck]) == before


def test_train_longer_command_rewrites_the_flags():
    """Unit check of the hint: --load/--save/--train-iters/--lr-decay-iters in either spelling are replaced, a
    kept schedule keeps --use-checkpoint-opt_param-scheduler, the embedded default's (which ends at LR 0)
    is stretched."""
    from megapar.pretrain_gpt2 import parse
    from megapar.run.pretrain import train_longer_command
    argv = ["--train-iters=4", "--lr-decay-iters", "9", "--min-lr", "1e-5", "--load", "a", "--save=b",
            "--use-checkpoint-opt_param-scheduler", "--override-opt-param-scheduler", "--seed", "3"]
    cfg = parse(["--train-iters", "4", "--min-lr", "1e-5", "--save", "b", "--data-path", "x"], 1)
    sched = types.SimpleNamespace(min_lr=1e-5, decay_style="cosine", decay_steps=9)
    assert train_longer_command(cfg, sched, argv).split("   #")[0] == (
        "bash scripts/pretrain_gpt2.sh --nproc-per-node 1 --min-lr 1e-5 --use-checkpoint-opt_param-scheduler --seed 3 "
        "--load b --save b --train-iters 8 --lr-decay-iters 9")
    cfg = parse([], 1)                                   # the embedded default: 300 iterations, cosine to 0
    sched = types.SimpleNamespace(min_lr=0.0, decay_style="cosine", decay_steps=300)
    assert train_longer_command(cfg, sched, []).split("   #")[0] == (
        f"bash scripts/pretrain_gpt2.sh --nproc-per-node 1 --load {cfg.ckpt.save} --save {cfg.ckpt.save} "
        f"--train-iters 600 --override-opt_param-scheduler")


def test_a_run_stopped_early_is_told_how_to_resume():
    """After a signal or --exit-interval, the hint is the same run resumed, not a longer one."""
    from megapar.pretrain_gpt2 import parse
    from megapar.run.pretrain import resume_command
    argv = ["--train-iters", "100", "--save", "b", "--load=b", "--exit-signal-handler"]
    cfg = parse(argv + ["--data-path", "x"], 1)
    assert resume_command(cfg, argv).split("   #")[0] == (
        "bash scripts/pretrain_gpt2.sh --nproc-per-node 1 --train-iters 100 --exit-signal-handler --load b --save b")


def test_a_fine_tunes_next_commands_resume_it_without_finetune(tmp_path):
    """A fine-tune saves into its own --save; continuing it loads that, so --finetune (refused with --save equal
    to --load) is dropped from both hints."""
    from megapar.pretrain_gpt2 import parse
    from megapar.run.pretrain import resume_command, train_longer_command
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "latest_checkpointed_iteration.txt").write_text("release")
    ft = str(tmp_path / "ft")
    argv = ["--train-iters", "100", "--load", str(tmp_path / "base"), "--save", ft, "--finetune", "--seed", "3"]
    cfg = parse(argv + ["--data-path", "x"], 1)
    sched = types.SimpleNamespace(min_lr=1e-5, decay_style="cosine", decay_steps=100)
    for hint in (resume_command(cfg, argv), train_longer_command(cfg, sched, argv)):
        flags = hint.split("   #")[0].split()[4:]
        assert "--finetune" not in flags and flags[flags.index("--load") + 1] == ft, hint
        parse(flags + ["--data-path", "x"], 1)   # the hint itself is accepted


def test_the_next_commands_keep_the_processes_of_the_run(monkeypatch):
    """A run of several processes is continued by as many: the launcher's flags come from what torchrun
    started this process with (its environment), node 0's rendezvous flags for several nodes."""
    from megapar.config.command import Processes
    from megapar.pretrain_gpt2 import parse
    from megapar.run.pretrain import resume_command, train_longer_command
    argv = ["--train-iters", "100", "--save", "b", "--tensor-model-parallel-size", "2"]
    cfg = parse(argv + ["--data-path", "x"], 8)
    sched = types.SimpleNamespace(min_lr=1e-5, decay_style="cosine", decay_steps=100)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("MASTER_PORT", "6001")
    assert Processes.of_this_run() == Processes(4, 2, "10.0.0.7", 6001)
    for hint in (resume_command(cfg, argv), train_longer_command(cfg, sched, argv)):
        assert hint.startswith("bash scripts/pretrain_gpt2.sh --nnodes 2 --node-rank 0 --master-addr 10.0.0.7 "
                               "--master-port 6001 --nproc-per-node 4 --"), hint
        assert "--tensor-model-parallel-size 2" in hint and hint.endswith("on node 0; the same with --node-rank 1 "
                                                                          "on the other node"), hint
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resume_command(cfg, argv).startswith("bash scripts/pretrain_gpt2.sh --nproc-per-node 2 --train-iters 100 "
                                                "--tensor-model-parallel-size 2 --load b --save b")


@pytest.mark.slow
def test_a_fine_tune_says_what_it_loaded_and_its_train_longer_command_continues_it(trained, tmp_path):
    """--finetune names the checkpoint and iteration it took the weights from, and that the optimizer and the
    iteration count start afresh; its printed "train longer" command continues the fine-tune from its own
    --save (not from iteration 0 again). Two runs; test_a_fine_tunes_next_commands_resume_it_without_finetune
    is the quick check of the command."""
    ft = tmp_path / "ft"
    out = run(TRAIN + trained.base + ["--train-iters", "2", "--load", trained.ck, "--finetune", "--save", ft])
    assert out.rc == 0, out.output[-3000:]
    assert (f"successfully loaded checkpoint from {trained.ck} at iteration {ITERS} (--finetune: the model weights "
            f"only; a fresh optimizer and LR schedule, starting at iteration 0)") in out.output
    assert "training 2 iterations from iteration 0" in out.output, out.output[-3000:]
    longer = _train_longer(out.output, ft, ft)
    assert "--finetune" not in longer and longer[longer.index("--load") + 1] == str(ft)
    again = run(longer)
    assert again.rc == 0, again.output[-3000:]
    assert f"successfully loaded checkpoint from {ft} at iteration 2\n" in again.output
    assert "training 4 iterations from iteration 2" in again.output, again.output[-3000:]


@pytest.mark.slow
def test_a_data_parallel_runs_printed_command_keeps_its_processes(trained, tmp_path):
    """Two processes (dp 2) through the launcher; its printed "train longer" command, run as printed, starts two
    again (test_the_next_commands_keep_the_processes_of_the_run is the quick check)."""
    ck = tmp_path / "ck"
    launcher = ["bash", "scripts/pretrain_gpt2.sh", "--nproc-per-node", "2"]
    first = run(launcher + trained.base + ["--train-iters", "2", "--save", ck])
    assert first.rc == 0, first.output[-3000:]
    assert "world size 2 = tensor 1 x pipeline 1 x data 2" in first.output
    longer = _train_longer(first.output, ck, ck, as_printed=True)
    assert longer[2:4] == ["--nproc-per-node", "2"], longer
    again = run(longer)
    assert again.rc == 0, again.output[-3000:]
    assert "world size 2 = tensor 1 x pipeline 1 x data 2" in again.output
    assert "training 4 iterations from iteration 2" in again.output, again.output[-3000:]
