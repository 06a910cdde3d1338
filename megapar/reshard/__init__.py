"""Checkpoint resharding: any (tp, pp, dp) -> canonical full tensors -> any other layout.

    load_model_state_for(load_dir, tp, pp, tp_rank, pp_rank) -> (args, flat model state dict)
    ShardedCheckpoint(root)       a checkpoint of any layout, read as canonical tensors one at a time
    (see convert.py / canonical.py for writing)
"""
from __future__ import annotations

import argparse
import copy
from typing import Optional

import torch

from ..topology import check_parallel_shape, layer_counts

from .layout import split, stage_keys, target_padded_vocab
from .source import ShardedCheckpoint


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


def target_args(args: argparse.Namespace, vocab_size: Optional[int], tp: int, pp: int,
                dp: Optional[int] = None, distributed_optimizer: Optional[bool] = None,
                split: Optional[tuple[Optional[int], Optional[int]]] = None) -> argparse.Namespace:
    """A copy of a checkpoint's args with the parallel sizes and padded vocabulary of the target
    (ConfigError when the model cannot be split that way). split = (first, last) sets the target's
    --decoder-first/last-pipeline-num-layers; without it the pipeline keeps the source's at the
    same pipeline size, and another size gets an even split."""
    out = copy.deepcopy(args)
    if split is not None:
        out.decoder_first_pipeline_num_layers, out.decoder_last_pipeline_num_layers = split
    elif pp != args.pipeline_model_parallel_size:
        out.decoder_first_pipeline_num_layers = out.decoder_last_pipeline_num_layers = None
    check_parallel_shape(args.num_layers, args.num_attention_heads,
                         getattr(args, "ffn_hidden_size", None) or 4 * args.hidden_size, tp, pp,
                         "the target tensor-parallel size", "the target pipeline-parallel size",
                         getattr(out, "decoder_first_pipeline_num_layers", None),
                         getattr(out, "decoder_last_pipeline_num_layers", None))
    out.tensor_model_parallel_size, out.pipeline_model_parallel_size = tp, pp
    if vocab_size is not None:
        out.padded_vocab_size = target_padded_vocab(args, vocab_size, tp)
    if dp is not None:
        out.data_parallel_size = dp
        if hasattr(out, "world_size"):
            out.world_size = tp * pp * dp
    if distributed_optimizer is not None:
        out.use_distributed_optimizer = distributed_optimizer
    return out


def load_model_state_for(load_dir: str, tp: int, pp: int, tp_rank: int, pp_rank: int,
                         iteration: Optional[int | str] = None) -> tuple[argparse.Namespace, dict[str, torch.Tensor]]:
    """Load a checkpoint of any layout as the model state of shard (tp_rank, pp_rank) of a
    (tp, pp) model, in memory. Returns (args with tensor/pipeline sizes and padded_vocab_size
    updated for the target, flat GPT2Model state dict with stage-local layer indices) --
    ready for `GPT2Model.load_state_dict`. Vocab rows beyond the true vocab size are zeros.
    Raises CheckpointError naming the file for missing / truncated / inconsistent shards."""
    if not (0 <= tp_rank < tp and 0 <= pp_rank < pp):
        raise ValueError(f"shard ({tp_rank}, {pp_rank}) outside target layout tp={tp}, pp={pp}")
    src = ShardedCheckpoint(load_dir, iteration)
    args = target_args(src.args, src.vocab_size, tp, pp)
    padded = args.padded_vocab_size if src.vocab_size is not None else src.args.padded_vocab_size
    state = {}
    for local, name in stage_keys(src.names, layer_counts(args, pp), pp_rank):  # one full tensor at a time
        state[local] = split(src.full(name), name, tp, tp_rank, padded)
    src.release()
    return args, state


__all__ = ["ShardedCheckpoint", "bounded_heap", "load_model_state_for", "target_args"]
