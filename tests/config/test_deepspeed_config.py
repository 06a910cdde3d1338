"""--deepspeed-config: every DeepSpeed key's mapping onto megapar's flags, DeepSpeed's defaults,
the keys noted and refused (all problems in one message), real configs as DeepSpeed reads them,
the LR of DeepSpeed's log warm-up, and `megapar-ds-config`."""
import json
from pathlib import Path

import pytest

from megapar.config.build import build_config, parse_config
from megapar.config.overlays import parse_flags
from megapar.config.settings import ConfigError

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "32"]


def write(tmp_path: Path, config) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return str(path)


def flags_of(tmp_path, config, *extra: str, defaults: bool = False) -> dict:
    """The flags the config sets (with `extra` command-line flags), without the settings object;
    without those DeepSpeed's defaults for absent keys set, unless `defaults`."""
    given = parse_flags([*BASE, "--deepspeed-config", write(tmp_path, config), *extra])
    s = given.deepspeed
    return {k: v for k, v in given.values().items() if k not in parse_flags([*BASE, *extra]).values()
            and (defaults or k not in s.defaulted)}


def settings_of(tmp_path, config, *extra: str):
    return parse_flags([*BASE, "--deepspeed-config", write(tmp_path, config), *extra]).deepspeed


def config_of(tmp_path, config, *extra: str, world: int = 1, gpus: bool = False):
    """The Config of a run with `config` and `extra` flags (`gpus`: checked as a run on GPUs)."""
    given = parse_flags([*BASE, "--deepspeed-config", write(tmp_path, config), *extra])
    return build_config(given, world, assume_gpus=True) if gpus else \
        parse_config([*BASE, "--deepspeed-config", write(tmp_path, config), *extra], world)


def refused(tmp_path, config, *fragments: str, extra=(), world: int = 1) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config([*BASE, "--deepspeed-config", write(tmp_path, config), *extra], world)
    message = str(e.value)
    assert "\n" not in message
    for f in fragments:
        assert f in message, message
    return message


# ---- the mapping -----------------------------------------------------------------------------------
@pytest.mark.parametrize("config,expected", [
    ({"train_micro_batch_size_per_gpu": 2}, {"micro_batch_size": 2}),
    ({"train_batch_size": 16}, {"global_batch_size": 16}),
    ({"gradient_clipping": 0.5}, {"clip_grad": 0.5}),
    ({"steps_per_print": 5}, {"log_interval": 5}),
    ({"wall_clock_breakdown": True}, {"timing_log_level": 1}),
    ({"wall_clock_breakdown": False}, {}),
    ({"bf16": {"enabled": True}}, {"bf16": True}),
    ({"bfloat16": {"enabled": True}}, {"bf16": True}),
    ({"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 500,
               "hysteresis": 3, "min_loss_scale": 0.5}},
     {"fp16": True, "loss_scale": None, "initial_loss_scale": 65536.0, "loss_scale_window": 500, "hysteresis": 3,
      "min_loss_scale": 0.5}),
    ({"fp16": {"enabled": True, "loss_scale": 128}}, {"fp16": True, "loss_scale": 128.0}),
    ({"fp16": {"enabled": False, "loss_scale_window": 7}}, {"fp16": False}),   # ignored when off, as DeepSpeed does
    ({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6,
                                                "weight_decay": 0.1}}},
     {"lr": 3e-4, "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_eps": 1e-6, "weight_decay": 0.1}),
    ({"optimizer": {"type": "adam", "params": {"weight_decay": 0.01, "adam_w_mode": True}}}, {"weight_decay": 0.01}),
    ({"zero_optimization": {"stage": 2}}, {"zero_stage": 2}),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": True}}},
     {"zero_stage": 1, "optimizer_cpu_offload": True}),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "none"}}},
     {"zero_stage": 3, "param_cpu_offload": True, "optimizer_cpu_offload": False}),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme",
                                                              "buffer_count": 4, "pipeline_read": True}},
      "aio": {"block_size": 1048576, "queue_depth": 8}},
     {"zero_stage": 3, "optimizer_nvme_offload": "/local_nvme"}),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                   "warmup_num_steps": 100, "warmup_type": "linear"}}},
     {"lr_decay_style": "constant", "lr": 1e-3, "lr_warmup_iters": 100, "lr_warmup_style": "linear",
      "lr_warmup_init": 0.0}),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 2e-4,
                                                        "warmup_num_steps": 10, "warmup_type": "linear",
                                                        "total_num_steps": 1000}}},
     {"lr_decay_style": "linear", "lr": 2e-4, "lr_warmup_iters": 10, "lr_decay_iters": 1000, "min_lr": 0.0,
      "lr_warmup_style": "linear", "lr_warmup_init": 0.0}),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 2e-4,
                                                        "total_num_steps": 1000}}},
     {"lr_decay_style": "linear", "lr": 2e-4, "lr_decay_iters": 1000, "min_lr": 1e-5, "lr_warmup_init": 1e-5}),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
      "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 500, "warmup_min_ratio": 0.1}}},
     {"lr": 1e-3, "lr_decay_style": "cosine", "lr_decay_iters": 500, "lr_warmup_init": 1e-4}),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
      "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 500, "warmup_num_steps": 50,
                                                         "warmup_type": "linear", "cos_min_ratio": 0.1}}},
     {"lr": 1e-3, "lr_decay_style": "cosine", "lr_warmup_iters": 50, "lr_decay_iters": 500, "min_lr": 1e-4,
      "lr_warmup_style": "linear"}),
    # "auto": the command line or megapar's default decides
    ({"train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
      "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}},
      "zero_optimization": {"stage": "auto", "reduce_bucket_size": "auto"}}, {}),
])
def test_each_key_sets_its_flag(tmp_path, config, expected):
    got = flags_of(tmp_path, config)
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert got[k] == pytest.approx(v) if isinstance(v, float) else got[k] == v, k


def test_the_schedule_defaults_are_deepspeeds(tmp_path):
    """Absent scheduler params mean DeepSpeed's defaults (warmup 1000 steps; cosine floor 1e-4 x lr)."""
    got = flags_of(tmp_path, {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 5000,
                                                                               "warmup_type": "linear"}}},
                   "--lr", "2e-3", defaults=True)
    assert got["lr_warmup_iters"] == 1000 and got["min_lr"] == pytest.approx(2e-7)


def test_cosine_floor_follows_the_command_line_lr(tmp_path):
    cfg = config_of(tmp_path, {"scheduler": {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 100, "warmup_num_steps": 0, "warmup_type": "linear", "cos_min_ratio": 0.5}}},
        "--lr", "4e-4")
    assert cfg.train.min_lr == pytest.approx(2e-4) and cfg.train.lr == 4e-4


def test_accepted_not_acted_on_keys_are_listed_once(tmp_path):
    given = parse_flags([*BASE, "--deepspeed-config", write(tmp_path, {
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e8, "contiguous_gradients": True,
                              "offload_optimizer": {"device": "cpu", "pin_memory": True, "buffer_count": 4}}})])
    s = given.deepspeed
    assert list(s.noted) == ["zero_allow_untested_optimizer", "zero_optimization.contiguous_gradients",
                             "zero_optimization.offload_optimizer.pin_memory",
                             "zero_optimization.offload_optimizer.buffer_count"]
    lines = s.summary()
    assert len(lines) == 2
    assert "--zero-stage 2" in lines[0] and "--optimizer-cpu-offload" in lines[0]
    assert "--ddp-bucket-size 500000000" in lines[0] and "--overlap-grad-reduce" in lines[0]
    assert "accepted, not acted on:" in lines[1]
    assert "zero_optimization.contiguous_gradients (megapar's gradients always live in contiguous" in lines[1]
    off = parse_flags([*BASE, "--deepspeed-config", write(tmp_path, {"zero_optimization": {"overlap_comm": False}})])
    assert off.values()["overlap_grad_reduce"] is False
    assert "--no-overlap-grad-reduce" in off.deepspeed.summary()[0]


def test_nvme_offload_keys_that_tune_io_are_noted(tmp_path):
    """NVMe offload of the optimizer: nvme_path becomes the flag; DeepSpeed's I/O tuning (buffers,
    pipelining, aio) is noted with megapar's I/O; nvme_path beside device cpu is noted, not used."""
    given = parse_flags([*BASE, "--deepspeed-config", write(tmp_path, {
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme",
                                                                "buffer_size": 1e8, "pipeline_write": True}},
        "aio": {"thread_count": 2, "single_submit": False}})])
    s = given.deepspeed
    assert s.flags["optimizer_nvme_offload"] == "/nvme" and "optimizer_cpu_offload" not in s.flags
    assert set(s.noted) == {"zero_optimization.offload_optimizer.buffer_size", "aio.thread_count",
                            "zero_optimization.offload_optimizer.pipeline_write", "aio.single_submit"}
    assert all("megapar's NVMe offload runs its own" in why for why in s.noted.values())
    cpu = parse_flags([*BASE, "--deepspeed-config", write(tmp_path, {
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "nvme_path": "/nvme"}}})])
    noted = cpu.deepspeed.noted
    assert noted == {"zero_optimization.offload_optimizer.nvme_path": "used with device nvme only"}


@pytest.mark.parametrize("name", ["ds_config_zero2.json", "ds_config_zero3_offload.json"])
def test_example_configs_parse(name):
    given = parse_flags([*BASE, "--deepspeed", "--deepspeed_config", str(ROOT / "configs" / name)])
    s = given.deepspeed
    assert s.flags["zero_stage"] == (2 if "zero2" in name else 3)
    cfg = build_config(given, 4, assume_gpus=True)
    assert cfg.parallel.zero_stage == s.flags["zero_stage"] and cfg.deepspeed is s
    if "zero3" in name:
        t = cfg.train
        assert cfg.parallel.optimizer_cpu_offload and cfg.parallel.param_cpu_offload and t.bf16
        assert (t.micro_batch_size, t.global_batch_size, cfg.num_microbatches) == (4, 4 * 8 * 4, 8)
        assert (t.lr_decay_style, t.min_lr) == ("cosine", pytest.approx(1.2e-5))
    else:
        assert cfg.train.fp16 and cfg.train.initial_loss_scale == 2.0**16 and cfg.num_microbatches == 2


# ---- the batch triple, resolved at world size ---------------------------------------------------------
@pytest.mark.parametrize("config,world,micro,global_batch", [
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 2, 2, 16),
    ({"train_batch_size": 24, "gradient_accumulation_steps": 3}, 4, 2, 24),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, 2, 2, 16),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 2, 2, 16),
    ({"gradient_accumulation_steps": 2}, 1, 4, 8),                     # micro: megapar's default 4
])
def test_any_two_of_the_batch_triple_give_the_third(tmp_path, config, world, micro, global_batch):
    cfg = config_of(tmp_path, config, world=world)
    assert (cfg.train.micro_batch_size, cfg.train.global_batch_size) == (micro, global_batch)


def test_batch_triple_that_does_not_agree_at_this_world_size(tmp_path):
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}
    refused(tmp_path, config, "(train_batch_size / --global-batch-size) 16 != micro batch 2 x "
                              "gradient_accumulation_steps 4 x data-parallel size 4 (= 32)", world=4)
    refused(tmp_path, {"train_batch_size": 10, "gradient_accumulation_steps": 4},
            "(train_batch_size / --global-batch-size) 10 is not divisible by gradient_accumulation_steps 4 x "
            "data-parallel size 1")
    refused(tmp_path, {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
            "--global-batch-size 10 is not divisible", "(set by train_batch_size, train_micro_batch_size_per_gpu in")


def test_the_embedded_default_leaves_the_batch_to_the_triple(tmp_path):
    from megapar.pretrain_gpt2 import parse
    cfg = parse(["--deepspeed-config", write(tmp_path, {"train_micro_batch_size_per_gpu": 2,
                                                        "gradient_accumulation_steps": 3})], 1)
    assert (cfg.train.micro_batch_size, cfg.train.global_batch_size) == (2, 6)


# ---- command line vs config ------------------------------------------------------------------------
def test_same_value_on_both_sides_is_fine(tmp_path):
    cfg = config_of(tmp_path, {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}},
                    "--micro-batch-size", "2", "--bf16", "--deepspeed")
    assert cfg.train.micro_batch_size == 2 and cfg.train.bf16


@pytest.mark.parametrize("config,extra,fragments", [
    ({"train_micro_batch_size_per_gpu": 2}, ["--micro-batch-size", "4"],
     ["--micro-batch-size 4 on the command line", "train_micro_batch_size_per_gpu", "(= --micro-batch-size 2)"]),
    ({"fp16": {"enabled": False}}, ["--fp16"], ["--fp16 on the command line", "fp16.enabled", "(= no --fp16)"]),
    ({"fp16": {"enabled": True, "loss_scale": 0}}, ["--loss-scale", "128"],
     ["--loss-scale 128 on the command line", "fp16.loss_scale", "(= no --loss-scale)"]),
    ({"zero_optimization": {"stage": 3}}, ["--zero-stage", "1"], ["--zero-stage 1 on the command line"]),
])
def test_different_values_on_both_sides_are_refused(tmp_path, config, extra, fragments):
    refused(tmp_path, config, *fragments, extra=extra)


def test_errors_name_the_keys_that_set_the_flags(tmp_path):
    """A validation error names the key of each flag it mentions (--lr is not --lr-warmup-iters), and a
    schedule default the file left out is named as DeepSpeed's default."""
    message = refused(tmp_path, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                 "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "linear"}}},
                      "--lr-warmup-fraction and --lr-warmup-iters were both given",
                      "(set by scheduler.params.warmup_num_steps (absent: DeepSpeed's default) in",
                      extra=["--lr-warmup-fraction", "0.1"])
    assert "optimizer.params.lr" not in message


def test_two_keys_for_one_flag_must_agree(tmp_path):
    refused(tmp_path, {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                       "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 6e-4, "warmup_type": "linear"}}},
            "optimizer.params.lr (= --lr 0.001) and scheduler.params.warmup_max_lr (= --lr 0.0006) differ")


# ---- refusals ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("config,fragments", [
    ({"train_batch_sise": 8}, ["unknown key train_batch_sise: did you mean train_batch_size?"]),
    ({"zero_optimization": {"stage": 2, "overlap_com": True}},
     ["unknown key zero_optimization.overlap_com: did you mean zero_optimization.overlap_comm?"]),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "speed": 1}}},
     ["unknown key zero_optimization.offload_optimizer.speed: remove it"]),
    ({"activation_checkpointing": {"partition_activation": True}},
     ["unknown key activation_checkpointing.partition_activation: did you mean "
      "activation_checkpointing.partition_activations?"]),
    ({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 400}}},
     ['optimizer.type: "OneBitAdam" is not supported (1-bit Adam', 'use "AdamW"',
      "unknown key optimizer.params.freeze_step"]),
    ({"optimizer": {"type": "LAMB"}}, ['optimizer.type: "LAMB" is not supported (LAMB is another optimizer']),
    ({"curriculum_learning": {"enabled": True, "curriculum_type": "seqlen"}},
     ["curriculum_learning.enabled: true is not supported", "one --seq-length"]),
    ({"moe": {"enabled": True, "ep_size": 2}}, ["moe.enabled: true is not supported", "dense"]),
    ({"sparse_attention": {"mode": "fixed", "block": 16}}, ["sparse_attention is not supported"]),
    ({"aio": {"block_size": 1048576, "queue_deep": 8}}, ["unknown key aio.queue_deep: did you mean aio.queue_depth?"]),
    ({"communication_data_type": "fp8"}, ['communication_data_type: "fp8" is not a dtype', '"bf16"']),
    ({"sequence_parallel_size": 4}, ["sequence_parallel_size: 4 is not supported (megapar has no DeepSpeed-Ulysses",
                                     "--sequence-parallel"]),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
     ["fp16.fp16_master_weights_and_grads: true is not supported (megapar keeps fp32 masters"]),
    ({"tensorboard": {"enabled": True, "outputpath": "tb"}},
     ["unknown key tensorboard.outputpath: did you mean tensorboard.output_path?"]),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
     ['zero_optimization.offload_optimizer.device: "nvme" needs zero_optimization.offload_optimizer.nvme_path']),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}},
     ['zero_optimization.offload_param.device: "nvme"']),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}, ["is not a device"]),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
     ["zero_optimization.offload_optimizer.ratio: 0.3"]),
    ({"zero_optimization": {"stage": 4}}, ["zero_optimization.stage: 4 is not a ZeRO stage"]),
    ({"zero_optimization": {"stage": "two"}}, ["zero_optimization.stage \"two\" must be an integer"]),
    ({"zero_optimization": []}, ["zero_optimization must be a JSON object"]),
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, ['optimizer.type: "Lamb" is not supported', "AdamW"]),
    ({"optimizer": {"type": "Adam", "params": {"weight_decay": 0.1, "adam_w_mode": False}}},
     ["optimizer.params.adam_w_mode: false", "L2"]),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}, ["optimizer.params.betas: [0.9] is not a pair"]),
    ({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}}, ["optimizer.params.bias_correction"]),
    ({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}},
     ["optimizer.params.amsgrad: true is not supported (megapar's AdamW has no AMSGrad)", "set it to false"]),
    ({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, ["unknown key optimizer.params.max_grad_norm"]),
    ({"fp16": {"enabled": True, "consecutive_hysteresis": True}}, ["fp16.consecutive_hysteresis: true",
                                                                   "set it to false"]),
    ({"fp16": {"enabled": True, "initial_scale_power": 99}}, ["fp16.initial_scale_power: 99 is out of range"]),
    ({"fp16": {"enabled": True, "loss_scale": -1}}, ["fp16.loss_scale: -1.0 is negative"]),
    ({"fp16": {"enabled": "yes"}}, ['fp16.enabled "yes" must be true or false']),
    ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, ["bf16 and bfloat16"]),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, ["--fp16 and --bf16 were both given", "(set by"]),
    ({"gradient_accumulation_steps": 0}, ["gradient_accumulation_steps 0 must be >= 1"]),
    ({"train_micro_batch_size_per_gpu": 0}, ["--micro-batch-size 0 must be >= 1",
                                             "(set by train_micro_batch_size_per_gpu in"]),
    ({"gradient_clipping": -1}, ["--clip-grad -1.0 is out of range", "(set by gradient_clipping"]),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, ['scheduler.type: "OneCycle"', "WarmupLR, WarmupDecayLR"]),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "exp"}}},
     ['scheduler.params.warmup_type: "exp" is not a warmup DeepSpeed knows', 'use "log" or "linear"']),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 2e-3, "warmup_max_lr": 1e-3}}},
     ["--lr-warmup-init 0.002 is above --lr 0.001", "(set by scheduler.params.warmup_min_lr, "
      "scheduler.params.warmup_max_lr in"]),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_min_ratio": 1.5}}},
     ["scheduler.params.warmup_min_ratio: 1.5 is out of range", "use a ratio in [0, 1]"]),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_type": "linear"}}},
     ["WarmupDecayLR needs scheduler.params.total_num_steps"]),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "linear", "total_num_steps": 5}}},
     ["unknown key scheduler.params.total_num_steps"]),
])
def test_values_megapar_cannot_honour_are_refused(tmp_path, config, fragments):
    refused(tmp_path, config, *fragments)


def test_missing_unreadable_and_malformed_files(tmp_path):
    for argv, fragment in ((["--deepspeed-config", str(tmp_path / "nope.json")], "no such file"),
                           (["--deepspeed-config", str(tmp_path)], "is a directory")):
        with pytest.raises(ConfigError, match=fragment):
            parse_config([*BASE, *argv], 1)
    refused(tmp_path, '{\n  "train_batch_size": 8,\n  "bf16": {"enabled": true,}\n}',
            "is not valid JSON", "line 3 column")
    refused(tmp_path, "[1, 2]", "the top level is a JSON list, not an object")
    refused(tmp_path, '{"train_batch_size": 8, "train_batch_size": 16}', "key 'train_batch_size' appears twice")
    (tmp_path / "latin1.json").write_bytes(b'{"x": "\xff"}')
    with pytest.raises(ConfigError, match="cannot be read"):
        parse_config([*BASE, "--deepspeed-config", str(tmp_path / "latin1.json")], 1)


# ---- DeepSpeed's defaults for absent keys ------------------------------------------------------------
def test_absent_keys_take_deepspeeds_defaults(tmp_path):
    """fp16 without its scaler keys starts at 2^16 (DeepSpeed's), not megapar's 2^32; steps_per_print
    is DeepSpeed's 10; a WarmupLR without warmup_type warms up with DeepSpeed's log."""
    got = flags_of(tmp_path, {"fp16": {"enabled": True}, "scheduler": {"type": "WarmupLR"}}, defaults=True)
    assert got == {"fp16": True, "initial_loss_scale": 2.0**16, "loss_scale_window": 1000, "hysteresis": 2,
                   "min_loss_scale": 1.0, "log_interval": 10, "lr_decay_style": "constant", "lr_warmup_style": "log",
                   "lr_warmup_iters": 1000, "lr": 0.001, "lr_warmup_init": 0.0}
    assert "fp16.initial_scale_power (absent: DeepSpeed's default)" in settings_of(
        tmp_path, {"fp16": {"enabled": True}}).origin.values()
    # fp16 off (or its `enabled` left out: DeepSpeed's default is off): no loss-scale defaults
    assert "initial_loss_scale" not in flags_of(tmp_path, {"fp16": {"loss_scale": 0}}, defaults=True)


def test_the_command_line_wins_over_a_default_not_over_a_key(tmp_path):
    cfg = config_of(tmp_path, {"fp16": {"enabled": True}, "scheduler": {"type": "WarmupLR"}},
                    "--initial-loss-scale", "4096", "--lr", "6e-4", "--log-interval", "1")
    assert (cfg.train.initial_loss_scale, cfg.train.lr, cfg.log.log_interval) == (4096, 6e-4, 1)
    assert cfg.train.lr_warmup_style == "log" and cfg.train.lr_warmup_iters == 1000
    refused(tmp_path, {"fp16": {"enabled": True, "initial_scale_power": 16}},
            "--initial-loss-scale 4096 on the command line and fp16.initial_scale_power (= --initial-loss-scale 65536)",
            extra=["--initial-loss-scale", "4096"])


def test_a_short_log_warmup_lasts_two_steps_as_in_deepspeed(tmp_path):
    got = flags_of(tmp_path, {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}, defaults=True)
    assert got["lr_warmup_iters"] == 2 and got["lr_warmup_style"] == "log"


# ---- DeepSpeed's log warm-up: the LR, step by step --------------------------------------------------------
def _lrs(cfg, steps: int) -> list[float]:
    """The LR of each of the first `steps` iterations of a run with `cfg` (the scheduler of training)."""
    import torch
    from megapar.run.initialize import build_scheduler
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = build_scheduler(cfg, optimizer)
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
    return out


def test_log_warmup_follows_deepspeeds_formula(tmp_path):
    """WarmupDecayLR {warmup_max_lr 1e-3, warmup_num_steps 10, total_num_steps 30}, warmup_type left out.
    DeepSpeed's WarmupLR: after n optimizer steps (its last_batch_iteration = n - 1), while n - 1 < 10,
    lr = 1e-3 x ln(n) / ln(10). By hand: ln 2 / ln 10 = 0.30103, ln 5 / ln 10 = 0.69897,
    ln 9 / ln 10 = 0.95424. Then megapar's linear decay to 0 at step 30."""
    cfg = config_of(tmp_path, {"scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_max_lr": 1e-3, "warmup_num_steps": 10, "total_num_steps": 30}}}, "--train-iters", "30")
    lrs = _lrs(cfg, 31)
    expected = {0: 0.0, 1: 0.0, 2: 0.30103e-3, 5: 0.69897e-3, 9: 0.95424e-3, 10: 1e-3, 20: 0.5e-3, 30: 0.0}
    for n, lr in expected.items():
        assert lrs[n] == pytest.approx(lr, abs=1e-8), (n, lrs[n])
    assert all(a <= b for a, b in zip(lrs[:11], lrs[1:11]))


def test_log_warmup_from_warmup_min_lr_decays_back_to_it(tmp_path):
    """warmup_min_lr 1e-4: lr = 1e-4 + 9e-4 x ln(n) / ln(10) during the warmup (by hand, n = 2:
    1e-4 + 9e-4 x 0.30103 = 3.70927e-4), and WarmupDecayLR's floor at step 30 is 1e-4."""
    cfg = config_of(tmp_path, {"scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 10, "total_num_steps": 30}}},
        "--train-iters", "40")
    lrs = _lrs(cfg, 35)
    for n, lr in {0: 1e-4, 1: 1e-4, 2: 3.70927e-4, 10: 1e-3, 20: 5.5e-4, 30: 1e-4, 34: 1e-4}.items():
        assert lrs[n] == pytest.approx(lr, abs=1e-9), (n, lrs[n])


def test_linear_warmup_is_unchanged(tmp_path):
    cfg = config_of(tmp_path, {"scheduler": {"type": "WarmupLR", "params": {
        "warmup_max_lr": 1e-3, "warmup_num_steps": 4, "warmup_type": "linear"}}}, "--train-iters", "8")
    assert _lrs(cfg, 6) == pytest.approx([0.0, 0.25e-3, 0.5e-3, 0.75e-3, 1e-3, 1e-3])


def test_a_resume_compares_the_warmup_style():
    import torch
    from megapar.optimizer.lr_schedule import OptimizerParamScheduler
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    saved = OptimizerParamScheduler(opt, 1e-3, 0.0, 10, 100, warmup_style="log").state_dict()
    run = OptimizerParamScheduler(opt, 1e-3, 0.0, 10, 100)
    assert run.differences(saved) == ["--lr-warmup-style log (checkpoint) vs linear (run)"]
    del saved["lr_warmup_style"]  # Megatron's checkpoints and older megapar ones: not compared
    assert run.differences(saved) == []


# ---- keys that ask for nothing: one note line ------------------------------------------------------------
NOTHING_ASKED = {
    "prescale_gradients": False, "gradient_predivide_factor": 1.0, "dump_state": False, "sparse_gradients": False,
    "comms_config": {"verbose": False}, "monitor_config": {"enabled": False},
    "zero_optimization": {"stage": 1, "elastic_checkpoint": False, "load_from_fp32_weights": True},
    "activation_checkpointing": {"partition_activations": False, "contiguous_memory_optimization": False,
                                 "cpu_checkpointing": False, "number_checkpoints": None,
                                 "synchronize_checkpoint_boundary": False, "profile": False},
    "tensorboard": {"enabled": False, "output_path": "tb", "job_name": "x"},
    "flops_profiler": {"enabled": False, "profile_step": 1, "module_depth": -1, "top_modules": 1, "detailed": True},
    "curriculum_learning": {"enabled": False, "curriculum_type": "seqlen"},
    "comms_logger": {"enabled": False}, "checkpoint": {"tag_validation": "Warn"},
    "data_types": {"grad_accum_dtype": "fp32"}, "wall_clock_breakdown": False, "sequence_parallel_size": 1,
    "elastic_checkpoint": False,
    "my_comment": "DeepSpeed ignores top-level keys it does not know",
}


def test_keys_that_ask_for_nothing_are_noted_on_one_line(tmp_path):
    s = settings_of(tmp_path, NOTHING_ASKED)
    assert s.flags == {"zero_stage": 1, "log_interval": 10} and not s.problems
    lines = s.summary()
    assert len(lines) == 2 and lines[1].count("accepted, not acted on") == 1
    for key in ("prescale_gradients", "dump_state", "comms_config", "monitor_config",
                "zero_optimization.elastic_checkpoint", "activation_checkpointing.partition_activations",
                "activation_checkpointing.cpu_checkpointing", "tensorboard.output_path", "flops_profiler.detailed",
                "curriculum_learning.curriculum_type", "my_comment", "checkpoint.tag_validation",
                "sequence_parallel_size", "elastic_checkpoint"):
        assert key in s.noted, key
    assert "--sequence-parallel" in s.noted["activation_checkpointing.partition_activations"]
    assert "--recompute-granularity" in s.noted["activation_checkpointing.synchronize_checkpoint_boundary"]


@pytest.mark.parametrize("legacy,stage", [(True, 1), (False, 0)])
def test_the_legacy_boolean_zero_optimization(tmp_path, legacy, stage):
    assert flags_of(tmp_path, {"zero_optimization": legacy}) == {"zero_stage": stage}


# ---- sections megapar honours ------------------------------------------------------------------------------
@pytest.mark.parametrize("config,expected", [
    ({"tensorboard": {"enabled": True, "output_path": "runs/", "job_name": "gpt2"}},
     {"tensorboard_dir": "runs/gpt2"}),
    ({"tensorboard": {"enabled": True}}, {"tensorboard_dir": "DeepSpeedJobName"}),
    ({"csv_monitor": {"enabled": True, "output_path": "logs", "job_name": "run1"}}, {"csv_log_dir": "logs/run1"}),
    ({"wandb": {"enabled": True, "project": "gpt2", "group": "a"}}, {"wandb_project": "gpt2"}),
    ({"wandb": {"enabled": True}}, {"wandb_project": "deepspeed"}),
    ({"flops_profiler": {"enabled": True, "profile_step": 5, "top_modules": 3}},
     {"profile": True, "profile_step_start": 5, "profile_step_end": 6}),
    ({"communication_data_type": "bf16"}, {"grad_reduce_dtype": "bf16"}),
    ({"communication_data_type": "fp16"}, {"grad_reduce_dtype": "fp16"}),
    ({"communication_data_type": "fp32"}, {"grad_reduce_dtype": "fp32"}),
    ({"pipeline": {"stages": 2, "partition": "parameters"}}, {"pipeline_model_parallel_size": 2}),
    ({"tensor_parallel": {"autotp_size": 2}}, {"tensor_model_parallel_size": 2}),
    ({"zero_optimization": {"stage": 2, "cpu_offload": True}}, {"zero_stage": 2, "optimizer_cpu_offload": True}),
])
def test_sections_megapar_has_set_its_flags(tmp_path, config, expected):
    assert flags_of(tmp_path, config) == expected


def test_wandb_group_and_team_are_noted_with_the_variable_to_set(tmp_path):
    s = settings_of(tmp_path, {"wandb": {"enabled": True, "project": "p", "team": "t", "group": "g"}})
    assert "WANDB_ENTITY" in s.noted["wandb.team"] and "WANDB_RUN_GROUP" in s.noted["wandb.group"]
    assert "wandb.project" not in s.noted


# ---- every problem at once --------------------------------------------------------------------------------
def test_every_problem_of_a_config_in_one_message(tmp_path):
    message = refused(tmp_path, {
        "train_batch_sise": 8,
        "optimizer": {"type": "OneBitLamb", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 5, "overlap_com": True, "offload_param": {"device": "nvme"}},
        "fp16": {"enabled": "yes"},
        "curriculum_learning": {"enabled": True},
        "scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 5, "warmup_num_steps": "many"}},
    }, extra=["--micro-batch-size", "2"])
    parts = message.split(": ", 1)[1].split("; ")
    expected = ["unknown key train_batch_sise: did you mean train_batch_size?",
                'fp16.enabled "yes" must be true or false',
                'optimizer.type: "OneBitLamb" is not supported',
                "unknown key zero_optimization.overlap_com: did you mean zero_optimization.overlap_comm?",
                "zero_optimization.stage: 5 is not a ZeRO stage",
                'zero_optimization.offload_param.device: "nvme" is not supported',
                'scheduler.params.warmup_num_steps "many" must be an integer',
                "scheduler.params.last_batch_iteration: 5 is not supported",
                "curriculum_learning.enabled: true is not supported"]
    for fragment in expected:
        assert sum(fragment in p for p in parts) == 1, (fragment, parts)
    assert message.startswith(str(tmp_path / "ds_config.json") + ": ")


# ---- real configs, as their users run them ------------------------------------------------------------------
# Hugging Face's ZeRO-2 / ZeRO-3 templates (the Trainer fills the "auto"s from its arguments) and LLaMA-Factory's
HF_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
HF_ZERO3 = {**HF_ZERO2, "zero_optimization": {
    "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
    "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
    "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}}
LLAMA_FACTORY_Z3 = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "overlap_comm": False, "contiguous_gradients": True, "sub_group_size": 1e9,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}}
# Megatron-DeepSpeed's example (examples_deepspeed) and DeepSpeed's CIFAR-10 example
MEGATRON_DEEPSPEED = {
    "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
    "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "prescale_gradients": False,
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1,
             "initial_scale_power": 11},
    "bf16": {"enabled": False}, "wall_clock_breakdown": False,
    "optimizer": {"type": "Adam", "params": {"lr": 6e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 6e-4,
                                                 "warmup_num_steps": 100}}}
DEEPSPEED_CIFAR = {
    "train_batch_size": 16, "steps_per_print": 2000,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                 "warmup_num_steps": 1000}},
    "gradient_clipping": 1.0, "prescale_gradients": False, "bf16": {"enabled": True},
    "fp16": {"enabled": False, "fp16_master_weights_and_grads": False, "loss_scale": 0, "loss_scale_window": 500,
             "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
    "wall_clock_breakdown": False,
    "zero_optimization": {"stage": 0, "allgather_partitions": True, "reduce_scatter": True,
                          "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000, "overlap_comm": True,
                          "contiguous_gradients": True, "cpu_offload": False}}


def test_hf_templates_with_autos_take_the_command_line(tmp_path):
    """The Trainer's arguments become megapar's flags; the start line says what each "auto" became."""
    for template, stage in ((HF_ZERO2, 2), (HF_ZERO3, 3), (LLAMA_FACTORY_Z3, 3)):
        cfg = config_of(tmp_path, template, "--bf16", "--lr", "2e-5", "--micro-batch-size", "2",
                        "--global-batch-size", "16", "--lr-warmup-iters", "50", "--adam-beta2", "0.95", world=2,
                        gpus=True)
        t = cfg.train
        assert cfg.parallel.zero_stage == stage and t.bf16 and not t.fp16
        assert (t.lr, t.micro_batch_size, t.global_batch_size, cfg.num_microbatches) == (2e-5, 2, 16, 4)
        assert t.adam_beta2 == 0.95 and t.clip_grad == 1.0
        if template is not LLAMA_FACTORY_Z3:
            assert (t.lr_decay_style, t.lr_warmup_style, t.lr_warmup_iters) == ("constant", "log", 50)
            assert cfg.log.log_interval == 2000
        autos = cfg.deepspeed.summary(cfg)[1]
        for fragment in ("train_batch_size -> --global-batch-size 16", "gradient_accumulation_steps -> 4",
                         "fp16.enabled -> no --fp16", "bf16.enabled -> --bf16", "gradient_clipping -> --clip-grad 1"):
            assert fragment in autos, autos
        if template is not LLAMA_FACTORY_Z3:
            assert "optimizer.params.lr -> --lr 2e-05" in autos
            assert "optimizer.params.betas -> --adam-beta1 0.9, --adam-beta2 0.95" in autos


def test_megatron_deepspeed_and_deepspeed_examples_read_as_deepspeed_reads_them(tmp_path):
    cfg = config_of(tmp_path, MEGATRON_DEEPSPEED, world=2)
    t = cfg.train
    assert t.fp16 and t.initial_loss_scale == 2.0**11 and t.loss_scale_window == 500
    assert (t.lr, t.adam_beta2, t.weight_decay, t.lr_warmup_iters) == (6e-4, 0.95, 0.1, 100)
    assert (t.lr_decay_style, t.lr_warmup_style) == ("constant", "log") and cfg.parallel.zero_stage == 1
    assert "prescale_gradients" in cfg.deepspeed.noted
    cfg = config_of(tmp_path, DEEPSPEED_CIFAR, world=2)
    t = cfg.train
    assert t.bf16 and not t.fp16 and t.initial_loss_scale == 2.0**32   # fp16's keys: ignored while it is off
    assert (t.global_batch_size, t.lr_warmup_style, cfg.parallel.zero_stage) == (16, "log", 0)
    assert not cfg.parallel.optimizer_cpu_offload


# ---- the docs table and megapar-ds-config ----------------------------------------------------------------------
def test_the_guide_has_the_table_of_every_key():
    """docs/guide.md carries key_table() as is: regenerate it with `megapar-ds-config --table`."""
    from megapar.config.deepspeed.keys import HONOURED, NOTED, SWITCHED
    from megapar.config.deepspeed.read import key_table
    guide = (ROOT / "docs" / "guide.md").read_text()
    assert key_table() in guide
    for key in (*HONOURED, *NOTED, *SWITCHED):
        assert f"`{key}" in key_table()


def test_ds_config_tool_prints_what_the_config_becomes(tmp_path, capsys):
    from megapar.cli.ds_config import main
    path = write(tmp_path, HF_ZERO3)
    assert main([path, "--world-size", "4", *BASE, "--bf16", "--lr", "1e-4", "--micro-batch-size", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"> --deepspeed-config {path} set: ")
    for fragment in ("--zero-stage 3", "--optimizer-cpu-offload", "--param-cpu-offload",
                     "--lr-warmup-style log (DeepSpeed's default)", "--log-interval 2000"):
        assert fragment in out[0], out[0]
    assert "\"auto\": " in out[1] and "train_batch_size -> --global-batch-size 8" in out[1]
    assert "accepted, not acted on:" in out[2] and "stage3_max_live_parameters" in out[2]
    assert out[3].endswith("global batch 8 = micro batch 2 x 1 microbatches x data 4")


def test_ds_config_tool_lists_every_refusal(tmp_path, capsys):
    from megapar.cli.ds_config import main
    path = write(tmp_path, {"optimizer": {"type": "Lamb"}, "zero_optimisation": {"stage": 2}})
    assert main([path]) == 2
    out, err = capsys.readouterr()
    assert out.startswith(f"> --deepspeed-config {path} set: ")
    assert err.count("\n") == 1 and err.startswith(f"error: {path}: ")
    assert 'optimizer.type: "Lamb" is not supported' in err
    assert "unknown key zero_optimisation: did you mean zero_optimization?" in err
