"""Megatron-compatible command line -> typed, validated config dataclasses.

No global `get_args()`: `parse_config(argv, world_size)` returns a `Config` that is passed to
whoever needs it. Validation runs before any process group or model exists and raises
`ConfigError` with one message that names the flags and a fix.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Optional, Sequence

from .topology import ConfigError, check_parallel_shape, pipeline_layer_counts

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "TikTokenizer")


@dataclass
class ModelConfig:
    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 8
    ffn_hidden_size: Optional[int] = None          # default 4 * hidden_size
    seq_length: int = 256
    max_position_embeddings: Optional[int] = None  # default seq_length
    make_vocab_size_divisible_by: int = 128
    padded_vocab_size: Optional[int] = None        # set once the tokenizer is known
    vocab_size: Optional[int] = None               # true (unpadded) vocabulary size
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    attention_backend: str = "auto"                # auto | flash | cudnn | fused | torch
    layernorm_impl: str = "torch"                  # torch | fused
    recompute_granularity: Optional[str] = None    # None | full | selective
    recompute_method: Optional[str] = None         # uniform | block
    recompute_num_layers: int = 1
    torch_compile: bool = False                    # torch.compile each transformer layer
    gradient_accumulation_fusion: bool = True      # weight-grad GEMMs accumulate into the fp32 main_grad
    decoder_first_pipeline_num_layers: Optional[int] = None  # uneven pipeline stages (default: even split)
    decoder_last_pipeline_num_layers: Optional[int] = None
    sequence_parallel: bool = False                # split LayerNorm/dropout/residual work along the sequence (tp > 1)

    @property
    def kv_channels(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    data_parallel_size: int = 1                    # derived: world / (tp * pp)
    use_distributed_optimizer: bool = False
    pipeline_schedule: str = "1f1b"                # 1f1b | afab
    distributed_backend: Optional[str] = None      # nccl | gloo (default: nccl on GPU)
    distributed_timeout_minutes: float = 10.0
    pipeline_hang_diagnostics: bool = False        # NCCL: poll p2p waits (reports the step; slower)


@dataclass
class TrainConfig:
    micro_batch_size: int = 4
    global_batch_size: Optional[int] = None        # default micro * dp
    train_iters: Optional[int] = None
    train_samples: Optional[int] = None
    lr: float = 6e-4
    min_lr: float = 0.0
    lr_decay_style: str = "cosine"
    lr_decay_iters: Optional[int] = None
    lr_warmup_fraction: Optional[float] = None
    lr_warmup_iters: int = 0
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    adam_impl: str = "auto"                        # auto | torch | fused (csrc one-launch AdamW + param copy)
    seed: int = 1234
    fp16: bool = False
    bf16: bool = False
    loss_scale: Optional[float] = None             # static scale; None = dynamic
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    exit_signal_handler: bool = False
    enable_cuda_graph: bool = False                # capture the whole step as one CUDA graph
    cuda_graph_warmup_steps: int = 3               # eager steps before the capture

    @property
    def params_dtype_name(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"


@dataclass
class DataConfig:
    data_path: list[str] = field(default_factory=list)
    split: str = "969,30,1"
    tokenizer_type: str = "GPT2BPETokenizer"
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    data_cache_path: Optional[str] = None


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_save_optim: bool = False
    no_save_rng: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False


@dataclass
class LogConfig:
    log_interval: int = 10
    eval_interval: int = 1000
    eval_iters: int = 10
    tensorboard_dir: Optional[str] = None
    timing_log_level: int = 0
    profile: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12


@dataclass
class Config:
    model: ModelConfig
    parallel: ParallelConfig
    train: TrainConfig
    data: DataConfig
    ckpt: CheckpointConfig
    log: LogConfig
    args: argparse.Namespace                        # the flat namespace, stored in checkpoints

    @property
    def num_microbatches(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.data_parallel_size)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="megapar GPT-2 pretraining (Megatron-LM compatible flags)",
                                allow_abbrev=False)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", "--tensor-parallel", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", "--pipeline-parallel", type=int, default=1)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with tp > 1: split LayerNorm, dropout and residual work (and their activations) along "
                        "the sequence; all-reduces become reduce-scatter + all-gather")
    g.add_argument("--pipeline-schedule", choices=["1f1b", "afab"], default="1f1b",
                   help="1f1b (default) or all-forward-all-backward (reference)")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None)
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument("--pipeline-hang-diagnostics", action="store_true",
                   help="on GPUs, poll pipeline send/recv against --distributed-timeout-minutes and name the "
                        "schedule step, microbatch and operation a rank hangs on (blocks the CPU per transfer; "
                        "always on with gloo)")

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--num-attention-heads", type=int, default=8)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=256)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--attention-backend", choices=["auto", "flash", "cudnn", "fused", "torch"], default="auto",
                   help="flash = torch SDPA (default where available), cudnn = SDPA preferring cuDNN attention, "
                        "fused = csrc softmax, torch = reference")
    g.add_argument("--layernorm-impl", choices=["torch", "fused"], default="torch")
    g.add_argument("--torch-compile", action="store_true",
                   help="torch.compile each transformer layer (fuses LayerNorm, GELU, dropout, residual adds)")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="layers on the first pipeline stage (the rest split evenly over the other stages)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="layers on the last pipeline stage, which also runs the LM head and the loss")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion",
                   help="weight-gradient GEMMs write a bf16 grad that a hook adds to the fp32 buffer (default: "
                        "they accumulate into the fp32 buffer directly)")
    g.add_argument("--recompute-activations", action="store_true", help="= --recompute-granularity selective")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="old name: = --recompute-granularity full --recompute-method uniform --recompute-num-layers 1")

    g = p.add_argument_group("batch, schedule and optimizer")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--lr", type=float, default=6e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine")
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--adam-impl", choices=["auto", "torch", "fused"], default="auto",
                   help="fused: csrc's one-launch AdamW that also writes the bf16/fp16 params (GPUs; JIT-built on "
                        "first use when not built at install); torch: torch's fused (GPU) / foreach (CPU) AdamW, "
                        "then a copy into the bf16/fp16 params; auto: fused on GPUs when setup.py built the "
                        "kernels, else torch")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--enable-cuda-graph", action="store_true",
                   help="capture the whole training step (forward, backward, gradient reduction, optimizer) as "
                        "one CUDA graph and replay it every iteration (removes kernel-launch overhead; GPUs, "
                        "no pipeline parallelism, no fp16, no dropout, no recompute)")
    g.add_argument("--cuda-graph-warmup-steps", type=int, default=3,
                   help="eager steps before the capture (compilation, cuBLAS autotuning, optimizer state)")

    g = p.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="static loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=[])
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--tokenizer-type", default="GPT2BPETokenizer")
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--data-cache-path", default=None)

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    for flag in ("--no-save-optim", "--no-save-rng", "--no-load-optim", "--no-load-rng", "--finetune"):
        g.add_argument(flag, action="store_true")

    g = p.add_argument_group("logging, evaluation and exit")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--timing-log-level", type=int, choices=[0, 1, 2], default=0)
    g.add_argument("--profile", action="store_true",
                   help="torch.profiler over iterations [--profile-step-start, --profile-step-end): rank 0 prints "
                        "the top kernels and writes a Chrome trace (to --tensorboard-dir or the working directory)")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--exit-signal-handler", action="store_true")
    return p


def _pick(cls, ns: argparse.Namespace):
    return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})


def _normalise(ns: argparse.Namespace) -> None:
    """Resolve aliases and defaults that depend on other flags (in place)."""
    if ns.checkpoint_activations:
        ns.recompute_granularity = ns.recompute_granularity or "full"
        ns.recompute_method = ns.recompute_method or "uniform"
        ns.recompute_num_layers = ns.recompute_num_layers or 1
    if ns.recompute_activations:
        ns.recompute_granularity = ns.recompute_granularity or "selective"
    if ns.recompute_granularity == "full" and ns.recompute_method is None:
        ns.recompute_method = "uniform"
    if ns.recompute_num_layers is None:
        ns.recompute_num_layers = 1
    if ns.attention_backend == "auto":  # torch SDPA (flash kernels on GPU, math on CPU)
        ns.attention_backend = "flash"
    ns.ffn_hidden_size = ns.ffn_hidden_size or 4 * ns.hidden_size
    ns.max_position_embeddings = ns.max_position_embeddings or ns.seq_length
    if ns.tensor_model_parallel_size == 1:  # nothing to split (Megatron also turns it off)
        ns.sequence_parallel = False


def config_from_namespace(ns: argparse.Namespace, world_size: int) -> Config:
    """Validate `ns` for a job of `world_size` processes and build the Config."""
    _normalise(ns)
    validate(ns, world_size)
    ns.data_parallel_size = world_size // (ns.tensor_model_parallel_size * ns.pipeline_model_parallel_size)
    ns.global_batch_size = ns.global_batch_size or ns.micro_batch_size * ns.data_parallel_size
    _check_batch(ns)
    return Config(model=_pick(ModelConfig, ns), parallel=_pick(ParallelConfig, ns), train=_pick(TrainConfig, ns),
                  data=_pick(DataConfig, ns), ckpt=_pick(CheckpointConfig, ns), log=_pick(LogConfig, ns), args=ns)


def parse_config(argv: Optional[Sequence[str]], world_size: int) -> Config:
    return config_from_namespace(build_parser().parse_args(argv), world_size)


def _fail(msg: str) -> None:
    raise ConfigError(msg)


def validate(ns: argparse.Namespace, world_size: int) -> None:
    """Every check that needs no process group. Raises ConfigError naming flags and a fix."""
    tp, pp = ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        _fail(f"--tensor-model-parallel-size ({tp}) and --pipeline-model-parallel-size ({pp}) must be >= 1")
    if world_size % (tp * pp):
        _fail(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
              f"--pipeline-model-parallel-size {pp} = {tp * pp}; launch a multiple of {tp * pp} processes "
              f"or change the parallel sizes")
    if ns.hidden_size % ns.num_attention_heads:
        _fail(f"--hidden-size {ns.hidden_size} is not divisible by --num-attention-heads "
              f"{ns.num_attention_heads}; pick a head count that divides the hidden size")
    check_parallel_shape(ns.num_layers, ns.num_attention_heads, ns.ffn_hidden_size, tp, pp,
                         first=ns.decoder_first_pipeline_num_layers, last=ns.decoder_last_pipeline_num_layers)
    if ns.seq_length > ns.max_position_embeddings:
        _fail(f"--seq-length {ns.seq_length} is larger than --max-position-embeddings "
              f"{ns.max_position_embeddings}; raise --max-position-embeddings or shorten --seq-length")
    if ns.fp16 and ns.bf16:
        _fail("--fp16 and --bf16 were both given; choose one precision")
    if ns.tokenizer_type not in TOKENIZER_TYPES:
        _fail(f"unknown --tokenizer-type {ns.tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}")
    if ns.sequence_parallel and tp > 1 and ns.seq_length % tp:
        _fail(f"--sequence-parallel splits the sequence over tensor parallelism: --seq-length {ns.seq_length} "
              f"is not divisible by --tensor-model-parallel-size {tp}; pick a multiple of {tp}")
    if ns.train_iters is not None and ns.train_samples is not None:
        _fail("--train-iters and --train-samples were both given; choose one")
    if ns.lr_warmup_fraction is not None and ns.lr_warmup_iters:
        _fail("--lr-warmup-fraction and --lr-warmup-iters were both given; choose one")
    if ns.recompute_method is not None and ns.recompute_granularity != "full":
        _fail("--recompute-method needs --recompute-granularity full")
    per_stage = min(pipeline_layer_counts(ns.num_layers, pp, ns.decoder_first_pipeline_num_layers,
                                          ns.decoder_last_pipeline_num_layers))
    if ns.recompute_granularity == "full" and not 1 <= ns.recompute_num_layers <= per_stage:
        _fail(f"--recompute-num-layers {ns.recompute_num_layers} must be between 1 and the layers of the "
              f"smallest pipeline stage ({per_stage})")
    if ns.enable_cuda_graph:
        _check_cuda_graph(ns)
    for flag in ("micro_batch_size", "num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        if getattr(ns, flag) < 1:
            _fail(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(ns, flag)}")
    if ns.make_vocab_size_divisible_by < 1:
        _fail("--make-vocab-size-divisible-by must be >= 1")


def _check_cuda_graph(ns: argparse.Namespace) -> None:
    """--enable-cuda-graph captures one step whose kernels and addresses never change."""
    import torch
    blockers = [
        (not torch.cuda.is_available() or ns.distributed_backend == "gloo", "it needs CUDA GPUs and NCCL"),
        (ns.pipeline_model_parallel_size > 1, "pipeline schedules are not captured; use "
                                              "--pipeline-model-parallel-size 1"),
        (ns.fp16, "fp16 loss scaling reads the overflow flag back every step; use --bf16"),
        (ns.hidden_dropout > 0 or ns.attention_dropout > 0,
         "dropout swaps RNG states, which a capture forbids; set --hidden-dropout 0 --attention-dropout 0"),
        (ns.recompute_granularity is not None, "recompute swaps RNG states, which a capture forbids; "
                                               "drop the recompute flags"),
        (ns.cuda_graph_warmup_steps < 1, "--cuda-graph-warmup-steps must be >= 1"),
    ]
    for blocked, why in blockers:
        if blocked:
            _fail(f"--enable-cuda-graph: {why} (or drop --enable-cuda-graph)")


def _check_batch(ns: argparse.Namespace) -> None:
    per_step = ns.micro_batch_size * ns.data_parallel_size
    if ns.global_batch_size % per_step:
        _fail(f"--global-batch-size {ns.global_batch_size} is not divisible by --micro-batch-size "
              f"{ns.micro_batch_size} x data-parallel size {ns.data_parallel_size} = {per_step}; "
              f"use a multiple of {per_step}")
