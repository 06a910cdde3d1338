import pytest
import torch.distributed as dist

from megapar.config.build import parse_config
from megapar.config.settings import ConfigError
from megapar.topology import padded_vocab_size, pipeline_layer_counts

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "32"]


def test_aliases_and_derived_sizes():
    cfg = parse_config(BASE + ["--tensor-parallel", "2", "--pipeline-parallel", "2", "--micro-batch-size", "2",
                               "--global-batch-size", "16"], world_size=8)
    assert cfg.parallel.tensor_model_parallel_size == 2 and cfg.parallel.pipeline_model_parallel_size == 2
    assert cfg.parallel.data_parallel_size == 2 and cfg.num_microbatches == 4
    assert cfg.model.ffn_hidden_size == 256 and cfg.model.max_position_embeddings == 32


def test_old_checkpoint_activations_flag():
    cfg = parse_config(BASE + ["--checkpoint-activations"], world_size=1)
    m = cfg.model
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == ("full", "uniform", 1)


@pytest.mark.parametrize("extra,world,message", [
    (["--tensor-parallel", "3"], 4, "world size 4 is not divisible by --tensor-model-parallel-size 3"),
    (["--tensor-parallel", "16"], 16, "--num-attention-heads 8 is not divisible by --tensor-model-parallel-size 16"),
    (["--hidden-size", "60"], 1, "--hidden-size 60 is not divisible by --num-attention-heads 8"),
    (["--pipeline-parallel", "3"], 3, "--num-layers 4 is not divisible by --pipeline-model-parallel-size 3"),
    (["--micro-batch-size", "3", "--global-batch-size", "8"], 2, "--global-batch-size 8 is not divisible"),
    (["--max-position-embeddings", "16"], 1, "--seq-length 32 is larger than --max-position-embeddings 16"),
    (["--fp16", "--bf16"], 1, "--fp16 and --bf16 were both given"),
    (["--tokenizer-type", "BertWordPiece"], 1, "unknown --tokenizer-type 'BertWordPiece'"),
    (["--train-iters", "5", "--train-samples", "10"], 1, "--train-iters and --train-samples"),
    (["--recompute-method", "block"], 1, "--recompute-method needs --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "9"], 1, "--recompute-num-layers 9"),
    (["--sequence-parallel", "--tensor-parallel", "2", "--seq-length", "31"], 2,
     "--seq-length 31 is not divisible by --tensor-model-parallel-size 2"),
    (["--decoder-last-pipeline-num-layers", "1"], 1, "need a pipeline-parallel size > 1"),
    (["--pipeline-parallel", "3", "--decoder-last-pipeline-num-layers", "1"], 3,
     "the 3 layers left after --decoder-first/last-pipeline-num-layers cannot be split evenly over the other 2"),
    (["--pipeline-parallel", "2", "--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers",
      "2"], 2, "must equal --num-layers 4"),
])
def test_invalid_combinations_fail_before_any_process_group(extra, world, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("+", r"\+")):
        parse_config(BASE + extra, world_size=world)
    assert not dist.is_initialized()


def test_pipeline_layer_counts():
    assert pipeline_layer_counts(24, 4) == [6, 6, 6, 6]
    assert pipeline_layer_counts(24, 4, last=3) == [7, 7, 7, 3]
    assert pipeline_layer_counts(24, 4, first=5, last=3) == [5, 8, 8, 3]
    assert pipeline_layer_counts(24, 2, first=14) == [14, 10]


def test_padded_vocab_matches_megatron():
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(50257, 128, 2) == 50432
    assert padded_vocab_size(50257, 128, 4) == 50688


# ---- one default per setting -----------------------------------------------------------------------
def test_every_flag_is_one_config_field_with_no_parser_default():
    """The parser is built from the dataclasses: each flag writes one field and holds no default of
    its own (argparse.SUPPRESS), so the field's default is the only one; every field but the derived
    ones has a flag."""
    import argparse
    from dataclasses import fields

    from megapar.config.megatron import ALIAS_FLAGS, MEGATRON_NOTED, NOTED_DEST
    from megapar.config.settings import DEEPSPEED_DEST, SECTIONS, build_parser
    parser = build_parser()
    actions = [a for a in parser._actions if a.dest != "help"]
    cli_fields = {f.name for cls, _ in SECTIONS.values() for f in fields(cls) if f.metadata["cli"]}
    extra = set(ALIAS_FLAGS) | {"recipe", DEEPSPEED_DEST, "deepspeed"}  # read by parse_flags into overlays
    extra |= {NOTED_DEST + name for name in MEGATRON_NOTED}             # noted, not settings
    assert {a.dest for a in actions} == cli_fields | extra
    second = {a.dest: a.default for a in actions if a.default is not argparse.SUPPRESS}
    assert not second, f"flags with a parser default besides their dataclass field: {second}"
    names = [f.name for cls, _ in SECTIONS.values() for f in fields(cls)]
    assert len(names) == len(set(names)), "a setting is defined in two sections"


def test_flags_not_given_take_the_field_default_and_given_ones_win():
    from megapar.config.overlays import parse_flags
    from megapar.config.settings import ModelConfig, TrainConfig
    assert parse_flags(["--lr", "0.5"]).values() == {"lr": 0.5}
    cfg = parse_config(["--lr", "0.5"], world_size=1)
    assert cfg.train.lr == 0.5 and cfg.train.weight_decay == TrainConfig().weight_decay
    assert cfg.model == ModelConfig()
    assert parse_config(["--no-gradient-accumulation-fusion"], 1).model.gradient_accumulation_fusion is False


def test_megatron_overlap_and_bucket_flags():
    """Megatron's --overlap-grad-reduce / --overlap-param-gather turn on what is on here already (a Megatron
    script runs as written); --no-... turn them off; --ddp-bucket-size sizes the ZeRO-0/1 buckets."""
    on = parse_config(BASE + ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "1000"], 1)
    assert on.parallel.overlap_grad_reduce and on.parallel.overlap_param_gather and on.parallel.ddp_bucket_size == 1000
    default = parse_config(BASE, 1).parallel
    assert default.overlap_grad_reduce and default.overlap_param_gather and default.ddp_bucket_size == 40_000_000
    off = parse_config(BASE + ["--no-overlap-grad-reduce", "--no-overlap-param-gather"], 1).parallel
    assert not off.overlap_grad_reduce and not off.overlap_param_gather
    assert parse_config(BASE + ["--optimizer-offload-fraction", "1.0"], 1).parallel.optimizer_offload_fraction == 1.0


def test_a_megatron_gpt2_script_runs_as_written():
    """The flags of Megatron-LM's GPT-2 345M example (examples/pretrain_gpt.sh, with its kernel switches): the
    settings apply, the switches megapar decides itself are kept to be named at start, and change nothing."""
    from megapar.config.megatron import MEGATRON_NOTED, noted_line
    megatron = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
                "--max-position-embeddings", "1024", "--micro-batch-size", "4", "--global-batch-size", "8",
                "--lr", "0.00015", "--train-iters", "500000", "--lr-decay-iters", "320000",
                "--lr-decay-style", "cosine", "--min-lr", "1.0e-5", "--weight-decay", "1e-2",
                "--lr-warmup-fraction", ".01", "--clip-grad", "1.0",
                "--split", "949,50,1", "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000",
                "--eval-iters", "10", "--distributed-backend", "gloo"]
    switches = ["--data-impl", "mmap", "--DDP-impl", "local", "--use-flash-attn", "--no-bias-gelu-fusion",
                "--no-masked-softmax-fusion", "--accumulate-allreduce-grads-in-fp32", "--num-workers", "2",
                "--use-cpu-initialization", "--fp16-lm-cross-entropy"]
    cfg = parse_config(megatron + switches, world_size=2)
    plain = parse_config(megatron, world_size=2)
    assert cfg.megatron_noted == {"--data-impl": "mmap", "--DDP-impl": "local", "--use-flash-attn": True,
                                  "--no-bias-gelu-fusion": True, "--no-masked-softmax-fusion": True,
                                  "--accumulate-allreduce-grads-in-fp32": True, "--num-workers": 2,
                                  "--use-cpu-initialization": True, "--fp16-lm-cross-entropy": True}
    assert set(cfg.megatron_noted) <= set(MEGATRON_NOTED) and not plain.megatron_noted
    assert (cfg.model, cfg.parallel, cfg.train, cfg.data) == (plain.model, plain.parallel, plain.train, plain.data)
    assert cfg.parallel.data_parallel_size == 2 and cfg.train.lr == 0.00015
    line = noted_line(cfg.megatron_noted)
    assert "--data-impl mmap (megapar reads" in line and "--use-flash-attn (" in line and "--num-workers 2 (" in line


def test_flag_words_render_every_setting_as_the_parser_reads_it_back():
    """The one renderer from settings to command lines (planner, next-step commands, DeepSpeed
    notes): for every flag and a value unlike its default, the words parse back to that value."""
    import typing
    from dataclasses import fields

    from megapar.config.settings import SECTIONS, build_parser, flag_words
    parser = build_parser()
    checked = 0
    for cls, _ in SECTIONS.values():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if not f.metadata["cli"]:
                continue
            hint = hints[f.name]
            kind = hint if typing.get_origin(hint) is list else \
                next(a for a in typing.get_args(hint) or (hint,) if a is not type(None))
            choices = f.metadata["choices"]
            value = (not f.default if kind is bool else choices[-1] if choices else
                     [kind.__args__[0](3), kind.__args__[0](4)] if typing.get_origin(kind) is list else
                     kind(7) if kind in (int, float) else "x")
            got = vars(parser.parse_args(flag_words(f.name, value)))
            assert got.get(f.name) == value, (f.name, flag_words(f.name, value), got)
            checked += 1
    assert checked > 80


def test_an_error_names_where_a_value_came_from_when_the_command_line_did_not_type_it(tmp_path):
    """Values merge as defaults < recipes < DeepSpeed config < command line; every value keeps its
    Origin, named in an error about its flag unless typed on the command line or a default."""
    import json

    from megapar.config.settings import COMMAND_LINE, DEFAULT, SECTION_OF, Origin
    cfg = parse_config(["--recipe", "cpu-tiny", "--hidden-size", "64", "--train-iters", "1"], world_size=1)
    assert cfg.origin["num_layers"] == Origin("--recipe cpu-tiny") and cfg.origin["hidden_size"] == COMMAND_LINE
    assert cfg.origin["lr"] == DEFAULT and set(cfg.origin) == set(SECTION_OF)
    assert cfg.model.hidden_size == 64 and cfg.model.num_layers == 2
    ds_lr = tmp_path / "lr.json"
    ds_lr.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}}))
    cfg = parse_config(["--recipe", "cpu-tiny", "--deepspeed-config", str(ds_lr), "--seed", "7", "--train-iters", "1"],
                       world_size=1)
    assert cfg.origin["lr"] == Origin("optimizer.params.lr", str(ds_lr)) and cfg.train.lr == 3e-4
    assert cfg.origin["seed"] == COMMAND_LINE and cfg.origin["num_layers"] == Origin("--recipe cpu-tiny")
    assert cfg.origin["min_lr"] == DEFAULT and cfg.origin["train_iters"] == COMMAND_LINE
    with pytest.raises(ConfigError, match=r"by --micro-batch-size 3 .*"
                                          r"\(--global-batch-size set by --recipe cpu-tiny\)$"):
        parse_config(["--recipe", "cpu-tiny", "--micro-batch-size", "3", "--train-iters", "1"], world_size=1)
    with pytest.raises(ConfigError, match=r"--micro-batch-size 3 x data-parallel size 1 = 3; use a multiple of 3$"):
        parse_config(["--micro-batch-size", "3", "--global-batch-size", "4", "--train-iters", "1"], world_size=1)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 3}))
    with pytest.raises(ConfigError, match=r"\(set by train_micro_batch_size_per_gpu in .*ds.json; "
                                          r"--global-batch-size set by --recipe cpu-tiny\)$"):
        parse_config(["--recipe", "cpu-tiny", "--deepspeed-config", str(ds), "--train-iters", "1"], world_size=1)
    from megapar.pretrain_gpt2 import parse
    with pytest.raises(ConfigError, match=r"\(--global-batch-size set by the embedded default \(no --data-path\)\)$"):
        parse(["--micro-batch-size", "3", "--save", str(tmp_path / "ck")], world_size=1)


def test_an_error_carries_the_settings_it_concerns():
    """A ConfigError names its settings (dests), so the origin note needs no parsing of its message:
    a layout check in topology.py names a recipe's layer count, an alias flag's value is the command line's."""
    with pytest.raises(ConfigError, match=r"--num-layers 2 is not divisible by --pipeline-model-parallel-size 4.*"
                                          r"\(--num-layers set by --recipe cpu-tiny\)$") as e:
        parse_config(["--recipe", "cpu-tiny", "--pipeline-model-parallel-size", "4", "--train-iters", "1"], 4)
    assert e.value.dests == ("num_layers", "pipeline_model_parallel_size")
    from megapar.config.settings import COMMAND_LINE
    cfg = parse_config(BASE + ["--checkpoint-activations"], 1)
    assert cfg.model.recompute_granularity == "full" and cfg.origin["recompute_granularity"] == COMMAND_LINE


def test_checkpoint_args_namespace_keeps_megatron_fields():
    cfg = parse_config(BASE + ["--recompute-activations"], world_size=1)
    ns = cfg.megatron_args()
    assert ns.recompute_activations is True and ns.checkpoint_activations is False
    assert ns.ffn_hidden_size == 256 and ns.tensor_model_parallel_size == 1 and ns.data_path == []


def test_saved_config_from_a_megatron_args_namespace():
    """Megatron's checkpoints have `args` and no `model_config`: the loader fills megapar's defaults."""
    import argparse

    from megapar.checkpoint import CheckpointError, read_saved_config
    args = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128,
                              max_position_embeddings=None, padded_vocab_size=50304, tensor_model_parallel_size=2,
                              pipeline_model_parallel_size=1, tokenizer_type="GPT2BPETokenizer")
    saved = read_saved_config({"args": args})
    assert (saved.model.ffn_hidden_size, saved.model.max_position_embeddings) == (256, 128)
    assert saved.model.vocab_size is None and saved.model.padded_vocab_size == 50304
    assert saved.parallel.tensor_model_parallel_size == 2 and saved.data.tokenizer_type == "GPT2BPETokenizer"
    typed = read_saved_config({"args": args, "model_config": {"num_layers": 3, "hidden_size": 64,
                                                              "num_attention_heads": 4}})
    assert typed.model.num_layers == 3  # the typed config wins over args
    with pytest.raises(CheckpointError, match="has no 'args'"):
        read_saved_config({}, "ck/model_optim_rng.pt")


def test_a_run_planned_for_gpus_is_checked_as_on_gpus(monkeypatch):
    """The memory estimator plans GPU runs on any machine: `assume_gpus` lifts only the no-GPU refusals."""
    import torch
    from megapar.config.build import build_config
    from megapar.config.overlays import parse_flags
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    flags = BASE + ["--zero-stage", "3", "--optimizer-cpu-offload", "--param-cpu-offload"]
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        parse_config(flags, 2)
    cfg = build_config(parse_flags(flags), 2, assume_gpus=True)
    assert cfg.parallel.param_cpu_offload and cfg.parallel.zero_stage == 3
    with pytest.raises(ConfigError, match="needs --zero-stage 3"):
        build_config(parse_flags(BASE + ["--param-cpu-offload"]), 2, assume_gpus=True)


def test_nvme_offload_runs_on_a_cpu_and_goes_with_cpu_offload(monkeypatch, tmp_path):
    """--optimizer-nvme-offload moves host state to disk, so a CPU-only run takes it; beside
    --optimizer-cpu-offload (whose CPU step it implies) it is accepted, not a contradiction."""
    import torch
    from megapar.config.build import build_config
    from megapar.config.overlays import parse_flags
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    nvme = ["--zero-stage", "1", "--optimizer-nvme-offload", str(tmp_path)]
    assert parse_config(BASE + nvme, 2).parallel.optimizer_nvme_offload == str(tmp_path)
    both = build_config(parse_flags(BASE + nvme + ["--optimizer-cpu-offload"]), 2, assume_gpus=True)
    assert both.parallel.optimizer_cpu_offload and both.parallel.optimizer_nvme_offload == str(tmp_path)


# ---- --help -------------------------------------------------------------------------------------------
def test_every_training_flag_has_help_and_shows_its_default():
    """Each setting says what it does (a new field without help fails here) and --help shows its default
    where it has one; the usage line names the command."""
    from dataclasses import MISSING, fields

    from megapar.config.settings import SECTIONS, build_parser
    undocumented = [f.name for cls, _ in SECTIONS.values() for f in fields(cls)
                    if f.metadata["cli"] and not (f.metadata["help"] or "").strip()]
    assert not undocumented, f"settings without help text: {undocumented}"
    parser = build_parser()
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    assert all((a.help or "").strip() for a in actions.values()), [d for d, a in actions.items() if not a.help]
    for cls, _ in SECTIONS.values():
        for f in fields(cls):
            default = f.default_factory() if f.default is MISSING else f.default
            if f.metadata["cli"] and default is not None and not isinstance(default, bool) and default != []:
                assert f"default: {default}" in actions[f.name].help, (f.name, actions[f.name].help)
    assert parser.format_usage().startswith("usage: python -m megapar.pretrain_gpt2 ")


def test_the_launchers_help_names_the_script_and_its_own_flags():
    """scripts/pretrain_gpt2.sh --help (through megapar.launch): the script's usage, its launcher flags
    (processes, nodes), then the training flags; exit 0, nothing started."""
    import subprocess
    import sys
    from pathlib import Path

    from megapar.launch import LAUNCHER_FLAGS
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "megapar.launch", "--standalone", "--nproc-per-node", "2", "--",
                          "--train-iters", "3", "--help"], capture_output=True, text=True, cwd=root)
    assert out.returncode == 0 and not out.stderr, out.stderr
    assert out.stdout.startswith("usage: bash scripts/pretrain_gpt2.sh "), out.stdout[:200]
    for flag, _, _ in LAUNCHER_FLAGS:
        assert f"\n  {flag} " in out.stdout, flag
    assert "--train-iters N" in out.stdout and "--recompute-granularity" in out.stdout
    assert "launch.py" not in out.stdout
