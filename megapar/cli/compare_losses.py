"""Side-by-side per-iteration 'lm loss' of two training logs (e.g. two parallel layouts).

    python tools/compare_losses.py run_a.log run_b.log [--tolerance 0.02]

Prints a table of the iterations both logs report and the largest relative difference;
exits 1 when it exceeds --tolerance, 2 on bad input (a missing log: one `error:` line).
"""
from __future__ import annotations

import argparse
import os
import re
import sys

from megapar.errors import OneLineErrorParser

LINE = re.compile(r" iteration\s+(\d+)/\s*\d+ .*?lm loss: ([\d.E+-]+)")


def losses(path: str) -> dict[int, float]:
    with open(path, errors="replace") as f:
        return {int(m.group(1)): float(m.group(2)) for m in map(LINE.search, f) if m}


def main(argv=None) -> int:
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log_a", help="the first training log (its ' iteration ... lm loss: ...' lines)")
    p.add_argument("log_b", help="the second training log, the reference of the relative difference")
    p.add_argument("--tolerance", type=float, default=0.02, help="max relative difference (bf16: ~1e-2)")
    p.add_argument("--every", type=int, default=5, help="print every N-th common iteration")
    args = p.parse_args(argv)
    for path in (args.log_a, args.log_b):
        if not os.path.exists(path):
            p.error(f"no such log file: {path} (give the paths of two training logs)")
    a, b = losses(args.log_a), losses(args.log_b)
    common = sorted(set(a) & set(b))
    if not common:
        print(f"no common iterations between {args.log_a} and {args.log_b}", file=sys.stderr)
        return 2
    print(f"| iteration | {args.log_a} | {args.log_b} | rel. diff |\n|---|---|---|---|")
    worst = 0.0
    for i in common:
        rel = abs(a[i] - b[i]) / abs(b[i])
        worst = max(worst, rel)
        if i % args.every == 0 or i == common[0]:
            print(f"| {i} | {a[i]:.4f} | {b[i]:.4f} | {rel:.2e} |")
    print(f"max relative difference over {len(common)} iterations: {worst:.2e} (tolerance {args.tolerance})")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
