"""Training throughput benchmark: runs named run recipes (megapar/config/recipes.py) through
scripts/pretrain_gpt2.sh and prints tokens/s, TFLOP/s per GPU, MFU and peak memory per recipe.

    python benchmarks/bench_train.py --vocab-file gpt2/encoder.json --merge-file gpt2/vocab.bpe \
        --configs 345m 124m --iters 30 [--extra FLAG ...]

Each run is the recipe's flags (model, batch, precision, kernels, parallel sizes: what
`--recipe NAME` gives any training run) followed by benchmark-only flags: iteration count, log
interval, no evaluation or checkpoint, a short warm-up, dropout 0 (as nanoGPT's bench.py, so that
every recipe is measured alike), and the data (the embedded default corpus tokenised with GPT-2
BPE, built on first use). The numbers are those of the last logged window of --log-window iterations.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

from megapar.config.recipes import RECIPES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITER_RE = re.compile(r"elapsed time per iteration \(ms\): ([\d.]+).*tokens/s: (\d+) \| TFLOP/s/GPU: ([\d.]+) "
                     r"\| MFU: ([\d.%na/]+)")
MEM_RE = re.compile(r"max allocated: (\d+)")


def bench_flags(args) -> list[str]:
    """The flags every benchmark run adds after its recipe's: length, logging, no eval/save, dropout 0, data."""
    return ["--train-iters", str(args.iters), "--log-interval", str(args.log_window), "--eval-interval", "0",
            "--eval-iters", "0", "--save", "", "--lr", "3e-4", "--lr-warmup-iters", "5",
            "--hidden-dropout", "0", "--attention-dropout", "0",
            "--vocab-file", args.vocab_file, "--merge-file", args.merge_file, "--tokenizer-type", "GPT2BPETokenizer"]


def run_config(name: str, args) -> dict:
    """One recipe's run: its flags, the benchmark's and --extra (run_flags)."""
    return run_flags(name, RECIPES[name].gpus, [*RECIPES[name].flags, *bench_flags(args), *args.extra], args)


def run_flags(name: str, gpus: int, flags: list[str], args) -> dict:
    """scripts/pretrain_gpt2.sh on `gpus` processes with `flags`; its log to args.log_dir/<name>.log and the
    last logged window's ms/iteration, tokens/s, TFLOP/s per GPU, MFU and peak memory."""
    cmd = ["bash", os.path.join(ROOT, "scripts", "pretrain_gpt2.sh"), "--nproc-per-node", str(gpus), *flags]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=args.workdir)
    out = proc.stdout + proc.stderr
    with open(os.path.join(args.log_dir, f"{name}.log"), "w") as f:
        f.write(" ".join(cmd) + "\n" + out)
    iters = ITER_RE.findall(out)
    mems = [int(m) for m in MEM_RE.findall(out)]
    if proc.returncode != 0 or not iters:
        return {"name": name, "gpus": gpus, "error": f"rc={proc.returncode}: {out.strip().splitlines()[-1:]}"}
    ms, tok, tflops, mfu = iters[-1]
    return {"name": name, "gpus": gpus, "ms": float(ms), "tokens_s": int(tok), "tok_gpu": int(tok) / gpus,
            "tflops": float(tflops), "mfu": mfu, "mem_gb": max(mems) / 1024 if mems else float("nan"),
            "wall": time.time() - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["124m", "345m"],
                   choices=[n for n, r in RECIPES.items() if not r.cpu],
                   help="recipe names (python -m megapar.config.recipes lists them)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--log-window", type=int, default=10)
    p.add_argument("--vocab-file", required=True)
    p.add_argument("--merge-file", required=True)
    p.add_argument("--workdir", default=".")
    p.add_argument("--log-dir", default=".")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more pretrain flags for every config")
    args = p.parse_args()
    args.vocab_file, args.merge_file = os.path.abspath(args.vocab_file), os.path.abspath(args.merge_file)
    os.makedirs(args.log_dir, exist_ok=True)  # each config's whole log goes there, written after its run
    rows = []
    for name in args.configs:
        rows.append(run_config(name, args))
        print(rows[-1], flush=True)
    print("\n| config | GPUs | ms/iter | tokens/s | tokens/s/GPU | TFLOP/s/GPU | MFU | max alloc GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | {r['gpus']} | failed: {r['error']} |")
        else:
            print(f"| {r['name']} | {r['gpus']} | {r['ms']:.1f} | {r['tokens_s']} | {r['tok_gpu']:.0f} | "
                  f"{r['tflops']:.1f} | {r['mfu']} | {r['mem_gb']:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
