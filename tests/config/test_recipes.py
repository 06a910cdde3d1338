"""megapar.config.recipes: every named run recipe is a valid run on its GPU count; `--recipe` expands in
place with the command line's flags winning; an unknown name fails in one line naming the recipes."""
import subprocess
import sys

import pytest
import torch

from megapar.config.build import parse_config
from megapar.config.overlays import parse_flags
from megapar.config.recipes import RECIPES, describe, recipe_names
from megapar.config.settings import COMMAND_LINE, Origin, build_parser
from megapar.topology import ConfigError

GRAPHED = [name for name, r in RECIPES.items() if "--enable-cuda-graph" in r.flags]


@pytest.mark.parametrize("name", [name for name, r in RECIPES.items() if not r.cpu])
def test_every_recipe_parses_on_its_gpu_count(name, monkeypatch):
    r = RECIPES[name]
    ns = build_parser().parse_args(list(r.flags))
    assert vars(ns) == r.values  # its flags (flag_words) read back as its values
    assert ns.seq_length in (1024, 2048) and (getattr(ns, "bf16", False) or getattr(ns, "fp16", False))
    if name in GRAPHED or "--optimizer-cpu-offload" in r.flags or "--fp8-format" in r.flags:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # refused without CUDA: check everything else
        monkeypatch.setattr("megapar.config.checks._gpu_capability", lambda: (9, 0))     # an H100
        monkeypatch.setattr("megapar.fp8.torchao_installed", lambda: True)
    cfg = parse_config(list(r.flags), world_size=r.gpus)
    p = cfg.parallel
    assert p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.data_parallel_size == r.gpus


CPU_RECIPES = [name for name, r in RECIPES.items() if r.cpu]


@pytest.mark.parametrize("name", CPU_RECIPES)
def test_cpu_recipes_are_fp32_runs_of_the_embedded_default_without_a_gpu(name, tmp_path, monkeypatch):
    from megapar.pretrain_gpt2 import parse
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    cfg = parse(["--recipe", name], world_size=RECIPES[name].gpus)
    assert not cfg.data.data_path and cfg.train.train_iters == 300  # the embedded default
    assert not cfg.train.bf16 and not cfg.train.fp16
    layers, hidden = cfg.model.num_layers, cfg.model.hidden_size
    assert cfg.ckpt.save == f"checkpoints/gpt2_embedded_{layers}l_{hidden}h" and hidden <= 128


@pytest.mark.parametrize("argv", [["--recipe", "345m-tp2", "--micro-batch-size", "2"],
                                  ["--micro-batch-size", "2", "--recipe=345m-tp2"]])
def test_command_line_flags_override_the_recipe(argv):
    given = parse_flags(argv)
    assert [o.origin for o in given.overlays] == [Origin("--recipe 345m-tp2"), COMMAND_LINE]
    assert given.overlays[0].values == RECIPES["345m-tp2"].values
    cfg = parse_config(argv, world_size=2)
    assert cfg.train.micro_batch_size == 2 and cfg.origin["micro_batch_size"] == COMMAND_LINE
    assert cfg.parallel.tensor_model_parallel_size == 2 and cfg.model.num_layers == 24
    assert cfg.origin["num_layers"] == Origin("--recipe 345m-tp2")


def test_no_recipe_leaves_argv_alone():
    assert recipe_names(["--num-layers", "2", "--data-path", "x"]) == ([], ["--num-layers", "2", "--data-path", "x"])


@pytest.mark.parametrize("argv", [["--recipe", "nope"], ["--recipe=nope"], ["--recipe"]])
def test_unknown_or_missing_name_errors_in_one_line_naming_the_choices(argv):
    with pytest.raises(ConfigError) as e:
        parse_flags(argv)
    msg = str(e.value)
    assert "\n" not in msg and "--recipe" in msg and all(name in msg for name in RECIPES)


def test_describe_and_module_cli_list_every_recipe():
    table = describe()
    assert all(f"| {name} | {'CPU' if r.cpu else r.gpus} |" in table for name, r in RECIPES.items())
    assert CPU_RECIPES == ["cpu-tiny"]
    run = subprocess.run([sys.executable, "-m", "megapar.config.recipes", "345m-graph"], capture_output=True, text=True)
    assert run.returncode == 0 and "--enable-cuda-graph" in run.stdout and run.stdout.startswith("# 1 GPU(s)\n")
    cpu = subprocess.run([sys.executable, "-m", "megapar.config.recipes", "cpu-tiny"], capture_output=True, text=True)
    assert cpu.returncode == 0 and cpu.stdout.startswith("# CPU, 1 process(es)\n--num-layers 2 ")
    bad = subprocess.run([sys.executable, "-m", "megapar.config.recipes", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
