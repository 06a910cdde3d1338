"""Everything a training run builds before its first step: process groups, device, data,
model, gradient buffer, optimizer and LR schedule. Nothing here is global: each builder gets
the config and topology it needs and returns what it built."""
from __future__ import annotations

import argparse
import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .arguments import Config
from .checkpoint import AsyncSaves
from .model import GPT2Model, build_model, set_vocab
from .model.transformer import TransformerLayer
from .optimizer.grad_buffer import REDUCE_DTYPES, GradBuffer
from .optimizer.sharded_grads import ShardedGradBuffer
from .optimizer.sharded_params import ShardedParams
from .optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from .optimizer.lr_schedule import OptimizerParamScheduler
from .optimizer.optimizer import MixedPrecisionOptimizer
from .tensor_parallel.random import seed_everything
from .topology import Topology

GRAD_BUCKET_NUMEL = 40_000_000  # elements per DP bucket on GPU (Megatron's default)


def print_rank0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def free_port() -> int:
    """A TCP port free on this host now (for a rendezvous on 127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: Optional[str], timeout_minutes: float) -> tuple[int, int, torch.device]:
    """Initialise torch.distributed from torchrun's env (or as a 1-process world) ->
    (rank, world_size, device). NCCL on GPUs, gloo on CPU, unless --distributed-backend says."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python -m megapar.pretrain_gpt2`: a world of one
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(free_port()))
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl" and not torch.cuda.is_available():
            raise RuntimeError("--distributed-backend nccl needs CUDA GPUs; use gloo on CPU")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    rank = dist.get_rank()
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    return rank, dist.get_world_size(), device


def params_dtype(cfg: Config) -> torch.dtype:
    return torch.bfloat16 if cfg.train.bf16 else torch.float16 if cfg.train.fp16 else torch.float32


@dataclass
class Run:
    """What a training run holds (built once, passed around explicitly)."""
    cfg: Config
    topo: Topology
    rank: int
    device: torch.device
    model: GPT2Model
    grad_buffer: GradBuffer
    optimizer: Any
    scheduler: OptimizerParamScheduler
    saves: Optional[AsyncSaves] = None   # --async-save: the save in flight
    sharded: Optional[ShardedParams] = None   # ZeRO-3: the store of the layers' weights (checkpoints read and
                                              # write them through it)

    @property
    def coord(self):
        return self.topo.coord(self.rank)


def embedding_params(model: GPT2Model, topo: Topology) -> list[nn.Parameter]:
    """The tied word-embedding copy of this stage (or of its model chunks) that is all-reduced over
    the embedding group (pp > 1): the first stage's word embeddings or the last stage's head copy."""
    if topo.pp == 1:
        return []
    stage = model.stage
    return [model.output_embedding_weight()] if stage.is_first or stage.is_last else []


def build_run(cfg: Config, topo: Topology, rank: int, device: torch.device, vocab_size: int) -> Run:
    c = topo.coord(rank)
    seed_everything(cfg.train.seed, c.tp, c.pp)
    log = print_rank0
    set_vocab(cfg.model, vocab_size, topo.tp, log=log)
    p = cfg.parallel
    sharded = ShardedParams(topo.groups.dp, offload=p.param_cpu_offload) if p.zero_stage == 3 else None
    model = build_model(cfg.model, topo, rank, cfg.train.seed, device, params_dtype(cfg),
                        on_layer_built=sharded.shard_layer if sharded else None, layer_hooks=p.zero_stage >= 2)
    grad_buffer = build_grad_buffer(cfg, model, topo, device, sharded)
    t = cfg.train
    scaler = (ConstantGradScaler(t.loss_scale or 1.0, t.hysteresis) if not t.fp16 or t.loss_scale else
              DynamicGradScaler(t.initial_loss_scale, t.min_loss_scale, growth_interval=t.loss_scale_window,
                                hysteresis=t.hysteresis))
    if p.zero_stage >= 1:
        from .optimizer.distrib_optimizer import DistributedOptimizer
        optimizer = DistributedOptimizer(model, grad_buffer, t, scaler, c.tp, topo.groups.dp,
                                         norm_group=None, inf_group=None, sharded_params=sharded,
                                         offload=p.optimizer_cpu_offload, stage=p.zero_stage,
                                         nvme_root=p.optimizer_nvme_offload)
    else:
        optimizer = MixedPrecisionOptimizer(model, grad_buffer, t, scaler, c.tp, norm_group=topo.groups.mp,
                                            inf_group=None)
    log(f"> optimizer: AdamW ({'csrc fused, one launch' if optimizer.adam_impl == 'fused' else 'torch'}"
        f"{f', ZeRO-{p.zero_stage}' if p.zero_stage else ''}{offload_text(p)})")
    scheduler = build_scheduler(cfg, optimizer)
    saves = AsyncSaves(device) if cfg.ckpt.async_save else None
    return Run(cfg, topo, rank, device, model, grad_buffer, optimizer, scheduler, saves, sharded)


def offload_text(p) -> str:
    """Where the optimizer state lives, for the optimizer's log line."""
    if p.optimizer_nvme_offload is not None:
        return f", NVMe offload to {p.optimizer_nvme_offload}"
    return ", CPU offload" if p.optimizer_cpu_offload else ""


def build_grad_buffer(cfg: Config, model: GPT2Model, topo: Topology, device: torch.device,
                      sharded: Optional[ShardedParams]):
    """Stages 0-1: one flat fp32 buffer (all-reduced, or reduce-scattered for ZeRO-1); stages
    2-3: per-layer buckets reduce-scattered into this rank's shard (ZeRO-3 frees each layer's
    gathered weights once its gradients are handed over)."""
    tp_summed = [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]
    stage = cfg.parallel.zero_stage
    reduce_dtype = REDUCE_DTYPES[cfg.parallel.grad_reduce_dtype]
    if stage >= 2:
        layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]  # every chunk's, in order
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        release = (lambda i: sharded.units[i].release()) if sharded else None
        return ShardedGradBuffer(layers, [p for p in model.parameters() if id(p) not in in_layers], topo.groups.dp,
                                 tp_summed=tp_summed, tp_group=topo.groups.tp, on_layer_reduced=release,
                                 reduce_dtype=reduce_dtype)
    return GradBuffer(model.parameters(), topo.groups.dp, mode="reduce_scatter" if stage == 1 else "all_reduce",
                      bucket_numel=GRAD_BUCKET_NUMEL if device.type == "cuda" else None,
                      overlap=device.type == "cuda", late_params=embedding_params(model, topo),
                      tp_summed=tp_summed, tp_group=topo.groups.tp, reduce_dtype=reduce_dtype)


def train_iters(cfg: Config) -> int:
    t = cfg.train
    return t.train_iters if t.train_iters is not None else (t.train_samples or 0) // t.global_batch_size


def build_scheduler(cfg: Config, optimizer) -> OptimizerParamScheduler:
    t = cfg.train
    decay = t.lr_decay_iters or train_iters(cfg)
    warmup = int(t.lr_warmup_fraction * decay) if t.lr_warmup_fraction is not None else t.lr_warmup_iters
    return OptimizerParamScheduler(optimizer, t.lr, t.min_lr, warmup, decay, t.lr_decay_style, t.weight_decay,
                                   override_opt_param_scheduler=t.override_opt_param_scheduler,
                                   use_checkpoint_opt_param_scheduler=t.use_checkpoint_opt_param_scheduler,
                                   warmup_style=t.lr_warmup_style, warmup_init=t.lr_warmup_init)


def checkpoint_args(run: Run, consumed_samples: int) -> argparse.Namespace:
    """The `args` stored in checkpoints: every setting (Megatron's names), the sizes derived from the
    tokenizer and topology, and what Megatron-format readers look for (docs/design.md)."""
    ns = run.cfg.namespace()
    ns.consumed_train_samples = consumed_samples
    ns.openai_gelu, ns.bias_gelu_fusion = True, False
    return ns
