"""How each GPT-2 parameter is split across tensor-parallel ranks (by state-dict key)."""
from __future__ import annotations

from typing import Optional

_COLUMN = ("self_attention.query_key_value.weight", "self_attention.query_key_value.bias",
           "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias")
_ROW = ("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")
_VOCAB = ("word_embeddings.weight", "word_embeddings_for_head.weight")


def tp_partition_dim(key: str) -> Optional[int]:
    """0 for column-parallel and vocab-parallel tensors (rows split), 1 for row-parallel
    weights (columns split), None for tensors replicated on every TP rank."""
    if key.endswith(_COLUMN) or key.endswith(_VOCAB):
        return 0
    if key.endswith(_ROW):
        return 1
    return None


def is_vocab_parallel(key: str) -> bool:
    return key.endswith(_VOCAB)
