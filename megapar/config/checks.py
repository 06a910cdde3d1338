"""Validation: every check of a Config that needs no process group, reading its typed sections.

`validate(cfg, world_size)` runs before any process group or model exists; a failed check raises one
ConfigError whose message names the flags and a fix, and which carries the settings it concerns
(overlays.explain names where their values came from).
"""
from __future__ import annotations

import math
import os
from typing import Optional

from ..data.tokenizer import TOKENIZER_TYPES
from ..topology import check_parallel_shape, pipeline_layer_counts
from .settings import Config, TrainConfig, default_of, dest_of, fail, flag


def validate(cfg: Config, world_size: int, assume_gpus: bool = False) -> None:
    """Every check that needs no process group. Raises ConfigError naming flags and a fix.
    `assume_gpus`: as on a machine with CUDA GPUs, whatever this one has."""
    m, p, t, d, c = cfg.model, cfg.parallel, cfg.train, cfg.data, cfg.ckpt
    _check_ranges(cfg)
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    for opt, alias, size in (("--tensor-model-parallel-size", "--tensor-parallel", tp),
                             ("--pipeline-model-parallel-size", "--pipeline-parallel", pp)):
        if size < 1:
            fail(f"{opt} (or {alias}) {size} must be >= 1: the number of processes each model replica is split "
                 f"over in that dimension; 1 turns it off", dest_of(opt))
    if world_size % (tp * pp):
        fail(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
             f"--pipeline-model-parallel-size {pp} = {tp * pp}; launch a multiple of {tp * pp} processes "
             f"or change the parallel sizes", "tensor_model_parallel_size", "pipeline_model_parallel_size")
    if m.hidden_size % m.num_attention_heads:
        fail(f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
             f"{m.num_attention_heads}; pick a head count that divides the hidden size",
             "hidden_size", "num_attention_heads")
    check_parallel_shape(m.num_layers, m.num_attention_heads, m.ffn_hidden_size, tp, pp,
                         first=m.decoder_first_pipeline_num_layers, last=m.decoder_last_pipeline_num_layers)
    if m.seq_length > m.max_position_embeddings:
        fail(f"--seq-length {m.seq_length} is larger than --max-position-embeddings "
             f"{m.max_position_embeddings}; raise --max-position-embeddings or shorten --seq-length",
             "seq_length", "max_position_embeddings")
    if t.fp16 and t.bf16:
        fail("--fp16 and --bf16 were both given; choose one precision", "fp16", "bf16")
    if d.tokenizer_type not in TOKENIZER_TYPES:
        fail(f"unknown --tokenizer-type {d.tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}",
             "tokenizer_type")
    if m.sequence_parallel and tp > 1 and m.seq_length % tp:
        fail(f"--sequence-parallel splits the sequence over tensor parallelism: --seq-length {m.seq_length} "
             f"is not divisible by --tensor-model-parallel-size {tp}; pick a multiple of {tp}",
             "sequence_parallel", "seq_length", "tensor_model_parallel_size")
    if t.train_iters is not None and t.train_samples is not None:
        fail("--train-iters and --train-samples were both given; choose one", "train_iters", "train_samples")
    if t.lr_warmup_fraction is not None and t.lr_warmup_iters:
        fail("--lr-warmup-fraction and --lr-warmup-iters were both given; choose one",
             "lr_warmup_fraction", "lr_warmup_iters")
    _check_sample_based(cfg)
    given_wd = [f for f, v in (("--start-weight-decay", t.start_weight_decay),
                               ("--end-weight-decay", t.end_weight_decay)) if v is not None]
    if t.weight_decay_incr_style == "constant" and given_wd:
        fail(f"{given_wd[0]} sets where a changing weight decay starts or ends: add --weight-decay-incr-style "
             f"linear or cosine, or give --weight-decay alone for a constant one",
             *map(dest_of, given_wd), "weight_decay_incr_style", "weight_decay")
    if t.weight_decay_incr_style != "constant" and len(given_wd) < 2:
        fail(f"--weight-decay-incr-style {t.weight_decay_incr_style} moves the weight decay from "
             f"--start-weight-decay to --end-weight-decay; give both",
             "weight_decay_incr_style", "start_weight_decay", "end_weight_decay")
    if t.lr_warmup_init > t.lr:
        fail(f"--lr-warmup-init {t.lr_warmup_init:g} is above --lr {t.lr:g}: the warmup rises from it to --lr; "
             f"lower it", "lr_warmup_init", "lr")
    if t.override_opt_param_scheduler and t.use_checkpoint_opt_param_scheduler:
        fail("--override-opt_param-scheduler (take the LR schedule from the flags) and "
             "--use-checkpoint-opt_param-scheduler (take the checkpoint's) were both given; choose one",
             "override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler")
    if m.recompute_method is not None and m.recompute_granularity != "full":
        fail("--recompute-method needs --recompute-granularity full", "recompute_method", "recompute_granularity")
    per_stage = min(pipeline_layer_counts(m.num_layers, pp, m.decoder_first_pipeline_num_layers,
                                          m.decoder_last_pipeline_num_layers))
    if m.recompute_granularity == "full" and not 1 <= m.recompute_num_layers <= per_stage:
        fail(f"--recompute-num-layers {m.recompute_num_layers} must be between 1 and the layers of the "
             f"smallest pipeline stage ({per_stage})", "recompute_num_layers")
    if c.async_save and c.ckpt_format != "torch_dist":
        fail("--async-save needs --ckpt-format torch_dist (the legacy format is written by one rank per shard "
             "while training waits); add --ckpt-format torch_dist or drop --async-save", "async_save", "ckpt_format")
    gpus = assume_gpus or _has_gpus()
    _check_zero(cfg, gpus)
    _check_fp8(cfg, gpus)
    _check_loggers(cfg)
    if t.enable_cuda_graph:
        _check_cuda_graph(cfg, gpus)


# Numeric ranges, checked first (a zero head count must not reach `hidden_size % heads`).
# name -> (rule, low, high, low inclusive, high inclusive); None (flag not given) always passes.
# Integers: sizes and counts.
_AT_LEAST_1 = ("micro_batch_size", "global_batch_size", "num_layers", "hidden_size", "num_attention_heads",
               "seq_length", "ffn_hidden_size", "max_position_embeddings", "make_vocab_size_divisible_by",
               "log_interval", "save_interval", "exit_interval", "lr_decay_iters", "loss_scale_window",
               "hysteresis", "ddp_bucket_size", "lr_decay_samples")
_AT_LEAST_0 = ("train_iters", "train_samples", "lr_warmup_iters", "lr_warmup_samples", "eval_iters", "eval_interval",
               "profile_step_start", "profile_step_end")
_WHY = {"train_iters": "0 builds the model and exits", "eval_interval": "0 never evaluates during training",
        "eval_iters": "0 skips evaluation", "save_interval": "leave it out to save only at the end",
        "exit_interval": "leave it out to run to the end",
        "global_batch_size": "leave it out for --micro-batch-size x the data-parallel size"}
# Floats: (low, high, low included, high included); every one must also be finite.
# --distributed-timeout-minutes: below 3 s the processes cannot even connect to the rendezvous store (a
# connection timeout of 0 ms); above a year (c10d keeps a timeout as int64 nanoseconds, 2**63 ns is about 292
# years) a larger value overflows into a crash, and no collective should wait that long for a peer.
MIN_TIMEOUT_MINUTES, MAX_TIMEOUT_MINUTES = 0.05, 365 * 24 * 60
_FLOAT_RANGES = {
    "lr": (0.0, None, True, None), "min_lr": (0.0, None, True, None), "weight_decay": (0.0, None, True, None),
    "start_weight_decay": (0.0, None, True, None), "end_weight_decay": (0.0, None, True, None),
    "clip_grad": (0.0, None, True, None), "hidden_dropout": (0.0, 1.0, True, False),
    "attention_dropout": (0.0, 1.0, True, False), "adam_beta1": (0.0, 1.0, True, False),
    "adam_beta2": (0.0, 1.0, True, False), "adam_eps": (0.0, None, False, None),
    "layernorm_epsilon": (0.0, None, False, None), "init_method_std": (0.0, None, False, None),
    "lr_warmup_fraction": (0.0, 1.0, True, True), "lr_warmup_init": (0.0, None, True, None),
    "loss_scale": (0.0, None, False, None), "optimizer_offload_fraction": (0.0, 1.0, True, True),
    "initial_loss_scale": (0.0, None, False, None), "min_loss_scale": (0.0, None, False, None),
    "exit_duration_in_mins": (0.0, None, False, None),
    "distributed_timeout_minutes": (MIN_TIMEOUT_MINUTES, MAX_TIMEOUT_MINUTES, True, True),
}


def _range_text(low, high, low_in, high_in) -> str:
    if high is None:
        return f"a finite number {'>=' if low_in else '>'} {low:g}"
    return f"a number in {'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"


def _check_ranges(cfg: Config) -> None:
    """Sizes, counts and rates that would crash or train nonsense (--train-iters -5, --lr nan,
    --hidden-dropout 1.5, ...): one ConfigError naming the flag, the allowed range and a fix."""
    t = cfg.train
    for names, low in ((_AT_LEAST_1, 1), (_AT_LEAST_0, 0)):
        for name in names:
            v = cfg.get(name)
            if v is not None and v < low:
                default = default_of(name)
                fix = _WHY.get(name) or (f"the default is {default}" if default is not None else "")
                fail(f"{flag(name)} {v} must be >= {low}" + (f"; {fix}" if fix else ""), name)
    for name, (low, high, low_in, high_in) in _FLOAT_RANGES.items():
        v = cfg.get(name)
        if v is None:
            continue
        ok = math.isfinite(v) and (v >= low if low_in else v > low)
        if ok and high is not None:
            ok = v <= high if high_in else v < high
        if not ok:
            default = default_of(name)
            fail(f"{flag(name)} {v} is out of range: it must be {_range_text(low, high, low_in, high_in)}"
                 + (f"; the default is {default:g}" if default is not None else ""), name)
    if not 0 <= t.seed < 2**32:
        fail(f"--seed {t.seed} must be in [0, 2**32); e.g. the default {default_of('seed')}", "seed")


def _has_gpus() -> bool:
    import torch
    return torch.cuda.is_available()


def _check_zero(cfg: Config, gpus: bool) -> None:
    """ZeRO stages and offload: what cannot work is refused before any process group exists."""
    p, t = cfg.parallel, cfg.train
    stage = p.zero_stage
    gpus = gpus and p.distributed_backend != "gloo"
    if p.param_cpu_offload and stage != 3:
        fail(f"--param-cpu-offload keeps parameter shards on the CPU, which needs --zero-stage 3 "
             f"(this run: --zero-stage {stage}); add --zero-stage 3 or drop --param-cpu-offload",
             "param_cpu_offload", "zero_stage")
    if p.optimizer_cpu_offload and stage < 1:
        fail("--optimizer-cpu-offload moves the sharded optimizer state to the CPU: it needs --zero-stage 1, 2 "
             "or 3 (or --use-distributed-optimizer); add one or drop --optimizer-cpu-offload",
             "optimizer_cpu_offload", "zero_stage", "use_distributed_optimizer")
    for opt, on in (("--optimizer-cpu-offload", p.optimizer_cpu_offload),
                    ("--param-cpu-offload", p.param_cpu_offload)):
        if on and not gpus:
            fail(f"{opt} moves GPU state to CPU memory, but this run has no CUDA GPU (or uses gloo); "
                 f"drop {opt} on a CPU-only run", dest_of(opt))
    if p.optimizer_offload_fraction != 1.0:
        fail(f"--optimizer-offload-fraction {p.optimizer_offload_fraction:g}: megapar offloads the whole optimizer "
             f"state or none of it; use --optimizer-offload-fraction 1.0 (Megatron's default) with "
             f"--optimizer-cpu-offload, or drop both to keep the state on the GPUs",
             "optimizer_offload_fraction", "optimizer_cpu_offload")
    if p.optimizer_nvme_offload is not None:
        _check_nvme_offload(cfg, stage)
    if p.delayed_param_update and not (p.optimizer_cpu_offload or p.optimizer_nvme_offload):
        fail("--delayed-param-update overlaps the offloaded optimizer's CPU step with the next step, but this "
             "run's optimizer is not offloaded; add --optimizer-cpu-offload (or --optimizer-nvme-offload PATH) "
             "or drop --delayed-param-update",
             "delayed_param_update", "optimizer_cpu_offload", "optimizer_nvme_offload")
    if p.optimizer_cpu_offload and t.adam_impl == "fused":
        fail("--adam-impl fused is csrc's GPU kernel, but --optimizer-cpu-offload steps AdamW on the CPU (torch's "
             "fused CPU kernel); drop --adam-impl fused or --optimizer-cpu-offload",
             "adam_impl", "optimizer_cpu_offload")


def _check_nvme_offload(cfg: Config, stage: int) -> None:
    """--optimizer-nvme-offload PATH: ZeRO >= 1, the CPU step's AdamW, and a writable folder (its room
    is checked once the model's size is known: megapar/optimizer/nvme.py)."""
    p, t = cfg.parallel, cfg.train
    path = p.optimizer_nvme_offload
    if stage < 1:
        fail("--optimizer-nvme-offload moves the sharded optimizer state to files: it needs --zero-stage 1, 2 or "
             "3 (or --use-distributed-optimizer); add one or drop --optimizer-nvme-offload",
             "optimizer_nvme_offload", "zero_stage", "use_distributed_optimizer")
    if t.adam_impl == "fused":
        fail("--adam-impl fused is csrc's GPU kernel, but --optimizer-nvme-offload steps AdamW on the CPU (torch's "
             "fused CPU kernel); drop --adam-impl fused or --optimizer-nvme-offload",
             "adam_impl", "optimizer_nvme_offload")
    if not os.path.isdir(path):
        fail(f"--optimizer-nvme-offload {path} is not a directory; create it on a fast local disk (NVMe) or "
             f"give an existing one", "optimizer_nvme_offload")
    if not os.access(path, os.W_OK | os.X_OK):
        fail(f"--optimizer-nvme-offload {path} is not writable by this user; give a folder you can write to",
             "optimizer_nvme_offload")


def _check_fp8(cfg: Config, gpus: bool) -> None:
    """--fp8-format: bf16 training on a GPU with FP8 (compute capability >= 8.9), torchao installed,
    every transformer GEMM's sizes multiples of 16 (torch._scaled_mm)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    from ..fp8 import GEMM_MULTIPLE, MIN_CAPABILITY, torchao_installed

    fmt = m.fp8_format
    if fmt is None:
        if m.fp8_recipe != default_of("fp8_recipe"):
            fail(f"--fp8-recipe {m.fp8_recipe} is a setting of the fp8 GEMMs: add --fp8-format e4m3 or drop it",
                 "fp8_recipe", "fp8_format")
        return
    if t.fp16:
        fail(f"--fp8-format {fmt} runs beside bf16 (bf16 weights and activations, no loss scaling), not --fp16; "
             f"use --bf16 instead of --fp16", "fp8_format", "fp16", "bf16")
    if not t.bf16:
        fail(f"--fp8-format {fmt} needs --bf16 (the weights, activations and the GEMMs' outputs stay bf16); "
             f"add --bf16", "fp8_format", "bf16")
    if m.fp8_recipe == "rowwise" and fmt != "e4m3":
        fail(f"--fp8-recipe rowwise (torchao's) casts every operand, gradients too, to e4m3: use --fp8-format e4m3 "
             f"with it, or --fp8-recipe tensorwise with --fp8-format {fmt}", "fp8_recipe", "fp8_format")
    tp = p.tensor_model_parallel_size
    sizes = [(f"--hidden-size {m.hidden_size} / --tensor-model-parallel-size {tp}", m.hidden_size // tp),
             (f"--ffn-hidden-size {m.ffn_hidden_size} / --tensor-model-parallel-size {tp}", m.ffn_hidden_size // tp),
             (f"--micro-batch-size {t.micro_batch_size} x --seq-length {m.seq_length} (tokens per GEMM)",
              t.micro_batch_size * m.seq_length)]
    for what, n in sizes:
        if n % GEMM_MULTIPLE:
            fail(f"--fp8-format: torch._scaled_mm needs GEMM sizes that are multiples of {GEMM_MULTIPLE}, but "
                 f"{what} = {n}; pick sizes that make it a multiple of {GEMM_MULTIPLE} or drop --fp8-format",
                 "fp8_format")
    if not gpus or p.distributed_backend == "gloo":
        fail(f"--fp8-format {fmt} runs fp8 GEMMs on NVIDIA GPUs with FP8 (compute capability >= 8.9: H100, H200, "
             f"L4, L40, RTX 4090), but this run has no CUDA GPU (or uses gloo); drop --fp8-format", "fp8_format")
    capability = _gpu_capability()
    if capability is not None and capability < MIN_CAPABILITY:
        fail(f"--fp8-format {fmt} needs a GPU with FP8 (compute capability >= 8.9: Hopper, Ada), but this one "
             f"is {capability[0]}.{capability[1]}; drop --fp8-format on this GPU", "fp8_format")
    if not torchao_installed():
        fail(f"--fp8-format {fmt} needs the torchao package (float8 training), which is not installed: "
             f"pip install torchao (or pip install -e .[fp8]), or drop --fp8-format", "fp8_format")


def _gpu_capability() -> Optional[tuple[int, int]]:
    """This machine's first GPU's compute capability; None without a GPU."""
    import torch
    return tuple(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None


def _check_loggers(cfg: Config) -> None:
    """TensorBoard and W&B: the optional package is there, the W&B flags are complete."""
    import importlib.util

    lg = cfg.log
    if lg.wandb_project is None:
        for name in ("wandb_exp_name", "wandb_save_dir"):
            if cfg.get(name) is not None:
                fail(f"{flag(name)} is a setting of the W&B run that --wandb-project starts; add --wandb-project "
                     f"NAME or drop {flag(name)}", name, "wandb_project")
    elif not lg.wandb_project.strip():
        fail("--wandb-project is empty; name the W&B project, e.g. --wandb-project gpt2", "wandb_project")
    for opt, folder in (("--wandb-save-dir", lg.wandb_save_dir), ("--csv-log-dir", lg.csv_log_dir)):
        if folder is not None and os.path.exists(folder) and not os.path.isdir(folder):
            fail(f"{opt} {folder} is a file, not a folder; give a folder for the run's log files", dest_of(opt))
    for opt, value, package in (("--tensorboard-dir", lg.tensorboard_dir, "tensorboard"),
                                 ("--wandb-project", lg.wandb_project, "wandb")):
        if value is not None and importlib.util.find_spec(package) is None:
            fail(f"{opt} needs the {package} package, which is not installed: pip install {package} "
                 f"(or drop {opt})", dest_of(opt))


def _check_cuda_graph(cfg: Config, gpus: bool) -> None:
    """--enable-cuda-graph captures one step whose kernels and addresses never change, and which
    never waits for the host (run/cuda_graph.py)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    dropout = m.hidden_dropout > 0 or m.attention_dropout > 0
    blockers = [  # (blocked, why, the settings that block)
        (not gpus or p.distributed_backend == "gloo", "it needs CUDA GPUs and NCCL", ("distributed_backend",)),
        (m.recompute_granularity is not None and dropout,
         "recompute with dropout saves and restores RNG states through the host, which a capture forbids; set "
         "--hidden-dropout 0 --attention-dropout 0, or drop the recompute flags",
         ("recompute_granularity", "hidden_dropout", "attention_dropout")),
        (p.pipeline_hang_diagnostics, "--pipeline-hang-diagnostics polls each transfer from the host; drop it",
         ("pipeline_hang_diagnostics",)),
        (t.cuda_graph_warmup_steps < 1, "--cuda-graph-warmup-steps must be >= 1", ("cuda_graph_warmup_steps",)),
        (p.optimizer_cpu_offload or p.optimizer_nvme_offload is not None,
         "the offloaded optimizer steps on the CPU, outside any graph; drop the optimizer offload flags",
         ("optimizer_cpu_offload", "optimizer_nvme_offload")),
        (p.param_cpu_offload, "--param-cpu-offload fetches each layer's shard from host memory, which the "
                               "graph does not capture; drop --param-cpu-offload", ("param_cpu_offload",)),
        (t.rampup_batch_size is not None, "the graph captures one batch size, which --rampup-batch-size changes; "
                                           "drop --rampup-batch-size", ("rampup_batch_size",)),
        (t.weight_decay_incr_style != "constant", "the graph captures the weight decay as a constant, which "
                                                   f"--weight-decay-incr-style {t.weight_decay_incr_style} changes; "
                                                   "use a constant --weight-decay",
         ("weight_decay_incr_style", "weight_decay")),
    ]
    for blocked, why, dests in blockers:
        if blocked:
            fail(f"--enable-cuda-graph: {why} (or drop --enable-cuda-graph)", "enable_cuda_graph", *dests)


def _check_sample_based(cfg: Config) -> None:
    """Megatron's sample-based flags need sample-based training, and count the schedule in samples
    alone."""
    t = cfg.train
    by_samples = [f for f, on in (("--rampup-batch-size", t.rampup_batch_size is not None),
                                  ("--lr-decay-samples", t.lr_decay_samples is not None),
                                  ("--lr-warmup-samples", t.lr_warmup_samples > 0)) if on]
    if not by_samples:
        return
    if t.train_samples is None:
        fail(f"{by_samples[0]} counts in samples: it needs sample-based training; give --train-samples instead of "
             f"--train-iters", dest_of(by_samples[0]), "train_samples", "train_iters")
    for opt, given in (("--lr-decay-iters", t.lr_decay_iters is not None), ("--lr-warmup-iters", t.lr_warmup_iters)):
        if given:
            fail(f"{opt} counts the LR schedule in iterations, {by_samples[0]} in samples; use --lr-decay-samples "
                 f"and --lr-warmup-samples (or --lr-warmup-fraction)",
                 dest_of(opt), dest_of(by_samples[0]), "lr_decay_samples", "lr_warmup_samples", "lr_warmup_fraction")
    if t.lr_warmup_fraction is not None and t.lr_warmup_samples:
        fail("--lr-warmup-fraction and --lr-warmup-samples were both given; choose one",
             "lr_warmup_fraction", "lr_warmup_samples")
    ramp = t.rampup_batch_size
    if ramp is not None and (len(ramp) != 3 or min(ramp) < 1):
        fail(f"--rampup-batch-size {' '.join(map(str, ramp))}: give three numbers >= 1, START INCREMENT SAMPLES "
             f"(e.g. --rampup-batch-size 16 16 5859375)", "rampup_batch_size")


def check_rampup(t: TrainConfig, dp: int) -> None:
    """Every batch of the ramp is whole microbatches on every data-parallel rank, and it ends at
    --global-batch-size."""
    if t.rampup_batch_size is None:
        return
    start, increment, _ = t.rampup_batch_size
    given = f"--rampup-batch-size {' '.join(map(str, t.rampup_batch_size))}"
    if start > t.global_batch_size or (t.global_batch_size - start) % increment:
        fail(f"{given}: the ramp from {start} in steps of {increment} must end at --global-batch-size "
             f"{t.global_batch_size}; pick a START at most it, whose distance to it is a multiple of INCREMENT",
             "global_batch_size")
    per_step = t.micro_batch_size * dp
    if start % per_step or increment % per_step:
        fail(f"{given}: START and INCREMENT must be multiples of --micro-batch-size {t.micro_batch_size} x "
             f"data-parallel size {dp} = {per_step}, so that every batch of the ramp is whole microbatches",
             "micro_batch_size")


def check_batch(global_batch: int, micro_batch: int, dp: int) -> None:
    per_step = micro_batch * dp
    if global_batch % per_step:
        fail(f"--global-batch-size {global_batch} is not divisible by --micro-batch-size "
             f"{micro_batch} x data-parallel size {dp} = {per_step}; use a multiple of {per_step}",
             "global_batch_size", "micro_batch_size")
