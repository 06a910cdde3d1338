"""Hidden dropout in a compiled layer: what each way of drawing the mask costs.

    python benchmarks/bench_dropout.py [--seq 1024 --batch 8 --hidden 1024 --p 0.1]   (each variant in a fresh process)

Times forward and backward of LayerNorm(x + dropout(y)), the residual join a transformer layer makes
twice, compiled and replayed from a CUDA graph, at GPT-2 345M shapes by default ([1024, 8, 1024]
bf16). Variants: no dropout; Inductor's `F.dropout` (one `tl.rand` per element); the same with
`fallback_random` (ATen's generator writes a float tensor the kernel reads); megapar's mask
(`megapar/kernels/dropout.py`: one Philox call per four elements). The dropout's cost is a row's time
minus the no-dropout row's; a 345M step has 48 of them. The last column is the kept fraction, 1 - p.
"""
from __future__ import annotations

import argparse
import subprocess
import sys

import torch
import torch.nn.functional as F

from gpu_timing import graphed_us  # benchmarks/gpu_timing.py
from megapar.kernels.inductor import COMPILE_OPTIONS

VARIANTS = ["none", "inductor", "fallback_random", "megapar"]


def time_one(variant: str, seq: int, batch: int, hidden: int, p: float, iters: int = 200) -> None:
    import torch._inductor.config as inductor_config

    from megapar.kernels import dropout as fast
    inductor_config.fallback_random = variant == "fallback_random"
    drop = {"none": lambda y: y, "megapar": lambda y: fast.dropout(y, p)}.get(
        variant, lambda y: F.dropout(y, p=p, training=True))
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x, y = (torch.randn(seq, batch, hidden, **bf16, requires_grad=True) for _ in range(2))  # [s, b, h]
    w, b = torch.ones(hidden, **bf16, requires_grad=True), torch.zeros(hidden, **bf16, requires_grad=True)
    grad_out, grad_sum = torch.randn(seq, batch, hidden, **bf16), torch.randn(seq, batch, hidden, **bf16)

    @torch.compile(options=COMPILE_OPTIONS)
    def join(x, y, w, b):
        h = x + drop(y)                                    # the residual stream, also an output
        return F.layer_norm(h, (hidden,), w, b), h

    def step():
        out, h = join(x, y, w, b)
        return (h,) + torch.autograd.grad((out, h), (x, y, w, b), (grad_out, grad_sum))

    us = graphed_us(step, iters)
    h, *_ = step()
    kept = ((h - x) != 0).float().mean().item()            # y's elements that survived
    print(f"| {variant} | {us:.1f} | {kept:.4f} |", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", choices=VARIANTS, help="time one variant in this process")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--p", type=float, default=0.1)
    args = ap.parse_args()
    shape = ["--seq", str(args.seq), "--batch", str(args.batch), "--hidden", str(args.hidden), "--p", str(args.p)]
    if args.variant:
        time_one(args.variant, args.seq, args.batch, args.hidden, args.p)
    else:
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, [{args.seq}, {args.batch}, "
              f"{args.hidden}] bf16, p {args.p}")
        print("| dropout | forward + backward µs (graphed) | kept fraction |")
        print("|---|---|---|", flush=True)
        for variant in VARIANTS:
            subprocess.run([sys.executable, __file__, "--variant", variant, *shape], timeout=200, check=False)
