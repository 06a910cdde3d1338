"""Everything a training run builds before its first step: process groups, device, data,
model, gradient buffer, optimizer and LR schedule. Nothing here is global: each builder gets
the config and topology it needs and returns what it built."""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..config.settings import Config
from ..checkpoint.checkpointer import Checkpointer
from ..checkpoint.common import megatron_args
from ..checkpoint.formats import Parts
from ..model import GPT2Model, VirtualStages, build_model, set_vocab
from ..optimizer.base import BaseOptimizer
from ..optimizer.grad_buffer import GradReduction
from ..optimizer.lr_schedule import OptimizerParamScheduler
from ..optimizer.sharded_params import ShardedParams
from ..optimizer.zero import build_zero
from ..tensor_parallel.random import seed_everything
from ..tensor_parallel.wgrad_store import WeightGradStore
from ..topology import Topology


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
    model: GPT2Model | VirtualStages   # VirtualStages: this rank's model chunks under interleaved 1F1B
    grad_buffer: GradReduction
    optimizer: BaseOptimizer
    scheduler: OptimizerParamScheduler
    checkpointer: Checkpointer    # every save and load of the run
    sharded: Optional[ShardedParams] = None   # ZeRO-3: the store of the layers' weights (checkpoints read and
                                              # write them through it)
    wgrad_store: Optional[WeightGradStore] = None   # --enable-zero-bubble: the deferred weight gradients

    @property
    def coord(self):
        return self.topo.coord(self.rank)


def build_run(cfg: Config, topo: Topology, rank: int, device: torch.device, vocab_size: int) -> Run:
    c = topo.coord(rank)
    seed_everything(cfg.train.seed, c.tp, c.pp, device)
    log = print_rank0
    set_vocab(cfg.model, vocab_size, topo.tp, log=log)
    p = cfg.parallel
    model, zero = build_zero(cfg, topo, rank, device, lambda on_layer_built, layer_hooks: build_model(
        cfg.model, topo, rank, cfg.train.seed, device, params_dtype(cfg), on_layer_built=on_layer_built,
        layer_hooks=layer_hooks))
    optimizer = zero.optimizer
    nvme = optimizer.nvme
    log(f"> optimizer: AdamW ({'csrc fused, one launch' if optimizer.adam_impl == 'fused' else 'torch'}"
        f"{f', ZeRO-{p.zero_stage}' if p.zero_stage else ''}{offload_text(p, nvme.io_mode if nvme else '')})")
    scheduler = build_scheduler(cfg, optimizer)
    parts = Parts(model, optimizer, scheduler, cfg.model, topo, rank, zero.sharded)
    checkpointer = Checkpointer(cfg.ckpt, parts, device, lambda consumed: megatron_args(cfg, consumed))
    wgrad_store = WeightGradStore.attach(model.parameters()) if p.enable_zero_bubble else None
    return Run(cfg, topo, rank, device, model, zero.grad_buffer, optimizer, scheduler, checkpointer, zero.sharded,
               wgrad_store)


def offload_text(p, nvme_io: str = "") -> str:
    """Where the optimizer state lives (and whether its step is delayed), for the optimizer's log line;
    nvme_io: how NVMe offload moves it (NvmeState.io_mode)."""
    delayed = ", delayed parameter update (the CPU step overlaps the next iteration)" if p.delayed_param_update else ""
    if p.optimizer_nvme_offload is not None:
        return f", NVMe offload to {p.optimizer_nvme_offload}{f' via {nvme_io}' if nvme_io else ''}{delayed}"
    return f", CPU offload{delayed}" if p.optimizer_cpu_offload else ""


def build_scheduler(cfg: Config, optimizer) -> OptimizerParamScheduler:
    """The LR schedule in iterations, or with Megatron's sample-based flags in samples
    (`Config.schedule_in_samples`: the training loop then steps it by each step's global batch);
    the decay and a changing weight decay span the run (`Config.schedule_horizon`) unless told otherwise."""
    t, horizon = cfg.train, cfg.schedule_horizon
    if cfg.schedule_in_samples:
        decay, warmup = t.lr_decay_samples or horizon, t.lr_warmup_samples
    else:
        decay, warmup = t.lr_decay_iters or horizon, t.lr_warmup_iters
    if t.lr_warmup_fraction is not None:
        warmup = int(t.lr_warmup_fraction * decay)
    changing = t.weight_decay_incr_style != "constant"  # then from --start- to --end-weight-decay over the run
    return OptimizerParamScheduler(optimizer, t.lr, t.min_lr, warmup, decay, t.lr_decay_style,
                                   t.start_weight_decay if changing else t.weight_decay,
                                   override_opt_param_scheduler=t.override_opt_param_scheduler,
                                   use_checkpoint_opt_param_scheduler=t.use_checkpoint_opt_param_scheduler,
                                   warmup_style=t.lr_warmup_style, warmup_init=t.lr_warmup_init,
                                   end_weight_decay=t.end_weight_decay if changing else None,
                                   wd_incr_style=t.weight_decay_incr_style,
                                   wd_incr_steps=horizon)
