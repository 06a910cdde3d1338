"""Peak GPU memory per pipeline stage, and the host memory of CPU offload, predicted from the
training flags.

    static      = what stays on the GPU for the whole step, per parameter of a rank (n of them; L in
                  transformer layers, E = n - L outside them: embeddings, final LayerNorm, head)
                  ZeRO stage    params (2 B bf16/fp16)    fp32 grads         masters + moments (12 B)
                  0             2 n                       4 n                12 n
                  1             2 n                       4 n                12 n / dp
                  2             2 n                       4 L / dp + 4 E     12 n / dp
                  3             2 L / dp + 2 E            4 L / dp + 4 E     12 n / dp
                  (fp32 training: 4 B params that are also the masters, so 8 B of optimizer state).
                  E stays whole from stage 2: the engine keeps the non-layer parameters unsharded, and
                  the tied embedding's gradient builds up over the whole backward (used first and last).
    transient   = stage 2-3: fp32 gradient buffers of ~2 layers in flight (8 B x one layer's params);
                  stage 3 also the gathered layers, current + prefetched (2 x 2 B x one layer's params)
    CPU offload = --optimizer-cpu-offload moves masters + moments to pinned host memory (12 n / dp)
                  and adds a host fp32 gradient copy (4 n / dp); --param-cpu-offload (stage 3) moves
                  the parameter shards (2 L / dp). Host memory is summed over the ranks of a node.
    NVMe offload = --optimizer-nvme-offload puts masters + moments in files (12 n / dp of disk per
                  rank) and keeps in host memory the gradient copy (4 n / dp) and two chunks of
                  state (2 x 12 B x the chunk: nvme.CHUNK_NUMEL elements, or the largest parameter
                  when it is larger, at most n / dp). Disk is summed over the ranks of a node too.
                  --delayed-param-update with 16-bit weights adds their host copy (2 n / dp).
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
    held W      = --enable-zero-bubble (ZB-H1): stage k also holds back min(k, m) microbatches' weight
                  gradients, each keeping per layer the inputs and output gradients of its four GEMMs
                  (QKV, projection, fc1, fc2): (4 + 4 / tp + 2 f / (h tp)) s·b·h · bytes/2 (the LayerNorm
                  outputs and the row-parallel output gradients whole over TP)
    head        = last stage: logits kept for the loss + their gradient (s·b·V/tp each)

Calibrated against `max allocated` of the benchmark runs in docs/performance.md (GPT-2 345M, bf16, flash,
dropout 0); see tests/planner/test_memory_estimate.py.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Optional

from ..config.settings import Config
from ..pipeline.interleaved import num_warmup
from ..model.sizes import largest_param, layer_params, stage_params
from ..optimizer.nvme import BYTES_PER_PARAM, CHUNK_NUMEL
from ..topology import ConfigError, Topology, layer_counts

GiB = 2**30


@dataclass
class StageMemory:
    stage: int
    params: int
    static_bytes: float           # on the GPU for the whole step: weights, gradients, optimizer state
    activation_bytes: float
    head_bytes: float
    transient_bytes: float = 0.0  # stage 2-3: per-layer gradient buffers and gathered layers
    cpu_bytes: float = 0.0        # host memory of this rank's offloaded state
    disk_bytes: float = 0.0       # NVMe offload: this rank's optimizer state files

    @property
    def total(self) -> float:
        """Predicted peak GPU bytes of one rank of this stage."""
        return self.static_bytes + self.transient_bytes + self.activation_bytes + self.head_bytes


def zero_stage(cfg: Config) -> int:
    p = cfg.parallel
    return p.zero_stage if p.zero_stage is not None else int(p.use_distributed_optimizer)


def state_bytes(cfg: Config, n: int, layers: int, largest: int = 0) -> tuple[float, float, float, float]:
    """(GPU static, GPU transient, host, disk) bytes of the weights, gradients and optimizer state of
    a rank holding `n` parameters, `layers` transformer layers of them, the largest of `largest`
    elements (the table in the docstring)."""
    t, p = cfg.train, cfg.parallel
    dp, stage = p.data_parallel_size, zero_stage(cfg)
    elem = 2 if (t.bf16 or t.fp16) else 4
    one = layer_params(cfg)
    in_layers = one * layers
    whole = n - in_layers                                   # embeddings, final LayerNorm, head
    gpu = transient = host = 0.0
    if stage == 3:
        shards = elem * in_layers / dp
        host += shards if p.param_cpu_offload else 0.0
        gpu += elem * whole + (0.0 if p.param_cpu_offload else shards)
        transient += 2 * elem * one                         # the gathered layer and the prefetched one
    else:
        gpu += elem * n
    if stage >= 2:
        gpu += 4 * in_layers / dp + 4 * whole
        transient += 2 * 4 * one                            # fp32 gradients of ~2 layers in flight
    else:
        gpu += 4 * n
    optimizer = (12 if elem == 2 else 8) * n / (dp if stage >= 1 else 1)
    disk = 0.0
    if p.optimizer_nvme_offload is not None:
        disk = BYTES_PER_PARAM * n / dp                     # masters + moments in files
        host += 4 * n / dp + 2 * BYTES_PER_PARAM * min(n / dp, max(CHUNK_NUMEL, largest))  # grads, two chunks
    elif p.optimizer_cpu_offload:
        host += (12 + 4) * n / dp                           # masters + moments, and a gradient copy
    else:
        gpu += optimizer
    if p.delayed_param_update and elem == 2:
        host += 2 * n / dp                                  # the new weights, cast on the CPU
    return gpu, transient, host, disk


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


def held_weight_gradient_bytes(cfg: Config, layers: int) -> float:
    """--enable-zero-bubble: what one microbatch's deferred weight gradients keep alive on a stage of
    `layers` layers until its W runs (the GEMMs' inputs and output gradients)."""
    m, t = cfg.model, cfg.train
    tp = cfg.parallel.tensor_model_parallel_size
    sbh = m.seq_length * t.micro_batch_size * m.hidden_size
    elem = 4 if not (t.bf16 or t.fp16) else 2
    return layers * elem * sbh * (4 + 4 / tp + 2 * m.ffn_hidden_size / (m.hidden_size * tp))


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
    pp = p.pipeline_model_parallel_size
    elem = 4 if not (t.bf16 or t.fp16) else 2
    per_layer = layer_activation_bytes(cfg)
    sbh = m.seq_length * t.micro_batch_size * m.hidden_size
    counts, out = layer_counts(m, pp), []
    for stage in range(pp):
        n = stage_params(cfg, stage)
        static, transient, host, disk = state_bytes(cfg, n, counts[stage], largest_param(cfg, stage))
        layer_input = elem * sbh / (p.tensor_model_parallel_size if m.sequence_parallel else 1)
        v = m.virtual_pipeline_model_parallel_size or 1
        acts_one = activations_one_microbatch(cfg, counts[stage] // v, per_layer, layer_input)   # one chunk
        in_flight = v * min(pp - stage, cfg.num_microbatches) if pp > 1 else 1
        if v > 1:  # interleaved 1F1B: warmup + 1 chunk outputs alive (pipeline/interleaved.py)
            in_flight = min(num_warmup(pp, stage, v, cfg.num_microbatches) + 1, v * cfg.num_microbatches)
        if p.enable_zero_bubble:
            held = held_weight_gradient_bytes(cfg, counts[stage]) * min(stage, cfg.num_microbatches)
        else:
            held = 0.0
        head = 0.0
        if stage == pp - 1:
            head = 2 * elem * m.seq_length * t.micro_batch_size * m.padded_vocab_size / p.tensor_model_parallel_size
        out.append(StageMemory(stage, n, static, acts_one * in_flight + held, head, transient, host, disk))
    return out


def host_bytes_per_node(cfg: Config, rows: list[StageMemory], gpus_per_node: int, kind: str = "cpu_bytes") -> float:
    """Host memory of the fullest node: the offloaded state of the ranks it runs (ranks are placed
    on nodes in order, gpus_per_node each; a rank's pipeline stage follows from the topology).
    kind "disk_bytes": the NVMe offload files of the fullest node instead."""
    p = cfg.parallel
    topo = Topology(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size)
    world = topo.world_size
    per_node = [sum(getattr(rows[topo.coord(r).pp], kind) for r in range(first, min(first + gpus_per_node, world)))
                for first in range(0, world, gpus_per_node)]
    return max(per_node)


SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]i?B|B)\s*$", re.IGNORECASE)
UNITS = {"b": 1, **{f"{u}b": 1024 ** (i + 1) for i, u in enumerate("kmgt")},
         **{f"{u}ib": 1024 ** (i + 1) for i, u in enumerate("kmgt")}}
TIGHT = 0.9   # above this share of a GPU, the CUDA context and allocator fragmentation may not fit


def parse_size(text: str, flag: str) -> float:
    """'80GB', '141GiB', '1TB', '512MiB' -> bytes; ConfigError naming `flag`. GB and GiB both mean
    2^30 bytes, as GPU and memory vendors count them (an "80 GB" H100 has 79.6 GiB)."""
    match = SIZE.match(text)
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(f"{flag} {text!r} is not a memory size; write a positive number and a unit, e.g. 80GB, "
                          f"141GB or 1TB (KB MB GB TB, or KiB MiB GiB TiB: powers of 1024 either way)")
    return float(match.group(1)) * UNITS[match.group(2).lower()]


def verdict(needs: float, has: Optional[float], what: str) -> str:
    """'fits' or 'does not fit: needs X GiB, GPU has Y' (empty when the capacity was not given)."""
    if has is None:
        return ""
    if needs > has:
        return f"does not fit: needs {needs / GiB:.1f} GiB, {what} has {has / GiB:.1f}"
    tight = ", tight" if what == "GPU" and needs > TIGHT * has else ""
    return f"fits ({needs / GiB:.1f} of {has / GiB:.1f} GiB, {100 * needs / has:.0f}%{tight})"


# (ZeRO stage, optimizer offload, parameter offload): every combination megapar runs
COMBINATIONS = [(0, False, False), (1, False, False), (1, True, False), (2, False, False), (2, True, False),
                (3, False, False), (3, True, False), (3, False, True), (3, True, True)]


def with_zero(cfg: Config, stage: int, optimizer_offload: bool, param_offload: bool) -> Config:
    """A copy of `cfg` at another ZeRO stage and offload (same model, layout and batch)."""
    other = copy.deepcopy(cfg)
    p = other.parallel
    p.zero_stage, p.use_distributed_optimizer = stage, stage >= 1
    p.optimizer_cpu_offload, p.param_cpu_offload = optimizer_offload, param_offload
    p.optimizer_nvme_offload = None
    return other


def offload_name(cfg: Config) -> str:
    p = cfg.parallel
    optimizer = "optimizer (NVMe)" if p.optimizer_nvme_offload is not None else "optimizer"
    return " + ".join(n for n, on in ((optimizer, p.optimizer_cpu_offload or p.optimizer_nvme_offload is not None),
                                      ("params", p.param_cpu_offload)) if on) or "none"


def compare_zero(cfg: Config, gpus_per_node: int, gpu_memory: Optional[float], host_memory: Optional[float]
                 ) -> str:
    """The table of ZeRO stages 0-3 x CPU offload for the model and layout of `cfg`."""
    lines = ["| ZeRO stage | CPU offload | GPU GiB/rank | host GiB/node | GPU | host |", "|---|---|---|---|---|---|"]
    for combo in COMBINATIONS:
        c = with_zero(cfg, *combo)
        rows = estimate(c)
        gpu, host = max(r.total for r in rows), host_bytes_per_node(c, rows, gpus_per_node)
        lines.append(f"| {combo[0]} | {offload_name(c)} | {gpu / GiB:.1f} | {host / GiB:.1f} | "
                     f"{verdict(gpu, gpu_memory, 'GPU') or '-'} | {verdict(host, host_memory, 'host') or '-'} |")
    return "\n".join(lines)


def format_table(rows: list[StageMemory]) -> str:
    """One line per stage; a "disk GiB/rank" column with NVMe offload."""
    disk = any(r.disk_bytes for r in rows)
    lines = ["| stage | params/rank | static GiB | transient GiB | activations GiB | logits GiB | predicted peak GiB "
             "| host GiB/rank |" + (" disk GiB/rank |" if disk else ""), "|---|---|---|---|---|---|---|---|"
             + ("---|" if disk else "")]
    for r in rows:
        lines.append(f"| {r.stage} | {r.params / 1e6:.1f}M | {r.static_bytes / GiB:.2f} "
                     f"| {r.transient_bytes / GiB:.2f} | {r.activation_bytes / GiB:.2f} | {r.head_bytes / GiB:.2f} "
                     f"| {r.total / GiB:.2f} "
                     f"| {r.cpu_bytes / GiB:.2f} |" + (f" {r.disk_bytes / GiB:.2f} |" if disk else ""))
    return "\n".join(lines)
