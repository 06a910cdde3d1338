"""How many parameters a layer, a pipeline stage and the largest tensor of a stage hold on one
tensor-parallel rank, counted from the config as the model splits them (model/sharding.py): the one
count the memory estimator, the planner's cost model, NVMe offload and the disk checks share."""
from __future__ import annotations

from ..config.settings import Config
from ..topology import layer_counts
from .sharding import tp_partition_dim


def layer_params(cfg: Config) -> int:
    """Parameters of one transformer layer on one tensor-parallel rank."""
    return layer_params_of(cfg.model.hidden_size, cfg.model.ffn_hidden_size, cfg.parallel.tensor_model_parallel_size)


def layer_params_of(h: int, f: int, tp: int) -> int:
    """Parameters of one transformer layer of hidden size `h` and MLP width `f` on one of `tp`
    tensor-parallel ranks: each tensor split as the model splits it (model/sharding.py); the one
    count the estimator and the planner's cost model share."""
    split = lambda n, key: n // tp if tp_partition_dim(key) is not None else n  # noqa: E731
    return (4 * h                                                        # two LayerNorms
            + split(3 * h * h + 3 * h, "self_attention.query_key_value.weight")
            + split(h * h, "self_attention.dense.weight") + h
            + split(h * f + f, "mlp.dense_h_to_4h.weight")
            + split(f * h, "mlp.dense_4h_to_h.weight") + h)


def stage_params(cfg: Config, stage: int) -> int:
    """Parameters held by one tensor-parallel rank of pipeline stage `stage`."""
    m, tp, pp = cfg.model, cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    h = m.hidden_size
    n = layer_params(cfg) * layer_counts(m, pp)[stage]
    if stage == 0:
        n += m.padded_vocab_size * h // tp + m.max_position_embeddings * h
    if stage == pp - 1:
        n += 2 * h + (m.padded_vocab_size * h // tp if pp > 1 else 0)   # final LN (+ head copy)
    return n


def largest_param(cfg: Config, stage: int) -> int:
    """Elements of the largest parameter one tensor-parallel rank of pipeline stage `stage` holds."""
    m, tp, pp = cfg.model, cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    layer = max(3 * m.hidden_size * m.hidden_size, m.hidden_size * m.ffn_hidden_size) // tp
    embedding = m.padded_vocab_size * m.hidden_size // tp if stage in (0, pp - 1) else 0
    return max(layer, embedding)
