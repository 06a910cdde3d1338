"""Predict peak GPU memory per pipeline stage, and host memory (and NVMe disk) for offload, for a training
configuration.

    python tools/estimate_memory.py --world-size 4 --tensor-parallel 2 --pipeline-parallel 2 \
        --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 \
        --micro-batch-size 8 --global-batch-size 64 --bf16 [--zero-stage 0-3] [--optimizer-cpu-offload] \
        [--optimizer-nvme-offload PATH] \
        [--param-cpu-offload] [--checkpoint-activations] [--gpu-memory 80GB --host-memory 1TB] [--compare-stages]

Takes the training flags (megapar/config/settings.py; `--recipe NAME` and `--deepspeed-config FILE` too) plus:
  --world-size N       processes (GPUs) of the run (default 1)
  --vocab-size N       true vocabulary size (default GPT-2's 50257)
  --gpus-per-node N    GPUs per node, for host memory per node (default: the world size, at most 8)
  --gpu-memory SIZE    memory of one GPU (80GB, 141GB; GB = GiB = 2^30 bytes): say whether the run fits
  --host-memory SIZE   CPU memory of one node (1TB): say whether the offloaded state of its GPUs fits
  --compare-stages     also a table of ZeRO stages 0-3 x CPU offload for this model and layout
Prints parameters, static memory (weights, fp32 grads, optimizer state), transient per-layer buffers (ZeRO 2-3),
activations, logits, the predicted GPU peak and the host memory per stage (and the NVMe offload
files). Model: megapar/planner/memory_estimate.py.
"""
import argparse
import sys
from typing import Optional

from megapar.config.build import build_config
from megapar.config.overlays import parse_flags
from megapar.config.settings import ConfigError, build_parser
from megapar.data.tokenizer import GPT2_VOCAB_SIZE
from megapar.errors import OneLineErrorParser
from megapar.planner.memory_estimate import (GiB, compare_zero, estimate, format_table, host_bytes_per_node,
                                             offload_name, parse_size, verdict, zero_stage)
from megapar.model import set_vocab


def _own_flags(argv: Optional[list[str]]) -> tuple[argparse.Namespace, list[str]]:
    """This tool's flags (the rest are training flags). A bad value ends in one `error:` line."""
    pre = OneLineErrorParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--world-size", type=int, default=1, help="processes (GPUs) in all")
    pre.add_argument("--vocab-size", type=int, default=GPT2_VOCAB_SIZE,
                     help="the tokenizer's vocabulary (GPT-2's by default)")
    pre.add_argument("--gpus-per-node", type=int, default=None, help="GPUs sharing one host's memory (offload)")
    pre.add_argument("--gpu-memory", default=None, help="a GPU's memory, e.g. 80GB: adds a fits / does not fit verdict")
    pre.add_argument("--host-memory", default=None, help="a host's memory, e.g. 512GB: the offload verdict")
    pre.add_argument("--compare-stages", action="store_true", help="one row for each ZeRO stage")
    return pre.parse_known_args(argv)


def _check_own(known: argparse.Namespace) -> tuple[int, Optional[float], Optional[float]]:
    """(GPUs per node, GPU bytes, host bytes); ConfigError for a value out of range."""
    for flag, value in (("--world-size", known.world_size), ("--vocab-size", known.vocab_size),
                        ("--gpus-per-node", known.gpus_per_node)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value} must be >= 1")
    per_node = known.gpus_per_node or min(known.world_size, 8)
    gpu = parse_size(known.gpu_memory, "--gpu-memory") if known.gpu_memory is not None else None
    host = parse_size(known.host_memory, "--host-memory") if known.host_memory is not None else None
    return per_node, gpu, host


def main(argv=None) -> int:
    known, rest = _own_flags(argv)
    parser = build_parser(prog="python tools/estimate_memory.py")
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    try:
        per_node, gpu_memory, host_memory = _check_own(known)
        given = parse_flags(rest, parser)
        cfg = build_config(given, known.world_size, assume_gpus=True)  # a plan for GPUs, checked anywhere
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    set_vocab(cfg.model, known.vocab_size, cfg.parallel.tensor_model_parallel_size)
    p = cfg.parallel
    print(f"tp {p.tensor_model_parallel_size} x pp {p.pipeline_model_parallel_size} x dp {p.data_parallel_size}, "
          f"{cfg.num_microbatches} microbatches of {cfg.train.micro_batch_size}, {cfg.train.params_dtype_name}, "
          f"ZeRO stage {zero_stage(cfg)}, CPU offload {offload_name(cfg)}, recompute {cfg.model.recompute_granularity}")
    rows = estimate(cfg)
    print(format_table(rows))
    peak, host = max(r.total for r in rows), host_bytes_per_node(cfg, rows, per_node)
    if gpu_memory is not None:
        print(f"GPU: {verdict(peak, gpu_memory, 'GPU')}")
    if host_memory is not None:
        print(f"host ({per_node} GPU{'s' if per_node > 1 else ''} per node): {verdict(host, host_memory, 'host')}")
    if any(r.disk_bytes for r in rows):
        disk = host_bytes_per_node(cfg, rows, per_node, "disk_bytes")
        print(f"NVMe offload: {disk / GiB:.1f} GiB of optimizer state files per node ({per_node} GPU"
              f"{'s' if per_node > 1 else ''} per node) under --optimizer-nvme-offload {p.optimizer_nvme_offload}")
    if known.compare_stages:
        print(compare_zero(cfg, per_node, gpu_memory, host_memory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
