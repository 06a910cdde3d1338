"""Predicted time of one training step for a model, a layout and a machine (the planner's cost model).

Notation: L layers, h hidden, f ffn hidden, V padded vocabulary, s sequence, b micro-batch, B global batch;
tp t, pp p, v model chunks per pipeline rank, dp d, m = B / (b d) microbatches per step; T = s·b tokens of
a microbatch. Every time is in seconds, for the slowest pipeline stage (the last: it also runs the head).

    layer forward    = GEMMs + attention + elementwise + TP forward collectives   (+ layer overhead)
      GEMMs          Σ 2 T n k / eff(GEMM size) over QKV [T,h]x[h,3h/t], proj [T,h/t]x[h/t,h],
                     fc1 [T,h]x[h,f/t], fc2 [T,f/t]x[f/t,h]; eff from the calibration's GEMM table
      attention      2 b s² h / t causal FLOPs / attn_fwd_tflops
      elementwise    (R / sp + S / t) · T h bytes / HBM bandwidth (R LayerNorm/residual/dropout bytes,
                     replicated over TP unless sequence parallel; S GELU and the rest, split)
      TP             2 all-reduces of T h · 2 B (or with sequence parallelism 2 all-gathers + 2
                     reduce-scatters of the same tensor), not hidden (the next op needs the sum)
    layer backward   = 2 x the forward GEMMs + attention backward (2x the FLOPs at attn_bwd_tflops)
                     + 2 x the elementwise bytes + the backward collectives, a tp_bwd_overlap share of them
                     hidden behind the weight-gradient GEMMs
    recompute        full: + one layer forward per backward; selective: + the attention forward (with flash
                     attention nothing is recomputed: selective = none)
    head             last stage: logits GEMM 2 T h V / t (x3 with backward) + loss bytes 8 B per logit
    stage time t_mb  = layers per stage x (forward + backward) + head + pipeline p2p (send + receive of
                     T h · 2 B each way, v times with interleaving) + ZeRO-2/3 per-layer overheads
                     + exposed ZeRO-2/3 per-microbatch traffic + the per-microbatch overhead
    pipeline         (m + (p - 1) / v) · t_mb   (1F1B: the bubble is (p - 1) / (v m) of the ideal m · t_mb)
                     ZB-H1 (--enable-zero-bubble, v = 1): m · t_mb + (p - 1)(t_mb - 2 t_W), t_W the stage's
                     weight-gradient GEMMs of one microbatch (one forward's GEMMs): the deferred W's fill
                     1F1B's cooldown; its data-parallel reduction runs after the schedule, none hidden
    data parallel    bytes on the wire per rank, n parameters of this rank, g = (d - 1) / d:
                       ZeRO 0     all-reduce of the fp32 gradients       2 g · 4 n, once per step
                       ZeRO 1     reduce-scatter fp32 4 g n + all-gather of the bf16 params 2 g n, once
                       ZeRO 2     the reduce-scatter every microbatch, the all-gather once
                       ZeRO 3     + all-gather of the bf16 layer params in forward and again in backward,
                                  every microbatch
                     at intra-node bus bandwidth when the dp group fits in a node (tp d <= GPUs per node),
                     else inter-node; the gradient reduction is hidden behind the backward by dp_overlap
                     (never more than the backward it runs beside; with v chunks only the last chunk's 1/v),
                     the parameter all-gather after the step is not hidden
    optimizer        on the GPU: (30 B x owned + 8 B x local parameters) / HBM bandwidth; CPU offload:
                     owned x 4 B to the host (gradients) over PCIe, then the larger of owned / (CPU
                     AdamW rate / ranks per node) and owned x 4 B back (fp32 masters): the step sends each
                     chunk back while it steps the next (--delayed-param-update, which changes the
                     maths, is never picked); NVMe offload: also the larger of that and the state's
                     24 B per owned parameter (read and written) over the node's disk, shared by its ranks
    parameter offload (ZeRO-3) every microbatch 2 x 2 B x the layer shards over PCIe, offload_overlap hidden
    step             pipeline + data parallel (exposed) + optimizer + step overhead
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..optimizer.nvme import BYTES_PER_PARAM
from ..model.sizes import layer_params_of
from .calibration import Calibration, Link


@dataclass(frozen=True)
class Model:
    num_layers: int
    hidden: int
    heads: int
    ffn: int
    seq: int
    vocab: int              # padded vocabulary (multiple of 128 x tp)
    global_batch: int


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    v: int                  # model chunks per pipeline rank (1 = plain 1F1B)
    dp: int
    zero: int
    optimizer_offload: bool
    param_offload: bool
    micro: int
    recompute: str          # none | selective | full
    sp: bool
    nvme: bool = False      # the offloaded optimizer state in files (--optimizer-nvme-offload)
    zb: bool = False        # the ZB-H1 zero-bubble schedule (--enable-zero-bubble)

    @property
    def schedule(self) -> str:
        """The table's v column: the model chunks per rank, or zb for the zero-bubble schedule."""
        return "zb" if self.zb else str(self.v)

    @property
    def offload(self) -> str:
        optimizer = "optimizer (NVMe)" if self.nvme else "optimizer"
        return " + ".join(n for n, on in ((optimizer, self.optimizer_offload), ("params", self.param_offload))
                          if on) or "none"


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int

    @property
    def ranks_per_node(self) -> int:
        return min(self.gpus, self.gpus_per_node)


@dataclass
class StepTime:
    """The parts of one predicted step (seconds)."""
    pipeline: float          # (m + (p-1)/v) x t_mb
    microbatch: float        # t_mb of the slowest stage
    bubble: float            # (p-1)/v x t_mb
    dp_exposed: float
    optimizer: float
    overhead: float

    @property
    def total(self) -> float:
        return self.pipeline + self.dp_exposed + self.optimizer + self.overhead


GB = 1e9
BF16 = 2


def microbatches(model: Model, lay: Layout) -> int:
    """m = B / (b d): microbatches each data-parallel rank runs per step."""
    return model.global_batch // (lay.micro * lay.dp)


def gemm_time(cal: Calibration, m: int, n: int, k: int) -> float:
    """One GEMM [m,k]x[k,n]: 2 m n k FLOPs at the calibrated efficiency for its size."""
    flops = 2.0 * m * n * k
    return flops / (cal.gemm_efficiency(flops / 1e9) * 1e12)


def layer_gemms_forward(cal: Calibration, model: Model, lay: Layout) -> float:
    """QKV, attention projection, fc1, fc2 of one layer on one TP rank, forward."""
    T, h, f, t = model.seq * lay.micro, model.hidden, model.ffn, lay.tp
    return (gemm_time(cal, T, 3 * h // t, h) + gemm_time(cal, T, h, h // t)
            + gemm_time(cal, T, f // t, h) + gemm_time(cal, T, h, f // t))


def attention_forward(cal: Calibration, model: Model, lay: Layout) -> float:
    """Causal flash attention: 2 b s² h / t FLOPs (half of the 4 b s² h of a full score matrix)."""
    return 2.0 * lay.micro * model.seq ** 2 * model.hidden / lay.tp / (cal.attn_fwd_tflops * 1e12)


def attention_backward(cal: Calibration, model: Model, lay: Layout) -> float:
    """Twice the forward FLOPs at the backward rate."""
    return 2 * 2.0 * lay.micro * model.seq ** 2 * model.hidden / lay.tp / (cal.attn_bwd_tflops * 1e12)


def elementwise_forward(cal: Calibration, model: Model, lay: Layout) -> float:
    """Memory-bound LayerNorm / residual / dropout / GELU passes of one layer, forward:
    (R / sp + S / t) · T h bytes / HBM bandwidth."""
    sbh = model.seq * lay.micro * model.hidden
    sp = lay.tp if lay.sp else 1
    ffn_scale = model.ffn / (4 * model.hidden)
    bytes_ = sbh * (cal.elementwise_replicated_bytes / sp + cal.elementwise_split_bytes * ffn_scale / lay.tp)
    return bytes_ / (cal.hbm_gbps * GB)


def collective(link: Link, op: str, size: float, group: int) -> float:
    """NCCL time of one collective of `size` bytes (the full tensor) over `group` ranks:
    latency + factor · (g - 1) / g · size / bus, factor 2 for all-reduce, 1 for all-gather / reduce-scatter."""
    if group <= 1 or size <= 0:
        return 0.0
    factor = 2.0 if op == "all_reduce" else 1.0
    return link.latency_us * 1e-6 + factor * (group - 1) / group * size / (link.bus_gbps * GB)


def tp_link(cal: Calibration, lay: Layout, cluster: Cluster) -> Link:
    """TP groups are tp consecutive ranks: inside a node when tp <= GPUs per node."""
    return cal.intra_node if lay.tp <= cluster.gpus_per_node else cal.inter_node


def dp_link(cal: Calibration, lay: Layout, cluster: Cluster) -> Link:
    """A dp group spans tp x dp consecutive ranks (rank = tp_rank + tp (dp_rank + dp pp_rank))."""
    return cal.intra_node if lay.tp * lay.dp <= cluster.gpus_per_node else cal.inter_node


def pp_link(cal: Calibration, lay: Layout, cluster: Cluster) -> Link:
    """Pipeline neighbours are tp x dp ranks apart: in one node only when the whole model fits in one."""
    return cal.intra_node if lay.tp * lay.dp * lay.pp <= cluster.gpus_per_node else cal.inter_node


def tp_forward_comm(cal: Calibration, model: Model, lay: Layout, cluster: Cluster) -> float:
    """2 all-reduces of the layer output T h · 2 B (sequence parallel: 2 all-gathers + 2 reduce-scatters)."""
    if lay.tp == 1:
        return 0.0
    size, link = model.seq * lay.micro * model.hidden * BF16, tp_link(cal, lay, cluster)
    if lay.sp:
        return 2 * (collective(link, "all_gather", size, lay.tp) + collective(link, "reduce_scatter", size, lay.tp))
    return 2 * collective(link, "all_reduce", size, lay.tp)


def layer_times(cal: Calibration, model: Model, lay: Layout, cluster: Cluster) -> tuple[float, float]:
    """(forward, backward) seconds of one transformer layer for one microbatch, recompute included
    in the backward."""
    gemm, attn = layer_gemms_forward(cal, model, lay), attention_forward(cal, model, lay)
    elem, comm = elementwise_forward(cal, model, lay), tp_forward_comm(cal, model, lay, cluster)
    overhead = cal.layer_overhead_ms * 1e-3
    forward = gemm + attn + elem + comm + overhead
    backward = (2 * gemm + attention_backward(cal, model, lay) + 2 * elem + comm * (1 - cal.tp_bwd_overlap)
                + overhead)
    if lay.recompute == "full":
        backward += forward
    return forward, backward


def head_time(cal: Calibration, model: Model, lay: Layout) -> float:
    """Last stage: the logits GEMM [T,h]x[h,V/t] forward + 2x backward, and the fused loss's passes."""
    T = model.seq * lay.micro
    gemm = 3 * gemm_time(cal, T, model.vocab // lay.tp, model.hidden)
    loss = T * model.vocab / lay.tp * cal.loss_bytes_per_logit / (cal.hbm_gbps * GB)
    return gemm + loss


def exposed(comm: float, window: float, overlap: float) -> float:
    """Communication left on the critical path when an `overlap` share of it can hide behind `window`
    seconds of compute: max(comm (1 - overlap), comm - window)."""
    return max(comm * (1 - overlap), comm - window, 0.0)


def layer_params(model: Model, tp: int) -> float:
    """Parameters of one layer on one TP rank (the memory estimator's count)."""
    return layer_params_of(model.hidden, model.ffn, tp)


def stage_params(model: Model, lay: Layout, last: bool) -> float:
    """Parameters of one rank of the first (with the embeddings) or last (head copy) stage."""
    n = layer_params(model, lay.tp) * model.num_layers / lay.pp
    embedding = model.vocab * model.hidden / lay.tp
    return n + embedding + (model.seq * model.hidden if not last or lay.pp == 1 else 0)


def zero_microbatch_comm(cal: Calibration, model: Model, lay: Layout, cluster: Cluster,
                         fwd: float, bwd: float) -> float:
    """ZeRO-2/3 traffic of one microbatch that is not hidden: the per-layer gradient reduce-scatters
    (behind the backward), ZeRO-3's layer all-gathers (forward and backward), and the parameter shards
    fetched from the host with --param-cpu-offload."""
    if lay.zero < 2:
        return 0.0
    link, layers = dp_link(cal, lay, cluster), model.num_layers // lay.pp
    params = layer_params(model, lay.tp)
    per_layer_rs = collective(link, "reduce_scatter", 4 * params, lay.dp)
    out = exposed(layers * per_layer_rs, layers * bwd, cal.dp_overlap)
    if lay.zero == 3:
        gather = collective(link, "all_gather", BF16 * params, lay.dp)
        out += exposed(layers * gather, layers * fwd, cal.dp_overlap)
        out += exposed(layers * gather, layers * bwd, cal.dp_overlap)
        if lay.param_offload:
            fetch = 2 * layers * BF16 * params / lay.dp / (cal.pcie_h2d_gbps * GB)
            out += exposed(fetch, layers * (fwd + bwd), cal.offload_overlap)
    return out


def p2p_time(cal: Calibration, model: Model, lay: Layout, cluster: Cluster) -> float:
    """Per microbatch on a middle stage: receive + send the activation forward and its gradient backward
    (T h · 2 B each, / tp with sequence parallelism), v times with interleaving."""
    if lay.pp == 1:
        return 0.0
    size = model.seq * lay.micro * model.hidden * BF16 / (lay.tp if lay.sp else 1)
    link = pp_link(cal, lay, cluster)
    return lay.v * 4 * (link.latency_us * 1e-6 + size / (link.p2p_gbps * GB))


def dp_step_comm(cal: Calibration, model: Model, lay: Layout, cluster: Cluster, last_backward: float) -> float:
    """Exposed data-parallel traffic once per step: ZeRO 0 all-reduce, ZeRO 1 reduce-scatter (hidden
    behind the last microbatch's backward by dp_overlap; with v model chunks only the last chunk's 1/v of
    the buckets completes there, the rest is reduced after the schedule), ZeRO 2-3 the edge bucket
    (embeddings, reduced after the schedule), and the bf16 parameter all-gather after the step (ZeRO 1-2,
    not hidden; ZeRO-3 gathers in the next forward instead)."""
    if lay.dp == 1:
        return 0.0
    link, n = dp_link(cal, lay, cluster), stage_params(model, lay, last=False)
    if lay.zero <= 1:
        reduce = collective(link, "all_reduce" if lay.zero == 0 else "reduce_scatter", 4 * n, lay.dp)
        late = reduce * (lay.v - 1) / lay.v
        out = late + exposed(reduce - late, last_backward, cal.dp_overlap)
    else:
        edge = n - layer_params(model, lay.tp) * model.num_layers / lay.pp
        out = collective(link, "reduce_scatter", 4 * edge, lay.dp)
    if lay.zero in (1, 2):
        out += collective(link, "all_gather", BF16 * n, lay.dp)
    return out


def optimizer_time(cal: Calibration, model: Model, lay: Layout, cluster: Cluster) -> float:
    """The optimizer step of one rank: on the GPU memory-bound over its owned shard; with
    --optimizer-cpu-offload over PCIe and on the node's CPU cores (shared by its ranks); with NVMe
    offload also through the node's disk."""
    n = stage_params(model, lay, last=False)
    owned = n / lay.dp if lay.zero >= 1 else n
    local = cal.optimizer_bytes_local * n / (cal.hbm_gbps * GB)
    if not lay.optimizer_offload:
        return local + cal.optimizer_bytes_owned * owned / (cal.hbm_gbps * GB)
    down, up = 4 * owned / (cal.pcie_d2h_gbps * GB), 4 * owned / (cal.pcie_h2d_gbps * GB)
    cpu = owned / (cal.cpu_adam_gparams_s * 1e9 / cluster.ranks_per_node)
    disk = 2 * BYTES_PER_PARAM * owned * cluster.ranks_per_node / (cal.disk_gbps * GB) if lay.nvme else 0.0
    return local + down + max(cpu, up, disk)   # a chunk goes up (and to disk) while the CPU steps the next


def step_time(cal: Calibration, model: Model, lay: Layout, cluster: Cluster) -> StepTime:
    """The predicted step of a layout (the formulas of the module docstring)."""
    fwd, bwd = layer_times(cal, model, lay, cluster)
    layers = model.num_layers // lay.pp
    stage_overhead = {2: cal.zero2_layer_overhead_ms, 3: cal.zero3_layer_overhead_ms}.get(lay.zero, 0.0) * 1e-3
    t_mb = (layers * (fwd + bwd + stage_overhead) + head_time(cal, model, lay) + p2p_time(cal, model, lay, cluster)
            + zero_microbatch_comm(cal, model, lay, cluster, fwd, bwd) + cal.microbatch_overhead_ms * 1e-3)
    m = microbatches(model, lay)
    bubble = (lay.pp - 1) / lay.v * t_mb
    last_backward = layers * bwd / lay.v      # the backward beside which the step's reduction runs
    if lay.zb:                                # W passes fill the cooldown; the reduction waits for the last
        bubble = (lay.pp - 1) * max(t_mb - 2 * layers * layer_gemms_forward(cal, model, lay), 0.0)
        last_backward = 0.0
    return StepTime(pipeline=m * t_mb + bubble, microbatch=t_mb, bubble=bubble,
                    dp_exposed=dp_step_comm(cal, model, lay, cluster, last_backward),
                    optimizer=optimizer_time(cal, model, lay, cluster), overhead=cal.step_overhead_ms * 1e-3)


def flops_per_token(model: Model) -> float:
    """Model FLOPs per token (megapar/run/throughput.py): 72 L h² + 12 L h s + 6 h V (ffn = 4h)."""
    from ..run.throughput import flops_per_token as fpt
    return fpt(model.num_layers, model.hidden, model.seq, model.vocab)


def mfu(model: Model, seconds: float, gpus: int, peak_tflops: float) -> float:
    """Model FLOPs utilisation of a step of `seconds` on `gpus` GPUs."""
    tokens_per_s = model.global_batch * model.seq / seconds
    return flops_per_token(model) * tokens_per_s / (gpus * peak_tflops * 1e12)


def tokens_per_second(model: Model, seconds: Optional[float]) -> float:
    return model.global_batch * model.seq / seconds if seconds else 0.0
