"""Enumerate every layout of a model on a cluster, check each the way training would, predict its memory
(megapar/planner/memory_estimate.py, unchanged) and its step time (cost.py), and rank them.

A layout is (tp, pp, v or the zero-bubble schedule, dp, ZeRO stage, optimizer offload, parameter offload,
micro-batch, recompute, sequence parallel). A candidate is rejected, with the reason kept, when
  * the shape cannot be split that way (heads or ffn not divisible by tp, layers by pp, the global batch by
    dp x micro-batch) -- checked here first, since these need no configuration;
  * it is redundant (selective recompute with flash attention recomputes nothing: it is recompute none);
  * `build_config(..., assume_gpus=True)` refuses it: "refused by validation: <its message>";
  * it does not fit: the estimator's peak GPU memory is above the usable share of a GPU, or the offloaded
    state of a node above its host memory.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from ..config.build import build_config
from ..config.settings import ConfigError, default_of, flag_words
from ..data.tokenizer import GPT2_VOCAB_SIZE
from .memory_estimate import COMBINATIONS, GiB, estimate, host_bytes_per_node
from ..model import set_vocab
from ..topology import padded_vocab_size
from . import cost
from .calibration import Calibration

RECOMPUTE = ("none", "selective", "full")
REDUNDANT = "selective recompute = none with flash attention (no score matrix to recompute)"
RECOMPUTE_FLAGS = {"none": {}, "selective": {"recompute_granularity": "selective"},
                   "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}}


@dataclass
class Request:
    """What the user asked for: the model, the batch, the cluster, and the training flags to keep."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    global_batch_size: int
    gpus: int
    gpus_per_node: int
    gpu_memory: float                     # bytes
    host_memory: Optional[float]          # bytes per node; None: not checked
    ffn_hidden_size: Optional[int] = None
    vocab_size: int = GPT2_VOCAB_SIZE
    max_micro_batch: int = 16
    memory_fraction: float = 0.9          # usable share of a GPU (CUDA context, NCCL, fragmentation)
    extra: dict[str, Any] = field(default_factory=dict)   # other training flags ({dest: value})

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def cluster(self) -> cost.Cluster:
        return cost.Cluster(self.gpus, self.gpus_per_node)


@dataclass
class Candidate:
    layout: cost.Layout
    reason: Optional[str] = None          # None: accepted
    gpu_bytes: Optional[float] = None     # the estimator's peak over stages (one rank)
    host_bytes: Optional[float] = None    # the estimator's host memory of the fullest node
    step: Optional[cost.StepTime] = None

    @property
    def seconds(self) -> float:
        return self.step.total if self.step else float("inf")


@dataclass
class Plan:
    request: Request
    calibration: Calibration
    accepted: list[Candidate]             # fitting, fastest first
    rejected: list[Candidate]

    @property
    def best(self) -> Optional[Candidate]:
        return self.accepted[0] if self.accepted else None

    def reasons(self) -> list[tuple[str, int]]:
        """Rejection reasons grouped (the same text up to its numbers), most frequent first; each group is
        named by one of its reasons: the layout nearest to fitting, or the first enumerated."""
        groups: dict[str, list[Candidate]] = {}
        for c in self.rejected:
            groups.setdefault(re.sub(r"\d+(\.\d+)?", "N", c.reason), []).append(c)
        named = [(min(g, key=lambda c: c.gpu_bytes or 0.0).reason, len(g)) for g in groups.values()]
        return sorted(named, key=lambda rc: -rc[1])


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layouts(req: Request) -> Iterator[cost.Layout]:
    """Every (tp, pp, v, dp, ZeRO, offload, micro, recompute, SP) the cluster size allows; tp and pp
    divide the GPU count, v the layers of a stage, micro the per-rank batch (up to max_micro_batch). With
    --optimizer-nvme-offload among the kept flags, only layouts that offload the optimizer (to that folder)."""
    nvme = req.extra.get("optimizer_nvme_offload") is not None
    for tp in divisors(req.gpus):
        for pp in divisors(req.gpus // tp):
            dp = req.gpus // (tp * pp)
            per_stage = req.num_layers // pp if req.num_layers % pp == 0 else 1
            chunks = [1] + ([v for v in divisors(per_stage) if v > 1] if pp > 1 else [])
            per_rank = req.global_batch_size // dp if req.global_batch_size % dp == 0 else 1
            micros = [b for b in divisors(per_rank) if b <= req.max_micro_batch]
            for v in chunks:
                for zero, opt_off, param_off in COMBINATIONS:
                    if nvme and not opt_off:
                        continue                   # NVMe offload is an optimizer offload
                    for micro in micros:
                        for recompute in RECOMPUTE:
                            for sp in ((False, True) if tp > 1 else (False,)):
                                for zb in ((False, True) if pp > 1 and v == 1 and zero <= 1 else (False,)):
                                    yield cost.Layout(tp, pp, v, dp, zero, opt_off, param_off, micro, recompute,
                                                      sp, nvme, zb)


def shape_reason(req: Request, lay: cost.Layout) -> Optional[str]:
    """Why this shape cannot be split this way (no configuration needed), or None."""
    if req.num_attention_heads % lay.tp:
        return f"heads not divisible by tp: --num-attention-heads {req.num_attention_heads}, tp {lay.tp}"
    if req.ffn % lay.tp:
        return f"ffn hidden size not divisible by tp: {req.ffn}, tp {lay.tp}"
    if req.num_layers % lay.pp:
        return f"layers not divisible by pp: --num-layers {req.num_layers}, pp {lay.pp}"
    if req.global_batch_size % lay.dp:
        return f"global batch not divisible by dp: --global-batch-size {req.global_batch_size}, dp {lay.dp}"
    if lay.recompute == "selective" and req.extra.get("attention_backend", "auto") in ("auto", "flash", "cudnn"):
        return REDUNDANT
    return None


def flags(req: Request, lay: cost.Layout) -> dict[str, Any]:
    """The training flags ({dest: value}) of a layout, as build_config takes them."""
    out = {**req.extra, "num_layers": req.num_layers, "hidden_size": req.hidden_size,
           "num_attention_heads": req.num_attention_heads, "seq_length": req.seq_length,
           "global_batch_size": req.global_batch_size, "micro_batch_size": lay.micro,
           "tensor_model_parallel_size": lay.tp, "pipeline_model_parallel_size": lay.pp,
           "zero_stage": lay.zero, **RECOMPUTE_FLAGS[lay.recompute]}
    if not out.get("fp16"):
        out.setdefault("bf16", True)
    if req.ffn_hidden_size is not None:
        out["ffn_hidden_size"] = req.ffn_hidden_size
    out.setdefault("max_position_embeddings", req.seq_length)
    if lay.v > 1:
        out["virtual_pipeline_model_parallel_size"] = lay.v
    for name, on in (("optimizer_cpu_offload", lay.optimizer_offload and not lay.nvme),
                     ("param_cpu_offload", lay.param_offload),
                     ("sequence_parallel", lay.sp), ("enable_zero_bubble", lay.zb)):
        if on:
            out[name] = True
    return out


def memory(req: Request, lay: cost.Layout):
    """(Config, GPU bytes, host bytes) of a layout from the memory estimator, exactly as
    tools/estimate_memory.py computes them; ConfigError when validation refuses the layout."""
    cfg = build_config(flags(req, lay), req.gpus, assume_gpus=True)
    set_vocab(cfg.model, req.vocab_size, lay.tp, log=lambda _: None)
    rows = estimate(cfg)
    gpu = max(r.total for r in rows)
    host = host_bytes_per_node(cfg, rows, req.gpus_per_node) if any(r.cpu_bytes for r in rows) else 0.0
    return cfg, gpu, host


def model_of(req: Request, tp: int) -> cost.Model:
    divisor = req.extra.get("make_vocab_size_divisible_by", default_of("make_vocab_size_divisible_by"))
    vocab = padded_vocab_size(req.vocab_size, divisor, tp)
    return cost.Model(req.num_layers, req.hidden_size, req.num_attention_heads, req.ffn, req.seq_length, vocab,
                      req.global_batch_size)


def evaluate(req: Request, cal: Calibration, lay: cost.Layout) -> Candidate:
    """One candidate: its rejection reason, or its memory and predicted step."""
    reason = shape_reason(req, lay)
    if reason:
        return Candidate(lay, reason)
    try:
        _, gpu, host = memory(req, lay)
    except ConfigError as e:
        return Candidate(lay, f"refused by validation: {e}")
    cand = Candidate(lay, None, gpu, host)
    limit = req.memory_fraction * req.gpu_memory
    if gpu > limit:
        cand.reason = (f"does not fit: needs {gpu / GiB:.1f} GiB, usable {limit / GiB:.1f} GiB of the GPU "
                       f"({100 * req.memory_fraction:.0f}%)")
    elif req.host_memory is not None and host > req.host_memory:
        cand.reason = (f"does not fit: needs {host / GiB:.1f} GiB of host memory per node, "
                       f"has {req.host_memory / GiB:.1f}")
    else:
        cand.step = cost.step_time(cal, model_of(req, lay.tp), lay, req.cluster)
    return cand


def plan(req: Request, cal: Calibration) -> Plan:
    """Every layout evaluated; accepted ones ranked by predicted step time (then GPU memory)."""
    accepted, rejected = [], []
    for lay in layouts(req):
        cand = evaluate(req, cal, lay)
        (rejected if cand.reason else accepted).append(cand)
    accepted.sort(key=lambda c: (c.seconds, c.gpu_bytes))
    return Plan(req, cal, accepted, rejected)


# ---- output ---------------------------------------------------------------------------------------
def row(plan_: Plan, c: Candidate) -> str:
    """One markdown table row of an accepted candidate."""
    lay, req = c.layout, plan_.request
    model = model_of(req, lay.tp)
    mfu = cost.mfu(model, c.seconds, req.gpus, plan_.calibration.peak_tflops)
    tokens = cost.tokens_per_second(model, c.seconds)
    return (f"| {lay.tp} | {lay.pp} | {lay.schedule} | {lay.dp} | {lay.zero} | {lay.offload} | {lay.micro} "
            f"| {lay.recompute} | {'yes' if lay.sp else 'no'} | {1e3 * c.seconds:,.1f} | {tokens:,.0f} "
            f"| {100 * mfu:.1f}% | {c.gpu_bytes / GiB:.1f} | {c.host_bytes / GiB:.1f} |")


HEADER = ("| tp | pp | v | dp | ZeRO | offload | micro | recompute | SP | ms/step | tokens/s | MFU | GPU GiB "
          "| host GiB/node |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def table(plan_: Plan, top: int = 10) -> str:
    return "\n".join([HEADER, *(row(plan_, c) for c in plan_.accepted[:top])])


def command(req: Request, lay: cost.Layout) -> str:
    """The `bash scripts/pretrain_gpt2.sh ...` line of a layout (on node 0 when it spans nodes)."""
    from ..config.command import Processes, training_command
    procs = Processes(req.cluster.ranks_per_node, -(-req.gpus // req.gpus_per_node))
    order = ["tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
             "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
             "max_position_embeddings", "micro_batch_size", "global_batch_size", "bf16", "zero_stage",
             "optimizer_cpu_offload", "param_cpu_offload", "recompute_granularity", "recompute_method",
             "recompute_num_layers", "sequence_parallel", "enable_zero_bubble"]
    given = flags(req, lay)
    words = [w for name in order + sorted(set(given) - set(order)) if name in given
             for w in flag_words(name, given[name])]
    return training_command(words, procs, "NODE0: the address of node 0" if procs.nodes > 1 else "")
