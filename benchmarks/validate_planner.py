"""The layout planner's predicted step time against measured runs, on the GPUs at hand.

    python benchmarks/validate_planner.py --vocab-file .gpu/encoder.json --merge-file .gpu/vocab.bpe \
        [--gpu h100|h200] [--calibration calib.json] [--only 345m 1.3b] [--iters 20] [--log-dir DIR]

For each layout of the set for this machine's GPU count (GPT-2 345M and the 1.3B shape, seq 1024: micro-batch,
ZeRO stage, recompute and offload on one GPU; dp, tp, pp, interleaving with more), the planner's
prediction (tools/plan_layout.py's cost model and memory estimator) is set beside the run of exactly the
command the planner prints for it (scripts/pretrain_gpt2.sh, eager as the planner's commands are, dropout 0,
the embedded corpus; the mean of the last --log-window iterations). Prints predicted vs measured step time
and memory, the ratio, and whether the planner's fastest layout of each model is the measured fastest.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from typing import Optional

import torch

from bench_train import ITER_RE, MEM_RE, ROOT, bench_flags
from megapar.planner.memory_estimate import GiB
from megapar.planner import calibration, cost, search

MODELS = {"345m": (24, 1024, 16), "1.3b": (24, 2048, 16)}
GLOBAL_BATCH = {"345m": 16, "1.3b": 16}


def L(micro: int, zero: int = 0, recompute: str = "none", tp: int = 1, pp: int = 1, v: int = 1, dp: int = 1,
      offload: bool = False) -> cost.Layout:
    return cost.Layout(tp, pp, v, dp, zero, offload, False, micro, recompute, False)


# (model, layout) pairs by GPU count: every knob the planner turns that this many GPUs can show
LAYOUTS = {
    1: [("345m", L(8)), ("345m", L(16)), ("345m", L(4, zero=1)), ("345m", L(8, zero=3)),
        ("345m", L(8, recompute="full")),
        ("1.3b", L(8)), ("1.3b", L(4, zero=1)), ("1.3b", L(8, zero=3)), ("1.3b", L(8, recompute="full")),
        ("1.3b", L(2, zero=2, offload=True))],
    2: [("345m", L(8, dp=2)), ("345m", L(8, dp=2, zero=1)), ("345m", L(8, dp=2, zero=3)), ("345m", L(8, tp=2)),
        ("345m", L(8, pp=2)), ("345m", L(4, pp=2, v=2)), ("1.3b", L(8, dp=2, zero=1)), ("1.3b", L(8, tp=2)),
        ("1.3b", L(4, pp=2)), ("1.3b", L(4, pp=2, v=2)), ("1.3b", L(8, dp=2, zero=3, recompute="full"))],
}


def request(model: str, gpus: int, gpu_memory: float) -> search.Request:
    layers, hidden, heads = MODELS[model]
    return search.Request(layers, hidden, heads, 1024, GLOBAL_BATCH[model], gpus, gpus, gpu_memory, None,
                          extra={"hidden_dropout": 0.0, "attention_dropout": 0.0})


def describe(lay: cost.Layout) -> str:
    parts = [f"tp {lay.tp}" * (lay.tp > 1), f"pp {lay.pp}" * (lay.pp > 1), f"v {lay.v}" * (lay.v > 1),
             f"dp {lay.dp}" * (lay.dp > 1), f"ZeRO-{lay.zero}" * (lay.zero > 0), "offload" * lay.optimizer_offload,
             f"micro {lay.micro}", "full recompute" * (lay.recompute == "full")]
    return ", ".join(p for p in parts if p)


def measure(req: search.Request, lay: cost.Layout, args, log_name: str) -> tuple[Optional[float], Optional[float], str]:
    """(ms per step, max allocated GiB, error) of the planner's command for this layout."""
    cmd = [*shlex.split(search.command(req, lay)), *bench_flags(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    out = proc.stdout + proc.stderr
    with open(os.path.join(args.log_dir, log_name), "w") as f:
        f.write(" ".join(cmd) + "\n" + out)
    iters, mems = ITER_RE.findall(out), [int(m) for m in MEM_RE.findall(out)]
    if proc.returncode != 0 or not iters:
        return None, None, f"rc={proc.returncode}: {out.strip().splitlines()[-1:]}"
    return float(iters[-1][0]), (max(mems) / 1024 if mems else None), ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab-file", required=True)
    p.add_argument("--merge-file", required=True)
    p.add_argument("--gpu", choices=list(calibration.DEFAULTS), default=None,
                   help="the planner's defaults to use (default: from this GPU's name)")
    p.add_argument("--calibration", default=None, help="a --calibrate JSON file instead of the defaults")
    p.add_argument("--only", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--log-window", type=int, default=5)
    p.add_argument("--log-dir", default=".")
    args = p.parse_args()
    gpus = torch.cuda.device_count()
    if gpus not in LAYOUTS:
        sys.exit(f"error: no layout set for {gpus} GPUs (sets for {sorted(LAYOUTS)})")
    name = torch.cuda.get_device_name()
    gpu = args.gpu or calibration.gpu_kind(name, "h100")
    cal = calibration.load_calibration(gpu, args.calibration)
    memory = torch.cuda.get_device_properties(0).total_memory
    args.vocab_file, args.merge_file = os.path.abspath(args.vocab_file), os.path.abspath(args.merge_file)
    os.makedirs(args.log_dir, exist_ok=True)
    rows = []
    for i, (model, lay) in enumerate(LAYOUTS[gpus]):
        if model not in args.only:
            continue
        req = request(model, gpus, memory)
        cand = search.evaluate(req, cal, lay)
        predicted = None if cand.reason else cand.seconds * 1e3
        ms, mem, err = measure(req, lay, args, f"layout{i}_{model}.log")
        rows.append((model, lay, predicted, cand.gpu_bytes, ms, mem, err or cand.reason or ""))
        print(rows[-1], flush=True)
    print(f"\n{name}, {gpus} GPU(s), planner defaults '{gpu}'" + (f" + {args.calibration}" if args.calibration else ""))
    print("| model | layout | predicted ms | measured ms | predicted / measured | estimator GiB | max alloc GiB "
          "| note |")
    print("|---|---|---|---|---|---|---|---|")
    for model, lay, pred, est, ms, mem, note in rows:
        ratio = f"{pred / ms:.2f}" if pred and ms else ""
        print(f"| {model} | {describe(lay)} | {pred or float('nan'):.1f} | {ms or float('nan'):.1f} | {ratio} "
              f"| {(est or 0) / GiB:.1f} | {mem or float('nan'):.1f} | {note} |")
    for model in args.only:
        done = [(pred, ms, lay) for m, lay, pred, _, ms, _, _ in rows if m == model and pred and ms]
        if done:
            by_pred, by_meas = min(done, key=lambda r: r[0]), min(done, key=lambda r: r[1])
            print(f"{model}: planner's fastest {describe(by_pred[2])}; measured fastest {describe(by_meas[2])}"
                  f" ({'same' if by_pred[2] == by_meas[2] else 'different'})")


if __name__ == "__main__":
    sys.exit(main())
