"""Names and split/merge rules between the canonical (unsharded) form and a (tp, pp) shard.

Canonical names are the flat GPT2Model state-dict keys of the tp=1, pp=1 model: global layer
indices and no `word_embeddings_for_head` (with pp > 1 the last stage's head copy is identical
to the first stage's word embeddings; the canonical form keeps one copy and writers re-create
the head copy when the target pp > 1). Vocab-parallel tensors hold only the true `vocab_size`
rows in canonical form; sharding re-pads them with zero rows to the target's padded size.
"""
from __future__ import annotations

import re
from typing import Optional

import torch

from ..config.settings import ModelConfig
from ..model.gpt2 import WORD_EMB as WORD
from ..model.sharding import is_vocab_parallel, tp_partition_dim
from ..topology import layer_counts
from .common import CHUNK_KEY

HEAD = "word_embeddings_for_head.weight"
_LAYER = re.compile(r"^language_model\.encoder\.layers\.(\d+)\.(.+)$")


def to_global(local_key: str, layer_start: int) -> str:
    """Stage-local key of a stage whose first layer is `layer_start` -> canonical key (the head
    copy maps to the word embeddings)."""
    if local_key == HEAD:
        return WORD
    m = _LAYER.match(local_key)
    if m is None:
        return local_key
    return f"language_model.encoder.layers.{int(m.group(1)) + layer_start}.{m.group(2)}"


# A pipeline layout: per pipeline rank, its model chunks as (key prefix, first layer, end layer).
# One chunk with prefix "" per rank, or under interleaved 1F1B v chunks "model{j}." (Megatron's
# model0, model1, ... checkpoint entries) holding layer block j * pp + rank.
Chunks = list[tuple[str, int, int]]


def chunk_layout(model: ModelConfig, pp: int) -> list[Chunks]:
    """The pipeline layout of a ModelConfig split over pp ranks (uneven stages or model chunks)."""
    v = model.virtual_pipeline_model_parallel_size
    if v is None or v <= 1:
        counts = layer_counts(model, pp)
        return [[("", sum(counts[:r]), sum(counts[:r + 1]))] for r in range(pp)]
    n = model.num_layers // (pp * v)
    return [[(f"model{j}.", (j * pp + r) * n, (j * pp + r + 1) * n) for j in range(v)] for r in range(pp)]


def canonical_key(local_key: str, chunks: Chunks) -> str:
    """A key of a rank's checkpoint shard (prefixed by its chunk under interleaving) -> canonical key."""
    m = CHUNK_KEY.match(local_key)
    j, key = (int(m.group(1)), m.group(2)) if m and chunks[0][0] else (0, local_key)
    return to_global(key, chunks[j][1])


def stage_of(name: str, layout: list[Chunks]) -> tuple[int, str]:
    """Canonical key -> (pp_rank holding it, its key in that rank's shard, chunk prefix included).
    Non-layer keys: embeddings on the first chunk of rank 0, the final LayerNorm on the last
    chunk of the last rank."""
    m = _LAYER.match(name)
    if m is not None:
        g = int(m.group(1))
        for rank, chunks in enumerate(layout):
            for prefix, start, end in chunks:
                if start <= g < end:
                    return rank, f"{prefix}language_model.encoder.layers.{g - start}.{m.group(2)}"
        raise ValueError(f"{name}: layer index beyond the {max(c[2] for r in layout for c in r)} layers of the layout")
    if name.startswith("language_model.encoder."):
        return len(layout) - 1, layout[-1][-1][0] + name
    return 0, layout[0][0][0] + name


def stage_keys(names: list[str], layout: list[Chunks], pp_rank: int) -> list[tuple[str, str]]:
    """[(shard key, canonical key)] of pipeline rank `pp_rank`, chunk by chunk in model order."""
    out = [(local, n) for n in names for s, local in [stage_of(n, layout)] if s == pp_rank]
    if len(layout) > 1 and pp_rank == len(layout) - 1:
        out.append((layout[-1][-1][0] + HEAD, WORD))
    order = {prefix: j for j, (prefix, _, _) in enumerate(layout[pp_rank])}
    return sorted(out, key=lambda kn: order[_prefix(kn[0])])   # stable: model order within a chunk


def _prefix(key: str) -> str:
    m = CHUNK_KEY.match(key)
    return f"model{m.group(1)}." if m else ""


def split(full: torch.Tensor, name: str, tp: int, tp_rank: int, padded_vocab: Optional[int]) -> torch.Tensor:
    """The full tensor -> TP rank `tp_rank`'s shard (a fresh contiguous tensor). Vocab-parallel
    tensors are first zero-padded to `padded_vocab` rows. QKV rows are per head [np, 3, hn], so a
    contiguous row split keeps whole heads on each rank."""
    dim = tp_partition_dim(name)
    if is_vocab_parallel(name) and padded_vocab is not None:
        if full.shape[0] > padded_vocab or padded_vocab % tp:
            raise ValueError(f"{name}: {full.shape[0]} rows do not fit the padded vocabulary {padded_vocab} "
                             f"split {tp} ways")
        per = padded_vocab // tp
        out = full.new_zeros((per,) + tuple(full.shape[1:]))
        lo, hi = tp_rank * per, min((tp_rank + 1) * per, full.shape[0])
        if hi > lo:
            out[: hi - lo].copy_(full[lo:hi])
        return out
    if dim is None or tp == 1:
        return full.clone().contiguous()
    if full.shape[dim] % tp:
        raise ValueError(f"{name}: dimension {dim} of size {full.shape[dim]} is not divisible by "
                         f"tensor-parallel size {tp}")
    return full.chunk(tp, dim=dim)[tp_rank].clone().contiguous()


def expected_full_shape(name: str, model: ModelConfig) -> Optional[tuple[int, ...]]:
    """The full (merged, padded) shape implied by the checkpoint's model config, or None if unknown."""
    h, f = model.hidden_size, model.ffn_hidden_size
    table = {"query_key_value.weight": (3 * h, h), "query_key_value.bias": (3 * h,),
             "self_attention.dense.weight": (h, h), "dense_h_to_4h.weight": (f, h), "dense_h_to_4h.bias": (f,),
             "dense_4h_to_h.weight": (h, f), "layernorm.weight": (h,), "layernorm.bias": (h,),
             "position_embeddings.weight": (model.max_position_embeddings, h)}
    if is_vocab_parallel(name):
        return (model.padded_vocab_size, h)
    for suffix, shape in table.items():
        if name.endswith(suffix):
            return shape
    return None
