"""GPT-2 from tensor-parallel layers, sliced into pipeline stages.

A stage builds layers [layer_start, layer_end) of the full model. The first stage owns the
embeddings, the last the final LayerNorm, the (tied) output layer and the loss. With pp > 1 the
last stage keeps its own copy of the word embeddings (`word_embeddings_for_head`), initialised
from the same seed as the first stage's, kept identical by all-reducing their gradients.

State-dict keys follow Megatron's legacy layout (docs/design.md), with layer indices local to the stage:
  language_model.embedding.{word_embeddings,position_embeddings}.weight
  language_model.encoder.layers.{i}.{input_layernorm,self_attention.query_key_value,...}.{weight,bias}
  language_model.encoder.final_layernorm.{weight,bias}
  word_embeddings_for_head.weight
"""
from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn

from ..config.settings import ModelConfig
from ..topology import layer_counts, pipeline_layer_counts
from ..tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from ..tensor_parallel.fused_cross_entropy import linear_cross_entropy_mean
from ..tensor_parallel.layers import Init, VocabParallelEmbedding, full_normal, parallel_lm_logits
from ..tensor_parallel.mappings import scatter_to_sp, to_tp_region
from ..tensor_parallel.random import checkpoint
from .kv_cache import KVCache
from .transformer import TransformerLayer, make_layernorm, sp_dropout

WORD_EMB = "language_model.embedding.word_embeddings.weight"


@dataclass(frozen=True)
class Stage:
    """Which part of the model this rank builds."""
    layer_start: int
    layer_end: int
    is_first: bool
    is_last: bool

    @staticmethod
    def of(num_layers: int, pp: int, pp_rank: int, first: Optional[int] = None, last: Optional[int] = None) -> "Stage":
        """Stage pp_rank of a pp-stage pipeline (first/last: --decoder-first/last-pipeline-num-layers)."""
        return Stage._of_counts(pipeline_layer_counts(num_layers, pp, first, last), pp_rank)

    @staticmethod
    def for_config(cfg: ModelConfig, pp: int, pp_rank: int) -> "Stage":
        return Stage._of_counts(layer_counts(cfg, pp), pp_rank)

    @staticmethod
    def virtual(num_layers: int, pp: int, pp_rank: int, v: int, chunk: int) -> "Stage":
        """Model chunk `chunk` of pipeline rank `pp_rank` with v chunks per rank (interleaved 1F1B):
        layer block chunk * pp + pp_rank of num_layers / (pp * v) layers. Only chunk 0 of rank 0 is
        the first stage and only chunk v - 1 of the last rank is the last."""
        n = num_layers // (pp * v)
        start = (chunk * pp + pp_rank) * n
        return Stage(start, start + n, pp_rank == 0 and chunk == 0, pp_rank == pp - 1 and chunk == v - 1)

    @staticmethod
    def _of_counts(counts: list[int], pp_rank: int) -> "Stage":
        start = sum(counts[:pp_rank])
        return Stage(start, start + counts[pp_rank], pp_rank == 0, pp_rank == len(counts) - 1)


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig, seed: int, tp_group, device, dtype):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(
            cfg.padded_vocab_size, cfg.hidden_size, Init(seed, WORD_EMB, cfg.init_method_std), tp_group,
            device=device, dtype=dtype)
        pos = full_normal((cfg.max_position_embeddings, cfg.hidden_size),
                          Init(seed, "language_model.embedding.position_embeddings.weight", cfg.init_method_std))
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size,
                                                device=device, dtype=dtype)
        with torch.no_grad():
            self.position_embeddings.weight.copy_(pos)
        self.dropout, self.sequence_parallel, self.tp_group = cfg.hidden_dropout, cfg.sequence_parallel, tp_group

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(ids) + self.position_embeddings(position_ids)          # [b, s, h]
        x = x.transpose(0, 1).contiguous()                                              # [s, b, h]
        if self.sequence_parallel:
            x = scatter_to_sp(x, self.tp_group)                                         # [s/tp, b, h]
        return sp_dropout(x, self.dropout, self.training, self.sequence_parallel)


# Layers built at once: a layer's weights are drawn on the CPU, each from its own generator (serial
# work that releases the GIL), so threads draw several layers in parallel with the same values.
BUILD_THREADS = min(8, os.cpu_count() or 1)


def built_in_order(build: Callable[[int], nn.Module], indices: range) -> Iterator[nn.Module]:
    """build(i) for each of `indices`, yielded in order, with at most BUILD_THREADS built ahead of
    the one yielded (bounded memory before ZeRO-3 shards each)."""
    with ThreadPoolExecutor(BUILD_THREADS, thread_name_prefix="megapar-build") as pool:
        ahead: deque = deque()
        for i in indices:
            ahead.append(pool.submit(build, i))
            if len(ahead) == BUILD_THREADS:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()


class Encoder(nn.Module):
    def __init__(self, cfg: ModelConfig, stage: Stage, seed: int, tp_group, device, dtype,
                 on_layer_built: Optional[Callable[[nn.Module], None]] = None):
        super().__init__()
        if device is not None and torch.device(device).type == "cuda" and torch.device(device).index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # a new thread's current GPU is 0
        self.layers = nn.ModuleList()
        for layer in built_in_order(lambda g: TransformerLayer(cfg, g, seed, tp_group, device, dtype),
                                    range(stage.layer_start, stage.layer_end)):
            self.layers.append(layer)
            if on_layer_built is not None:   # ZeRO-3 shards each layer as soon as it exists
                on_layer_built(layer)
        if stage.is_last:
            self.final_layernorm = make_layernorm(cfg, device, dtype)
        self.full_recompute = cfg.recompute_granularity == "full"
        self.recompute_method, self.recompute_num_layers = cfg.recompute_method, cfg.recompute_num_layers
        self.recompute_rng = cfg.hidden_dropout > 0 or cfg.attention_dropout > 0  # replay dropout's masks

    def _run_layers(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        for layer in self.layers[start:end]:
            x = layer(x)
        return x

    def forward(self, x: torch.Tensor, kv_cache: Optional[KVCache] = None) -> torch.Tensor:
        n = len(self.layers)
        if kv_cache is not None or not (self.full_recompute and self.training):
            for i, layer in enumerate(self.layers):
                x = layer(x, None if kv_cache is None else kv_cache.layers[i])
        elif self.recompute_method == "uniform":   # checkpoint chunks of recompute_num_layers layers
            for start in range(0, n, self.recompute_num_layers):
                x = checkpoint(self._run_layers, x, start, min(start + self.recompute_num_layers, n),
                               rng=self.recompute_rng)
        else:                                     # block: checkpoint only the first recompute_num_layers
            for i in range(n):
                x = checkpoint(self._run_layers, x, i, i + 1, rng=self.recompute_rng) if i < self.recompute_num_layers \
                    else self.layers[i](x)
        return self.final_layernorm(x) if hasattr(self, "final_layernorm") else x


class LanguageModel(nn.Module):
    def __init__(self, cfg: ModelConfig, stage: Stage, seed: int, tp_group, device, dtype,
                 on_layer_built: Optional[Callable[[nn.Module], None]] = None):
        super().__init__()
        if stage.is_first:
            self.embedding = Embedding(cfg, seed, tp_group, device, dtype)
        self.encoder = Encoder(cfg, stage, seed, tp_group, device, dtype, on_layer_built)


class HeadEmbedding(nn.Module):
    """The last stage's copy of the word embeddings (pp > 1)."""

    def __init__(self, cfg: ModelConfig, seed: int, tp_group, device, dtype):
        super().__init__()
        emb = VocabParallelEmbedding(cfg.padded_vocab_size, cfg.hidden_size,
                                     Init(seed, WORD_EMB, cfg.init_method_std), tp_group, device=device, dtype=dtype)
        self.weight = emb.weight


class GPT2Model(nn.Module):
    """One pipeline stage of GPT-2 on one tensor-parallel rank.

    forward(input_ids [b, s], position_ids [b, s], labels [b, s] | None):
      first stage reads input_ids; later stages read the tensor given to `set_input_tensor`
      ([s, b, h], or [s/tp, b, h] under sequence parallelism).
      last stage returns per-token loss [b, s] (fp32) with labels (with cfg.cross_entropy_loss_fusion: the
      mean loss over the microbatch's tokens, a scalar, from the fused chunked head), else vocab-parallel logits
      [b, s, V_padded/tp]; other stages return hidden states [s, b, h].
    """

    def __init__(self, cfg: ModelConfig, stage: Stage, seed: int, tp_group=None, device=None,
                 dtype: torch.dtype = torch.float32, on_layer_built: Optional[Callable[[nn.Module], None]] = None):
        """on_layer_built(layer): called as each transformer layer is built (ZeRO-3 shards it)."""
        super().__init__()
        if cfg.padded_vocab_size is None or cfg.vocab_size is None:
            raise ValueError("ModelConfig.vocab_size and padded_vocab_size must be set (see build_model)")
        self.cfg, self.stage, self.tp_group = cfg, stage, tp_group
        self.language_model = LanguageModel(cfg, stage, seed, tp_group, device, dtype, on_layer_built)
        if stage.is_last and not stage.is_first:
            self.word_embeddings_for_head = HeadEmbedding(cfg, seed, tp_group, device, dtype)
        self.input_tensor: Optional[torch.Tensor] = None

    def set_input_tensor(self, t: Optional[torch.Tensor]) -> None:
        """Activation received from the previous pipeline stage ([s, b, h])."""
        self.input_tensor = t

    def output_embedding_weight(self) -> torch.Tensor:
        if self.stage.is_first:
            return self.language_model.embedding.word_embeddings.weight
        return self.word_embeddings_for_head.weight

    def forward(self, input_ids: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, kv_cache: Optional[KVCache] = None) -> torch.Tensor:
        if self.stage.is_first:
            if position_ids is None:
                offset = 0 if kv_cache is None else kv_cache.length
                position_ids = torch.arange(offset, offset + input_ids.shape[1], device=input_ids.device)
                position_ids = position_ids.unsqueeze(0).expand_as(input_ids)
            x = self.language_model.embedding(input_ids, position_ids)                    # [s, b, h]
        else:
            x = self.input_tensor
        x = self.language_model.encoder(x, kv_cache)
        if not self.stage.is_last:
            return x
        if labels is not None and self.cfg.cross_entropy_loss_fusion:
            x = to_tp_region(x, self.tp_group, self.cfg.sequence_parallel)                 # [s, b, h]
            return linear_cross_entropy_mean(x, self.output_embedding_weight(), labels.transpose(0, 1),
                                             self.cfg.vocab_size, self.tp_group)           # []
        logits = parallel_lm_logits(x, self.output_embedding_weight(), self.tp_group,
                                    sequence_parallel=self.cfg.sequence_parallel)          # [s, b, V/tp]
        if labels is None:
            return logits.transpose(0, 1).contiguous()                                     # [b, s, V/tp]
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), self.cfg.vocab_size, self.tp_group)
        return loss.transpose(0, 1).contiguous()                                           # [b, s]
