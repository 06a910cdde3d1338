"""The run's settings, each defined once: a dataclass field per setting (its default, help text and
any Megatron alias, `arg()`), grouped in sections; `Config` holds the sections once resolved; the
command line is derived from the fields (`build_parser`: the parser holds no defaults of its own, so
a flag not given is absent from what it parses) and rendered back by `flag` / `flag_words`.

`ConfigError` (errors.py, below topology, which raises it too) is the one error of a bad setting: its
message names the flags and a fix, and it carries the settings (dests) it concerns, so that an error can
name where their values came from (overlays.explain) without reading its own message.
"""
from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, Field, asdict, dataclass, field, fields
from typing import Any, Optional, Sequence

from ..data.tokenizer import TOKENIZER_TYPES
from ..errors import ConfigError, OneLineErrorParser, fail  # noqa: F401  (the config's error, defined below topology)
from ..fp8 import FP8_FORMATS, FP8_RECIPES
from .megatron import ALIAS_FLAGS, MEGATRON_NOTED, NOTED_DEST


@dataclass(frozen=True)
class Origin:
    """Where a setting's value came from: `what` set it (`the command line`, `--recipe 1.3b`, a
    DeepSpeed key, the embedded default, `default`), in `where` (the config file) if any."""
    what: str
    where: str = ""


COMMAND_LINE = Origin("the command line")
DEFAULT = Origin("default")

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
SECTION_OF = {f.name: section for section, (cls, _) in SECTIONS.items() for f in fields(cls)}  # setting -> section


@dataclass
class Config:
    """The resolved settings, by section, with what the run derives from them once (`total_iters`,
    `schedule_horizon`: config/build.py) and where each value came from (`origin`: every setting,
    COMMAND_LINE and DEFAULT included)."""
    model: ModelConfig
    parallel: ParallelConfig
    train: TrainConfig
    data: DataConfig
    ckpt: CheckpointConfig
    log: LogConfig
    aliases: dict[str, bool] = field(default_factory=dict)  # the ALIAS_FLAGS as given (kept in `args`)
    megatron_noted: dict[str, Any] = field(default_factory=dict)  # the MEGATRON_NOTED flags given
    deepspeed: Any = None  # the DeepSpeedSettings of --deepspeed-config (not kept in `args`)
    origin: dict[str, Origin] = field(default_factory=dict)  # dest -> where its value came from
    total_iters: int = 0        # the optimizer steps the run trains to (--train-iters, or from --train-samples)
    schedule_horizon: int = 0   # the run's length in the LR schedule's unit (samples or iterations)

    def get(self, name: str) -> Any:
        """The value of setting `name`, from the section that holds it."""
        return getattr(getattr(self, SECTION_OF[name]), name)

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

    def megatron_args(self) -> argparse.Namespace:
        """The flat Megatron-style `args` (every setting, one attribute each), as checkpoints store it."""
        flat = {name: self.aliases.get(name, False) for name in ALIAS_FLAGS}
        for section in SECTIONS:
            flat.update(asdict(getattr(self, section)))
        return argparse.Namespace(**flat)


# ---- the command line, derived from the fields ---------------------------------------------------
def flag(name: str) -> str:
    """The flag of setting `name`: `zero_stage` -> `--zero-stage` (the one place it is spelled)."""
    return "--" + name.replace("_", "-")


def dest_of(flag_text: str) -> str:
    """The setting a flag sets: `--zero-stage` -> `zero_stage` (flag's inverse)."""
    return flag_text.lstrip("-").replace("-", "_")


def flag_words(name: str, value: Any) -> list[str]:
    """The command-line words that set `name` to `value` (what the parser reads back as `value`):
    `--zero-stage 3`, `--bf16`, `--lr 0.5`, a default-on switch's negative flag for False, nothing for None."""
    negative = _negative_flags().get(name)
    if value is False and negative:
        return [negative]
    if value is True:
        return [flag(name)]
    if value is False or value is None:
        return []
    if isinstance(value, list):
        return [flag(name), *map(_word, value)]
    return [flag(name), _word(value)]


def _word(value: Any) -> str:
    """A value as the parser reads it back: a whole float without its `.0` (`--hidden-dropout 0`)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value)


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
DEEPSPEED_DEST = "deepspeed_config"   # the parser's dest of --deepspeed-config (read into its own overlay)


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
        noted.add_argument(name, dest=NOTED_DEST + name, help=why, **kw)
    groups["model"].add_argument("--recipe", metavar="NAME", help="start from a named run configuration "
                                 "(megapar/config/recipes.py); flags given after it override it")
    ds = p.add_argument_group("DeepSpeed users")
    ds.add_argument("--deepspeed-config", "--deepspeed_config", metavar="JSON", dest=DEEPSPEED_DEST,
                    help="read a DeepSpeed ds_config.json and set the matching flags (docs/guide.md, Coming from "
                         "DeepSpeed); a flag also given here must have the same value")
    ds.add_argument("--deepspeed", action="store_true", help="accepted and ignored (DeepSpeed's launch marker)")
    return p


def default_of(name: str) -> Any:
    """The default of the setting `name` (its dataclass field); KeyError for no such setting."""
    f = next(f for f in fields(SECTIONS[SECTION_OF[name]][0]) if f.name == name)
    return f.default_factory() if f.default is MISSING else f.default


def section_from_args(cls, args: argparse.Namespace):
    """A config section (e.g. ModelConfig) from a flat Megatron-style `args` namespace, such as
    a checkpoint's: the settings it holds, the section's defaults for those it lacks (Megatron's
    own checkpoints and older megapar ones do not hold every megapar setting)."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None})

