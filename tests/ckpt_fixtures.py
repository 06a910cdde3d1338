"""Write real megapar checkpoints at any (tp, pp, dp) for the resharding tests.

`save_tiny_checkpoint(root, tp, pp, dp, zero)` spawns tp*pp*dp gloo processes; each builds its
GPT2Model stage, an optimizer (ZeRO-1 with zero=True) that takes `steps` AdamW steps on
deterministic layout-independent gradients (a full-shape tensor per global parameter name,
sliced like the parameter), an LR scheduler, and calls megapar.checkpoint.save_checkpoint --
so the files are exactly what training writes.
"""
from __future__ import annotations

import zlib

import torch

from distributed import run_distributed
from gpt_helpers import tiny_model_config
from megapar.checkpoint import save_checkpoint
from megapar.model import GPT2Model, Stage
from megapar.model.sharding import tp_partition_dim
from megapar.optimizer.distrib_optimizer import DistributedOptimizer
from megapar.optimizer.grad_buffer import GradBuffer
from megapar.optimizer.grad_scaler import DynamicGradScaler
from megapar.optimizer.lr_schedule import OptimizerParamScheduler
from megapar.optimizer.optimizer import MixedPrecisionOptimizer
from megapar.checkpoint.layout import to_global
from megapar.tensor_parallel.random import seed_everything
from megapar.topology import Topology

VOCAB = 100
SEED = 7


def _fake_grad(global_name: str, full_shape, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(global_name.encode()) + 1000 * step)
    return torch.randn(full_shape, generator=g) * 0.01


def _local_grad(name: str, p: torch.Tensor, layer_start: int, tp: int, tp_rank: int, step: int):
    dim = tp_partition_dim(name)
    shape = list(p.shape)
    if dim is not None:
        shape[dim] *= tp
    full = _fake_grad(to_global(name, layer_start), shape, step)
    if "word_embeddings" in name:
        full[VOCAB:] = 0          # dummy vocabulary rows never get gradient (masked in the loss)
    return full if dim is None else full.chunk(tp, dim=dim)[tp_rank]


def _save_body(rank, world, root, tp, pp, dp, zero, steps, iteration, extra):
    topo = Topology(tp, pp, dp)
    topo.create_groups(rank)
    c = topo.coord(rank)
    flags = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
             "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-2"] + list(extra)
    if zero:
        flags.append("--use-distributed-optimizer")
    cfg = tiny_model_config(flags, world_size=world, vocab=VOCAB, tp=tp)
    seed_everything(SEED, c.tp, c.pp)
    model = GPT2Model(cfg.model, Stage.for_config(cfg.model, pp, c.pp), SEED, topo.groups.tp if tp > 1 else None)
    scaler = DynamicGradScaler(initial_scale=2.0 ** 16)
    if zero:
        buf = GradBuffer(model.parameters(), topo.groups.dp, mode="reduce_scatter")
        opt = DistributedOptimizer(model, buf, cfg.train, scaler, c.tp, topo.groups.dp)
    else:
        buf = GradBuffer(model.parameters(), topo.groups.dp)
        opt = MixedPrecisionOptimizer(model, buf, cfg.train, scaler, c.tp, norm_group=topo.groups.mp)
    sched = OptimizerParamScheduler(opt, cfg.train.lr, 0.0, 2, 100, "cosine")
    for step in range(steps):
        for name, p in model.named_parameters():
            p.main_grad.copy_(_local_grad(name, p, model.stage.layer_start, tp, c.tp, step))
        opt.step()
        sched.step()
    args = cfg.megatron_args()
    args.consumed_train_samples = 8 * iteration
    save_checkpoint(root, iteration, model, opt, sched, args, cfg.model, topo, rank)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def save_tiny_checkpoint(root: str, tp: int, pp: int, dp: int = 1, zero: bool = False, steps: int = 2,
                         iteration: int = 20, extra=()) -> list[dict]:
    """Returns each rank's model state dict (rank order tp, dp, pp)."""
    return run_distributed(_save_body, world_size=tp * pp * dp,
                           args=(root, tp, pp, dp, zero, steps, iteration, tuple(extra)))


def write_hf_gpt2(folder, n_layer: int = 2, n_embd: int = 32, n_head: int = 4, vocab: int = VOCAB,
                  n_positions: int = 32, n_inner=None, seed: int = 0, extra_tensors=None, **config) -> dict:
    """A GPT2LMHeadModel folder (config.json + model.safetensors) with random weights, written with
    safetensors alone (no transformers): what `save_pretrained` writes for such a model. `config`
    adds or overrides config.json settings. Returns {key: tensor}."""
    import json
    import os
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    f = n_inner or 4 * n_embd
    shapes = {"wte.weight": (vocab, n_embd), "wpe.weight": (n_positions, n_embd),
              "ln_f.weight": (n_embd,), "ln_f.bias": (n_embd,)}
    for i in range(n_layer):
        shapes.update({f"h.{i}.ln_1.weight": (n_embd,), f"h.{i}.ln_1.bias": (n_embd,),
                       f"h.{i}.attn.c_attn.weight": (n_embd, 3 * n_embd), f"h.{i}.attn.c_attn.bias": (3 * n_embd,),
                       f"h.{i}.attn.c_proj.weight": (n_embd, n_embd), f"h.{i}.attn.c_proj.bias": (n_embd,),
                       f"h.{i}.ln_2.weight": (n_embd,), f"h.{i}.ln_2.bias": (n_embd,),
                       f"h.{i}.mlp.c_fc.weight": (n_embd, f), f"h.{i}.mlp.c_fc.bias": (f,),
                       f"h.{i}.mlp.c_proj.weight": (f, n_embd), f"h.{i}.mlp.c_proj.bias": (n_embd,)})
    tensors = {f"transformer.{k}": torch.randn(s, generator=g) * 0.05 + float("ln_" in k and k.endswith("weight"))
               for k, s in shapes.items()}
    tensors.update(extra_tensors or {})
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
           "vocab_size": vocab, "n_positions": n_positions, "n_embd": n_embd, "n_layer": n_layer, "n_head": n_head,
           "n_inner": n_inner, "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
           "initializer_range": 0.02, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
           "reorder_and_upcast_attn": False, "add_cross_attention": False, "tie_word_embeddings": True,
           **config}
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    return tensors
