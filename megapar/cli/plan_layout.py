r"""Pick a parallel layout: every (tp, pp, v, dp, ZeRO stage, offload, micro-batch, recompute, sequence
parallel) for a model on N GPUs, ranked by predicted step time, with the memory estimator's GPU and host
memory for each and the reason each rejected one was rejected.

    python tools/plan_layout.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \
        --global-batch-size 512 --gpus 16 --gpus-per-node 8 --gpu-memory 80GB --host-memory 1TB \
        [--gpu h100|h200] [--calibration calib.json] [--top 10] [--show-rejected N] [training flags]
    python tools/plan_layout.py --calibrate --out calib.json [--gpu h100|h200]   # on a GPU machine

Options:
  --gpus N               GPUs of the run;  --gpus-per-node N (default min(N, 8))
  --gpu h100|h200        the defaults of the cost model (placeholders until calibrated) and of --gpu-memory
                         (80GB / 141GB)
  --gpu-memory SIZE      one GPU (GB = GiB = 2^30 bytes);  --host-memory SIZE: CPU memory of a node (offload)
  --memory-fraction F    usable share of a GPU (default 0.9: the CUDA context, NCCL and fragmentation)
  --max-micro-batch N    largest micro-batch tried (default 16);  --vocab-size N (default 50257)
  --calibration FILE     constants measured by --calibrate (keys it lacks keep the --gpu defaults)
  --calibrate --out FILE measure this machine's GEMM, attention, HBM, NCCL, PCIe and CPU AdamW rates
Any other flag is a training flag kept in every layout and in the printed command (e.g. --hidden-dropout 0,
--torch-compile); the flags the planner chooses (parallel sizes, micro-batch, ZeRO, offload, recompute,
sequence parallelism) are refused there. Cost model: megapar/planner/cost.py; memory:
megapar/planner/memory_estimate.py (the numbers tools/estimate_memory.py prints).
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from megapar.config.settings import ConfigError, build_parser, flag
from megapar.data.tokenizer import GPT2_VOCAB_SIZE
from megapar.errors import OneLineErrorParser
from megapar.planner.memory_estimate import GiB, parse_size
from megapar.planner import calibration as calibration_
from megapar.planner import search

CHOSEN = {"tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
          "num_layers_per_virtual_pipeline_stage", "micro_batch_size", "zero_stage", "use_distributed_optimizer",
          "optimizer_cpu_offload", "param_cpu_offload", "recompute_granularity", "recompute_method",
          "recompute_num_layers", "recompute_activations", "checkpoint_activations", "sequence_parallel",
          "pipeline_schedule", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
          "recipe", "deepspeed_config", "enable_cuda_graph"}
GPU_MEMORY = {"h100": "80GB", "h200": "141GB"}


def _parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(add_help=False, allow_abbrev=False)
    for name in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--global-batch-size",
                 "--gpus"):
        p.add_argument(name, type=int, default=None)
    p.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP width (default 4 x --hidden-size)")
    p.add_argument("--vocab-size", type=int, default=GPT2_VOCAB_SIZE)
    p.add_argument("--gpus-per-node", type=int, default=None)
    p.add_argument("--gpu", choices=sorted(calibration_.DEFAULTS), default="h100")
    p.add_argument("--gpu-memory", default=None)
    p.add_argument("--host-memory", default=None)
    p.add_argument("--memory-fraction", type=float, default=0.9)
    p.add_argument("--max-micro-batch", type=int, default=16)
    p.add_argument("--calibration", default=None)
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--show-rejected", type=int, default=0)
    p.add_argument("--calibrate", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("-h", "--help", action="store_true", help="print the usage text and exit")
    return p


def _request(own: argparse.Namespace, extra: dict) -> search.Request:
    """The planning request from the parsed flags; ConfigError (one line) for a value out of range."""
    missing = [flag(n) for n in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                                                      "global_batch_size", "gpus") if getattr(own, n) is None]
    if missing:
        raise ConfigError(f"missing {', '.join(missing)}: the planner needs the model shape, the global batch and "
                          f"the GPU count (e.g. --gpus 8)")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "global_batch_size", "gpus",
                 "ffn_hidden_size", "vocab_size", "gpus_per_node", "max_micro_batch", "top"):
        value = getattr(own, name)
        if value is not None and value < 1:
            raise ConfigError(f"{flag(name)} {value} must be >= 1")
    per_node = own.gpus_per_node or min(own.gpus, 8)
    if own.gpus > per_node and own.gpus % per_node:
        raise ConfigError(f"--gpus {own.gpus} is not a multiple of --gpus-per-node {per_node}: the launcher starts "
                          f"the same number of processes on every node; use {own.gpus // per_node * per_node} or "
                          f"{-(-own.gpus // per_node) * per_node} GPUs")
    if own.show_rejected < 0:
        raise ConfigError(f"--show-rejected {own.show_rejected} must be >= 0")
    if not 0 < own.memory_fraction <= 1:
        raise ConfigError(f"--memory-fraction {own.memory_fraction} must be in (0, 1]")
    chosen = sorted(flag(n) for n in CHOSEN & set(extra))
    if chosen:
        raise ConfigError(f"{', '.join(chosen)}: the planner chooses these itself; drop them (or use "
                          f"tools/estimate_memory.py to check one layout)")
    gpu_memory = parse_size(own.gpu_memory or GPU_MEMORY[own.gpu], "--gpu-memory")
    host_memory = parse_size(own.host_memory, "--host-memory") if own.host_memory is not None else None
    return search.Request(own.num_layers, own.hidden_size, own.num_attention_heads, own.seq_length,
                          own.global_batch_size, own.gpus, per_node, gpu_memory,
                          host_memory, own.ffn_hidden_size, own.vocab_size, own.max_micro_batch,
                          own.memory_fraction, extra)


def _describe(req: search.Request, cal: calibration_.Calibration, calibrated: bool) -> str:
    nodes = -(-req.gpus // req.gpus_per_node)
    host = f"{req.host_memory / GiB:.0f} GiB host memory per node" if req.host_memory else "host memory not checked"
    return (f"model: {req.num_layers} layers, hidden {req.hidden_size}, {req.num_attention_heads} heads, seq "
            f"{req.seq_length}, global batch {req.global_batch_size} ({req.global_batch_size * req.seq_length:,} "
            f"tokens)\ncluster: {req.gpus} GPUs ({nodes} node{'s' if nodes > 1 else ''} of {req.gpus_per_node}), "
            f"{req.gpu_memory / GiB:.1f} GiB each (usable {req.memory_fraction * req.gpu_memory / GiB:.1f}), {host}\n"
            f"cost model: {cal.name}" + ("" if calibrated else "; predictions are uncalibrated"))


def _rejected(plan: search.Plan, n: int) -> str:
    """Grouped reasons and the first `n` rejected layouts (those that nearly fit first)."""
    lines = ["| rejected layouts | reason (of the one nearest to fitting) |", "|---|---|"]
    lines += [f"| {count} | {reason} |" for reason, count in plan.reasons()]
    near = sorted(plan.rejected, key=lambda c: (c.gpu_bytes is None, c.gpu_bytes or 0.0))[:n]
    if near:
        lines += ["", "| tp | pp | v | dp | ZeRO | offload | micro | recompute | SP | reason |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for c in near:
            lay = c.layout
            lines.append(f"| {lay.tp} | {lay.pp} | {lay.schedule} | {lay.dp} | {lay.zero} | {lay.offload} "
                         f"| {lay.micro} | {lay.recompute} | {'yes' if lay.sp else 'no'} | {c.reason} |")
    return "\n".join(lines)


def _summary(best: search.Candidate) -> str:
    s = best.step
    return (f"best: predicted {1e3 * s.total:,.1f} ms per step = pipeline {1e3 * s.pipeline:,.1f} ms (microbatch "
            f"{1e3 * s.microbatch:,.1f} ms, bubble {1e3 * s.bubble:,.1f}) + data parallel {1e3 * s.dp_exposed:,.1f} + "
            f"optimizer {1e3 * s.optimizer:,.1f} + overhead {1e3 * s.overhead:,.1f}")


def calibrate(own: argparse.Namespace) -> int:
    from megapar.planner.measure import calibrate as measure
    if not own.out:
        raise ConfigError("--calibrate needs --out FILE for the calibration JSON")
    cal = measure(own.gpu, log=lambda msg: print(msg, file=sys.stderr))
    with open(own.out, "w") as f:
        f.write(cal.to_json() + "\n")
    print(f"wrote {own.out}; plan with --calibration {own.out}")
    print("\n".join(cal.notes))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    own, rest = _parser().parse_known_args(argv)
    if own.help:
        print(f"usage: python tools/plan_layout.py --gpus N [model and batch flags] [training flags]\n{__doc__}")
        return 0
    try:
        training = vars(build_parser().parse_args(rest))   # the other flags must be training flags
        if own.calibrate:
            return calibrate(own)
        req = _request(own, training)
        cal = calibration_.load_calibration(own.gpu, own.calibration)
        plan = search.plan(req, cal)
        if plan.best is None:
            groups = "; ".join(f"{reason} ({count} layout{'s' if count > 1 else ''} like it)"
                               for reason, count in plan.reasons() if not reason.startswith(search.REDUNDANT))
            raise ConfigError(f"no valid layout: {groups}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(_describe(req, cal, own.calibration is not None))
    print(f"layouts: {len(plan.accepted) + len(plan.rejected):,} enumerated, {len(plan.accepted):,} fit, "
          f"{len(plan.rejected):,} rejected" + ("" if own.show_rejected else " (--show-rejected N lists them)"))
    print()
    print(search.table(plan, own.top))
    print()
    print(_summary(plan.best))
    print("command (add your data, tokenizer and schedule flags: --data-path, --vocab-file, --train-iters, ...):")
    print(search.command(req, plan.best.layout))
    if own.show_rejected:
        print()
        print(_rejected(plan, own.show_rejected))
    return 0


if __name__ == "__main__":
    sys.exit(main())
