"""megapar against nanoGPT's bench.py on the same GPU, alternating, one shape at a time.

    python benchmarks/bench_vs_nanogpt.py --nanogpt-dir .gpu/nanogpt --vocab-file .gpu/encoder.json \
        --merge-file .gpu/vocab.bpe [--shapes 124m 345m 1.3b] [--rounds 2] [--log-dir DIR]

nanoGPT is not part of megapar and is never committed: put its `bench.py`, `model.py` and
`configurator.py` (github.com/karpathy/nanoGPT) into a git-ignored folder and name it with
--nanogpt-dir. bench.py builds a 124M model; for the other shapes this script writes a copy of it
(`bench_<shape>.py`, same folder) whose only change is the model-size line, then runs it with
bench.py's own configurator flags: batch size as megapar's recipe, seq 1024, random data
(`real_data=False`), compiled, bf16, and `bias=True` (GPT-2's layers have biases, as megapar's do;
`--nanogpt-no-bias` measures bench.py's bias-free default instead).

`--nanogpt-variants published expert` also runs an expert's bench.py: the same file with three lines
changed (`torch.compile(model, mode="max-autotune")`, which autotunes the GEMMs and replays the model in
CUDA graphs; Inductor's coordinate-descent tuning on; the loss read back once per timed stage instead of
after every iteration, so the host runs ahead of the GPU as megapar's does). Nothing else changes.

Each round runs megapar's recipe (benchmarks/bench_train.py: the mean of the last 10 of 50 iterations)
and then bench.py (its mean over 20 iterations after 10 of burn-in), so drifting clocks hit both. Both
models have the same shape and padded vocabulary (50304), so the ratio of step times is the ratio of
tokens/s; MFU is megapar's formula (docs/performance.md) for both.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import torch

from bench_train import run_config
from megapar.config.recipes import RECIPES
from megapar.run.throughput import device_peak_tflops, flops_per_token

NANO_SIZE_LINE = "n_layer = 12, n_head = 12, n_embd = 768, # size of the model"
NANO_TIME_RE = re.compile(r"time per iteration: ([\d.]+)ms")
VOCAB, SEQ = 50304, 1024   # nanoGPT's padded vocabulary = megapar's for GPT-2 BPE; both recipes' seq
SHAPES = {"124m": "124m-graph", "345m": "345m-graph", "1.3b": "1.3b-graph"}
NANO_COMPILE_LINE = "model = torch.compile(model) # pytorch 2.0"
NANO_ITEM_LINE = "lossf = loss.item()"
VARIANTS = {   # variant -> the (line, replacement) pairs that make its script from bench.py
    "published": (),
    "expert": ((NANO_COMPILE_LINE, 'model = torch.compile(model, mode="max-autotune")\n'
                                   "    import torch._inductor.config\n"
                                   "    torch._inductor.config.coordinate_descent_tuning = True"),
               (NANO_ITEM_LINE, 'lossf = loss.item() if k == num_steps - 1 else float("nan")')),
}


@dataclass(frozen=True)
class Shape:
    """The model and batch of a megapar recipe, which bench.py is given too."""
    recipe: str
    layers: int
    hidden: int
    heads: int
    micro: int

    @classmethod
    def of(cls, recipe: str) -> "Shape":
        flags = RECIPES[recipe].flags

        def value(flag: str) -> int:
            return int(flags[flags.index(flag) + 1])
        assert value("--seq-length") == SEQ, f"{recipe}: bench.py is run at seq {SEQ}"
        return cls(recipe, value("--num-layers"), value("--hidden-size"), value("--num-attention-heads"),
                   value("--micro-batch-size"))

    def flops_per_step(self) -> float:
        return flops_per_token(self.layers, self.hidden, SEQ, VOCAB) * SEQ * self.micro


def nanogpt_script(nano_dir: str, name: str, shape: Shape, variant: str) -> str:
    """bench.py with the model-size line set to `shape` and `variant`'s lines changed (bench.py itself
    when nothing changes)."""
    src = open(os.path.join(nano_dir, "bench.py")).read()
    size = f"n_layer = {shape.layers}, n_head = {shape.heads}, n_embd = {shape.hidden}, # size of the model"
    changes = ((NANO_SIZE_LINE, size),) + VARIANTS[variant]
    for line, _ in changes:
        if line not in src:
            sys.exit(f"error: {nano_dir}/bench.py has no line {line!r}; use nanoGPT's bench.py as published")
    if all(line == new for line, new in changes):
        return "bench.py"
    for line, new in changes:
        src = src.replace(line, new)
    path = os.path.join(nano_dir, f"bench_{name}_{variant}.py")
    with open(path, "w") as f:
        f.write(src)
    return os.path.basename(path)


def run_nanogpt(nano_dir: str, name: str, shape: Shape, variant: str, bias: bool, log_path: str) -> dict:
    script = nanogpt_script(nano_dir, name, shape, variant)
    cmd = [sys.executable, script, f"--batch_size={shape.micro}", f"--block_size={SEQ}", "--real_data=False",
           f"--bias={bias}", "--compile=True", "--dtype=bfloat16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=nano_dir)
    out = proc.stdout + proc.stderr
    with open(log_path, "w") as f:
        f.write(" ".join(cmd) + "\n" + out)
    times = NANO_TIME_RE.findall(out)
    if proc.returncode != 0 or not times:
        return {"error": f"rc={proc.returncode}: {out.strip().splitlines()[-1:]}"}
    return {"ms": float(times[-1])}


def mfu(shape: Shape, ms: float, peak_tflops: float) -> str:
    return f"{shape.flops_per_step() / (ms * 1e-3) / (peak_tflops * 1e12):.1%}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nanogpt-dir", required=True, help="folder with nanoGPT's bench.py, model.py, configurator.py")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rounds", type=int, default=1, help="megapar / nanoGPT pairs per shape")
    p.add_argument("--nanogpt-no-bias", action="store_true", help="bench.py's default bias=False")
    p.add_argument("--nanogpt-variants", nargs="+", default=["published"], choices=list(VARIANTS),
                   help="bench.py as published, and/or the expert's (max-autotune, no per-iteration read-back)")
    p.add_argument("--vocab-file", required=True)
    p.add_argument("--merge-file", required=True)
    p.add_argument("--log-dir", default=".")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more pretrain flags for megapar's runs")
    args = p.parse_args()
    for name in ("bench.py", "model.py", "configurator.py"):
        if not os.path.isfile(os.path.join(args.nanogpt_dir, name)):
            sys.exit(f"error: {args.nanogpt_dir} has no {name}; copy nanoGPT's bench.py, model.py and "
                     f"configurator.py there (a git-ignored folder)")
    nano_dir = os.path.abspath(args.nanogpt_dir)
    args.vocab_file, args.merge_file = os.path.abspath(args.vocab_file), os.path.abspath(args.merge_file)
    args.iters, args.log_window, args.workdir = 50, 10, "."
    os.makedirs(args.log_dir, exist_ok=True)
    peak = device_peak_tflops(torch.device("cuda"))[0] or float("nan")
    rows = []
    for name in args.shapes:
        shape = Shape.of(SHAPES[name])
        for r in range(args.rounds):
            ours = run_config(shape.recipe, args)
            rows.append((name, r, "megapar " + shape.recipe, ours, ours))
            for variant in args.nanogpt_variants:
                theirs = run_nanogpt(nano_dir, name, shape, variant, not args.nanogpt_no_bias,
                                     os.path.join(args.log_dir, f"nanogpt_{name}_{variant}_{r}.log"))
                rows.append((name, r, f"nanoGPT bench.py, {variant}", theirs, ours))
                print(name, r, ours, variant, theirs, flush=True)
    print(f"\n| shape | round | run (nanoGPT bias={not args.nanogpt_no_bias}) | ms | MFU | megapar speed-up |")
    print("|---|---|---|---|---|---|")
    for name, r, label, res, ours in rows:
        shape = Shape.of(SHAPES[name])
        a = f"{res['ms']:.1f} | {mfu(shape, res['ms'], peak)}" if "ms" in res else f"failed: {res['error']} |"
        ratio = f"{res['ms'] / ours['ms']:.3f}x" if "ms" in ours and "ms" in res and res is not ours else ""
        print(f"| {name} | {r} | {label} | {a} | {ratio} |")


if __name__ == "__main__":
    sys.exit(main())
