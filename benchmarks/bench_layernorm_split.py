"""Inductor's LayerNorm backward: the mix-order reduction split size.

    python benchmarks/bench_layernorm_split.py          (each setting in a fresh process)

Under torch.compile one Triton kernel computes a LayerNorm's input gradient and fp32 partial sums
of its weight and bias gradients, one row of partials per `split` tokens; the generated wrapper then
sums the partials with ATen (the 96 fp32 `aten::sum` calls of a 345M step's profile). Times forward
and backward of add + LayerNorm at GPT-2 345M shapes ([1024, 8, 1024] bf16), replayed from a CUDA
graph, for Inductor's tuned default, fixed split sizes and the fusion turned off. 2x H200
(2026-11-21): 54.7 µs default, 51.7 µs at split 64, 60.4 µs off (docs/benchmarks/log_h100_20261121.md).
"""
from __future__ import annotations

import subprocess
import sys

import torch
import torch.nn.functional as F

from gpu_timing import graphed_us  # benchmarks/gpu_timing.py
from megapar.kernels.inductor import COMPILE_OPTIONS

SETTINGS = ["default", "16", "32", "64", "128", "off"]


def time_one(setting: str, seq: int = 1024, batch: int = 8, hidden: int = 1024, iters: int = 200) -> None:
    import torch._inductor.config as inductor_config
    if setting == "off":
        inductor_config.triton.mix_order_reduction = False
    elif setting != "default":
        inductor_config.triton.mix_order_reduction_split_size = int(setting)
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x, res = (torch.randn(seq, batch, hidden, **bf16, requires_grad=True) for _ in range(2))  # [s, b, h]
    w, b = (torch.randn(hidden, **bf16, requires_grad=True) for _ in range(2))
    grad_out, grad_sum = torch.randn(seq, batch, hidden, **bf16), torch.randn(seq, batch, hidden, **bf16)

    @torch.compile(options=COMPILE_OPTIONS)
    def add_layernorm(x, res, w, b):
        y = x + res                                        # the residual stream, also an output
        return F.layer_norm(y, (hidden,), w, b), y

    def step():
        out, y = add_layernorm(x, res, w, b)
        return torch.autograd.grad((out, y), (x, res, w, b), (grad_out, grad_sum))

    grads = step()
    us = graphed_us(step, iters)
    print(f"| {setting} | {us:.1f} | {grads[2].float().norm().item():.4f} |", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(f"usage: python benchmarks/bench_layernorm_split.py [SETTING]\n{__doc__}")
    elif len(sys.argv) > 1:
        time_one(sys.argv[1])
    else:
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
        print("| split | forward + backward µs (graphed) | weight-gradient norm (equal across rows) |")
        print("|---|---|---|", flush=True)
        for setting in SETTINGS:
            subprocess.run([sys.executable, __file__, setting], timeout=150, check=False)
