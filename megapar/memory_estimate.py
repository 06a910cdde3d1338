"""Peak GPU memory per pipeline stage, predicted from the training flags.

    static      = params (2 B bf16/fp16, 4 B fp32) + fp32 main grads (4 B)
                + optimizer: fp32 masters + Adam moments, 12 B per parameter (÷ dp with ZeRO-1;
                  fp32 training reuses the parameters as masters: 8 B)
    activations = per layer and microbatch, bytes saved for backward (flash attention: no score
                  matrix), with s·b·h = seq × micro-batch × hidden:
                    LayerNorm inputs/outputs (replicated over TP)           8 s·b·h · bytes/2
                    q, k, v + attention output (split over TP)              8 s·b·h / tp
                    MLP input of GELU + its output (4h each, split over TP) 16 s·b·h / tp
                  (+ dropout masks, 1 B per element, when dropout is on)
                  --sequence-parallel splits the LayerNorm inputs and dropout masks over TP; the
                  LayerNorm outputs are kept all-gathered (the weight gradients of the QKV and
                  h->4h GEMMs read them: gathered once, not again in backward)
                  full recompute keeps only each checkpointed layer's input (2 s·b·h) plus one
                  layer's activations during its recompute
    in flight   = microbatches whose activations a stage holds: 1F1B stage k keeps min(pp − k, m)
    head        = last stage: logits kept for the loss + their gradient (s·b·V/tp each)

Calibrated against `max allocated` of the benchmark runs in docs/performance.md (GPT-2 345M, bf16, flash,
dropout 0); see tests/test_memory_estimate.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from .arguments import Config
from .topology import layer_counts
from .pipeline.interleaved import num_warmup
from .model.sharding import tp_partition_dim

GiB = 2**30


@dataclass
class StageMemory:
    stage: int
    params: int
    static_bytes: float
    activation_bytes: float
    head_bytes: float

    @property
    def total(self) -> float:
        return self.static_bytes + self.activation_bytes + self.head_bytes


def stage_params(cfg: Config, stage: int) -> int:
    """Parameters held by one tensor-parallel rank of pipeline stage `stage`."""
    m, tp, pp = cfg.model, cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    h, f = m.hidden_size, m.ffn_hidden_size
    split = lambda n, key: n // tp if tp_partition_dim(key) is not None else n  # noqa: E731
    layer = (4 * h                                                       # two LayerNorms
             + split(3 * h * h + 3 * h, "self_attention.query_key_value.weight")
             + split(h * h, "self_attention.dense.weight") + h
             + split(h * f + f, "mlp.dense_h_to_4h.weight")
             + split(f * h, "mlp.dense_4h_to_h.weight") + h)
    n = layer * layer_counts(m, pp)[stage]
    if stage == 0:
        n += m.padded_vocab_size * h // tp + m.max_position_embeddings * h
    if stage == pp - 1:
        n += 2 * h + (m.padded_vocab_size * h // tp if pp > 1 else 0)   # final LN (+ head copy)
    return n


def layer_activation_bytes(cfg: Config) -> float:
    m, t = cfg.model, cfg.train
    tp = cfg.parallel.tensor_model_parallel_size
    sbh = m.seq_length * t.micro_batch_size * m.hidden_size
    elem = 4 if not (t.bf16 or t.fp16) else 2
    ffn_ratio = m.ffn_hidden_size / m.hidden_size
    sp = tp if m.sequence_parallel else 1
    saved = elem * sbh * (2 + 2 / sp + (4 + 2 * ffn_ratio) / tp)
    if m.hidden_dropout > 0:
        saved += 2 * sbh / sp                                              # two bool masks
    if m.attention_dropout > 0 and m.attention_backend not in ("flash", "cudnn"):
        saved += m.num_attention_heads // tp * m.seq_length ** 2 * t.micro_batch_size
    if m.attention_backend not in ("flash", "cudnn"):                      # probabilities kept
        saved += elem * m.num_attention_heads // tp * m.seq_length ** 2 * t.micro_batch_size
    return saved


def activations_one_microbatch(cfg: Config, layers: int, per_layer: float, layer_input: float) -> float:
    """Bytes one microbatch keeps in a stage of `layers` layers, with or without full recompute."""
    m = cfg.model
    if m.recompute_granularity != "full":
        return per_layer * layers
    n = min(m.recompute_num_layers, layers)
    if m.recompute_method == "block":   # first n layers keep only their input
        return layer_input * n + per_layer * (layers - n + 1)
    chunks = -(-layers // n)            # uniform: chunk inputs + one chunk during its recompute
    return layer_input * chunks + per_layer * n


def estimate(cfg: Config) -> list[StageMemory]:
    """Predicted peak bytes per pipeline stage (one TP rank; all TP ranks are alike)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    pp, dp = p.pipeline_model_parallel_size, p.data_parallel_size
    elem = 4 if not (t.bf16 or t.fp16) else 2
    opt_per_param = 12 if elem == 2 else 8
    per_layer = layer_activation_bytes(cfg)
    sbh = m.seq_length * t.micro_batch_size * m.hidden_size
    counts, out = layer_counts(m, pp), []
    for stage in range(pp):
        n = stage_params(cfg, stage)
        optim = opt_per_param * n / (dp if p.use_distributed_optimizer else 1)
        static = elem * n + 4 * n + optim
        layer_input = elem * sbh / (p.tensor_model_parallel_size if m.sequence_parallel else 1)
        v = m.virtual_pipeline_model_parallel_size or 1
        acts_one = activations_one_microbatch(cfg, counts[stage] // v, per_layer, layer_input)   # one chunk
        in_flight = v * min(pp - stage, cfg.num_microbatches) if pp > 1 else 1
        if v > 1:  # interleaved 1F1B: warmup + 1 chunk outputs alive (pipeline/interleaved.py)
            in_flight = min(num_warmup(pp, stage, v, cfg.num_microbatches) + 1, v * cfg.num_microbatches)
        head = 0.0
        if stage == pp - 1:
            head = 2 * elem * m.seq_length * t.micro_batch_size * m.padded_vocab_size / p.tensor_model_parallel_size
        out.append(StageMemory(stage, n, static, acts_one * in_flight, head))
    return out


def format_table(rows: list[StageMemory]) -> str:
    lines = ["| stage | params/rank | static GiB | activations GiB | logits GiB | predicted peak GiB |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.stage} | {r.params / 1e6:.1f}M | {r.static_bytes / GiB:.2f} | "
                     f"{r.activation_bytes / GiB:.2f} | {r.head_bytes / GiB:.2f} | {r.total / GiB:.2f} |")
    return "\n".join(lines)
