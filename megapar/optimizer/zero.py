"""One builder for every ZeRO stage: what a stage needs besides the model, built in one place.

    stage  parameter store            gradient buffer                       optimizer
    0      -                          GradBuffer, all-reduce                MixedPrecisionOptimizer
    1      -                          GradBuffer, reduce-scatter            DistributedOptimizer
    2      -                          ShardedGradBuffer (per layer)         DistributedOptimizer
    3      ShardedParams (per layer)  ShardedGradBuffer, frees each layer   DistributedOptimizer
`--optimizer-cpu-offload` keeps the DistributedOptimizer's state and step on the CPU
(`--optimizer-nvme-offload` the step, with the state in files: nvme.py; `--delayed-param-update`
runs that step in the background of the next one); `--param-cpu-offload` the
ShardedParams' shards. The store exists before the model (each layer is
sharded as it is built), so `build_zero` builds the model through the caller's `make_model`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..config.settings import Config
from ..model import GPT2Model
from ..model.transformer import TransformerLayer
from ..topology import Topology
from .base import BaseOptimizer
from .distrib_optimizer import DistributedOptimizer
from .grad_buffer import REDUCE_DTYPES, GradBuffer, GradReduction
from .grad_scaler import ConstantGradScaler, DynamicGradScaler
from .optimizer import MixedPrecisionOptimizer
from .sharded_grads import ShardedGradBuffer
from .sharded_params import ShardedParams


# make_model(on_layer_built, layer_hooks) -> the model: each layer handed to on_layer_built as it is
# built (ZeRO-3 shards it there), layer_hooks: the layers take forward hooks (stages 2-3, and 1 when its
# all-gathers wait for the next forward)
MakeModel = Callable[[Optional[Callable[[nn.Module], None]], bool], GPT2Model]


@dataclass
class Zero:
    """A stage's objects: the ZeRO-3 parameter store (None below stage 3; checkpoints read and write
    the layers' weights through it), the gradient buffer, the optimizer."""
    sharded: Optional[ShardedParams]
    grad_buffer: GradReduction
    optimizer: BaseOptimizer


def build_zero(cfg: Config, topo: Topology, rank: int, device: torch.device,
               make_model: MakeModel) -> tuple[GPT2Model, Zero]:
    p = cfg.parallel
    sharded = ShardedParams(topo.groups.dp, offload=p.param_cpu_offload) if p.zero_stage == 3 else None
    # ZeRO-1/2's all-gathers wait for the next forward (layer pre-hooks) where NCCL gathers in place
    defer_gathers = p.overlap_param_gather and device.type == "cuda" and p.zero_stage >= 1 \
        and not (p.optimizer_cpu_offload or p.optimizer_nvme_offload)
    model = make_model(sharded.shard_layer if sharded else None, p.zero_stage >= 2 or defer_gathers)
    grad_buffer = build_grad_buffer(cfg, model, topo, device, sharded)
    t, tp_rank = cfg.train, topo.coord(rank).tp
    scaler = (ConstantGradScaler(t.loss_scale or 1.0, t.hysteresis) if not t.fp16 or t.loss_scale else
              DynamicGradScaler(t.initial_loss_scale, t.min_loss_scale, growth_interval=t.loss_scale_window,
                                hysteresis=t.hysteresis))
    if p.zero_stage >= 1:
        optimizer = DistributedOptimizer(model, grad_buffer, t, scaler, tp_rank, topo.groups.dp,
                                         norm_group=None, sharded_params=sharded,
                                         offload=p.optimizer_cpu_offload, stage=p.zero_stage,
                                         nvme_root=p.optimizer_nvme_offload, delayed=p.delayed_param_update,
                                         forward_units=forward_units(model) if defer_gathers else ())
    else:
        optimizer = MixedPrecisionOptimizer(model, grad_buffer, t, scaler, tp_rank, norm_group=topo.groups.mp)
    return model, Zero(sharded, grad_buffer, optimizer)


def layers_and_rest(module: nn.Module) -> tuple[list[TransformerLayer], list[nn.Parameter]]:
    """The transformer layers inside `module` (every model chunk's, in forward order) and its
    parameters outside them (embeddings, final LayerNorm, head)."""
    layers = [m for m in module.modules() if isinstance(m, TransformerLayer)]
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    return layers, [p for p in module.parameters() if id(p) not in in_layers]


def forward_units(model: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Where each parameter is first used in a forward: each model chunk (its embeddings, final
    LayerNorm and head, used from its start on), then each transformer layer, in forward order."""
    chunks = [m for m in model.modules() if isinstance(m, GPT2Model)]
    return ([(c, layers_and_rest(c)[1]) for c in chunks]
            + [(layer, list(layer.parameters())) for layer in layers_and_rest(model)[0]])


def embedding_params(model: GPT2Model, topo: Topology) -> list[nn.Parameter]:
    """The tied word-embedding copy of this stage (or of its model chunks) that is all-reduced over
    the embedding group (pp > 1): the first stage's word embeddings or the last stage's head copy."""
    if topo.pp == 1:
        return []
    stage = model.stage
    return [model.output_embedding_weight()] if stage.is_first or stage.is_last else []


def build_grad_buffer(cfg: Config, model: GPT2Model, topo: Topology, device: torch.device,
                      sharded: Optional[ShardedParams]) -> GradReduction:
    """Stages 0-1: one flat fp32 buffer (all-reduced, or reduce-scattered for ZeRO-1); stages
    2-3: per-layer buckets reduce-scattered into this rank's shard (ZeRO-3 frees each layer's
    gathered weights once its gradients are handed over)."""
    tp_summed = [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]
    stage = cfg.parallel.zero_stage
    reduce_dtype = REDUCE_DTYPES[cfg.parallel.grad_reduce_dtype]
    if stage >= 2:
        layers, rest = layers_and_rest(model)
        release = (lambda i: sharded.units[i].release()) if sharded else None
        return ShardedGradBuffer(layers, rest, topo.groups.dp,
                                 tp_summed=tp_summed, tp_group=topo.groups.tp, on_layer_reduced=release,
                                 reduce_dtype=reduce_dtype)
    gpu = device.type == "cuda"
    return GradBuffer(model.parameters(), topo.groups.dp, mode="reduce_scatter" if stage == 1 else "all_reduce",
                      bucket_numel=cfg.parallel.ddp_bucket_size if gpu else None,
                      overlap=cfg.parallel.overlap_grad_reduce and gpu,
                      late_params=embedding_params(model, topo),
                      tp_summed=tp_summed, tp_group=topo.groups.tp, reduce_dtype=reduce_dtype)
