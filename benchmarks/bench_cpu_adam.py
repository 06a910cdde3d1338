"""CPU AdamW for --optimizer-cpu-offload against the host's memory bandwidth.

    python benchmarks/bench_cpu_adam.py [--numel 500000000] [--tensors 64] [--steps 3]

Times one AdamW step over `numel` fp32 parameters split into `tensors` tensors (the parts an
offloaded ZeRO shard hands to AdamW) with every core, for torch's fused CPU kernel and its foreach
path (megapar/planner/measure.py's `cpu_adam`, which --calibrate uses too; the offloaded step uses
the faster, distrib_optimizer.py). The bound is the host's memory bandwidth: a STREAM-like copy
and triad (a = b + s c) over `numel` fp32 elements, every core, counted in the bytes the memory
moves: a store to a line not in cache reads the line first, so copy moves 12 B per element and
triad 16 B (STREAM's own count, 8 and 12, leaves that read out). A fused AdamW step moves 28 B per
parameter (the fp32 weight, gradient and two moments read, the weight and moments written back
into lines already read), so its bound is triad's bytes/s / 28; the table gives each
implementation's share of it.
"""
from __future__ import annotations

import argparse
import time

import torch

from megapar.planner.measure import cpu_adam

ADAM_BYTES = 28   # per parameter: 4 fp32 tensors read, 3 written


def stream(numel: int, reps: int = 3) -> dict[str, float]:
    """Bytes per second the memory moves in the best of `reps` copy and triad passes over `numel` fp32
    elements (each store's read of its line included)."""
    a, b, c = (torch.full((numel,), float(i)) for i in range(3))
    passes = {"copy": (lambda: a.copy_(b), 12), "triad": (lambda: torch.add(b, c, alpha=3.0, out=a), 16)}
    rates = {}
    for name, (run, bytes_per) in passes.items():
        run()
        best = min(_seconds(run) for _ in range(reps))
        rates[name] = bytes_per * numel / best
    return rates


def _seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=500_000_000)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    rates = stream(a.numel)
    bound = rates["triad"] / ADAM_BYTES
    print(f"host memory ({torch.get_num_threads()} threads): copy {rates['copy'] / 1e9:.1f} GB/s, "
          f"triad {rates['triad'] / 1e9:.1f} GB/s; AdamW bound {bound / 1e6:.0f} Mparams/s ({ADAM_BYTES} B each)")
    print(f"\n| CPU AdamW ({a.numel / 1e6:.0f}M params) | s/step | Mparams/s | GB/s at {ADAM_BYTES} B | of the bound |")
    print("|---|---|---|---|---|")
    for name, kw in (("fused", {"fused": True}), ("foreach", {"foreach": True})):
        rate = cpu_adam(a.numel, a.tensors, a.steps, **kw) * 1e9
        print(f"| {name} | {a.numel / rate:.3f} | {rate / 1e6:.0f} | {rate * ADAM_BYTES / 1e9:.1f} | "
              f"{rate / bound:.0%} |", flush=True)


if __name__ == "__main__":
    main()
