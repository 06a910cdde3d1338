"""benchmarks/bench_vs_anchors.py's parts that run without a GPU: the runs planned from megapar's
recipes, the budget, the tables and ratios, a failed worker's row, and FSDP2's worker itself on the
CPU (gloo) at a tiny shape (its GPU runs are the lead's)."""
import importlib
import time
from dataclasses import replace
from pathlib import Path

import pytest

from megapar.config.recipes import GPT_1_3B, RECIPES, words

ROOT = Path(__file__).resolve().parents[2]
NANOGPT = ROOT / ".gpu" / "nanogpt"  # nanoGPT's model.py is never committed: git-ignored, where present


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # its sibling imports
    return importlib.import_module("bench_vs_anchors")


def args_for(bench, tmp_path, *argv):
    return bench.parse_args(["--out", str(tmp_path / "out"), "--systems", "megapar", "deepspeed", *argv])


@pytest.mark.parametrize("variant", ["graph", "compile"])
@pytest.mark.parametrize("stage", [2, 3])
def test_plan_takes_the_shape_from_megapars_recipe(bench, tmp_path, variant, stage):
    name = bench.VARIANTS[variant].format(shape="345m", stage=stage)
    if name not in RECIPES:
        pytest.skip(f"recipe {name} is not in this checkout's megapar/config/recipes.py")
    args = args_for(bench, tmp_path, "--megapar-variants", variant)
    plan = bench.stage_plan(stage, args, 50257)
    s = plan.spec
    assert (s.layers, s.hidden, s.heads, s.seq, s.vocab, s.token_vocab) == (24, 1024, 16, 1024, 50304, 50257)
    assert (s.micro_batch, s.global_batch, s.stage, s.offload, s.recompute, s.iters) == (8, 16, stage, False, False, 30)
    assert (s.lr, s.clip_grad) == (3e-4, 1.0) and s.result_path == str(tmp_path / "out" / f"result_zero{stage}.json")
    (flags,) = plan.megapar.values()
    assert flags[:2] == ["--recipe", name] and flags[flags.index("--log-interval") + 1] == "1"
    assert flags[flags.index("--train-iters") + 1] == "30" and "--hidden-dropout" in flags


def test_both_variants_share_one_anchor_spec(bench, tmp_path):
    if not all(v.format(shape="345m", stage=2) in RECIPES for v in bench.VARIANTS.values()):
        pytest.skip("the graphed dp2 ZeRO recipes are not in this checkout")
    plan = bench.stage_plan(2, args_for(bench, tmp_path, "--megapar-variants", "graph", "compile"), 50257)
    assert list(plan.megapar) == ["345m-dp2-zero2-graph", "345m-dp2-zero2"]


def test_defaults_and_bad_options(bench, tmp_path, capsys):
    args = args_for(bench, tmp_path)
    assert (args.shape, args.stages, args.megapar_variants, args.iters, args.warmup, args.rounds) == \
        ("345m", [2, 3], ["graph"], 30, 10, 1)
    with pytest.raises(SystemExit):
        args_for(bench, tmp_path, "--iters", "10")
    assert "--iters must be more than --warmup (10)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--systems", "fsdp2", "--nanogpt-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert f"error: --nanogpt-dir {tmp_path} has no model.py; copy nanoGPT's" in err.strip().splitlines()[-1]


@pytest.mark.parametrize("stage", [2, 3])
def test_shape_1_3b_plans_the_1_3b_recipes_and_model_for_every_system(bench, tmp_path, stage):
    args = args_for(bench, tmp_path, "--shape", "1.3b", "--megapar-variants", "graph", "compile")
    plan = bench.stage_plan(stage, args, 50257)
    assert list(plan.megapar) == [f"1.3b-dp2-zero{stage}-graph", f"1.3b-dp2-zero{stage}"]
    assert plan.shape == bench.Shape(words(GPT_1_3B), 2, stage) and plan.stage == stage
    s = plan.spec  # DeepSpeed's GPT2Config and FSDP2's GPTConfig are built from it
    assert (s.layers, s.hidden, s.heads, s.seq, s.vocab) == (24, 2048, 16, 1024, 50304)
    assert (s.micro_batch, s.global_batch, s.stage, s.offload, s.recompute) == (8, 16, stage, False, False)
    assert bench.fsdp2_payload(s, "x", True)["spec"]["hidden"] == 2048


def test_a_shape_whose_recipes_are_another_model_is_refused(bench, tmp_path, monkeypatch):
    monkeypatch.setitem(bench.MODELS, "345m", words(GPT_1_3B))
    with pytest.raises(AssertionError, match="are not the 345m shape"):
        bench.stage_plan(2, args_for(bench, tmp_path), 50257)


def test_an_unknown_recipe_is_one_line_before_any_run(bench, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(bench.VARIANTS, "graph", "no-such-recipe-{stage}")
    with pytest.raises(SystemExit) as e:
        bench.main(["--out", str(tmp_path / "out"), "--systems", "megapar"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and "no-such-recipe-2" in err
    assert err.strip().count("\n") == 0 and not (tmp_path / "out").exists()


def test_run_limit_keeps_inside_the_budget(bench):
    assert bench.run_limit(420, None) == 420
    assert bench.run_limit(420, time.monotonic() + 10_000) == 420
    assert 200 < bench.run_limit(420, time.monotonic() + 300) <= 300
    assert bench.run_limit(420, time.monotonic() + bench.MIN_RUN_S - 5) == 0


def spec(bench, tmp_path, stage=2):
    plan = bench.stage_plan(stage, args_for(bench, tmp_path, "--megapar-variants", "compile"), 50257)
    return plan.spec


def row(bench, s, kind, system, ms, rnd=0):
    return {"round": rnd, "stage": s.stage, "kind": kind, **bench.worker_row(system, {
        "step_ms": [9999.0] * 10 + [ms] * 20, "max_allocated_mib": 2048.0, "version": "x"}, s, 2, 989.0, 10)}


def test_tables_and_ratios(bench, tmp_path):
    s2, s3 = spec(bench, tmp_path, 2), spec(bench, tmp_path, 3)
    rows = [row(bench, s2, "megapar", "megapar 345m-dp2-zero2-graph", 100.0),
            row(bench, s2, "deepspeed", "DeepSpeed 0.19.8 ZeRO-2", 150.0),
            row(bench, s2, "fsdp2", "FSDP2 reshard_after_forward=False", 125.0),
            row(bench, s3, "megapar", "megapar 345m-dp2-zero3-graph", 110.0),
            {"round": 0, "stage": 3, "kind": "deepspeed", "system": "DeepSpeed ZeRO-3", "error": "rc=1: OOM (log: x)"},
            row(bench, s2, "megapar", "megapar 345m-dp2-zero2-graph", 100.0, rnd=1),
            row(bench, s2, "deepspeed", "DeepSpeed 0.19.8 ZeRO-2", 200.0, rnd=1),
            row(bench, s2, "fsdp2", "FSDP2 reshard_after_forward=False", 125.0, rnd=1),
            row(bench, s3, "megapar", "megapar 345m-dp2-zero3-graph", 110.0, rnd=1),
            row(bench, s3, "deepspeed", "DeepSpeed 0.19.8 ZeRO-3", 220.0, rnd=1)]
    assert rows[0]["tokens_s"] == 16 * 1024 / 0.1  # steps 11-30: the warm-up's 9999 ms left out
    got = [(st, ours, theirs, [None if x is None else round(x, 6) for x in per])
           for st, ours, theirs, per in bench.ratios(rows)]
    assert got == [(2, "megapar 345m-dp2-zero2-graph", "DeepSpeed 0.19.8 ZeRO-2", [1.5, 2.0]),
                   (2, "megapar 345m-dp2-zero2-graph", "FSDP2 reshard_after_forward=False", [1.25, 1.25]),
                   (3, "megapar 345m-dp2-zero3-graph", "DeepSpeed 0.19.8 ZeRO-3", [None, 2.0])]
    runs = bench.format_runs(rows, "H100").splitlines()
    assert runs[4] == "| 0 | 2 | megapar 345m-dp2-zero2-graph | 100.0 | 163840 | 81920 | " \
                      f"{rows[0]['tflops']:.1f} | {rows[0]['mfu']:.1%} | 2.0 |"
    assert runs[8] == "| 0 | 3 | DeepSpeed ZeRO-3 | failed: rc=1: OOM (log: x) | | | | | |"
    table = bench.format_ratios(rows).splitlines()
    assert table[2] == "| 2 | megapar 345m-dp2-zero2-graph | DeepSpeed 0.19.8 ZeRO-2 | 1.50x, 2.00x |"
    assert table[4] == "| 3 | megapar 345m-dp2-zero3-graph | DeepSpeed 0.19.8 ZeRO-3 | n/a, 2.00x |"


def test_each_anchor_run_of_a_sweep_gets_its_own_ratio(bench, tmp_path):
    s2 = spec(bench, tmp_path, 2)
    units = {1: 200.0, 24: 150.0}   # FSDP2 runs of --fsdp2-blocks-per-unit 1 24: ms per step
    rows = [row(bench, s2, "megapar", "megapar 345m-dp2-zero2-graph", 100.0)]
    for n, ms in units.items():
        label = f"FSDP2 reshard_after_forward=False, {n} block(s) per unit"
        rows.append({**row(bench, s2, "fsdp2", f"{label} (torch x)", ms), "label": label})
    got = [(theirs, round(per[0], 6)) for _, _, theirs, per in bench.ratios(rows)]
    assert got == [("FSDP2 reshard_after_forward=False, 1 block(s) per unit (torch x)", 2.0),
                   ("FSDP2 reshard_after_forward=False, 24 block(s) per unit (torch x)", 1.5)]


@pytest.mark.slow
def test_a_failed_worker_is_a_row_with_its_last_error(bench, tmp_path):
    s = replace(spec(bench, tmp_path), iters=3)
    payload = bench.fsdp2_payload(s, str(tmp_path), False, "cpu")  # a folder without nanoGPT's model.py
    (tmp_path / "out").mkdir()
    got = bench.run_fsdp2(s, payload, 2, None, str(tmp_path / "out" / "fsdp2.log"), 120, 1)
    assert got["system"] == "FSDP2 reshard_after_forward=False, 1 block(s) per unit"
    assert got["error"].startswith("rc=1: FileNotFoundError: ") and "model.py" in got["error"]
    assert (tmp_path / "out" / "fsdp2.log").read_text().count("Traceback") >= 1


@pytest.mark.slow
@pytest.mark.skipif(not (NANOGPT / "model.py").is_file(), reason="nanoGPT's model.py is not in .gpu/nanogpt")
@pytest.mark.parametrize("stage", [2, 3])
def test_fsdp2_worker_trains_on_two_cpu_processes(bench, tmp_path, stage):
    from bench_offload_vs_deepspeed import DsSpec
    s = DsSpec(layers=2, hidden=64, heads=4, seq=32, vocab=128, token_vocab=100, micro_batch=2, global_batch=8,
               stage=stage, lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, clip_grad=1.0, recompute=False,
               iters=3, result_path=str(tmp_path / "result.json"), offload=False)
    log, trace = tmp_path / "fsdp2.log", tmp_path / "trace.json"
    payload = bench.fsdp2_payload(s, str(NANOGPT), False, "cpu", warmup=1, profile_path=str(trace),
                                  blocks_per_unit=stage - 1)  # 1: a unit per block; 2: both blocks in one unit
    result, why = bench.run_worker([bench.__file__, bench.FSDP2_WORKER], payload, s.result_path, 2, str(log), 120)
    assert why == "" and len(result["step_ms"]) == 3 and result["max_allocated_mib"] == 0.0
    assert all(ms > 0 for ms in result["step_ms"])
    lines = log.read_text().splitlines()
    assert sum("FSDP2 step" in line for line in lines) == 3
    loss = float(next(line for line in lines if "last lm loss" in line).split(": ")[1])
    assert 4.0 < loss < 5.5  # ln(100) = 4.6 on random tokens
    assert "traceEvents" in trace.read_text()  # steps 2 and 3 profiled (--fsdp2-profile)
