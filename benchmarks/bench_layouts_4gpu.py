"""Every sensible layout of GPT-3 1.3B, 6.7B and 13B (seq 2048, bf16, no offload) on one 4-GPU node,
each at the micro-batch, recompute and sequence parallelism the layout planner predicts fastest for it,
measured one after the other, with the planner's prediction and overall pick beside each.

    python benchmarks/bench_layouts_4gpu.py [--shapes 1.3b 6.7b 13b] [--layouts dp4-zero1 tp2-dp2 ...] \
        [--global-batch 64] [--iters 20] [--calibration calib.json] [--budget SECONDS] [--dry-run]

A layout names (tp, pp, v, dp, ZeRO stage, schedule): dp 4 at ZeRO-1/2/3, tp 2 x dp 2, pp 2 x dp 2, tp 2 x
pp 2 (interleaved with 2 chunks too), tp 4, pp 4; the pipelines with 1F1B and with ZB-H1 (--enable-zero-bubble).
For each shape and layout the planner (megapar/planner/search.py, the cost model of
tools/plan_layout.py) ranks every micro-batch, recompute and sequence-parallel choice that fits 141 GB; the
fastest is run through scripts/pretrain_gpt2.sh with --torch-compile, the whole step in one CUDA graph where
validation allows it (else compiled alone) and benchmarks/bench_train.py's benchmark flags. `--dry-run`
prints the plan (and each run's command) without running anything: what a device call would do, checked on a
CPU.

The table: shape, layout, the planner's choice, predicted ms/step and MFU, measured ms/step, tokens/s per
GPU, TFLOP/s per GPU, MFU (megapar's formula, docs/performance.md) and peak memory, and which layout the
planner picks overall (`*`) next to which was fastest measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Optional

from bench_train import bench_flags, run_flags
from megapar.planner import cost, search
from megapar.planner.calibration import load_calibration

GPUS, GPU_MEMORY = 4, 141 * 2**30
SHAPES = {"1.3b": (24, 2048, 16), "6.7b": (32, 4096, 32), "13b": (40, 5120, 40)}  # layers, hidden, heads
LAYOUTS = {   # name -> (tp, pp, v, dp, ZeRO stage, zero-bubble schedule)
    "dp4-zero1": (1, 1, 1, 4, 1, False), "dp4-zero2": (1, 1, 1, 4, 2, False), "dp4-zero3": (1, 1, 1, 4, 3, False),
    "tp2-dp2": (2, 1, 1, 2, 1, False), "pp2-dp2": (1, 2, 1, 2, 1, False), "pp2-dp2-zb": (1, 2, 1, 2, 1, True),
    "tp2-pp2": (2, 2, 1, 1, 0, False), "tp2-pp2-v2": (2, 2, 2, 1, 0, False), "tp2-pp2-zb": (2, 2, 1, 1, 0, True),
    "tp4": (4, 1, 1, 1, 0, False), "pp4": (1, 4, 1, 1, 0, False), "pp4-zb": (1, 4, 1, 1, 0, True),
}
SEQ = 2048
COMPILED = {"torch_compile": True, "adam_impl": "fused"}
GRAPHED = {**COMPILED, "enable_cuda_graph": True}


@dataclasses.dataclass
class Choice:
    """The planner's fastest candidate of one layout, and whether it runs as one CUDA graph."""
    shape: str
    layout: str
    candidate: Optional[search.Candidate]   # None: no choice of this layout fits
    graphed: bool
    request: search.Request

    def words(self) -> list[str]:
        """The training flags after `pretrain_gpt2.sh --nproc-per-node 4` in the planner's command (the
        layout's and the request's kept flags: compiled, graphed)."""
        line = search.command(self.request, self.candidate.layout)
        return line.split("--nproc-per-node")[1].split()[1:]


def request(shape: str, global_batch: int, extra: dict) -> search.Request:
    layers, hidden, heads = SHAPES[shape]
    return search.Request(layers, hidden, heads, SEQ, global_batch, GPUS, GPUS, GPU_MEMORY, None, extra=dict(extra))


def choose(shape: str, name: str, global_batch: int, cal) -> Choice:
    """The fastest fitting candidate of layout `name`, graphed where validation allows the graph."""
    want = LAYOUTS[name]
    for extra, graphed in ((GRAPHED, True), (COMPILED, False)):
        req = request(shape, global_batch, extra)
        cands = [search.evaluate(req, cal, lay) for lay in search.layouts(req)
                 if (lay.tp, lay.pp, lay.v, lay.dp, lay.zero, lay.zb) == want and lay.offload == "none"]
        fits = sorted((c for c in cands if c.reason is None), key=lambda c: (c.seconds, c.gpu_bytes))
        if fits:
            return Choice(shape, name, fits[0], graphed, req)
    return Choice(shape, name, None, False, req)


def overall_pick(shape: str, global_batch: int, cal) -> Optional[cost.Layout]:
    """The planner's own pick for the shape on 4 GPUs (no offload; compiled and graphed flags kept)."""
    plan = search.plan(request(shape, global_batch, GRAPHED), cal)
    best = next((c for c in plan.accepted if c.layout.offload == "none"), None)
    return best.layout if best else None


def predicted(choice: Choice, cal) -> tuple[float, float]:
    c = choice.candidate
    model = search.model_of(choice.request, c.layout.tp)
    return 1e3 * c.seconds, cost.mfu(model, c.seconds, GPUS, cal.peak_tflops)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--global-batch", type=int, default=64, help="sequences per step (of 2048 tokens)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--log-window", type=int, default=5, help="the last window of this many iterations is reported")
    p.add_argument("--calibration", help="a file of tools/plan_layout.py --calibrate (else the H200 defaults)")
    p.add_argument("--budget", type=float, help="seconds for all runs: no run starts after it is spent")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the commands, run nothing")
    p.add_argument("--vocab-file", default="tests/data/gpt2/encoder.json")
    p.add_argument("--merge-file", default="tests/data/gpt2/vocab.bpe")
    p.add_argument("--log-dir", default=".gpu/layouts_4gpu")
    p.add_argument("--workdir", default=".")
    args = p.parse_args(argv)
    args.vocab_file, args.merge_file = os.path.abspath(args.vocab_file), os.path.abspath(args.merge_file)
    cal = load_calibration("h200", args.calibration)
    deadline = None if args.budget is None else time.monotonic() + args.budget
    os.makedirs(args.log_dir, exist_ok=True)
    print("| shape | layout | planner's choice (micro, recompute, SP, graph) | predicted ms | predicted MFU "
          "| measured ms | tokens/s/GPU | TFLOP/s/GPU | MFU | max alloc GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        pick = overall_pick(shape, args.global_batch, cal)
        for name in args.layouts:
            choice = choose(shape, name, args.global_batch, cal)
            if choice.candidate is None:
                print(f"| {shape} | {name} | nothing fits 141 GB | | | | | | | |", flush=True)
                continue
            lay = choice.candidate.layout
            star = "*" if pick is not None and dataclasses.astuple(lay) == dataclasses.astuple(pick) else ""
            what = (f"{star}micro {lay.micro}, recompute {lay.recompute}, SP {'yes' if lay.sp else 'no'}, "
                    f"{'graph' if choice.graphed else 'compiled'}")
            ms, mfu = predicted(choice, cal)
            flags = choice.words()   # the planner's command: the layout and the kept compile/graph flags
            head = f"| {shape} | {name} | {what} | {ms:,.0f} | {mfu:.1%} |"
            if args.dry_run:
                print(f"{head} (dry run) | | | | |\n    pretrain_gpt2.sh --nproc-per-node {GPUS} {' '.join(flags)}",
                      flush=True)
                continue
            if deadline is not None and time.monotonic() > deadline:
                print(f"{head} skipped: --budget spent | | | | |", flush=True)
                continue
            r = run_flags(f"{shape}-{name}", GPUS, flags + bench_flags(args), args)
            if "error" in r:
                print(f"{head} failed: {r['error']} | | | | |", flush=True)
            else:
                print(f"{head} {r['ms']:,.0f} | {r['tok_gpu']:,.0f} | {r['tflops']:.1f} | {r['mfu']} "
                      f"| {r['mem_gb']:.1f} |", flush=True)
    print("\n*: the planner's pick for the shape among every layout it enumerates on 4 GPUs (no offload)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
