"""CPU AdamW for --optimizer-cpu-offload: torch's fused CPU kernel against its foreach path.

    python benchmarks/bench_cpu_adam.py [--numel 500000000] [--tensors 64] [--steps 3]

Times one AdamW step over `numel` fp32 parameters split into `tensors` tensors (the parts an
offloaded ZeRO shard hands to AdamW) with every core, and prints parameters per second for each
implementation (megapar/planner/measure.py's `cpu_adam`, which --calibrate uses too); the offloaded
step uses the faster (distrib_optimizer.py).
"""
from __future__ import annotations

import argparse

import torch

from megapar.planner.measure import cpu_adam


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=500_000_000)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    print(f"| CPU AdamW ({torch.get_num_threads()} threads, {a.numel / 1e6:.0f}M params) | s/step | Mparams/s |")
    print("|---|---|---|")
    for name, kw in (("fused", {"fused": True}), ("foreach", {"foreach": True})):
        rate = cpu_adam(a.numel, a.tensors, a.steps, **kw) * 1e9
        print(f"| {name} | {a.numel / rate:.3f} | {rate / 1e6:.0f} |", flush=True)


if __name__ == "__main__":
    main()
