"""benchmarks/bench_offload_vs_deepspeed.py's pure parts: the DeepSpeed run derived from megapar's
flags, DeepSpeed's config, megapar's log parsed, the table's maths (its GPU runs are the lead's)."""
import importlib
from dataclasses import replace
import sys
from pathlib import Path

import pytest

from megapar.run.throughput import flops_per_token, throughput_fields

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # its sibling import of bench_train
    return importlib.import_module("bench_offload_vs_deepspeed")


def spec_for(bench, argv, token_vocab=50257):
    args = bench.parse_args(argv)
    shape = bench.SHAPES[args.shape]
    return bench.ds_spec(bench.megapar_flags(shape, args), shape, token_vocab, args.ds_stage, args.iters, "r.json")


def test_spec_mirrors_megapars_parsed_flags(bench):
    s = spec_for(bench, [])
    assert (s.layers, s.hidden, s.heads, s.seq, s.vocab, s.token_vocab) == (32, 4096, 32, 2048, 50304, 50257)
    assert (s.micro_batch, s.global_batch, s.stage, s.recompute, s.iters) == (2, 16, 2, False, 6)
    assert (s.lr, s.betas, s.eps, s.weight_decay, s.clip_grad) == (3e-4, (0.9, 0.999), 1e-8, 0.01, 1.0)
    s = spec_for(bench, ["--shape", "1.3b", "--global-batch-size", "32", "--ds-stage", "3",
                         "--megapar-extra", "--recompute-activations", "--adam-beta2", "0.95"])
    assert (s.layers, s.hidden, s.heads, s.global_batch, s.stage, s.recompute, s.betas) == \
        (24, 2048, 16, 32, 3, True, (0.9, 0.95))
    s = spec_for(bench, ["--shape", "13b"])
    assert (s.layers, s.hidden, s.heads, s.stage) == (40, 5120, 40, 3) and bench.SHAPES["13b"].gpus == 2


def test_megapar_flags_keep_the_offload_recipe_and_put_extra_last(bench):
    args = bench.parse_args(["--shape", "13b", "--megapar-extra", "--delayed-param-update"])
    flags = bench.megapar_flags(bench.SHAPES["13b"], args)
    assert flags[:2] == ["--recipe", "6.7b-offload"] and flags[-1] == "--delayed-param-update"
    assert flags[flags.index("--zero-stage") + 1] == "3" and flags[flags.index("--log-interval") + 1] == "1"


def test_ds_config(bench):
    spec = spec_for(bench, [])
    c = bench.ds_config(spec, 1)
    assert (c["train_batch_size"], c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"]) == (16, 2, 8)
    zero = c["zero_optimization"]
    assert zero["stage"] == 2 and zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["contiguous_gradients"] and zero["overlap_comm"] and "allgather_bucket_size" in zero
    assert c["bf16"] == {"enabled": True} and c["gradient_clipping"] == 1.0
    assert c["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                          "weight_decay": 0.01}}
    c3 = bench.ds_config(replace(spec, stage=3), 2)
    assert c3["gradient_accumulation_steps"] == 4 and "stage3_prefetch_bucket_size" in c3["zero_optimization"]
    with pytest.raises(ValueError, match="not a multiple"):
        bench.ds_config(replace(spec, global_batch=6), 2)


def test_megapar_log_parsed_and_warmup_left_out(bench):
    fpt = flops_per_token(32, 4096, 2048, 50304)
    lines = [" iteration        1/       5 | first iteration (ms): 9000.0 | learning rate: 0.0 |"]
    for it, seconds in ((2, 8.0), (3, 6.0), (4, 5.0), (5, 7.0)):
        lines.append(f" iteration {it:8d}/       5 | consumed samples: {16 * it:12d} | elapsed time per iteration "
                     f"(ms): {seconds * 1000:.1f} | learning rate: 1.0E-04 | lm loss: 1.0E+01 | "
                     f"{throughput_fields(16 * 2048, seconds, fpt, 1, 989.0)} | ETA: 1s |")
    lines.append(" memory (MB) | allocated: 100 | max allocated: 40000 | reserved: 1 | max reserved: 2")
    steps = bench.megapar_step_ms("\n".join(lines))
    assert steps == {2: 8000.0, 3: 6000.0, 4: 5000.0, 5: 7000.0}
    assert bench.steady_mean(steps) == 6000.0
    with pytest.raises(ValueError, match="--iters 3"):
        bench.steady_mean({1: 1.0, 2: 2.0})


def test_table_row_maths_and_ratio(bench):
    spec = spec_for(bench, [])
    row = bench.table_row("megapar", 4000.0, spec, 1, 989.0, 40960)
    assert row["tokens_s"] == 16 * 2048 / 4.0
    assert row["tflops"] == pytest.approx(flops_per_token(32, 4096, 2048, 50304) * 8192 / 1e12)
    assert row["mfu"] == pytest.approx(row["tflops"] / 989.0) and row["mem_gib"] == 40.0
    assert bench.table_row("x", 1000.0, spec, 2, None, 0)["mfu"] is None
    ds = bench.table_row("DeepSpeed 0.19.8 ZeRO-2", 8000.0, spec, 1, 989.0, 20480)
    table = bench.format_table([(0, row), (0, ds), (1, row), (1, {"system": "DeepSpeed ZeRO-2", "error": "rc=1: OOM"})],
                               "H100")
    lines = table.splitlines()
    assert "| 0 | megapar | 4000 | 8192 |" in lines[4] and lines[4].endswith("| 2.00x |")
    assert "failed: rc=1: OOM" in lines[7] and lines[6].endswith("|  |")


def test_host_peak_sees_what_a_run_allocates(bench, tmp_path):
    """run_logged reports the largest resident memory of the command's process tree: here a child
    process that holds 300 MiB for a few samples."""
    code = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
            "\"import time; b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(2.5)\"])")
    rc, _, host = bench.run_logged([sys.executable, "-c", code], str(tmp_path / "run.log"), timeout=30)
    assert rc == 0 and 0.3 < host < 0.6, host


def test_iters_must_outlast_the_warmup(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--iters", "2"])
    assert "--iters must be more than the 2 warm-up steps" in capsys.readouterr().err


@pytest.mark.parametrize("extra, says", [(["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
                                         (["--zero-stage", "0"], "--optimizer-cpu-offload")])
def test_bad_megapar_flags_are_one_line_before_any_run(bench, tmp_path, capsys, extra, says):
    with pytest.raises(SystemExit) as e:
        bench.main(["--out", str(tmp_path), "--megapar-extra", *extra])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and says in err and err.strip().count("\n") == 0
    assert not list(tmp_path.iterdir())  # nothing ran: no log, no spec


def test_ds_config_without_offload_leaves_the_optimizer_to_the_worker(bench):
    spec = replace(spec_for(bench, ["--ds-stage", "3"]), offload=False, micro_batch=8)
    c = bench.ds_config(spec, 2)
    assert "optimizer" not in c and "offload_optimizer" not in c["zero_optimization"]
    assert c["zero_optimization"]["stage"] == 3 and c["gradient_accumulation_steps"] == 1
    assert c["bf16"] == {"enabled": True} and c["gradient_clipping"] == 1.0


def test_decay_groups_leave_biases_and_norms_undecayed(bench):
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, plain = bench.decay_groups(model)
    assert [p.shape for p in decay["params"]] == [(4, 4)] and len(plain["params"]) == 3
    assert plain["weight_decay"] == 0.0 and "weight_decay" not in decay
    model[0].weight.data = torch.empty(0)  # as deepspeed.zero.Init leaves a partitioned parameter
    model[0].weight.ds_shape = torch.Size([4, 4])
    assert bench.decay_groups(model)[0]["params"] == [model[0].weight]


def test_failure_names_the_ranks_error_not_the_launchers(bench):
    out = ("step 1\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
           "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
           "E1126 api.py:1002] failed (exitcode: 1) local_rank: 1\nTraceback (most recent call last):\n"
           "  File \"run.py\", line 9\n    raise ChildFailedError(\n"
           f"{bench.LAUNCHER_FAILED}: \n=====\nx.py FAILED\n  error_file: <N/A>\n=====\n")
    assert bench.failure(1, out, "l.log") == "rc=1: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate " \
                                             "2.00 GiB (log: l.log)"
    assert bench.failure(2, "error: --zero-stage 0 ...\n", "l.log") == "rc=2: error: --zero-stage 0 ... (log: l.log)"


def test_a_timeout_kills_the_command_and_its_descendants(bench, tmp_path):
    import os
    import time
    pid_file = tmp_path / "pid"  # a grandchild in a session of its own, as torchrun starts its ranks
    rc, out, _ = bench.run_logged(["bash", "-c", f"echo started; setsid sleep 60 & echo $! > {pid_file}; wait"],
                                  str(tmp_path / "run.log"), timeout=1)
    assert rc == 124 and out.startswith("started") and out.endswith("timed out after 1 s")
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # SIGKILL is delivered at once; its exit is noticed by its reaper
        if not os.path.exists(f"/proc/{grandchild}") or "Z" in open(f"/proc/{grandchild}/stat").read().split()[2]:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the command's child {grandchild} outlived the timeout")
    assert "timed out after 1 s" in (tmp_path / "run.log").read_text()
