"""Megatron-compatible command line -> typed, validated config dataclasses.

Each setting is defined once, as a dataclass field below: its default, its help text and any
Megatron alias. `build_parser()` derives the command line from those fields (the parser holds
no defaults of its own: a flag the user did not give is absent from the parsed namespace, and
the dataclass default applies). No global `get_args()`: `parse_config(argv, world_size)`
returns a `Config` that is passed to whoever needs it. Validation runs before any process group
or model exists and raises `ConfigError` with one message that names the flags and a fix.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import typing
from dataclasses import MISSING, Field, asdict, dataclass, field, fields
from typing import Any, Optional, Sequence

from ..data.tokenizer import TOKENIZER_TYPES
from ..errors import OneLineErrorParser
from ..fp8 import FP8_FORMATS, FP8_RECIPES
from .recipes import recipe, recipe_names
from ..topology import ConfigError, _fail, check_parallel_shape, pipeline_layer_counts



def arg(default: Any = None, help: Optional[str] = None, *, aliases: Sequence[str] = (),
        choices: Optional[Sequence] = None, negative: Optional[str] = None, group: Optional[str] = None,
        cli: bool = True) -> Field:
    """A config field that is also the flag --field-name (plus `aliases`). A bool field that
    defaults to True is turned off by its `negative` flag; `cli=False` marks a derived field."""
    meta = {"help": help, "aliases": tuple(aliases), "choices": choices, "negative": negative, "group": group,
            "cli": cli}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    """The model's shape and how it runs; what checkpoints store as `model_config`."""
    num_layers: int = arg(4, "transformer layers")
    hidden_size: int = arg(256, "width of the embeddings and of every layer")
    num_attention_heads: int = arg(8, "attention heads per layer (a multiple of the tensor-parallel size)")
    ffn_hidden_size: Optional[int] = arg(None, "inner width of the MLP; default 4 x --hidden-size")
    seq_length: int = arg(256, "tokens per training sample")
    max_position_embeddings: Optional[int] = arg(None, "rows of the position-embedding table; default --seq-length")
    make_vocab_size_divisible_by: int = arg(128, "pad the vocabulary to a multiple of this x the tensor-parallel size")
    padded_vocab_size: Optional[int] = arg(None, cli=False)   # set once the tokenizer is known
    vocab_size: Optional[int] = arg(None, cli=False)          # true (unpadded) vocabulary size
    hidden_dropout: float = arg(0.1, "dropout on the embeddings and the attention and MLP outputs")
    attention_dropout: float = arg(0.1, "dropout on the attention probabilities")
    layernorm_epsilon: float = arg(1e-5, "LayerNorm epsilon")
    init_method_std: float = arg(0.02, "standard deviation of the normal weight initialization")
    attention_backend: str = arg("auto", "flash = torch SDPA (what auto picks), cudnn = SDPA preferring cuDNN "
                                 "attention, fused = csrc softmax, torch = reference",
                                 choices=("auto", "flash", "cudnn", "fused", "torch"))
    layernorm_impl: str = arg("torch", "torch = torch LayerNorm, fused = csrc kernel (GPUs)",
                              choices=("torch", "fused"))
    recompute_granularity: Optional[str] = arg(
        None, "activation recomputation (less memory, more compute): full = rerun whole layers in the backward, "
              "selective = only the attention core; default none", choices=("full", "selective"))
    recompute_method: Optional[str] = arg(None, "with --recompute-granularity full: uniform = every block of "
                                          "--recompute-num-layers layers, block = only the first "
                                          "--recompute-num-layers layers of each stage; default uniform",
                                          choices=("uniform", "block"))
    recompute_num_layers: int = arg(1, "layers per recomputed block (--recompute-method)")
    cross_entropy_loss_fusion: bool = arg(False, "the LM head and the loss fused, in chunks of tokens: the "
                                                 "[tokens, vocabulary] logits never exist (less memory, a slower "
                                                 "head: for when the logits do not fit)")
    torch_compile: bool = arg(False, "torch.compile each transformer layer (fuses LayerNorm, GELU, dropout, "
                                     "residual adds)")
    gradient_accumulation_fusion: bool = arg(
        True, "weight-gradient GEMMs write a bf16 grad that a hook adds to the fp32 buffer (default: they "
              "accumulate into the fp32 buffer directly)", negative="--no-gradient-accumulation-fusion")
    decoder_first_pipeline_num_layers: Optional[int] = arg(
        None, "layers on the first pipeline stage (the rest split evenly over the other stages)")
    decoder_last_pipeline_num_layers: Optional[int] = arg(
        None, "layers on the last pipeline stage, which also runs the LM head and the loss")
    sequence_parallel: bool = arg(False, "with tp > 1: split LayerNorm, dropout and residual work (and their "
                                         "activations) along the sequence; all-reduces become reduce-scatter + "
                                         "all-gather", group="parallelism")
    virtual_pipeline_model_parallel_size: Optional[int] = arg(
        None, "model chunks per pipeline rank (interleaved 1F1B): chunk j of rank r holds layer block j x pp + r; "
              "the number of microbatches must be a multiple of the pipeline size", group="parallelism")
    num_layers_per_virtual_pipeline_stage: Optional[int] = arg(
        None, "layers per model chunk (the other way to ask for interleaved 1F1B)", group="parallelism")
    fp8_format: Optional[str] = arg(
        None, "fp8 GEMMs in the transformer layers (torchao float8 training; Hopper/Ada GPUs, --bf16, "
              "pip install torchao): e4m3 = every operand e4m3, hybrid = e4m3 forward, e5m2 output gradients",
        choices=FP8_FORMATS, group="mixed precision")
    fp8_recipe: str = arg("tensorwise", "with --fp8-format: tensorwise = one dynamic scale per tensor, rowwise = "
                                        "one per row (torchao's, --fp8-format e4m3 only)",
                          choices=FP8_RECIPES, group="mixed precision")

    def __post_init__(self) -> None:  # the defaults that depend on other fields, resolved once here
        self.ffn_hidden_size = self.ffn_hidden_size or 4 * self.hidden_size
        self.max_position_embeddings = self.max_position_embeddings or self.seq_length
        if self.attention_backend == "auto":  # torch SDPA (flash kernels on GPU, math on CPU)
            self.attention_backend = "flash"
        if self.recompute_granularity == "full" and self.recompute_method is None:
            self.recompute_method = "uniform"

    @property
    def kv_channels(self) -> int:
        return self.hidden_size // self.num_attention_heads



@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = arg(1, "tensor-parallel size: each layer split over this many GPUs",
                                          aliases=["--tensor-parallel"])
    pipeline_model_parallel_size: int = arg(1, "pipeline-parallel size: the layers split into this many stages",
                                            aliases=["--pipeline-parallel"])
    data_parallel_size: int = arg(1, cli=False)     # derived: world / (tp * pp)
    use_distributed_optimizer: bool = arg(False, "= --zero-stage 1 (Megatron's name)")
    zero_stage: Optional[int] = arg(
        None, "ZeRO over each data-parallel group: 0 plain data parallelism, 1 + shard the optimizer state, "
              "2 + shard the gradients (reduce-scattered layer by layer), 3 + shard the parameters (gathered "
              "layer by layer); default 0, or 1 with --use-distributed-optimizer", choices=(0, 1, 2, 3))
    optimizer_cpu_offload: bool = arg(
        False, "fp32 master weights, Adam moments and the Adam step on the CPU (GPUs; --zero-stage >= 1)")
    optimizer_offload_fraction: float = arg(
        1.0, "Megatron's share of the optimizer state --optimizer-cpu-offload moves to the CPU; megapar moves all "
             "of it, so 1.0 is the one value it takes")
    optimizer_nvme_offload: Optional[str] = arg(
        None, "a folder on a fast local disk (NVMe): the fp32 master weights and Adam moments live in files under "
              "PATH/rank_NNNNN/ (made by the run, removed at its end), read and written chunk by chunk around "
              "the CPU Adam step (implies --optimizer-cpu-offload's CPU step; --zero-stage >= 1)")
    delayed_param_update: bool = arg(
        False, "with the optimizer offloaded: each step's CPU Adam update runs while the next step's forward and "
               "backward do, so that step computes its gradients with weights one update older (ZeRO-Offload's "
               "delayed parameter update); a checkpoint or evaluation first applies the pending update")
    param_cpu_offload: bool = arg(False, "--zero-stage 3: parameter shards live in CPU memory, fetched ahead "
                                         "of their layer (GPUs)")
    overlap_grad_reduce: bool = arg(
        True, "on GPUs, reduce each data-parallel gradient bucket as soon as backward completes it, behind the "
              "rest of the backward (--zero-stage 0-1; stages 2-3 always reduce layer by layer); on by default "
              "here, off in Megatron", negative="--no-overlap-grad-reduce", aliases=["--overlap-grad-reduce"])
    overlap_param_gather: bool = arg(
        True, "on GPUs, the all-gathers of the new weights after a step (--zero-stage 1-2) travel behind the next "
              "forward, each bucket waited for just before its first layer; on by default here, off in Megatron",
        negative="--no-overlap-param-gather", aliases=["--overlap-param-gather"])
    ddp_bucket_size: int = arg(
        40_000_000, "elements per data-parallel gradient bucket at --zero-stage 0-1 on GPUs (Megatron's default); "
                    "one bucket on the CPU")
    grad_reduce_dtype: str = arg("fp32", "the dtype gradients are summed over data parallelism in: fp32 "
                                         "(Megatron's), or bf16 / fp16 (half the bytes on the wire; DeepSpeed's "
                                         "communication_data_type); the fp32 gradient buffers stay",
                                 choices=("fp32", "bf16", "fp16"))
    pipeline_schedule: str = arg("1f1b", "1f1b (default) or all-forward-all-backward (reference)",
                                 choices=("1f1b", "afab"))
    enable_zero_bubble: bool = arg(
        False, "ZB-H1 zero-bubble pipeline schedule (1F1B's activation memory): each backward is split into the "
               "input gradient, sent to the previous stage at once, and the weight-gradient GEMMs, deferred to "
               "fill 1F1B's cooldown bubbles (--pipeline-model-parallel-size > 1, --pipeline-schedule 1f1b, no "
               "virtual pipeline, --zero-stage 0 or 1, gradient-accumulation fusion, no fp8)")
    distributed_backend: Optional[str] = arg(None, "torch.distributed backend; default nccl on GPUs, gloo on CPU",
                                             choices=("nccl", "gloo"))
    distributed_timeout_minutes: float = arg(10.0, "how long a collective waits for a silent peer before "
                                                                 "the run stops naming it")
    pipeline_hang_diagnostics: bool = arg(
        False, "on GPUs, poll pipeline send/recv against --distributed-timeout-minutes and name the schedule "
               "step, microbatch and operation a rank hangs on (blocks the CPU per transfer; always on with gloo)")


@dataclass
class TrainConfig:
    micro_batch_size: int = arg(4, "samples per forward/backward pass on each data-parallel rank")
    global_batch_size: Optional[int] = arg(None, "samples per optimizer step (gradient accumulation makes up the "
                                                      "rest); default --micro-batch-size x data-parallel size")
    train_iters: Optional[int] = arg(None, "optimizer steps to train to (counted from 0: a resume trains up to "
                                             "it); this or --train-samples is required with --data-path")
    train_samples: Optional[int] = arg(None, "samples to train on, instead of --train-iters")
    rampup_batch_size: Optional[list[int]] = arg(
        None, "START INCREMENT SAMPLES: the global batch starts at START and grows by INCREMENT at equal steps over "
              "the first SAMPLES samples up to --global-batch-size (Megatron's; with --train-samples)")
    lr: float = arg(6e-4, "peak learning rate (after warmup)")
    min_lr: float = arg(0.0, "learning rate at the end of the decay, and after it")
    lr_decay_style: str = arg("cosine", "shape of the decay from --lr to --min-lr",
                              choices=("constant", "linear", "cosine"))
    lr_decay_iters: Optional[int] = arg(None, "iteration where the decay reaches --min-lr; default --train-iters")
    lr_decay_samples: Optional[int] = arg(None, "sample where the decay reaches --min-lr (the schedule then counts "
                                                "samples; with --train-samples, its default)")
    lr_warmup_samples: int = arg(0, "samples of warmup (the schedule then counts samples; with --train-samples)")
    lr_warmup_fraction: Optional[float] = arg(None, "warmup as a fraction of --lr-decay-iters, instead of "
                                                        "--lr-warmup-iters")
    lr_warmup_iters: int = arg(0, "iterations of warmup from --lr-warmup-init to --lr")
    lr_warmup_init: float = arg(0.0, "the LR the warmup starts from (it rises to --lr)")
    lr_warmup_style: str = arg("linear", "the warmup's shape: after n steps it has risen n / warmup of the way "
                                         "(linear, Megatron's) or ln(n) / ln(warmup) of it (log, DeepSpeed's "
                                         "WarmupLR default)", choices=("linear", "log"))
    weight_decay: float = arg(0.01, "AdamW weight decay (not on biases and LayerNorm weights)")
    weight_decay_incr_style: str = arg("constant", "constant: --weight-decay throughout; linear or cosine: from "
                                                   "--start-weight-decay to --end-weight-decay over the run "
                                                   "(Megatron's)", choices=("constant", "linear", "cosine"))
    start_weight_decay: Optional[float] = arg(None, "the weight decay at the start of a linear or cosine "
                                                    "--weight-decay-incr-style")
    end_weight_decay: Optional[float] = arg(None, "the weight decay at the end of a linear or cosine "
                                                  "--weight-decay-incr-style")
    override_opt_param_scheduler: bool = arg(
        False, "on resume, take the LR schedule (--lr, --min-lr, warmup, decay iterations and style, "
               "--weight-decay) from these flags, not from the checkpoint", aliases=["--override-opt_param-scheduler"])
    use_checkpoint_opt_param_scheduler: bool = arg(
        False, "on resume, keep the checkpoint's LR schedule whatever these flags say",
        aliases=["--use-checkpoint-opt_param-scheduler"])
    clip_grad: float = arg(1.0, "clip the global gradient norm to this (0 = no clipping)")
    adam_beta1: float = arg(0.9, "Adam beta1")
    adam_beta2: float = arg(0.999, "Adam beta2")
    adam_eps: float = arg(1e-8, "Adam epsilon")
    adam_impl: str = arg("auto", "fused: csrc's one-launch AdamW that also writes the bf16/fp16 params (GPUs; "
                                 "JIT-built on first use when not built at install); torch: torch's fused (GPU) / "
                                 "foreach (CPU) AdamW, then a copy into the bf16/fp16 params; auto: fused on GPUs "
                                 "when setup.py built the kernels, else torch", choices=("auto", "torch", "fused"))
    seed: int = arg(1234, "random seed (weights, dropout, data order)")
    fp16: bool = arg(False, "float16 weights and activations with loss scaling (fp32 master weights)",
                     group="mixed precision")
    bf16: bool = arg(False, "bfloat16 weights and activations (fp32 master weights); the usual choice on "
                                "GPUs", group="mixed precision")
    loss_scale: Optional[float] = arg(None, "static loss scale (default: dynamic)", group="mixed precision")
    initial_loss_scale: float = arg(2.0**32, "--fp16: the dynamic loss scale to start from", group="mixed precision")
    min_loss_scale: float = arg(1.0, "--fp16: the dynamic loss scale never goes below this",
                                 group="mixed precision")
    loss_scale_window: int = arg(1000, "--fp16: steps without overflow before the loss scale doubles",
                                   group="mixed precision")
    hysteresis: int = arg(2, "--fp16: overflows tolerated before the loss scale halves", group="mixed precision")
    exit_interval: Optional[int] = arg(None, "save (with --save) and exit at the first iteration that is a "
                                             "multiple of this", group="logging, evaluation and exit")
    exit_duration_in_mins: Optional[float] = arg(None, "save (with --save) and exit once the run has trained "
                                                     "this many minutes", group="logging, evaluation and exit")
    exit_signal_handler: bool = arg(False, "on SIGTERM or a first Ctrl-C, finish the iteration, save (with "
                                        "--save) and exit 0", group="logging, evaluation and exit")
    enable_cuda_graph: bool = arg(
        False, "capture the whole training step (forward, backward, gradient reduction, optimizer) as one CUDA "
               "graph and replay it every iteration (removes kernel-launch overhead; GPUs; not with optimizer "
               "offload, nor recompute together with dropout)")
    cuda_graph_warmup_steps: int = arg(3, "eager steps before the capture (compilation, cuBLAS autotuning, "
                                          "optimizer state)")
    empty_unused_memory_level: int = arg(
        0, "GPUs: hand the allocator's unused cached memory back (torch.cuda.empty_cache) after each step's "
           "forward-backward and each evaluation batch (1), and after the optimizer too (2); against "
           "fragmentation, at some speed (each call waits for the GPU)", choices=(0, 1, 2))

    @property
    def params_dtype_name(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"


@dataclass
class DataConfig:
    data_path: list[str] = arg([], "dataset prefixes (PREFIX.bin/.idx), optionally weighted: W1 P1 W2 P2 ...; "
                                   "none = the embedded default corpus")
    split: str = arg("969,30,1", "train,validation,test weights: how each dataset's documents are divided")
    tokenizer_type: str = arg("GPT2BPETokenizer", "the tokenizer the data was preprocessed with: "
                              + ", ".join(TOKENIZER_TYPES))
    vocab_file: Optional[str] = arg(None, "GPT2BPETokenizer: the vocabulary (vocab.json / encoder.json)")
    merge_file: Optional[str] = arg(None, "GPT2BPETokenizer: the merges (merges.txt / vocab.bpe)")
    tokenizer_model: Optional[str] = arg(None, "SentencePieceTokenizer / TikTokenizer: the model file")
    data_cache_path: Optional[str] = arg(None, "where the dataset index files are cached; default next to the data "
                                                 "(the embedded corpus: data_cache/embedded)")


@dataclass
class CheckpointConfig:
    save: Optional[str] = arg(None, "checkpoint folder to save to (at --save-interval and at the end); none: "
                                "nothing is saved")
    load: Optional[str] = arg(None, "checkpoint folder to resume from (the same as --save continues a run)")
    save_interval: Optional[int] = arg(None, "save every this many iterations; default only at the end")
    no_save_optim: bool = arg(False, "save the model weights only (a resume then needs --no-load-optim)")
    no_save_rng: bool = arg(False, "save no random-number-generator states")
    no_load_optim: bool = arg(False, "resume without the optimizer state (fresh Adam moments)")
    no_load_rng: bool = arg(False, "resume without the random-number-generator states")
    finetune: bool = arg(False, "take only the model weights from --load: a fresh optimizer and LR schedule, "
                                   "starting at iteration 0 (--save must be another folder)")
    ckpt_format: str = arg("torch", "checkpoint format of saves: torch_dist (every rank writes what it owns; "
                                    "loads at any layout) or torch (Megatron's legacy files, one per tp x pp "
                                    "shard; what Megatron's and Hugging Face's converters read). Loads read "
                                    "either", choices=("torch", "torch_dist"))
    async_save: bool = arg(False, "torch_dist only: copy the state to host memory and write it in the background "
                                  "while training goes on (one save in flight; the tracker moves when it is "
                                  "complete)")


@dataclass
class LogConfig:
    log_interval: int = arg(10, "print a training line every this many iterations")
    log_params_norm: bool = arg(False, "add the L2 norm of the weights (the fp32 masters, each counted once) to "
                                       "each training line (Megatron's); a delayed update is waited for at those "
                                       "iterations")
    eval_interval: int = arg(1000, "evaluate on the validation split every this many iterations (0 = only "
                                    "at the end), and at the end")
    eval_iters: int = arg(10, "batches per evaluation (0 = no evaluation)")
    tensorboard_dir: Optional[str] = arg(None, "write the training scalars for TensorBoard here (needs the "
                                               "tensorboard package)")
    wandb_project: Optional[str] = arg(None, "also log the training scalars to this Weights & Biases project "
                                             "(needs the wandb package; WANDB_MODE=offline logs without network)")
    wandb_exp_name: Optional[str] = arg(None, "the W&B run's name (default: one W&B picks)")
    wandb_save_dir: Optional[str] = arg(None, "where W&B writes the run's files (default: --save/wandb, or "
                                              "./wandb without --save)")
    csv_log_dir: Optional[str] = arg(None, "also append each training scalar to DIR/<name>.csv (step,value rows; "
                                           "DeepSpeed's csv_monitor layout)")
    timing_log_level: int = arg(0, "1 or 2: time the forward-backward, gradient sync and optimizer of each "
                                     "iteration (on the log line); 0 = no timers", choices=(0, 1, 2))
    profile: bool = arg(False, "torch.profiler over iterations [--profile-step-start, --profile-step-end): rank 0 "
                               "prints the top kernels and writes a Chrome trace (to --tensorboard-dir or the "
                               "working directory)")
    profile_step_start: int = arg(10, "--profile: first profiled iteration (0-based)")
    profile_step_end: int = arg(12, "--profile: the iteration profiling stops before")


# Section -> its argument group in --help.
SECTIONS = {"model": (ModelConfig, "model"), "parallel": (ParallelConfig, "parallelism"),
            "train": (TrainConfig, "batch, schedule and optimizer"), "data": (DataConfig, "data"),
            "ckpt": (CheckpointConfig, "checkpointing"), "log": (LogConfig, "logging, evaluation and exit")}
# Megatron's alias flags: not settings of their own, resolved into recompute_* by `_resolve_aliases`.
ALIAS_FLAGS = {
    "recompute_activations": "= --recompute-granularity selective",
    "checkpoint_activations": "old name: = --recompute-granularity full --recompute-method uniform "
                              "--recompute-num-layers 1",
}

# Megatron switches whose choice megapar makes itself: accepted, so that a Megatron script runs as
# written, and named in one line at start. flag -> (what it takes: None a switch, int a number, else
# its choices; why it changes nothing here)
_KERNELS = "torch.compile (--torch-compile) and --attention-backend choose megapar's kernels"
_ONE_IMPL = "megapar has one GPT-2 implementation"
MEGATRON_NOTED: dict[str, tuple[Any, str]] = {
    "--data-impl": (("mmap", "infer"), "megapar reads Megatron's memory-mapped .bin/.idx"),
    "--DDP-impl": (("local", "torch"), "megapar's data parallelism is its own (gradient buffers, ZeRO)"),
    "--use-flash-attn": (None, "attention is torch SDPA's flash kernel unless --attention-backend says otherwise"),
    "--use-mcore-models": (None, _ONE_IMPL),
    "--transformer-impl": (("local", "transformer_engine"), _ONE_IMPL + " (fp8: --fp8-format)"),
    "--no-masked-softmax-fusion": (None, _KERNELS),
    "--no-bias-gelu-fusion": (None, _KERNELS),
    "--no-bias-dropout-fusion": (None, _KERNELS),
    "--attention-softmax-in-fp32": (None, "the softmax always computes in fp32"),
    "--accumulate-allreduce-grads-in-fp32": (None, "gradients always accumulate in fp32 (--grad-reduce-dtype sets "
                                                   "what travels)"),
    "--log-throughput": (None, "every log line has tokens/s, TFLOP/s per GPU and MFU"),
    "--num-workers": (int, "the memory-mapped dataset is read in the training process"),
    "--use-cpu-initialization": (None, "every weight is drawn on the CPU at its full shape, then sliced"),
    "--fp16-lm-cross-entropy": (None, "the loss reads the logits in their own dtype and computes in fp32, with no "
                                      "fp32 copy of them"),
}
NOTED = "megatron_noted"   # parse_flags: {flag: value} of the MEGATRON_NOTED flags given


@dataclass
class Config:
    model: ModelConfig
    parallel: ParallelConfig
    train: TrainConfig
    data: DataConfig
    ckpt: CheckpointConfig
    log: LogConfig
    aliases: dict[str, bool] = field(default_factory=dict)  # the ALIAS_FLAGS as given (kept in `args`)
    megatron_noted: dict[str, Any] = field(default_factory=dict)  # the MEGATRON_NOTED flags given
    deepspeed: Any = None  # the DeepSpeedSettings of --deepspeed-config (not kept in `args`)
    origin: dict[str, Origin] = field(default_factory=dict)  # settings not typed on the command line

    @property
    def num_microbatches(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.data_parallel_size)

    def global_batch_at(self, consumed_samples: int) -> int:
        """The global batch of the step that starts once `consumed_samples` samples are trained on:
        --global-batch-size, or while --rampup-batch-size START INCREMENT SAMPLES ramps it, START plus
        INCREMENT for each SAMPLES / increments samples consumed (Megatron's ramp-up calculator)."""
        t = self.train
        if t.rampup_batch_size is None:
            return t.global_batch_size
        start, increment, ramp_samples = t.rampup_batch_size
        increments = (t.global_batch_size - start) // increment
        if increments == 0 or consumed_samples > ramp_samples:
            return t.global_batch_size
        return start + int(consumed_samples / (ramp_samples / increments)) * increment

    def microbatches_at(self, consumed_samples: int) -> int:
        """The number of microbatches of that step (global_batch_at over micro-batch x dp)."""
        return self.global_batch_at(consumed_samples) // (self.train.micro_batch_size *
                                                           self.parallel.data_parallel_size)

    @property
    def schedule_in_samples(self) -> bool:
        """Whether the LR schedule counts samples (Megatron's sample-based flags: --lr-decay-samples,
        --lr-warmup-samples, a batch ramp-up), stepped by each step's global batch, or iterations."""
        t = self.train
        return t.rampup_batch_size is not None or t.lr_decay_samples is not None or t.lr_warmup_samples > 0

    def namespace(self) -> argparse.Namespace:
        """The flat Megatron-style `args` (every setting, one attribute each), as checkpoints store it."""
        flat = {name: self.aliases.get(name, False) for name in ALIAS_FLAGS}
        for section in SECTIONS:
            flat.update(asdict(getattr(self, section)))
        return argparse.Namespace(**flat)


# ---- the command line, derived from the fields ---------------------------------------------------
def flag(name: str) -> str:
    """The flag of setting `name`: `zero_stage` -> `--zero-stage` (the one place it is spelled)."""
    return "--" + name.replace("_", "-")


def flag_words(name: str, value: Any) -> list[str]:
    """The command-line words that set `name` to `value` (what the parser reads back as `value`):
    `--zero-stage 3`, `--bf16`, a default-on switch's negative flag for False, nothing for None."""
    negative = _negative_flags().get(name)
    if value is False and negative:
        return [negative]
    if value is True:
        return [flag(name)]
    if value is False or value is None:
        return []
    if isinstance(value, list):
        return [flag(name), *map(str, value)]
    return [flag(name), str(value)]


def _negative_flags() -> dict[str, str]:
    """{name: --no-... flag} of the settings that default to True."""
    return {f.name: f.metadata["negative"] for cls, _ in SECTIONS.values() for f in fields(cls)
            if f.metadata.get("negative")}


def _add_field(group: argparse._ArgumentGroup, f: Field, hint: Any) -> None:
    m = f.metadata
    shown = f.default_factory() if f.default is MISSING else f.default
    suffix = None if shown is None or isinstance(shown, bool) or shown == [] else f"default: {shown}"
    kw: dict[str, Any] = {"dest": f.name, "help": "; ".join(filter(None, (m["help"], suffix))) or None}
    if hint is bool:
        if f.default is True:   # its aliases: Megatron's switch that turns on what is on already
            group.add_argument(m["negative"], action="store_false", **kw)
            if m["aliases"]:
                group.add_argument(*m["aliases"], action="store_true", dest=f.name, help="the default")
            return
        kw["action"] = "store_true"
    else:
        optional = typing.get_origin(hint) is typing.Union
        kind = next(a for a in typing.get_args(hint) if a is not type(None)) if optional else hint  # Optional[X]: X
        if typing.get_origin(kind) is list:
            kw.update(nargs="*", type=typing.get_args(kind)[0])
        else:
            kw.update(type=kind, choices=m["choices"])
            if m["choices"] is None and kind in (int, float):
                kw["metavar"] = "N" if kind is int else "X"
    group.add_argument(flag(f.name), *m["aliases"], **kw)


TRAINING_PROG = "python -m megapar.pretrain_gpt2"


def build_parser(prog: str = TRAINING_PROG) -> argparse.ArgumentParser:
    """The pretraining command line, one flag per config field (Megatron's names and aliases);
    `prog` names the command in --help."""
    p = OneLineErrorParser(prog=prog, usage="%(prog)s [FLAGS]",
                description="megapar GPT-2 pretraining (Megatron-LM compatible flags). Every flag is optional: "
                            "with no --data-path it trains a small GPT-2 on the embedded corpus.",
                allow_abbrev=False, argument_default=argparse.SUPPRESS)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for cls, title in SECTIONS.values():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if f.metadata["cli"]:
                title_f = f.metadata["group"] or title
                group = groups.get(title_f) or groups.setdefault(title_f, p.add_argument_group(title_f))
                _add_field(group, f, hints[f.name])
    for name, help in ALIAS_FLAGS.items():
        groups["model"].add_argument(flag(name), action="store_true", help=help)
    noted = p.add_argument_group("Megatron switches megapar decides itself (accepted, not acted on)")
    for name, (takes, why) in MEGATRON_NOTED.items():
        kw: dict[str, Any] = {"action": "store_true"} if takes is None else \
            {"type": int, "metavar": "N"} if takes is int else {"choices": takes}
        noted.add_argument(name, dest=f"{NOTED}:{name}", help=why, **kw)
    groups["model"].add_argument("--recipe", metavar="NAME", help="start from a named run configuration "
                                 "(megapar/config/recipes.py); flags given after it override it")
    ds = p.add_argument_group("DeepSpeed users")
    ds.add_argument("--deepspeed-config", "--deepspeed_config", metavar="JSON", dest=DEEPSPEED_CONFIG,
                    help="read a DeepSpeed ds_config.json and set the matching flags (docs/guide.md, Coming from "
                         "DeepSpeed); a flag also given here must have the same value")
    ds.add_argument("--deepspeed", action="store_true", help="accepted and ignored (DeepSpeed's launch marker)")
    return p


DEEPSPEED_CONFIG = "deepspeed_config"   # the parsed flag; in the given flags, replaced by its settings
ORIGINS = "origins"                     # in the given flags: {dest: Origin} of values not typed by the user


@dataclass(frozen=True)
class Origin:
    """Where a setting's value came from when the command line did not type it: `what` set it
    (`--recipe 1.3b`, a DeepSpeed key, the embedded default), in `where` (the config file) if any."""
    what: str
    where: str = ""


def parse_flags(argv: Optional[Sequence[str]], parser: Optional[argparse.ArgumentParser] = None
                ) -> dict[str, Any]:
    """The flags the user gave ({dest: value}, without defaults), merged in a stated order: each
    `--recipe` in turn < `--deepspeed-config` < the command line (a flag both set must agree,
    deepspeed/read.py). Under ORIGINS: the Origin of each recipe's value the command line did not
    override (config_from_namespace adds the DeepSpeed keys'). `parser`: build_parser()'s, renamed."""
    names, typed = recipe_names(list(sys.argv[1:] if argv is None else argv))
    parser = parser or build_parser()
    given: dict[str, Any] = {}
    origins: dict[str, Origin] = {}
    for name in names:
        values = vars(parser.parse_args(recipe(name).flags))
        given.update(values)
        origins.update(dict.fromkeys(values, Origin(f"--recipe {name}")))
    own = vars(parser.parse_args(typed))
    given.update(own)
    for dest in own:
        origins.pop(dest, None)
    if origins:
        given[ORIGINS] = origins
    _gather_noted(given)
    return apply_config_files(given)


def noted_line(noted: dict[str, Any]) -> str:
    """The start-up line naming the MEGATRON_NOTED flags given ({flag: value}) and why each changes nothing."""
    return "> Megatron flags accepted, not acted on: " + "; ".join(
        f"{name}{'' if value is True else f' {value}'} ({MEGATRON_NOTED[name][1]})" for name, value in noted.items())


def _gather_noted(given: dict[str, Any]) -> None:
    """Move the MEGATRON_NOTED flags among the parsed `given` under NOTED, as {flag: value}."""
    noted = {dest.split(":", 1)[1]: given.pop(dest) for dest in [d for d in given if d.startswith(NOTED + ":")]}
    if noted:
        given[NOTED] = {**given.get(NOTED, {}), **noted}


def apply_config_files(given: dict[str, Any]) -> dict[str, Any]:
    """Merge a --deepspeed-config file into the parsed flags `given` (in place, returned): its
    settings become flags, and the DeepSpeedSettings under DEEPSPEED_CONFIG carry the rest (the
    gradient accumulation steps, resolved at world size, what to print at start, and the key
    each setting came from)."""
    given.pop("deepspeed", None)
    path = given.pop(DEEPSPEED_CONFIG, None)
    if path is not None:
        from .deepspeed.read import apply
        origins = given.pop(ORIGINS, {})
        given[DEEPSPEED_CONFIG] = apply(path, given, below=frozenset(origins))
        if origins:
            given[ORIGINS] = origins
    return given


def explain(message: str, origins: dict[str, Origin]) -> str:
    """A validation error with where the values of the flags it names came from, when they were
    not typed on the command line: `... (--micro-batch-size set by --recipe 124m; set by
    train_batch_size in ds.json)`."""
    named = {dest: o for dest, o in origins.items() if re.search(re.escape(flag(dest)) + r"(?![\w-])", message)}
    groups: dict[Origin, list[str]] = {}
    for dest, o in named.items():  # a file's keys name themselves; a recipe's flags are named
        key = Origin("", o.where) if o.where else o
        groups.setdefault(key, []).append(o.what if o.where else flag(dest))
    parts = [f"set by {', '.join(dict.fromkeys(names))} in {o.where}" if o.where else
             f"{', '.join(names)} set by {o.what}" for o, names in groups.items()]
    return f"{message} ({'; '.join(parts)})" if parts else message


def default_of(name: str) -> Any:
    """The default of the setting `name` (its dataclass field)."""
    for cls, _ in SECTIONS.values():
        for f in fields(cls):
            if f.name == name:
                return f.default_factory() if f.default is MISSING else f.default
    raise KeyError(name)


def _pick(cls, given: dict[str, Any]):
    return cls(**{f.name: given[f.name] for f in fields(cls) if f.name in given})


def section_from_args(cls, args: argparse.Namespace):
    """A config section (e.g. ModelConfig) from a flat Megatron-style `args` namespace, such as
    a checkpoint's: the settings it holds, the section's defaults for those it lacks (Megatron's
    own checkpoints and older megapar ones do not hold every megapar setting)."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None})


def _resolve_aliases(given: dict[str, Any]) -> dict[str, bool]:
    """--checkpoint-activations / --recompute-activations -> recompute_* (in place); returns them."""
    aliases = {name: bool(given.pop(name, False)) for name in ALIAS_FLAGS}
    if aliases["checkpoint_activations"]:
        given.setdefault("recompute_granularity", "full")
        given.setdefault("recompute_method", "uniform")
    if aliases["recompute_activations"]:
        given.setdefault("recompute_granularity", "selective")
    return aliases


def config_from_namespace(ns: argparse.Namespace | dict[str, Any], world_size: int, assume_gpus: bool = False
                          ) -> Config:
    """Validate the given flags (a parsed namespace or dict) for a job of `world_size` processes
    and build the Config; every flag not given takes its dataclass default. `assume_gpus`: check
    a run planned for CUDA GPUs (the memory estimator) also on a machine without any."""
    given = dict(vars(ns) if isinstance(ns, argparse.Namespace) else ns)
    given.pop("recipe", None)
    _gather_noted(given)   # (a namespace straight from build_parser())
    noted = given.pop(NOTED, {})
    if isinstance(given.get(DEEPSPEED_CONFIG), str):  # a namespace straight from build_parser()
        apply_config_files(given)
    ds = given.pop(DEEPSPEED_CONFIG, None)
    origins = given.pop(ORIGINS, {})
    if ds is not None:
        origins = {**origins, **{dest: Origin(key, ds.path) for dest, key in ds.origin.items()}}
    aliases = _resolve_aliases(given)
    cfg = Config(**{section: _pick(cls, given) for section, (cls, _) in SECTIONS.items()}, aliases=aliases,
                 megatron_noted=noted, deepspeed=ds, origin=origins)
    try:
        _resolve_and_validate(cfg, given, world_size, assume_gpus)
    except ConfigError as e:
        if not origins:
            raise
        raise ConfigError(explain(str(e), origins)) from None  # a value the user did not type: say who set it
    return cfg


def _resolve_and_validate(cfg: Config, given: dict[str, Any], world_size: int, assume_gpus: bool) -> None:
    """The derived settings (data-parallel size, ZeRO stage, batch sizes), checked."""
    if cfg.parallel.tensor_model_parallel_size == 1:  # nothing to split (Megatron also turns it off)
        cfg.model.sequence_parallel = False
    _resolve_zero_stage(cfg.parallel)
    validate(cfg.namespace(), world_size, assume_gpus)
    p, t = cfg.parallel, cfg.train
    p.data_parallel_size = world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
    if cfg.deepspeed is not None:  # gradient_accumulation_steps: the batch triple needs dp
        from .deepspeed.read import resolve_batch
        t.micro_batch_size, t.global_batch_size = resolve_batch(
            cfg.deepspeed, given.get("micro_batch_size"), given.get("global_batch_size"),
            default_of("micro_batch_size"), p.data_parallel_size)
    t.global_batch_size = t.global_batch_size or t.micro_batch_size * p.data_parallel_size
    _check_batch(t.global_batch_size, t.micro_batch_size, p.data_parallel_size)
    _check_rampup(t, p.data_parallel_size)
    _resolve_virtual_stages(cfg)
    _check_zero_bubble(cfg)


def _check_zero_bubble(cfg: Config) -> None:
    """--enable-zero-bubble (pipeline/zero_bubble.py): what the B/W split cannot run with is refused."""
    p, m = cfg.parallel, cfg.model
    if not p.enable_zero_bubble:
        return
    blockers = [
        (p.pipeline_model_parallel_size == 1, "it fills pipeline bubbles, so it needs "
                                              "--pipeline-model-parallel-size > 1; add one"),
        (p.pipeline_schedule != "1f1b", f"it is a form of the 1f1b schedule, not of --pipeline-schedule "
                                        f"{p.pipeline_schedule}; drop --pipeline-schedule {p.pipeline_schedule}"),
        (m.virtual_pipeline_model_parallel_size is not None,
         f"the interleaved schedule (--virtual-pipeline-model-parallel-size "
         f"{m.virtual_pipeline_model_parallel_size}) has no zero-bubble form here; drop the virtual-pipeline flags"),
        (p.zero_stage >= 2, f"--zero-stage {p.zero_stage} reduces each layer's gradients as soon as its backward "
                            f"ends, before the deferred weight gradients exist; use --zero-stage 0 or 1"),
        (not m.gradient_accumulation_fusion, "the weight-gradient GEMMs are deferred on the fused path only; drop "
                                             "--no-gradient-accumulation-fusion"),
        (m.fp8_format is not None, f"--fp8-format {m.fp8_format}'s GEMMs (torchao's) compute their weight "
                                   f"gradients in one pass; drop --fp8-format"),
    ]
    for blocked, why in blockers:
        if blocked:
            _fail(f"--enable-zero-bubble: {why} (or drop --enable-zero-bubble)")


def virtual_stages(num_layers: int, pp: int, v: Optional[int], per_stage: Optional[int]) -> Optional[int]:
    """Model chunks per pipeline rank from --virtual-pipeline-model-parallel-size (v) and/or
    --num-layers-per-virtual-pipeline-stage (per_stage); None when not interleaved (v = 1)."""
    if v is None and per_stage is None:
        return None
    if (v is not None and v < 1) or (per_stage is not None and per_stage < 1):
        _fail(f"--virtual-pipeline-model-parallel-size ({v}) and --num-layers-per-virtual-pipeline-stage "
              f"({per_stage}) must be >= 1")
    if per_stage is not None:
        if num_layers % (pp * per_stage):
            _fail(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
                  f"--num-layers-per-virtual-pipeline-stage {per_stage} = {pp * per_stage}; pick a layer count "
                  f"per virtual stage that divides {num_layers // pp if num_layers % pp == 0 else num_layers} evenly")
        from_layers = num_layers // (pp * per_stage)
        if v is not None and v != from_layers:
            _fail(f"--virtual-pipeline-model-parallel-size {v} disagrees with --num-layers-per-virtual-pipeline-stage "
                  f"{per_stage} (--num-layers {num_layers} over --pipeline-model-parallel-size {pp} gives "
                  f"{from_layers} chunks per rank); give only one of the two")
        v = from_layers
    elif num_layers % (pp * v):
        _fail(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
              f"--virtual-pipeline-model-parallel-size {v} = {pp * v}; every model chunk must get the same "
              f"number of layers")
    return v if v > 1 else None


def _resolve_virtual_stages(cfg: Config) -> None:
    """Interleaved 1F1B: resolve both virtual-pipeline flags into one chunk count (ModelConfig keeps
    both, consistent) and refuse what the interleaved schedule cannot run."""
    m, pp = cfg.model, cfg.parallel.pipeline_model_parallel_size
    v = virtual_stages(m.num_layers, pp, m.virtual_pipeline_model_parallel_size,
                       m.num_layers_per_virtual_pipeline_stage)
    m.virtual_pipeline_model_parallel_size = v
    m.num_layers_per_virtual_pipeline_stage = None if v is None else m.num_layers // (pp * v)
    if v is None:
        return
    opt = "--virtual-pipeline-model-parallel-size"
    if pp == 1:
        _fail(f"{opt} {v} interleaves model chunks over pipeline stages: it needs --pipeline-model-parallel-size "
              f"> 1; add one or drop the virtual-pipeline flags")
    if m.decoder_first_pipeline_num_layers is not None or m.decoder_last_pipeline_num_layers is not None:
        _fail(f"{opt} {v} splits the layers into equal chunks: it cannot be combined with "
              f"--decoder-first/last-pipeline-num-layers; drop one or the other")
    if cfg.parallel.pipeline_schedule != "1f1b":
        _fail(f"{opt} {v} runs the interleaved 1F1B schedule; --pipeline-schedule "
              f"{cfg.parallel.pipeline_schedule} has no interleaved form: drop --pipeline-schedule or the "
              f"virtual-pipeline flags")
    if cfg.train.rampup_batch_size is not None and any(
            (n // (cfg.train.micro_batch_size * cfg.parallel.data_parallel_size)) % pp
            for n in cfg.train.rampup_batch_size[:2]):
        _fail(f"{opt} {v}: every batch of --rampup-batch-size {' '.join(map(str, cfg.train.rampup_batch_size))} "
              f"must be a multiple of --pipeline-model-parallel-size {pp} microbatches; make START and INCREMENT "
              f"multiples of {cfg.train.micro_batch_size * cfg.parallel.data_parallel_size * pp}")
    if cfg.num_microbatches % pp:
        _fail(f"{opt} {v}: the number of microbatches ({cfg.num_microbatches} = --global-batch-size "
              f"{cfg.train.global_batch_size} / (--micro-batch-size {cfg.train.micro_batch_size} x data-parallel "
              f"size {cfg.parallel.data_parallel_size})) must be a multiple of --pipeline-model-parallel-size {pp}; "
              f"use --global-batch-size "
              f"{cfg.train.micro_batch_size * cfg.parallel.data_parallel_size * pp * -(-cfg.num_microbatches // pp)}")
    if m.recompute_granularity == "full" and m.recompute_num_layers > m.num_layers_per_virtual_pipeline_stage:
        _fail(f"--recompute-num-layers {m.recompute_num_layers} must be between 1 and the layers of one model "
              f"chunk ({m.num_layers_per_virtual_pipeline_stage} with {opt} {v})")


def _resolve_zero_stage(p: ParallelConfig) -> None:
    """--use-distributed-optimizer is Megatron's name for stage 1; afterwards both say the same."""
    if p.zero_stage is None:
        p.zero_stage = 1 if p.use_distributed_optimizer else 0
    elif p.zero_stage == 0 and p.use_distributed_optimizer:
        _fail("--use-distributed-optimizer (= --zero-stage 1) and --zero-stage 0 were both given; choose one")
    p.use_distributed_optimizer = p.zero_stage >= 1


def parse_config(argv: Optional[Sequence[str]], world_size: int) -> Config:
    return config_from_namespace(parse_flags(argv), world_size)


def validate(ns: argparse.Namespace, world_size: int, assume_gpus: bool = False) -> None:
    """Every check that needs no process group. Raises ConfigError naming flags and a fix.
    `assume_gpus`: as on a machine with CUDA GPUs, whatever this one has."""
    _check_ranges(ns)
    tp, pp = ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size
    for opt, alias, size in (("--tensor-model-parallel-size", "--tensor-parallel", tp),
                             ("--pipeline-model-parallel-size", "--pipeline-parallel", pp)):
        if size < 1:
            _fail(f"{opt} (or {alias}) {size} must be >= 1: the number of processes each model replica is split "
                  f"over in that dimension; 1 turns it off")
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
    _check_sample_based(ns)
    given_wd = [f for f, v in (("--start-weight-decay", ns.start_weight_decay),
                               ("--end-weight-decay", ns.end_weight_decay)) if v is not None]
    if ns.weight_decay_incr_style == "constant" and given_wd:
        _fail(f"{given_wd[0]} sets where a changing weight decay starts or ends: add --weight-decay-incr-style "
              f"linear or cosine, or give --weight-decay alone for a constant one")
    if ns.weight_decay_incr_style != "constant" and len(given_wd) < 2:
        _fail(f"--weight-decay-incr-style {ns.weight_decay_incr_style} moves the weight decay from "
              f"--start-weight-decay to --end-weight-decay; give both")
    if ns.lr_warmup_init > ns.lr:
        _fail(f"--lr-warmup-init {ns.lr_warmup_init:g} is above --lr {ns.lr:g}: the warmup rises from it to --lr; "
              f"lower it")
    if ns.override_opt_param_scheduler and ns.use_checkpoint_opt_param_scheduler:
        _fail("--override-opt_param-scheduler (take the LR schedule from the flags) and "
              "--use-checkpoint-opt_param-scheduler (take the checkpoint's) were both given; choose one")
    if ns.recompute_method is not None and ns.recompute_granularity != "full":
        _fail("--recompute-method needs --recompute-granularity full")
    per_stage = min(pipeline_layer_counts(ns.num_layers, pp, ns.decoder_first_pipeline_num_layers,
                                          ns.decoder_last_pipeline_num_layers))
    if ns.recompute_granularity == "full" and not 1 <= ns.recompute_num_layers <= per_stage:
        _fail(f"--recompute-num-layers {ns.recompute_num_layers} must be between 1 and the layers of the "
              f"smallest pipeline stage ({per_stage})")
    if ns.async_save and ns.ckpt_format != "torch_dist":
        _fail("--async-save needs --ckpt-format torch_dist (the legacy format is written by one rank per shard "
              "while training waits); add --ckpt-format torch_dist or drop --async-save")
    gpus = assume_gpus or _has_gpus()
    _check_zero(ns, gpus)
    _check_fp8(ns, gpus)
    _check_loggers(ns)
    if ns.enable_cuda_graph:
        _check_cuda_graph(ns, gpus)


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


def _check_ranges(ns: argparse.Namespace) -> None:
    """Sizes, counts and rates that would crash or train nonsense (--train-iters -5, --lr nan,
    --hidden-dropout 1.5, ...): one ConfigError naming the flag, the allowed range and a fix."""
    import math

    for names, low in ((_AT_LEAST_1, 1), (_AT_LEAST_0, 0)):
        for name in names:
            v = getattr(ns, name)
            if v is not None and v < low:
                default = default_of(name)
                fix = _WHY.get(name) or (f"the default is {default}" if default is not None else "")
                _fail(f"{flag(name)} {v} must be >= {low}" + (f"; {fix}" if fix else ""))
    for name, (low, high, low_in, high_in) in _FLOAT_RANGES.items():
        v = getattr(ns, name)
        if v is None:
            continue
        ok = math.isfinite(v) and (v >= low if low_in else v > low)
        if ok and high is not None:
            ok = v <= high if high_in else v < high
        if not ok:
            default = default_of(name)
            _fail(f"{flag(name)} {v} is out of range: it must be {_range_text(low, high, low_in, high_in)}"
                  + (f"; the default is {default:g}" if default is not None else ""))
    if not 0 <= ns.seed < 2**32:
        _fail(f"--seed {ns.seed} must be in [0, 2**32); e.g. the default {default_of('seed')}")


def _has_gpus() -> bool:
    import torch
    return torch.cuda.is_available()


def _check_zero(ns: argparse.Namespace, gpus: bool) -> None:
    """ZeRO stages and offload: what cannot work is refused before any process group exists."""
    stage = ns.zero_stage
    gpus = gpus and ns.distributed_backend != "gloo"
    if ns.param_cpu_offload and stage != 3:
        _fail(f"--param-cpu-offload keeps parameter shards on the CPU, which needs --zero-stage 3 "
              f"(this run: --zero-stage {stage}); add --zero-stage 3 or drop --param-cpu-offload")
    if ns.optimizer_cpu_offload and stage < 1:
        _fail("--optimizer-cpu-offload moves the sharded optimizer state to the CPU: it needs --zero-stage 1, 2 "
              "or 3 (or --use-distributed-optimizer); add one or drop --optimizer-cpu-offload")
    for opt, on in (("--optimizer-cpu-offload", ns.optimizer_cpu_offload),
                    ("--param-cpu-offload", ns.param_cpu_offload)):
        if on and not gpus:
            _fail(f"{opt} moves GPU state to CPU memory, but this run has no CUDA GPU (or uses gloo); "
                  f"drop {opt} on a CPU-only run")
    if ns.optimizer_offload_fraction != 1.0:
        _fail(f"--optimizer-offload-fraction {ns.optimizer_offload_fraction:g}: megapar offloads the whole optimizer "
              f"state or none of it; use --optimizer-offload-fraction 1.0 (Megatron's default) with "
              f"--optimizer-cpu-offload, or drop both to keep the state on the GPUs")
    if ns.optimizer_nvme_offload is not None:
        _check_nvme_offload(ns, stage)
    if ns.delayed_param_update and not (ns.optimizer_cpu_offload or ns.optimizer_nvme_offload):
        _fail("--delayed-param-update overlaps the offloaded optimizer's CPU step with the next step, but this "
              "run's optimizer is not offloaded; add --optimizer-cpu-offload (or --optimizer-nvme-offload PATH) "
              "or drop --delayed-param-update")
    if ns.optimizer_cpu_offload and ns.adam_impl == "fused":
        _fail("--adam-impl fused is csrc's GPU kernel, but --optimizer-cpu-offload steps AdamW on the CPU (torch's "
              "fused CPU kernel); drop --adam-impl fused or --optimizer-cpu-offload")


def _check_nvme_offload(ns: argparse.Namespace, stage: int) -> None:
    """--optimizer-nvme-offload PATH: ZeRO >= 1, the CPU step's AdamW, and a writable folder (its room
    is checked once the model's size is known: megapar/optimizer/nvme.py)."""
    path = ns.optimizer_nvme_offload
    if stage < 1:
        _fail("--optimizer-nvme-offload moves the sharded optimizer state to files: it needs --zero-stage 1, 2 or "
              "3 (or --use-distributed-optimizer); add one or drop --optimizer-nvme-offload")
    if ns.adam_impl == "fused":
        _fail("--adam-impl fused is csrc's GPU kernel, but --optimizer-nvme-offload steps AdamW on the CPU (torch's "
              "fused CPU kernel); drop --adam-impl fused or --optimizer-nvme-offload")
    if not os.path.isdir(path):
        _fail(f"--optimizer-nvme-offload {path} is not a directory; create it on a fast local disk (NVMe) or "
              f"give an existing one")
    if not os.access(path, os.W_OK | os.X_OK):
        _fail(f"--optimizer-nvme-offload {path} is not writable by this user; give a folder you can write to")


def _check_fp8(ns: argparse.Namespace, gpus: bool) -> None:
    """--fp8-format: bf16 training on a GPU with FP8 (compute capability >= 8.9), torchao installed,
    every transformer GEMM's sizes multiples of 16 (torch._scaled_mm)."""
    from ..fp8 import GEMM_MULTIPLE, MIN_CAPABILITY, torchao_installed

    fmt = ns.fp8_format
    if fmt is None:
        if ns.fp8_recipe != default_of("fp8_recipe"):
            _fail(f"--fp8-recipe {ns.fp8_recipe} is a setting of the fp8 GEMMs: add --fp8-format e4m3 or drop it")
        return
    if ns.fp16:
        _fail(f"--fp8-format {fmt} runs beside bf16 (bf16 weights and activations, no loss scaling), not --fp16; "
              f"use --bf16 instead of --fp16")
    if not ns.bf16:
        _fail(f"--fp8-format {fmt} needs --bf16 (the weights, activations and the GEMMs' outputs stay bf16); "
              f"add --bf16")
    if ns.fp8_recipe == "rowwise" and fmt != "e4m3":
        _fail(f"--fp8-recipe rowwise (torchao's) casts every operand, gradients too, to e4m3: use --fp8-format e4m3 "
              f"with it, or --fp8-recipe tensorwise with --fp8-format {fmt}")
    tp = ns.tensor_model_parallel_size
    sizes = [(f"--hidden-size {ns.hidden_size} / --tensor-model-parallel-size {tp}", ns.hidden_size // tp),
             (f"--ffn-hidden-size {ns.ffn_hidden_size} / --tensor-model-parallel-size {tp}", ns.ffn_hidden_size // tp),
             (f"--micro-batch-size {ns.micro_batch_size} x --seq-length {ns.seq_length} (tokens per GEMM)",
              ns.micro_batch_size * ns.seq_length)]
    for what, n in sizes:
        if n % GEMM_MULTIPLE:
            _fail(f"--fp8-format: torch._scaled_mm needs GEMM sizes that are multiples of {GEMM_MULTIPLE}, but "
                  f"{what} = {n}; pick sizes that make it a multiple of {GEMM_MULTIPLE} or drop --fp8-format")
    if not gpus or ns.distributed_backend == "gloo":
        _fail(f"--fp8-format {fmt} runs fp8 GEMMs on NVIDIA GPUs with FP8 (compute capability >= 8.9: H100, H200, "
              f"L4, L40, RTX 4090), but this run has no CUDA GPU (or uses gloo); drop --fp8-format")
    capability = _gpu_capability()
    if capability is not None and capability < MIN_CAPABILITY:
        _fail(f"--fp8-format {fmt} needs a GPU with FP8 (compute capability >= 8.9: Hopper, Ada), but this one "
              f"is {capability[0]}.{capability[1]}; drop --fp8-format on this GPU")
    if not torchao_installed():
        _fail(f"--fp8-format {fmt} needs the torchao package (float8 training), which is not installed: "
              f"pip install torchao (or pip install -e .[fp8]), or drop --fp8-format")


def _gpu_capability() -> Optional[tuple[int, int]]:
    """This machine's first GPU's compute capability; None without a GPU."""
    import torch
    return tuple(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None


def _check_loggers(ns: argparse.Namespace) -> None:
    """TensorBoard and W&B: the optional package is there, the W&B flags are complete."""
    import importlib.util

    if ns.wandb_project is None:
        for name in ("wandb_exp_name", "wandb_save_dir"):
            if getattr(ns, name) is not None:
                _fail(f"{flag(name)} is a setting of the W&B run that --wandb-project starts; add --wandb-project "
                      f"NAME or drop {flag(name)}")
    elif not ns.wandb_project.strip():
        _fail("--wandb-project is empty; name the W&B project, e.g. --wandb-project gpt2")
    for opt, folder in (("--wandb-save-dir", ns.wandb_save_dir), ("--csv-log-dir", ns.csv_log_dir)):
        if folder is not None and os.path.exists(folder) and not os.path.isdir(folder):
            _fail(f"{opt} {folder} is a file, not a folder; give a folder for the run's log files")
    for opt, value, package in (("--tensorboard-dir", ns.tensorboard_dir, "tensorboard"),
                                 ("--wandb-project", ns.wandb_project, "wandb")):
        if value is not None and importlib.util.find_spec(package) is None:
            _fail(f"{opt} needs the {package} package, which is not installed: pip install {package} "
                  f"(or drop {opt})")


def _check_cuda_graph(ns: argparse.Namespace, gpus: bool) -> None:
    """--enable-cuda-graph captures one step whose kernels and addresses never change, and which
    never waits for the host (run/cuda_graph.py)."""
    dropout = ns.hidden_dropout > 0 or ns.attention_dropout > 0
    blockers = [
        (not gpus or ns.distributed_backend == "gloo", "it needs CUDA GPUs and NCCL"),
        (ns.recompute_granularity is not None and dropout,
         "recompute with dropout saves and restores RNG states through the host, which a capture forbids; set "
         "--hidden-dropout 0 --attention-dropout 0, or drop the recompute flags"),
        (ns.pipeline_hang_diagnostics, "--pipeline-hang-diagnostics polls each transfer from the host; drop it"),
        (ns.cuda_graph_warmup_steps < 1, "--cuda-graph-warmup-steps must be >= 1"),
        (ns.optimizer_cpu_offload or ns.optimizer_nvme_offload is not None,
         "the offloaded optimizer steps on the CPU, outside any graph; drop the optimizer offload flags"),
        (ns.param_cpu_offload, "--param-cpu-offload fetches each layer's shard from host memory, which the "
                               "graph does not capture; drop --param-cpu-offload"),
        (ns.rampup_batch_size is not None, "the graph captures one batch size, which --rampup-batch-size changes; "
                                           "drop --rampup-batch-size"),
        (ns.weight_decay_incr_style != "constant", "the graph captures the weight decay as a constant, which "
                                                   f"--weight-decay-incr-style {ns.weight_decay_incr_style} changes; "
                                                   "use a constant --weight-decay"),
    ]
    for blocked, why in blockers:
        if blocked:
            _fail(f"--enable-cuda-graph: {why} (or drop --enable-cuda-graph)")


def _check_sample_based(ns: argparse.Namespace) -> None:
    """Megatron's sample-based flags need sample-based training, and count the schedule in samples
    alone."""
    by_samples = [f for f, on in (("--rampup-batch-size", ns.rampup_batch_size is not None),
                                  ("--lr-decay-samples", ns.lr_decay_samples is not None),
                                  ("--lr-warmup-samples", ns.lr_warmup_samples > 0)) if on]
    if not by_samples:
        return
    if ns.train_samples is None:
        _fail(f"{by_samples[0]} counts in samples: it needs sample-based training; give --train-samples instead of "
              f"--train-iters")
    for opt, given in (("--lr-decay-iters", ns.lr_decay_iters is not None), ("--lr-warmup-iters", ns.lr_warmup_iters)):
        if given:
            _fail(f"{opt} counts the LR schedule in iterations, {by_samples[0]} in samples; use --lr-decay-samples "
                  f"and --lr-warmup-samples (or --lr-warmup-fraction)")
    if ns.lr_warmup_fraction is not None and ns.lr_warmup_samples:
        _fail("--lr-warmup-fraction and --lr-warmup-samples were both given; choose one")
    ramp = ns.rampup_batch_size
    if ramp is not None and (len(ramp) != 3 or min(ramp) < 1):
        _fail(f"--rampup-batch-size {' '.join(map(str, ramp))}: give three numbers >= 1, START INCREMENT SAMPLES "
              f"(e.g. --rampup-batch-size 16 16 5859375)")


def _check_rampup(t: TrainConfig, dp: int) -> None:
    """Every batch of the ramp is whole microbatches on every data-parallel rank, and it ends at
    --global-batch-size."""
    if t.rampup_batch_size is None:
        return
    start, increment, _ = t.rampup_batch_size
    given = f"--rampup-batch-size {' '.join(map(str, t.rampup_batch_size))}"
    if start > t.global_batch_size or (t.global_batch_size - start) % increment:
        _fail(f"{given}: the ramp from {start} in steps of {increment} must end at --global-batch-size "
              f"{t.global_batch_size}; pick a START at most it, whose distance to it is a multiple of INCREMENT")
    per_step = t.micro_batch_size * dp
    if start % per_step or increment % per_step:
        _fail(f"{given}: START and INCREMENT must be multiples of --micro-batch-size {t.micro_batch_size} x "
              f"data-parallel size {dp} = {per_step}, so that every batch of the ramp is whole microbatches")


def _check_batch(global_batch: int, micro_batch: int, dp: int) -> None:
    per_step = micro_batch * dp
    if global_batch % per_step:
        _fail(f"--global-batch-size {global_batch} is not divisible by --micro-batch-size "
              f"{micro_batch} x data-parallel size {dp} = {per_step}; use a multiple of {per_step}")
