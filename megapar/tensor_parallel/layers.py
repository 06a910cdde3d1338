"""Tensor-parallel layers: column/row-parallel linear and the vocab-parallel embedding.

Initialisation is layout invariant: every weight is drawn at its full (unsharded) shape from a
seed derived from the global seed and the parameter's name, then sliced. So tp=1 and tp=4 start
from identical weights.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..config.settings import default_of
from .linear import add_bias, linear
from .mappings import (Group, gather_from_tp, reduce_from_tp, reduce_scatter_to_sp, scatter_to_tp, to_tp_region,
                       tp_world)

if TYPE_CHECKING:
    from ..fp8 import Fp8Gemm


@dataclass(frozen=True)
class Init:
    """How to initialise one parameter: N(0, std) at full shape, seeded by (seed, name)."""
    seed: int
    name: str
    std: float = default_of("init_method_std")   # --init-method-std's default


def name_seed(seed: int, name: str) -> int:
    """A 63-bit seed derived from the global seed and a parameter name."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def full_normal(shape: tuple[int, ...], init: Init) -> torch.Tensor:
    """Draw the full tensor on CPU in fp32 (device- and layout-independent)."""
    gen = torch.Generator().manual_seed(name_seed(init.seed, init.name))
    return torch.empty(shape).normal_(0.0, init.std, generator=gen)


def tp_rank_size(group: Group) -> tuple[int, int]:
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


def _param(t: torch.Tensor, device, dtype, fused_grad_accumulation: bool = False) -> nn.Parameter:
    """fused_grad_accumulation: backward accumulates the gradient into main_grad (linear.py)."""
    p = nn.Parameter(t.to(device=device, dtype=dtype).contiguous())
    p.fused_grad_accumulation = fused_grad_accumulation
    return p


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split by rows (output features) across the TP group.

    Input [*, in] (replicated) -> output [*, out/tp], or [*, out] with gather_output=True.
    sequence_parallel: input [s/tp, b, in], this rank's part of the sequence, all-gathered first.
    fp8: the GEMM's operands are cast to fp8 (megapar/fp8.py); the weight's gradient then takes
    the unfused path.
    """

    def __init__(self, in_features: int, out_features: int, init: Init, tp_group: Group = None,
                 bias: bool = True, gather_output: bool = False, device=None, dtype=torch.float32,
                 fused_grad_accumulation: bool = False, sequence_parallel: bool = False,
                 fp8: Optional["Fp8Gemm"] = None):
        super().__init__()
        self.fp8 = fp8
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output and sequence_parallel cannot be combined")
        self.tp_group, self.gather_output, self.sequence_parallel = tp_group, gather_output, sequence_parallel
        rank, size = tp_rank_size(tp_group)
        self.out_per_rank = _divide(out_features, size, "output features")
        w = full_normal((out_features, in_features), init).chunk(size, dim=0)[rank]
        self.weight = _param(w, device, dtype, fused_grad_accumulation and fp8 is None)
        self.bias = _param(torch.zeros(self.out_per_rank), device, dtype, fused_grad_accumulation) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.tp_group, self.sequence_parallel, self.fp8)  # [*, out/tp]
        return gather_from_tp(y, self.tp_group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split by columns (input features) across the TP group.

    Input [*, in/tp] (input_is_parallel) or [*, in] (scattered here) -> output [*, out],
    all-reduced over the TP group; the bias is replicated and added after the reduction.
    sequence_parallel: the output is reduce-scattered along the sequence instead, [s/tp, b, out],
    and the bias is marked `sequence_parallel` (its gradient is summed over TP after
    backward: GradBuffer tp_summed). fp8: as ColumnParallelLinear's.
    """

    def __init__(self, in_features: int, out_features: int, init: Init, tp_group: Group = None,
                 bias: bool = True, input_is_parallel: bool = True, device=None, dtype=torch.float32,
                 fused_grad_accumulation: bool = False, sequence_parallel: bool = False,
                 fp8: Optional["Fp8Gemm"] = None):
        super().__init__()
        self.fp8 = fp8
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel")
        self.tp_group, self.input_is_parallel, self.sequence_parallel = tp_group, input_is_parallel, sequence_parallel
        rank, size = tp_rank_size(tp_group)
        _divide(in_features, size, "input features")
        w = full_normal((out_features, in_features), init).chunk(size, dim=1)[rank]
        self.weight = _param(w, device, dtype, fused_grad_accumulation and fp8 is None)
        self.bias = _param(torch.zeros(out_features), device, dtype, fused_grad_accumulation) if bias else None
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.tp_group)
        if tp_world(self.tp_group) == 1:  # no reduction: the bias joins the GEMM's autograd node
            return linear(x, self.weight, self.bias, fp8=self.fp8, bias_after_gemm=True)
        if self.sequence_parallel:
            y = reduce_scatter_to_sp(linear(x, self.weight, fp8=self.fp8), self.tp_group)  # [s/tp, b, out]
        else:
            y = linear(x, self.weight, fp8=self.fp8)
            if self.fp8 is not None and self.tp_group is not None:
                y = y.clone()  # torchao returns a view of its GEMM's output; the all-reduce works in place
            y = reduce_from_tp(y, self.tp_group)  # [*, out]
        return y if self.bias is None else add_bias(y, self.bias)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose (padded) vocabulary rows are split in contiguous ranges across TP.

    Each rank looks up the ids in its range (zeros elsewhere); the partial results are
    all-reduced, so every rank returns the full [*, hidden] embedding.
    """

    def __init__(self, padded_vocab_size: int, hidden_size: int, init: Init, tp_group: Group = None,
                 device=None, dtype=torch.float32):
        super().__init__()
        self.tp_group = tp_group
        rank, size = tp_rank_size(tp_group)
        per_rank = _divide(padded_vocab_size, size, "padded vocabulary size")
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank
        w = full_normal((padded_vocab_size, hidden_size), init)[self.vocab_start:self.vocab_end]
        self.weight = _param(w, device, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None or dist.get_world_size(self.tp_group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        emb = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(emb, self.tp_group)


def parallel_lm_logits(hidden: torch.Tensor, word_embeddings: torch.Tensor, tp_group: Group,
                       gather: bool = False, sequence_parallel: bool = False) -> torch.Tensor:
    """Output layer tied to the (vocab-parallel) input embedding: [*, h] -> [*, V/tp] ([*, V]).
    sequence_parallel: hidden is [s/tp, b, h], all-gathered along the sequence first."""
    logits = F.linear(to_tp_region(hidden, tp_group, sequence_parallel), word_embeddings)  # [s, b, V/tp]
    return gather_from_tp(logits, tp_group) if gather else logits

