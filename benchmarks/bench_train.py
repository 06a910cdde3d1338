"""Training throughput benchmark: runs anchor configurations through scripts/pretrain_gpt2.sh
and prints tokens/s, TFLOP/s per GPU, MFU and peak memory per configuration.

    python benchmarks/bench_train.py --vocab-file gpt2/encoder.json --merge-file gpt2/vocab.bpe \
        --configs 345m 124m --iters 30

Data: the embedded default corpus tokenised with GPT-2 BPE (built on first use); dropout 0 (as
nanoGPT's bench.py), bf16, seq 1024. The numbers
are the mean over the last --log-window iterations (after warm-up).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT2_345M = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16"]
GPT2_124M = ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12"]
# name: (gpus, model flags, extra flags)
CONFIGS = {
    "124m": (1, GPT2_124M, ["--micro-batch-size", "16", "--global-batch-size", "16"]),
    "345m": (1, GPT2_345M, ["--micro-batch-size", "8", "--global-batch-size", "8"]),
    "345m-fused-ln": (1, GPT2_345M, ["--micro-batch-size", "8", "--global-batch-size", "8",
                                     "--layernorm-impl", "fused"]),
    "124m-compile": (1, GPT2_124M, ["--micro-batch-size", "16", "--global-batch-size", "16", "--torch-compile"]),
    "345m-compile": (1, GPT2_345M, ["--micro-batch-size", "8", "--global-batch-size", "8", "--torch-compile"]),
    "124m-graph": (1, GPT2_124M, ["--micro-batch-size", "16", "--global-batch-size", "16", "--torch-compile",
                                  "--enable-cuda-graph", "--adam-impl", "fused"]),
    "345m-graph": (1, GPT2_345M, ["--micro-batch-size", "8", "--global-batch-size", "8", "--torch-compile",
                                  "--enable-cuda-graph", "--adam-impl", "fused"]),
    "345m-m8": (1, GPT2_345M, ["--micro-batch-size", "8", "--global-batch-size", "64"]),
    "345m-recompute": (1, GPT2_345M, ["--micro-batch-size", "8", "--global-batch-size", "8",
                                      "--recompute-granularity", "full", "--recompute-method", "uniform"]),
    "345m-dp2": (2, GPT2_345M, ["--micro-batch-size", "8", "--global-batch-size", "16"]),
    "345m-dp4": (4, GPT2_345M, ["--micro-batch-size", "8", "--global-batch-size", "32"]),
    "345m-dp4-zero1": (4, GPT2_345M, ["--micro-batch-size", "8", "--global-batch-size", "32",
                                      "--use-distributed-optimizer"]),
    "345m-tp2": (2, GPT2_345M, ["--micro-batch-size", "8", "--global-batch-size", "8", "--tensor-parallel", "2"]),
    "345m-tp2-graph": (2, GPT2_345M, ["--micro-batch-size", "8", "--global-batch-size", "8", "--tensor-parallel", "2",
                                      "--torch-compile", "--enable-cuda-graph", "--adam-impl", "fused"]),
    "345m-tp2-sp": (2, GPT2_345M, ["--micro-batch-size", "8", "--global-batch-size", "8", "--tensor-parallel", "2",
                                   "--sequence-parallel"]),
    "345m-pp2-m8": (2, GPT2_345M, ["--micro-batch-size", "8", "--global-batch-size", "64", "--pipeline-parallel", "2"]),
    "345m-pp4-m8": (4, GPT2_345M, ["--micro-batch-size", "8", "--global-batch-size", "64", "--pipeline-parallel", "4"]),
    # the last stage also runs the LM head and the loss: give it fewer layers
    "345m-pp2-m8-last11": (2, GPT2_345M, ["--micro-batch-size", "8", "--global-batch-size", "64", "--pipeline-parallel",
                                          "2", "--decoder-last-pipeline-num-layers", "11"]),
    "345m-pp4-m8-last3": (4, GPT2_345M, ["--micro-batch-size", "8", "--global-batch-size", "64", "--pipeline-parallel",
                                         "4", "--decoder-last-pipeline-num-layers", "3"]),
    "345m-tp2-pp2": (4, GPT2_345M, ["--micro-batch-size", "8", "--global-batch-size", "64", "--tensor-parallel", "2",
                                    "--pipeline-parallel", "2", "--use-distributed-optimizer"]),
}
ITER_RE = re.compile(r"elapsed time per iteration \(ms\): ([\d.]+).*tokens/s: (\d+) \| TFLOP/s/GPU: ([\d.]+) \| MFU: ([\d.%na/]+)")
MEM_RE = re.compile(r"max allocated: (\d+)")


def run_config(name: str, args) -> dict:
    gpus, model, extra = CONFIGS[name]
    cmd = ["bash", os.path.join(ROOT, "scripts", "pretrain_gpt2.sh"), "--nproc-per-node", str(gpus), *model, *extra,
           "--seq-length", "1024", "--max-position-embeddings", "1024", "--bf16", "--train-iters", str(args.iters),
           "--log-interval", str(args.log_window), "--eval-interval", "0", "--eval-iters", "0", "--save-interval", "0",
           "--vocab-file", args.vocab_file, "--merge-file", args.merge_file, "--tokenizer-type", "GPT2BPETokenizer",
           "--lr", "3e-4", "--lr-warmup-iters", "5", "--hidden-dropout", "0", "--attention-dropout", "0",
           "--save", "",
           *args.extra]
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
    p.add_argument("--configs", nargs="+", default=["124m", "345m"], choices=sorted(CONFIGS))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--log-window", type=int, default=10)
    p.add_argument("--vocab-file", required=True)
    p.add_argument("--merge-file", required=True)
    p.add_argument("--workdir", default=".")
    p.add_argument("--log-dir", default=".")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more pretrain flags for every config")
    args = p.parse_args()
    args.vocab_file, args.merge_file = os.path.abspath(args.vocab_file), os.path.abspath(args.merge_file)
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
