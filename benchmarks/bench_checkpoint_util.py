#!/usr/bin/env python3
"""Time and peak memory (RSS) of tools/checkpoint_util.py on a synthetic GPT-2 checkpoint.

  python benchmarks/bench_checkpoint_util.py [--layers 24 --hidden 1024 --heads 16 --vocab 50257]
        [--source-tp 2 --source-pp 2] [--workdir /tmp/bench_ckpt] [--no-optim] [--keep]

Writes a source checkpoint with random weights and optimizer state (fp32 masters and Adam
moments) in megapar's layout -- streamed by the same writer as the converter, so this script
itself stays small in memory -- then runs each conversion in a fresh process and prints a table
of wall time and the child's peak RSS. The checkpoint is deleted afterwards unless --keep.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
import zlib
from dataclasses import asdict

import torch

from megapar.config.build import parse_config
from megapar.checkpoint import read_saved_config
from megapar.model import set_vocab
from megapar.reshard import bounded_heap
from megapar.reshard.convert import write_sharded

TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "checkpoint_util.py")


class SyntheticSource:
    """A canonical source of random tensors (the interface of ShardedCheckpoint)."""

    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, seq: int = 1024):
        cfg = parse_config(["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads",
                            str(heads), "--seq-length", str(seq), "--use-distributed-optimizer"], world_size=1)
        set_vocab(cfg.model, vocab, 1, log=lambda *_: None)
        args = cfg.megatron_args()
        args.consumed_train_samples = 0
        self.saved = read_saved_config({"args": args, "model_config": asdict(cfg.model)})
        self.iteration, self.has_optim, self.distributed = 100, True, False
        h, f = hidden, 4 * hidden
        shapes = {"language_model.embedding.word_embeddings.weight": (vocab, h),
                  "language_model.embedding.position_embeddings.weight": (seq, h)}
        for i in range(layers):
            p = f"language_model.encoder.layers.{i}."
            shapes.update({p + "input_layernorm.weight": (h,), p + "input_layernorm.bias": (h,),
                           p + "self_attention.query_key_value.weight": (3 * h, h),
                           p + "self_attention.query_key_value.bias": (3 * h,),
                           p + "self_attention.dense.weight": (h, h), p + "self_attention.dense.bias": (h,),
                           p + "post_attention_layernorm.weight": (h,), p + "post_attention_layernorm.bias": (h,),
                           p + "mlp.dense_h_to_4h.weight": (f, h), p + "mlp.dense_h_to_4h.bias": (f,),
                           p + "mlp.dense_4h_to_h.weight": (h, f), p + "mlp.dense_4h_to_h.bias": (h,)})
        shapes["language_model.encoder.final_layernorm.weight"] = (h,)
        shapes["language_model.encoder.final_layernorm.bias"] = (h,)
        self.shapes, self.names = shapes, list(shapes)
        self.numel = sum(torch.Size(s).numel() for s in shapes.values())

    def spec(self, name, kind="param"):
        return self.shapes[name], torch.float32

    def full(self, name, kind="param"):
        g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{kind}".encode()))
        return torch.randn(self.shapes[name], generator=g) * 0.02

    def optim_meta(self):
        return {"step": 100, "grad_scaler": {"scale": 1.0},
                "param_groups": [{"lr": 1e-4, "weight_decay": 0.01}, {"lr": 1e-4, "weight_decay": 0.0}]}

    def meta(self):
        return {"source_layout": {"tp": 0, "pp": 0, "dp": 1}, "rng_states": {},
                "opt_param_scheduler": {"num_steps": 100, "max_lr": 1e-4, "min_lr": 0.0}}

    def release(self):
        pass


def run(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS in MiB) of one child process (its VmHWM, read just before exit)."""
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", "import resource, runpy, sys; sys.argv = sys.argv[1:]; "
                        "rc = 0\ntry:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
                        "except SystemExit as e:\n    rc = e.code or 0\n"
                        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]\n"
                        "print('MAXRSS_KB', hwm)\nsys.exit(rc)",
                        *cmd], capture_output=True, text=True)
    wall = time.time() - t0
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}")
    kb = int(next(l.split()[1] for l in r.stdout.splitlines() if l.startswith("MAXRSS_KB")))
    return wall, kb / 1024


def vm_hwm() -> float:
    """This process's peak RSS in MiB (VmHWM; unlike ru_maxrss it is not inherited across fork+exec)."""
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith("VmHWM")).split()[1]) / 1024


def du(path: str) -> float:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) / 2**30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--source-tp", type=int, default=2)
    p.add_argument("--source-pp", type=int, default=2)
    p.add_argument("--workdir", default="/tmp/bench_checkpoint_util")
    p.add_argument("--no-optim", action="store_true")
    p.add_argument("--keep", action="store_true")
    a = p.parse_args()
    bounded_heap()
    shutil.rmtree(a.workdir, ignore_errors=True)
    src_dir = os.path.join(a.workdir, "src")
    src = SyntheticSource(a.layers, a.hidden, a.heads, a.vocab)
    t0 = time.time()
    write_sharded(src, src_dir, a.source_tp, a.source_pp, dp=1, distributed=False, with_optim=not a.no_optim,
                  log=lambda *_: None)
    print(f"model: {a.layers} layers, hidden {a.hidden}, {a.heads} heads, vocab {a.vocab} = {src.numel / 1e6:.1f}M "
          f"params; source tp{a.source_tp} pp{a.source_pp}, "
          f"{'weights only' if a.no_optim else 'with fp32 optimizer state'}: "
          f"{du(src_dir):.2f} GiB written in {time.time() - t0:.1f} s (peak RSS of this writer {vm_hwm():.0f} MiB)")
    print(f"CPU: {os.cpu_count()} cores; torch {torch.__version__}\n")
    print(f"| {'conversion':<34} | {'time (s)':>8} | {'peak RSS (MiB)':>14} | {'output (GiB)':>12} |")
    print(f"|{'-' * 36}|{'-' * 10}|{'-' * 16}|{'-' * 14}|")
    jobs = [("tp%d pp%d -> tp1 pp1" % (a.source_tp, a.source_pp), "tp1pp1",
             ["--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1"], src_dir),
            ("tp1 pp1 -> tp4 pp2", "tp4pp2",
             ["--target-tensor-parallel-size", "4", "--target-pipeline-parallel-size", "2"], "tp1pp1"),
            ("tp%d pp%d -> canonical (--to-full)" % (a.source_tp, a.source_pp), "full", ["--to-full"], src_dir)]
    for label, out, flags, load in jobs:
        load = load if os.path.isabs(load) else os.path.join(a.workdir, load)
        out = os.path.join(a.workdir, out)
        wall, rss = run([TOOL, "--load-dir", load, "--save-dir", out] + flags + (["--no-optim"] if a.no_optim else []))
        print(f"| {label:<34} | {wall:8.1f} | {rss:14.0f} | {du(out):12.2f} |", flush=True)
    if not a.keep:
        shutil.rmtree(a.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
