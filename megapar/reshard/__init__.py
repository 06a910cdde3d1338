"""Checkpoint resharding: any (tp, pp, dp) -> canonical full tensors -> any other layout.

    load_model_state_for(load_dir, tp, pp, tp_rank, pp_rank) -> (SavedConfig, flat model state dict)
    open_source(path)             a checkpoint of any format and layout, read as canonical tensors one at a time
    ShardedCheckpoint(root)       the legacy layout's reader (DistSource: torch_dist's, CanonicalFolder: the full form)
    (see convert.py / canonical.py for writing)
"""
from __future__ import annotations

import copy
import dataclasses
import os
from typing import Optional

import torch

from ..config.settings import ParallelConfig, section_from_args
from ..checkpoint.common import SavedConfig, iter_dir, read_tracker
from ..checkpoint.dist import DistFormat
from ..checkpoint.formats import detect
from ..topology import ConfigError, check_parallel_shape, padded_vocab_size
from ..checkpoint.layout import chunk_layout, split, stage_keys
from .canonical import CanonicalFolder, is_canonical
from .source import ShardedCheckpoint, Source
from .torch_dist import DistSource


def open_source(path: str, iteration: Optional[int | str] = None, from_full: bool = False) -> Source:
    """A checkpoint of any format, read as canonical tensors one at a time: a canonical folder
    (CanonicalFolder), a torch_dist checkpoint (DistSource) or the legacy layout (ShardedCheckpoint)."""
    if from_full or is_canonical(path):
        return CanonicalFolder(path)
    if iteration is not None and iteration != "release":
        iteration = int(iteration)
    it = iteration if iteration is not None or not os.path.isdir(path) else read_tracker(path)
    if it is not None and isinstance(detect(iter_dir(path, it)), DistFormat):
        return DistSource(path, it)
    return ShardedCheckpoint(path, iteration)


def bounded_heap(threshold: int = 1 << 20) -> bool:
    """Make glibc serve allocations >= `threshold` bytes with mmap (returned to the OS on free).
    Without it, the dynamic mmap threshold lets tensors of a few MB land on the heap, which
    fragments as full tensors and shards of different sizes come and go: a streaming conversion
    of GPT-2 345M then peaks at several GB instead of a few tensors. Process-wide; the CLI tools
    call it. Returns False where mallopt is unavailable (non-glibc)."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, threshold))          # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def retarget(saved: SavedConfig, tp: int, pp: int, dp: Optional[int] = None,
             distributed_optimizer: Optional[bool] = None,
             split: Optional[tuple[Optional[int], Optional[int]]] = None,
             virtual: Optional[int] = None) -> SavedConfig:
    """The checkpoint's config with the parallel sizes and padded vocabulary of the target
    (ConfigError when the model cannot be split that way): new `model`, `parallel` and the
    Megatron `args` to write. split = (first, last) sets the target's
    --decoder-first/last-pipeline-num-layers; without it the pipeline keeps the source's at the
    same pipeline size, and another size gets an even split. virtual: model chunks per pipeline
    rank (interleaved 1F1B; 1 = none); without it the source's are kept at the same pipeline size."""
    model = dataclasses.replace(saved.model)
    same_pp = pp == saved.parallel.pipeline_model_parallel_size
    if split is not None:
        model.decoder_first_pipeline_num_layers, model.decoder_last_pipeline_num_layers = split
    elif not same_pp:
        model.decoder_first_pipeline_num_layers = model.decoder_last_pipeline_num_layers = None
    v = virtual if virtual is not None else (model.virtual_pipeline_model_parallel_size if same_pp else None)
    model.virtual_pipeline_model_parallel_size, model.num_layers_per_virtual_pipeline_stage = _chunks(model, pp, v)
    check_parallel_shape(model.num_layers, model.num_attention_heads, model.ffn_hidden_size, tp, pp,
                         "the target tensor-parallel size", "the target pipeline-parallel size",
                         model.decoder_first_pipeline_num_layers, model.decoder_last_pipeline_num_layers)
    if model.vocab_size is not None:
        model.padded_vocab_size = padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, tp)
    args = copy.deepcopy(saved.args)
    changed = {"decoder_first_pipeline_num_layers": model.decoder_first_pipeline_num_layers,
               "decoder_last_pipeline_num_layers": model.decoder_last_pipeline_num_layers,
               "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
               "padded_vocab_size": model.padded_vocab_size,
               "virtual_pipeline_model_parallel_size": model.virtual_pipeline_model_parallel_size,
               "num_layers_per_virtual_pipeline_stage": model.num_layers_per_virtual_pipeline_stage}
    if dp is not None:
        changed["data_parallel_size"] = dp
        if hasattr(args, "world_size"):
            changed["world_size"] = tp * pp * dp
    if distributed_optimizer is not None:  # the files are the same for ZeRO stages 1-3
        changed["use_distributed_optimizer"] = distributed_optimizer
        stage = getattr(args, "zero_stage", None) or 0
        changed["zero_stage"] = max(stage, 1) if distributed_optimizer else 0
    vars(args).update(changed)
    parallel = section_from_args(ParallelConfig, args)  # as read_saved_config derives it
    return SavedConfig(args, model, parallel, saved.data)


def _chunks(model, pp: int, v: Optional[int]) -> tuple[Optional[int], Optional[int]]:
    """(virtual_pipeline_model_parallel_size, num_layers_per_virtual_pipeline_stage) of a target
    with v model chunks per pipeline rank ((None, None) for v in (None, 1))."""
    if v is None or v == 1:
        return None, None
    if v < 1 or pp == 1 or model.num_layers % (pp * v):
        raise ConfigError(f"the target virtual-pipeline size {v} needs a pipeline-parallel size > 1 and "
                          f"--num-layers {model.num_layers} divisible by pipeline-parallel size {pp} x {v}; pick "
                          f"another --target-virtual-pipeline-parallel-size (1: no model chunks)")
    if model.decoder_first_pipeline_num_layers is not None or model.decoder_last_pipeline_num_layers is not None:
        raise ConfigError("model chunks (--target-virtual-pipeline-parallel-size) need an even pipeline split: "
                          "drop --target-decoder-first/last-pipeline-num-layers or the virtual-pipeline target")
    return v, model.num_layers // (pp * v)


def load_model_state_for(load_dir: str, tp: int, pp: int, tp_rank: int, pp_rank: int,
                         iteration: Optional[int | str] = None) -> tuple[SavedConfig, dict[str, torch.Tensor]]:
    """Load a checkpoint of any layout as the model state of shard (tp_rank, pp_rank) of a
    (tp, pp) model, in memory. Returns (the checkpoint's SavedConfig with tensor/pipeline sizes
    and padded_vocab_size updated for the target, flat GPT2Model state dict with stage-local layer indices) --
    ready for `GPT2Model.load_state_dict`. Vocab rows beyond the true vocab size are zeros.
    Raises CheckpointError naming the file for missing / truncated / inconsistent shards."""
    if not (0 <= tp_rank < tp and 0 <= pp_rank < pp):
        raise ValueError(f"shard ({tp_rank}, {pp_rank}) outside target layout tp={tp}, pp={pp}")
    src = open_source(load_dir, iteration)
    target = retarget(src.saved, tp, pp, virtual=1)   # inference builds plain stages
    state = {}
    for local, name in stage_keys(src.names, chunk_layout(target.model, pp), pp_rank):  # one full tensor at a time
        state[local] = split(src.full(name), name, tp, tp_rank, target.model.padded_vocab_size)
    src.release()
    return target, state


__all__ = ["ShardedCheckpoint", "Source", "bounded_heap", "load_model_state_for", "open_source", "retarget"]
