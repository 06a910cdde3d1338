"""Shared tiny-GPT-2 builders for tests."""
import torch

from megapar.config.build import parse_config
from megapar.model import set_vocab
from megapar.model.sharding import tp_partition_dim

TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--attention-backend", "torch"]


def tiny_model_config(extra=(), world_size=1, vocab=100, tp=1):
    cfg = parse_config(TINY + list(extra), world_size=world_size)
    set_vocab(cfg.model, vocab, tp, log=lambda *_: None)
    return cfg


def batch(vocab=100, b=3, s=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, s + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def gather_grads(model, tp_group, tp):
    """Full-shape gradients of every parameter (TP shards concatenated)."""
    import torch.distributed as dist
    out = {}
    for name, p in model.named_parameters():
        dim = tp_partition_dim(name)
        g = p.grad.detach()
        if dim is not None and tp > 1:
            parts = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(parts, g.contiguous(), group=tp_group)
            g = torch.cat(parts, dim=dim)
        out[name] = g
    return out
