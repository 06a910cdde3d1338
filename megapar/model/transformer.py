"""The GPT-2 transformer layer built from tensor-parallel pieces (activations are [s, b, h])."""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..config.settings import ModelConfig
from ..fp8 import layer_fp8
from ..kernels import dropout as fast_dropout
from ..kernels.softmax import scaled_masked_softmax
from ..tensor_parallel.layers import ColumnParallelLinear, Init, RowParallelLinear, tp_rank_size
from ..tensor_parallel.random import checkpoint, get_rng_tracker
from .kv_cache import LayerKVCache


def make_layernorm(cfg: ModelConfig, device, dtype) -> nn.Module:
    """torch.nn.LayerNorm (reference) or the fused csrc kernel, by --layernorm-impl. Under sequence
    parallelism its parameters are marked `sequence_parallel` (each TP rank normalises other tokens,
    so their gradients are summed over TP: GradBuffer tp_summed)."""
    if cfg.layernorm_impl == "fused":
        from ..kernels.layernorm import LayerNorm
        ln = LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, impl="fused").to(device=device, dtype=dtype)
    else:
        ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon, device=device, dtype=dtype)
    for p in ln.parameters():
        p.sequence_parallel = cfg.sequence_parallel
    return ln


def sp_dropout(x: torch.Tensor, p: float, training: bool, sequence_parallel: bool,
               fast: bool = True) -> torch.Tensor:
    """Dropout on activations outside the TP region: on the default RNG stream (the same on every TP
    rank, which hold the same tokens), or, under sequence parallelism (each rank holds other
    tokens), on the tracker's model-parallel stream, as Megatron does.

    In a compiled layer on a GPU that records gradients the mask is kernels/dropout.py's (a quarter
    of the Philox work of Inductor's own). fast=False keeps Inductor's: full recompute runs a
    layer's first forward without gradients and must draw the same masks when it runs it again."""
    if not (training and p > 0):
        return x
    with get_rng_tracker().fork() if sequence_parallel else contextlib.nullcontext():
        if fast and torch.compiler.is_compiling() and torch.is_grad_enabled() and fast_dropout.available(x):
            return fast_dropout.dropout(x, p)
        return F.dropout(x, p=p, training=True)


# torch SDPA backends: "flash" = torch's default choice (FlashAttention-2 on GPUs, math on CPU);
# "cudnn" = cuDNN's fused attention first (Hopper), then torch's default order.
SDPA_BACKENDS = {"flash": None,
                 "cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                           SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]}


def core_attention(q, k, v, backend: str, dropout_p: float, causal: bool = True) -> torch.Tensor:
    """softmax(q k^T / sqrt(hn), causal) v with dropout.   q,k,v: [b, np, s, hn] -> [b, np, sq, hn].

    Dropout runs on the tracker's model-parallel RNG stream (each TP rank owns other heads)."""
    with get_rng_tracker().fork() if dropout_p > 0 else contextlib.nullcontext():
        if backend in SDPA_BACKENDS:
            order = SDPA_BACKENDS[backend]
            with sdpa_kernel(order, set_priority=True) if order else contextlib.nullcontext():
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)
        scale = 1.0 / math.sqrt(q.shape[-1])
        scores = torch.matmul(q, k.transpose(-1, -2))                                  # [b, np, sq, sk]
        probs = scaled_masked_softmax(scores, scale, causal=causal, impl="fused" if backend == "fused" else "torch")
        if dropout_p > 0:
            probs = F.dropout(probs, p=dropout_p)
        return torch.matmul(probs, v)


class ParallelAttention(nn.Module):
    """Self-attention with heads split across TP ranks. QKV rows are laid out per head,
    [np, 3, hn] (Megatron checkpoint_version >= 2), so a TP shard holds whole heads."""

    def __init__(self, cfg: ModelConfig, prefix: str, seed: int, tp_group, device, dtype):
        super().__init__()
        h, out_std = cfg.hidden_size, cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        _, tp = tp_rank_size(tp_group)
        fused, sp = cfg.gradient_accumulation_fusion, cfg.sequence_parallel
        fp8 = layer_fp8(cfg.fp8_format, cfg.fp8_recipe, device)
        self.heads_local, self.hn = cfg.num_attention_heads // tp, cfg.kv_channels
        self.backend, self.dropout = cfg.attention_backend, cfg.attention_dropout
        self.selective_recompute = cfg.recompute_granularity == "selective" and self.backend not in SDPA_BACKENDS
        self.query_key_value = ColumnParallelLinear(
            h, 3 * h, Init(seed, f"{prefix}.query_key_value.weight", cfg.init_method_std), tp_group,
            device=device, dtype=dtype, fused_grad_accumulation=fused, sequence_parallel=sp, fp8=fp8)
        self.dense = RowParallelLinear(h, h, Init(seed, f"{prefix}.dense.weight", out_std), tp_group,
                                       device=device, dtype=dtype, fused_grad_accumulation=fused, sequence_parallel=sp,
                                       fp8=fp8)

    def forward(self, x: torch.Tensor, kv_cache: Optional[LayerKVCache] = None) -> torch.Tensor:
        qkv = self.query_key_value(x)                                                  # [s, b, 3h/tp]
        s, b, _ = qkv.shape                           # x is [s/tp, b, h] under sequence parallelism
        qkv = qkv.view(s, b, self.heads_local, 3, self.hn)                             # [s, b, np, 3, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in qkv.unbind(dim=3))                   # [b, np, s, hn]
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)                                               # [b, np, sk, hn]
        p = self.dropout if self.training else 0.0
        if self.selective_recompute and self.training:
            ctx = checkpoint(core_attention, q, k, v, self.backend, p, rng=p > 0)
        else:
            backend, causal = self.backend, True
            if kv_cache is not None and q.shape[2] != k.shape[2]:  # decoding with a cache
                # one new query sees every cached key: no mask, any backend; longer chunks
                # need the offset causal mask of the reference path
                backend, causal = ("flash", False) if q.shape[2] == 1 else ("torch", True)
            ctx = core_attention(q, k, v, backend, p, causal)                         # [b, np, s, hn]
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads_local * self.hn)        # [s, b, h/tp]
        return self.dense(ctx)


class ParallelMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, seed: int, tp_group, device, dtype):
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        fused, sp = cfg.gradient_accumulation_fusion, cfg.sequence_parallel
        fp8 = layer_fp8(cfg.fp8_format, cfg.fp8_recipe, device)
        self.dense_h_to_4h = ColumnParallelLinear(
            h, f, Init(seed, f"{prefix}.dense_h_to_4h.weight", cfg.init_method_std), tp_group,
            device=device, dtype=dtype, fused_grad_accumulation=fused, sequence_parallel=sp, fp8=fp8)
        self.dense_4h_to_h = RowParallelLinear(f, h, Init(seed, f"{prefix}.dense_4h_to_h.weight", out_std),
                                               tp_group, device=device, dtype=dtype,
                                               fused_grad_accumulation=fused, sequence_parallel=sp, fp8=fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate="tanh"))  # GPT-2 tanh GELU


class TransformerLayer(nn.Module):
    """Pre-LayerNorm block: x + drop(attn(ln(x))); x + drop(mlp(ln(x))).
    x is [s, b, h], or [s/tp, b, h] under sequence parallelism."""

    def __init__(self, cfg: ModelConfig, global_index: int, seed: int, tp_group, device, dtype):
        super().__init__()
        prefix = f"language_model.encoder.layers.{global_index}"
        self.input_layernorm = make_layernorm(cfg, device, dtype)
        self.self_attention = ParallelAttention(cfg, f"{prefix}.self_attention", seed, tp_group, device, dtype)
        self.post_attention_layernorm = make_layernorm(cfg, device, dtype)
        self.mlp = ParallelMLP(cfg, f"{prefix}.mlp", seed, tp_group, device, dtype)
        self.hidden_dropout, self.sequence_parallel = cfg.hidden_dropout, cfg.sequence_parallel
        self.fast_dropout = cfg.recompute_granularity != "full"

    def forward(self, x: torch.Tensor, kv_cache: Optional[LayerKVCache] = None) -> torch.Tensor:
        p, sp, fast = self.hidden_dropout, self.sequence_parallel, self.fast_dropout
        x = x + sp_dropout(self.self_attention(self.input_layernorm(x), kv_cache), p, self.training, sp, fast)
        return x + sp_dropout(self.mlp(self.post_attention_layernorm(x)), p, self.training, sp, fast)
