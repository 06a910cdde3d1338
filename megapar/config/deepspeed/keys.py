"""Every DeepSpeed config key megapar knows, one `Key` row each: what megapar does with it, and why.

The reader (read.py) and docs/guide.md's table of every key (`key_table`) both come from `KEYS`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

Disposition = Literal["honoured", "noted", "ignored", "switched", "given"]


@dataclass(frozen=True)
class Key:
    """One DeepSpeed key (`section.key`; `section.*`: every key of the section) and what megapar does with it:
    honoured (sets settings; a one-to-one key names its `dest` of `type`, and `default` is DeepSpeed's value when
    the key is absent), noted (accepted, listed at start with `why`; "false only": other values refused), ignored
    (a top-level key DeepSpeed ignores), switched (a section with `enabled`: noted while off, refused when on) or
    given (a section on when given: refused when it holds anything); `why` says why, or what to do instead."""
    path: str
    disposition: Disposition
    why: str
    dest: Optional[str] = None
    type: Optional[type] = None
    default: Any = None


_OWN_COMMS = "megapar schedules its own gradient and parameter communication, per layer"
_NVME_IO = "tunes DeepSpeed's NVMe I/O; megapar's NVMe offload runs its own (see NVMe offload)"
_NVME_PARAM = "an NVMe setting; megapar offloads parameters to CPU memory only"
_RECOMPUTE = ("--recompute-granularity / --checkpoint-activations switch recompute on, as Megatron-DeepSpeed's "
              "flags do")
_STAGE3 = "stage 3 gathers exactly one layer ahead and frees it after use"
_SAVE = "checkpoints are megapar's own layout; tools/convert_to_hf.py writes full weights"
NVME_TUNING = ("buffer_count", "buffer_size", "max_in_cpu", "fast_init", "pipeline_read", "pipeline_write", "pipeline")

KEYS: tuple[Key, ...] = (
    Key("train_batch_size", "honoured", "`--global-batch-size`", dest="global_batch_size", type=int),
    Key("train_micro_batch_size_per_gpu", "honoured", "`--micro-batch-size`", dest="micro_batch_size", type=int),
    Key("gradient_accumulation_steps", "honoured",
        "train_batch_size = micro × steps × dp: any two give the third at the world size; all three must agree"),
    Key("gradient_clipping", "honoured", "`--clip-grad`", dest="clip_grad", type=float),
    Key("steps_per_print", "honoured",
        "`--log-interval` (absent: DeepSpeed's 10)", dest="log_interval", type=int, default=10),
    Key("wall_clock_breakdown", "honoured", "true: `--timing-log-level 1`"),
    Key("communication_data_type", "honoured", "`--grad-reduce-dtype` (fp32, bf16, fp16; absent: fp32)"),
    Key("fp16.enabled", "honoured", "`--fp16`"),
    Key("fp16.loss_scale", "honoured", "0: dynamic scaling; else `--loss-scale`"),
    Key("fp16.initial_scale_power", "honoured", "`--initial-loss-scale 2^p` (absent: DeepSpeed's 16)", default=16),
    Key("fp16.loss_scale_window", "honoured",
        "`--loss-scale-window` (absent: DeepSpeed's 1000)", dest="loss_scale_window", type=int, default=1000),
    Key("fp16.hysteresis", "honoured",
        "`--hysteresis` (absent: DeepSpeed's 2)", dest="hysteresis", type=int, default=2),
    Key("fp16.min_loss_scale", "honoured",
        "`--min-loss-scale` (absent: DeepSpeed's 1)", dest="min_loss_scale", type=float, default=1.0),
    Key("bf16.enabled", "honoured", "`--bf16` (also spelt `bfloat16`)"),
    Key("optimizer.type", "honoured", "Adam, AdamW (any case): megapar's AdamW"),
    Key("optimizer.params.lr", "honoured", "`--lr`", dest="lr", type=float),
    Key("optimizer.params.betas", "honoured", "`--adam-beta1`, `--adam-beta2`"),
    Key("optimizer.params.eps", "honoured", "`--adam-eps`", dest="adam_eps", type=float),
    Key("optimizer.params.weight_decay", "honoured",
        "`--weight-decay` (decoupled, as DeepSpeed's Adam unless adam_w_mode is false)",
        dest="weight_decay", type=float),
    Key("optimizer.params.adam_w_mode", "honoured",
        "true: decoupled decay (megapar's AdamW); false with a weight decay: refused"),
    Key("optimizer.params.bias_correction", "honoured", "true: as megapar's AdamW; false: refused"),
    Key("scheduler.type", "honoured",
        "WarmupLR, WarmupDecayLR, WarmupCosineLR: `--lr-decay-style` constant, linear, cosine"),
    Key("scheduler.params.warmup_type", "honoured", "`--lr-warmup-style` log (absent: DeepSpeed's log) or linear"),
    Key("scheduler.params.warmup_num_steps", "honoured",
        "`--lr-warmup-iters` (absent: DeepSpeed's 1000; at least 2 with log)"),
    Key("scheduler.params.warmup_max_lr", "honoured", "`--lr` (absent: DeepSpeed's 0.001)"),
    Key("scheduler.params.warmup_min_lr", "honoured",
        "`--lr-warmup-init` (absent: DeepSpeed's 0); WarmupDecayLR: also `--min-lr`"),
    Key("scheduler.params.total_num_steps", "honoured", "`--lr-decay-iters`"),
    Key("scheduler.params.cos_min_ratio", "honoured", "`--min-lr` = ratio × `--lr` (absent: DeepSpeed's 0.0001)"),
    Key("scheduler.params.warmup_min_ratio", "honoured", "`--lr-warmup-init` = ratio × `--lr` (absent: DeepSpeed's 0)"),
    Key("scheduler.params.last_batch_iteration", "honoured",
        "-1 (others refused: megapar resumes the schedule from its checkpoint)"),
    Key("zero_optimization", "honoured",
        "true: `--zero-stage 1`, false: `--zero-stage 0` (DeepSpeed's legacy boolean)"),
    Key("zero_optimization.stage", "honoured", "`--zero-stage`"),
    Key("zero_optimization.reduce_bucket_size", "honoured",
        "`--ddp-bucket-size` (the gradient buckets of stages 0-1 on GPUs; stages 2-3 reduce a layer at a time; "
        "absent: megapar's 40,000,000)", dest="ddp_bucket_size", type=int),
    Key("zero_optimization.overlap_comm", "honoured",
        "`--overlap-grad-reduce` (true) or `--no-overlap-grad-reduce` (false); absent: megapar's overlap",
        dest="overlap_grad_reduce", type=bool),
    Key("zero_optimization.offload_optimizer.device", "honoured",
        "cpu: `--optimizer-cpu-offload`; nvme: `--optimizer-nvme-offload nvme_path`; none: neither"),
    Key("zero_optimization.offload_optimizer.nvme_path", "honoured",
        "with device nvme: `--optimizer-nvme-offload` (the state files go in nvme_path/rank_NNNNN/); otherwise noted"),
    Key("zero_optimization.offload_optimizer.ratio", "honoured", "1.0 (a partial offload is refused)"),
    Key("zero_optimization.offload_param.device", "honoured",
        "cpu / none: `--param-cpu-offload` on / off (nvme refused: parameters offload to CPU memory only)"),
    Key("zero_optimization.cpu_offload", "honoured", "`--optimizer-cpu-offload` (DeepSpeed's older spelling)"),
    Key("zero_optimization.cpu_offload_param", "honoured", "`--param-cpu-offload` (DeepSpeed's older spelling)"),
    Key("pipeline.stages", "honoured", "`--pipeline-model-parallel-size` (\"auto\": the command line decides)"),
    Key("tensor_parallel.autotp_size", "honoured", "`--tensor-model-parallel-size` (DeepSpeed's AutoTP)"),
    Key("sequence_parallel_size", "honoured",
        "1 (DeepSpeed-Ulysses above 1 is refused: megapar's --sequence-parallel splits activations over tensor "
        "parallelism)"),
    Key("tensorboard.enabled", "honoured", "`--tensorboard-dir output_path/job_name`"),
    Key("tensorboard.output_path", "honoured", "(see enabled; absent: the working directory)"),
    Key("tensorboard.job_name", "honoured", "(see enabled; absent: DeepSpeedJobName)"),
    Key("wandb.enabled", "honoured", "`--wandb-project project`"),
    Key("wandb.project", "honoured", "(see enabled; absent: deepspeed)"),
    Key("csv_monitor.enabled", "honoured",
        "`--csv-log-dir output_path/job_name` (a CSV file per scalar, as DeepSpeed's)"),
    Key("csv_monitor.output_path", "honoured", "(see enabled; absent: the working directory)"),
    Key("csv_monitor.job_name", "honoured", "(see enabled; absent: DeepSpeedJobName)"),
    Key("flops_profiler.enabled", "honoured",
        "`--profile` of one step (megapar logs TFLOP/s every `--log-interval` anyway)"),
    Key("flops_profiler.profile_step", "honoured",
        "`--profile-step-start p --profile-step-end p+1` (absent: DeepSpeed's 1)"),
    Key("zero_allow_untested_optimizer", "noted", "megapar has one optimizer, AdamW"),
    Key("zero_force_ds_cpu_optimizer", "noted", "megapar steps offloaded optimizer state with its own CPU AdamW"),
    Key("memory_breakdown", "noted", "megapar logs memory after its first iterations anyway"),
    Key("dump_state", "noted", "megapar prints its settings at start"),
    Key("elastic_checkpoint", "noted", "megapar's torch_dist checkpoints load at any data-parallel size"),
    Key("prescale_gradients", "noted", "megapar divides gradients by the data-parallel size before it reduces them"),
    Key("gradient_predivide_factor", "noted", "the reduced gradient is the same average however the division is split"),
    Key("disable_allgather", "noted", _OWN_COMMS),
    Key("sparse_gradients", "noted", "megapar's embeddings have dense gradients"),
    Key("seq_parallel_communication_data_type", "noted",
        "sequence-parallel activations are communicated in the model's dtype"),
    Key("graph_harvesting", "noted", "megapar captures CUDA graphs with --enable-cuda-graph"),
    Key("dataloader_drop_last", "noted", "megapar's data loader reads whole global batches"),
    Key("comms_logger.*", "noted", "megapar times its communication with --timing-log-level 2"),
    Key("timers.*", "noted", "megapar logs throughput every --log-interval"),
    Key("checkpoint.*", "noted", "megapar's checkpoints load at any parallel layout and are checked on load"),
    Key("data_types.grad_accum_dtype", "noted", "megapar accumulates gradients in fp32"),
    Key("compile.*", "noted", "megapar uses torch.compile where --use-inductor asks for it"),
    Key("optimizer.params.torch_adam", "noted", "--adam-impl chooses the AdamW implementation"),
    Key("optimizer.params.amsgrad", "noted", "false only: megapar's AdamW has no AMSGrad"),
    Key("fp16.fp16_master_weights_and_grads", "noted", "false only: megapar keeps fp32 masters and gradients"),
    Key("fp16.consecutive_hysteresis", "noted", "false only: megapar refills --hysteresis only when the scale grows"),
    Key("fp16.auto_cast", "noted", "false only: megapar keeps the whole model in fp16 with fp32 masters"),
    Key("bf16.immediate_grad_update", "noted", "megapar adds each microbatch's gradient to its fp32 buffer at once"),
    Key("activation_checkpointing.*", "noted", _RECOMPUTE),
    Key("activation_checkpointing.partition_activations", "noted",
        "megapar's --sequence-parallel (tensor parallel > 1) splits the activations over the tensor-parallel ranks"),
    Key("activation_checkpointing.cpu_checkpointing", "noted", "megapar keeps recomputed layers' inputs on the GPU"),
    Key("tensorboard.*", "noted", "not used while tensorboard.enabled is false"),
    Key("wandb.*", "noted", "not used while wandb.enabled is false"),
    Key("wandb.group", "noted", "megapar has no W&B group flag: set WANDB_RUN_GROUP"),
    Key("wandb.team", "noted", "megapar has no W&B entity flag: set WANDB_ENTITY"),
    Key("csv_monitor.*", "noted", "not used while csv_monitor.enabled is false"),
    Key("flops_profiler.*", "noted", "megapar's --profile prints the top kernels and writes a Chrome trace instead"),
    Key("pipeline.*", "noted", "megapar splits layers evenly over --pipeline-model-parallel-size stages"),
    Key("tensor_parallel.*", "noted",
        "megapar's tensor parallelism is Megatron's, fixed by --tensor-model-parallel-size"),
    Key("zero_optimization.contiguous_gradients", "noted",
        "megapar's gradients always live in contiguous fp32 buffers"),
    Key("zero_optimization.reduce_scatter", "noted",
        "megapar reduce-scatters gradients at --zero-stage >= 1, all-reduces at 0"),
    Key("zero_optimization.allgather_partitions", "noted",
        "megapar all-gathers updated parameters at --zero-stage 1-2"),
    Key("zero_optimization.allgather_bucket_size", "noted", _OWN_COMMS),
    Key("zero_optimization.use_multi_rank_bucket_allreduce", "noted", _OWN_COMMS),
    Key("zero_optimization.round_robin_gradients", "noted", _OWN_COMMS),
    Key("zero_optimization.load_from_fp32_weights", "noted",
        "megapar always restores the fp32 masters from its checkpoint"),
    Key("zero_optimization.elastic_checkpoint", "noted",
        "megapar's torch_dist checkpoints load at any data-parallel size"),
    Key("zero_optimization.legacy_stage1", "noted", "megapar has one stage-1 implementation"),
    Key("zero_optimization.sub_group_size", "noted", "megapar steps each rank's whole optimizer shard at once"),
    Key("zero_optimization.cpu_offload_use_pin_memory", "noted", "offloaded state is always in pinned CPU memory"),
    Key("zero_optimization.ignore_unused_parameters", "noted", "every GPT-2 parameter gets a gradient"),
    Key("zero_optimization.memory_efficient_linear", "noted", _STAGE3),
    Key("zero_optimization.override_module_apply", "noted", _STAGE3),
    Key("zero_optimization.pipeline_loading_checkpoint", "noted", _STAGE3),
    Key("zero_optimization.mics_shard_size", "noted", _OWN_COMMS),
    Key("zero_optimization.mics_hierarchical_params_gather", "noted", _OWN_COMMS),
    Key("zero_optimization.zero_hpz_partition_size", "noted", _OWN_COMMS),
    Key("zero_optimization.zero_quantized_weights", "noted", "megapar communicates parameters in full precision"),
    Key("zero_optimization.zero_quantized_nontrainable_weights", "noted", "every GPT-2 parameter is trained"),
    Key("zero_optimization.zero_quantized_gradients", "noted",
        "--grad-reduce-dtype sets the gradients' communication dtype"),
    Key("zero_optimization.zeropp_loco_param", "noted", "megapar communicates parameters in full precision"),
    Key("zero_optimization.log_trace_cache_warnings", "noted", _STAGE3),
    Key("zero_optimization.stage3_gather_16bit_weights_on_model_save", "noted", _SAVE),
    Key("zero_optimization.stage3_gather_fp16_weights_on_model_save", "noted", _SAVE),
    Key("zero_optimization.gather_16bit_weights_on_model_save", "noted", _SAVE),
    *[Key(f"zero_optimization.{p}{k}", "noted", _STAGE3) for p in ("", "stage3_") for k in (
        "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold", "max_live_parameters",
        "max_reuse_distance", "module_granularity_threshold", "use_all_reduce_for_fetch_params")],
    *[Key(f"zero_optimization.{o}.pin_memory", "noted", "offloaded state is always in pinned CPU memory")
      for o in ("offload_optimizer", "offload_param")],
    *[Key(f"zero_optimization.offload_optimizer.{k}", "noted", _NVME_IO) for k in NVME_TUNING],
    *[Key(f"zero_optimization.offload_param.{k}", "noted", _NVME_PARAM) for k in (*NVME_TUNING, "nvme_path")],
    *[Key(f"aio.{k}", "noted", _NVME_IO) for k in ("block_size", "queue_depth", "intra_op_parallelism", "thread_count",
                                                   "single_submit", "overlap_events", "use_gds")],
    Key("comms_config", "ignored", "DeepSpeed ignores it"),
    Key("monitor_config", "ignored", "DeepSpeed ignores it (it reads tensorboard, wandb and csv_monitor)"),
    Key("amp", "switched", "use --bf16 or --fp16 (megapar's mixed precision)"),
    Key("curriculum_learning", "switched", "megapar trains at one --seq-length over shuffled data; drop the section"),
    Key("data_efficiency", "switched", "megapar trains at one --seq-length over shuffled data; drop the section"),
    Key("progressive_layer_drop", "switched", "megapar trains every layer every step; drop the section"),
    Key("eigenvalue", "switched", "megapar does not compute Hessian eigenvalues; drop the section"),
    Key("quantize_training", "switched",
        "megapar trains in bf16/fp16 with fp32 masters (fp8: --fp8-format); drop the section"),
    Key("sparse_attention", "given", "megapar's attention is dense (--attention-backend); drop the section"),
    Key("elasticity", "switched", "give --global-batch-size and --micro-batch-size for the world size you launch"),
    Key("autotuning", "switched", "megapar-plan-layout suggests a layout; drop the section"),
    Key("hybrid_engine", "switched", "megapar trains only; drop the section"),
    Key("nebula", "switched", "megapar writes checkpoints to --save; drop the section"),
    Key("comet", "switched", "megapar logs to TensorBoard (tensorboard), W&B (wandb) or CSV (csv_monitor)"),
    Key("compression_training", "given", "megapar does not compress models; drop the section"),
    Key("weight_quantization", "given", "megapar trains unquantized weights; drop the section"),
    Key("moe", "switched", "megapar trains dense GPT-2 models; drop the section"),

)
BY_PATH = {k.path: k for k in KEYS}
HONOURED, NOTED, SWITCHED = ({k.path: k.why for k in KEYS if k.disposition in kinds}
                             for kinds in (("honoured",), ("noted",), ("switched", "given")))
