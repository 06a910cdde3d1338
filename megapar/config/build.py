"""The config pipeline: a run's overlays merged (overlays.py), the settings resolved once (the
data-parallel size, the ZeRO stage, the batch sizes, interleaved stages, the run's length), and
validated (checks.py) into one `Config` that is passed to whoever needs it (no global `get_args()`).

    parse_config(argv, world_size)           the command line (recipes, a DeepSpeed config) -> Config
    build_config(given, world_size)          parsed flags (overlays.parse_flags), or a {dest: value} dict
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any, Optional, Sequence

from .checks import check_batch, check_rampup, validate
from .deepspeed.read import resolve_batch
from .megatron import ALIAS_FLAGS, resolve_aliases
from .overlays import Given, Overlay, explain, merge, parse_flags
from .settings import COMMAND_LINE, DEFAULT, SECTION_OF, SECTIONS, Config, ConfigError, ParallelConfig, default_of, fail


def parse_config(argv: Optional[Sequence[str]], world_size: int) -> Config:
    """The Config of a command line (`argv` None: sys.argv[1:]) for a job of `world_size` processes."""
    return build_config(parse_flags(argv), world_size)


def build_config(given: Given | dict[str, Any], world_size: int, assume_gpus: bool = False) -> Config:
    """Merge the given flags (a dict: the command line's {dest: value}), resolve and validate them for
    a job of `world_size` processes; every setting not given takes its field default. `assume_gpus`:
    check a run planned for CUDA GPUs (the memory estimator) also on a machine without any."""
    if isinstance(given, dict):
        given = Given([Overlay(COMMAND_LINE, dict(given))])
    values, origin = merge(*given.overlays)
    by_alias = {name: origin.pop(name) for name in ALIAS_FLAGS if name in origin}
    aliases = resolve_aliases(values)
    for dest in values.keys() - origin.keys():   # what an alias flag set: its origin
        origin[dest] = next(o for name, o in by_alias.items() if aliases[name])
    cfg = Config(**{section: cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})
                    for section, (cls, _) in SECTIONS.items()},
                 aliases=aliases, megatron_noted=dict(given.noted), deepspeed=given.deepspeed,
                 origin={**origin, **{dest: DEFAULT for dest in SECTION_OF if dest not in origin}})
    try:
        _resolve_and_validate(cfg, world_size, assume_gpus)
    except ConfigError as e:
        raise explain(e, cfg.origin) from None  # a value the command line did not type: say who set it
    return cfg


def _resolve_and_validate(cfg: Config, world_size: int, assume_gpus: bool) -> None:
    """The derived settings (data-parallel size, ZeRO stage, batch sizes, the run's length), checked."""
    if cfg.parallel.tensor_model_parallel_size == 1:  # nothing to split (Megatron also turns it off)
        cfg.model.sequence_parallel = False
    _resolve_zero_stage(cfg.parallel)
    validate(cfg, world_size, assume_gpus)
    p, t = cfg.parallel, cfg.train
    p.data_parallel_size = world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
    if cfg.deepspeed is not None:  # gradient_accumulation_steps: the batch triple needs dp
        given = {dest for dest, o in cfg.origin.items() if o != DEFAULT}
        t.micro_batch_size, t.global_batch_size = resolve_batch(
            cfg.deepspeed, t.micro_batch_size if "micro_batch_size" in given else None,
            t.global_batch_size if "global_batch_size" in given else None,
            default_of("micro_batch_size"), p.data_parallel_size)
    t.global_batch_size = t.global_batch_size or t.micro_batch_size * p.data_parallel_size
    check_batch(t.global_batch_size, t.micro_batch_size, p.data_parallel_size)
    check_rampup(t, p.data_parallel_size)
    _resolve_virtual_stages(cfg)
    _check_zero_bubble(cfg)
    cfg.total_iters = _total_iters(cfg)
    cfg.schedule_horizon = t.train_samples if cfg.schedule_in_samples else cfg.total_iters


def _check_zero_bubble(cfg: Config) -> None:
    """--enable-zero-bubble (pipeline/zero_bubble.py): what the B/W split cannot run with is refused."""
    p, m = cfg.parallel, cfg.model
    if not p.enable_zero_bubble:
        return
    blockers = [
        (p.pipeline_model_parallel_size == 1, "pipeline_model_parallel_size",
         "it fills pipeline bubbles, so it needs --pipeline-model-parallel-size > 1; add one"),
        (p.pipeline_schedule != "1f1b", "pipeline_schedule",
         f"it is a form of the 1f1b schedule, not of --pipeline-schedule {p.pipeline_schedule}; drop "
         f"--pipeline-schedule {p.pipeline_schedule}"),
        (m.virtual_pipeline_model_parallel_size is not None, "virtual_pipeline_model_parallel_size",
         f"the interleaved schedule (--virtual-pipeline-model-parallel-size "
         f"{m.virtual_pipeline_model_parallel_size}) has no zero-bubble form here; drop the virtual-pipeline flags"),
        (p.zero_stage >= 2, "zero_stage",
         f"--zero-stage {p.zero_stage} reduces each layer's gradients as soon as its backward ends, before the "
         f"deferred weight gradients exist; use --zero-stage 0 or 1"),
        (not m.gradient_accumulation_fusion, "gradient_accumulation_fusion",
         "the weight-gradient GEMMs are deferred on the fused path only; drop --no-gradient-accumulation-fusion"),
        (m.fp8_format is not None, "fp8_format",
         f"--fp8-format {m.fp8_format}'s GEMMs (torchao's) compute their weight gradients in one pass; drop "
         f"--fp8-format"),
    ]
    for blocked, dest, why in blockers:
        if blocked:
            fail(f"--enable-zero-bubble: {why} (or drop --enable-zero-bubble)", "enable_zero_bubble", dest)


def _total_iters(cfg: Config) -> int:
    """--train-iters, or the steps --train-samples makes: whole global batches, and with a batch
    ramp-up its steps as Megatron counts them (the ramp's batches while at most its samples are
    consumed, then whole --global-batch-size batches of the rest; a partial last batch is dropped)."""
    t = cfg.train
    if t.train_iters is not None:
        return t.train_iters
    samples = t.train_samples or 0
    iterations = consumed = 0
    if t.rampup_batch_size is not None:
        while consumed <= t.rampup_batch_size[2] and consumed <= samples:
            consumed += cfg.global_batch_at(consumed)
            iterations += 1
    return iterations + max(0, samples - consumed) // t.global_batch_size


def virtual_stages(num_layers: int, pp: int, v: Optional[int], per_stage: Optional[int]) -> Optional[int]:
    """Model chunks per pipeline rank from --virtual-pipeline-model-parallel-size (v) and/or
    --num-layers-per-virtual-pipeline-stage (per_stage); None when not interleaved (v = 1)."""
    if v is None and per_stage is None:
        return None
    if (v is not None and v < 1) or (per_stage is not None and per_stage < 1):
        fail(f"--virtual-pipeline-model-parallel-size ({v}) and --num-layers-per-virtual-pipeline-stage "
             f"({per_stage}) must be >= 1",
             "virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage")
    if per_stage is not None:
        if num_layers % (pp * per_stage):
            fail(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
                 f"--num-layers-per-virtual-pipeline-stage {per_stage} = {pp * per_stage}; pick a layer count "
                 f"per virtual stage that divides {num_layers // pp if num_layers % pp == 0 else num_layers} evenly",
                 "num_layers", "pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage")
        from_layers = num_layers // (pp * per_stage)
        if v is not None and v != from_layers:
            fail(f"--virtual-pipeline-model-parallel-size {v} disagrees with --num-layers-per-virtual-pipeline-stage "
                 f"{per_stage} (--num-layers {num_layers} over --pipeline-model-parallel-size {pp} gives "
                 f"{from_layers} chunks per rank); give only one of the two",
                 "virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage")
        v = from_layers
    elif num_layers % (pp * v):
        fail(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
             f"--virtual-pipeline-model-parallel-size {v} = {pp * v}; every model chunk must get the same "
             f"number of layers", "num_layers", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size")
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
        fail(f"{opt} {v} interleaves model chunks over pipeline stages: it needs --pipeline-model-parallel-size "
             f"> 1; add one or drop the virtual-pipeline flags",
             "virtual_pipeline_model_parallel_size", "pipeline_model_parallel_size")
    if m.decoder_first_pipeline_num_layers is not None or m.decoder_last_pipeline_num_layers is not None:
        fail(f"{opt} {v} splits the layers into equal chunks: it cannot be combined with "
             f"--decoder-first/last-pipeline-num-layers; drop one or the other",
             "virtual_pipeline_model_parallel_size",
             "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
    if cfg.parallel.pipeline_schedule != "1f1b":
        fail(f"{opt} {v} runs the interleaved 1F1B schedule; --pipeline-schedule "
             f"{cfg.parallel.pipeline_schedule} has no interleaved form: drop --pipeline-schedule or the "
             f"virtual-pipeline flags", "virtual_pipeline_model_parallel_size", "pipeline_schedule")
    if cfg.train.rampup_batch_size is not None and any(
            (n // (cfg.train.micro_batch_size * cfg.parallel.data_parallel_size)) % pp
            for n in cfg.train.rampup_batch_size[:2]):
        fail(f"{opt} {v}: every batch of --rampup-batch-size {' '.join(map(str, cfg.train.rampup_batch_size))} "
             f"must be a multiple of --pipeline-model-parallel-size {pp} microbatches; make START and INCREMENT "
             f"multiples of {cfg.train.micro_batch_size * cfg.parallel.data_parallel_size * pp}",
             "virtual_pipeline_model_parallel_size", "rampup_batch_size", "pipeline_model_parallel_size")
    if cfg.num_microbatches % pp:
        fail(f"{opt} {v}: the number of microbatches ({cfg.num_microbatches} = --global-batch-size "
             f"{cfg.train.global_batch_size} / (--micro-batch-size {cfg.train.micro_batch_size} x data-parallel "
             f"size {cfg.parallel.data_parallel_size})) must be a multiple of --pipeline-model-parallel-size {pp}; "
             f"use --global-batch-size "
             f"{cfg.train.micro_batch_size * cfg.parallel.data_parallel_size * pp * -(-cfg.num_microbatches // pp)}",
             "virtual_pipeline_model_parallel_size",
             "global_batch_size", "micro_batch_size", "pipeline_model_parallel_size")
    if m.recompute_granularity == "full" and m.recompute_num_layers > m.num_layers_per_virtual_pipeline_stage:
        fail(f"--recompute-num-layers {m.recompute_num_layers} must be between 1 and the layers of one model "
             f"chunk ({m.num_layers_per_virtual_pipeline_stage} with {opt} {v})",
             "recompute_num_layers", "virtual_pipeline_model_parallel_size")


def _resolve_zero_stage(p: ParallelConfig) -> None:
    """--use-distributed-optimizer is Megatron's name for stage 1; afterwards both say the same."""
    if p.zero_stage is None:
        p.zero_stage = 1 if p.use_distributed_optimizer else 0
    elif p.zero_stage == 0 and p.use_distributed_optimizer:
        fail("--use-distributed-optimizer (= --zero-stage 1) and --zero-stage 0 were both given; choose one",
             "use_distributed_optimizer", "zero_stage")
    p.use_distributed_optimizer = p.zero_stage >= 1

