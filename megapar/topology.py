"""Topology: the only place that does rank arithmetic and creates process groups.

Rank order is tensor-parallel fastest, then data-parallel, then pipeline (Megatron's
tp-dp-pp), so TP groups stay inside a node:

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

With 16 ranks, tp=2, pp=4 (dp=2): TP groups [0,1],[2,3],...; DP groups [0,2],[1,3],[4,6],...;
PP groups [0,4,8,12],[1,5,9,13],...; the embedding group of each pipeline is its first and
last stage. Everything except `create_groups` is pure arithmetic and needs no processes; so is the layout
arithmetic at the end (layers per pipeline stage, shape checks, vocabulary padding) that
training, resharding, generation and the memory estimate share.
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from .errors import ConfigError, fail  # noqa: F401  (ConfigError: imported from here too)


@dataclass(frozen=True)
class Coord:
    tp: int
    dp: int
    pp: int


@dataclass
class Groups:
    """The torch.distributed groups of one rank (None before `create_groups`)."""
    tp: Optional[dist.ProcessGroup] = None
    dp: Optional[dist.ProcessGroup] = None
    pp: Optional[dist.ProcessGroup] = None
    mp: Optional[dist.ProcessGroup] = None          # tp x pp: one full model replica
    embedding: Optional[dist.ProcessGroup] = None   # first + last stage (when they differ)
    pp_grad: Optional[dist.ProcessGroup] = None     # pp == 2 only: the pipeline again, for gradient messages
    ckpt: Optional[dist.ProcessGroup] = None        # every rank, gloo: checkpoint collectives (async saves
                                                    # run them on a background thread beside training's)




@dataclass
class Topology:
    tp: int
    pp: int
    dp: int
    groups: Groups = field(default_factory=Groups, repr=False)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"Topology: {name} must be >= 1, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    # ---- coordinates -------------------------------------------------------------------
    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        return Coord(tp=rank % self.tp, dp=(rank // self.tp) % self.dp, pp=rank // (self.tp * self.dp))

    def rank(self, tp: int, dp: int, pp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    # ---- group member lists (each a list of rank lists covering the world) ------------
    def tp_groups(self) -> list[list[int]]:
        return [[self.rank(t, d, p) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank(t, d, p) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank(t, d, p) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups: all tp x pp ranks holding one replica (one dp index)."""
        return [[self.rank(t, d, p) for p in range(self.pp) for t in range(self.tp)] for d in range(self.dp)]

    def embedding_groups(self) -> list[list[int]]:
        """First and last stage of each pipeline (one rank when pp == 1)."""
        return [sorted({g[0], g[-1]}) for g in self.pp_groups()]

    def pp_grad_groups(self) -> list[list[int]]:
        """With pp == 2, a second communicator over each pipeline: the interleaved schedule's ring
        then sends activations and gradients between the same two ranks in the same direction,
        and NCCL (which has no tags) would match them in one queue; gradients travel on this one."""
        return self.pp_groups() if self.pp == 2 else []

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The member list of `rank`'s group of `kind` (tp, dp, pp, mp, embedding)."""
        for members in getattr(self, f"{kind}_groups")():
            if rank in members:
                return members
        raise AssertionError(f"rank {rank} in no {kind} group")

    # ---- pipeline neighbours ---------------------------------------------------------
    def is_first_stage(self, rank: int) -> bool:
        return self.coord(rank).pp == 0

    def is_last_stage(self, rank: int) -> bool:
        return self.coord(rank).pp == self.pp - 1

    def next_rank(self, rank: int) -> Optional[int]:
        c = self.coord(rank)
        return None if c.pp == self.pp - 1 else self.rank(c.tp, c.dp, c.pp + 1)

    def prev_rank(self, rank: int) -> Optional[int]:
        c = self.coord(rank)
        return None if c.pp == 0 else self.rank(c.tp, c.dp, c.pp - 1)

    # ---- process groups ----------------------------------------------------------------
    def create_groups(self, rank: int, timeout: Optional[timedelta] = None) -> Groups:
        """Create every torch.distributed group (collectively: all ranks must call this).

        Each new_group call is made by every rank in the same order, as torch requires. `timeout`
        (--distributed-timeout-minutes) bounds every collective of every group: torch gives a new
        group its backend's default (30 minutes), not the world group's timeout."""
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"world size {dist.get_world_size()} != tp*pp*dp = {self.world_size}")
        mine = Groups()
        for kind in ("tp", "dp", "pp", "mp", "embedding", "pp_grad"):
            for members in getattr(self, f"{kind}_groups")():
                group = dist.new_group(members, timeout=timeout)
                if rank in members:
                    setattr(mine, kind, group)
        # Checkpoint collectives (a save's agreement, an async save's writer) honour the same timeout: a
        # rank frozen mid-save ends the job within --distributed-timeout-minutes, as during training.
        mine.ckpt = dist.new_group(list(range(self.world_size)), timeout=timeout, backend="gloo")
        self.groups = mine
        return mine


# ---- layout arithmetic ------------------------------------------------------------------
def check_parallel_shape(num_layers: int, heads: int, ffn_hidden_size: int, tp: int, pp: int,
                         tp_flag: str = "--tensor-model-parallel-size",
                         pp_flag: str = "--pipeline-model-parallel-size",
                         first: Optional[int] = None, last: Optional[int] = None) -> None:
    """Can a model of this shape be split tp x pp? (training, resharding and inference all ask)"""
    if tp < 1 or pp < 1:
        fail(f"{tp_flag} ({tp}) and {pp_flag} ({pp}) must be >= 1",
             "tensor_model_parallel_size", "pipeline_model_parallel_size")
    if heads % tp:
        fail(f"--num-attention-heads {heads} is not divisible by {tp_flag} {tp}; each tensor-parallel rank "
             f"must hold whole attention heads", "num_attention_heads", "tensor_model_parallel_size")
    if ffn_hidden_size % tp:
        fail(f"--ffn-hidden-size {ffn_hidden_size} is not divisible by {tp_flag} {tp}",
             "ffn_hidden_size", "tensor_model_parallel_size")
    pipeline_layer_counts(num_layers, pp, first, last, pp_flag)


def layer_counts(model, pp: int) -> list[int]:
    """Layers per pipeline stage of a ModelConfig split over `pp` stages."""
    return pipeline_layer_counts(model.num_layers, pp, model.decoder_first_pipeline_num_layers,
                                 model.decoder_last_pipeline_num_layers)


def pipeline_layer_counts(num_layers: int, pp: int, first: Optional[int] = None, last: Optional[int] = None,
                          pp_flag: str = "--pipeline-model-parallel-size") -> list[int]:
    """Transformer layers per pipeline stage: `first` / `last` on the first / last stage when
    given (--decoder-first/last-pipeline-num-layers), the rest split evenly over the others."""
    fixed = {0: first, pp - 1: last} if pp > 1 else {}
    fixed = {stage: n for stage, n in fixed.items() if n is not None}
    if pp == 1 and (first is not None or last is not None):
        fail("--decoder-first/last-pipeline-num-layers need a pipeline-parallel size > 1; drop them",
             "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "pipeline_model_parallel_size")
    for stage, n in fixed.items():
        if not 1 <= n <= num_layers:
            fail(f"--decoder-{'first' if stage == 0 else 'last'}-pipeline-num-layers {n} must be between 1 and "
                 f"--num-layers {num_layers}", f"decoder_{'first' if stage == 0 else 'last'}_pipeline_num_layers",
                 "num_layers")
    rest, others = num_layers - sum(fixed.values()), pp - len(fixed)
    if others == 0 and rest != 0:
        fail(f"--decoder-first-pipeline-num-layers {first} + --decoder-last-pipeline-num-layers {last} must equal "
             f"--num-layers {num_layers} with {pp_flag} 2",
             "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "num_layers")
    if others and not fixed and num_layers % pp:
        fail(f"--num-layers {num_layers} is not divisible by {pp_flag} {pp}; every pipeline stage must get an "
             f"equal share of the {num_layers} layers (or set --decoder-first/last-pipeline-num-layers)",
             "num_layers", "pipeline_model_parallel_size")
    if others and (rest < others or rest % others):
        fail(f"the {rest} layers left after --decoder-first/last-pipeline-num-layers cannot be split evenly "
             f"over the other {others} pipeline stages ({pp_flag} {pp}); pick values that leave a multiple "
             f"of {others} (at least one layer per stage)",
             "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "pipeline_model_parallel_size")
    return [fixed.get(stage, rest // others if others else 0) for stage in range(pp)]


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: round up to a multiple of divisible_by * tp."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)
