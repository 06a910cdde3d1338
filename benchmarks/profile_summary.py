"""Summarise a chrome trace from `--profile`: GPU kernel time by category, the top kernels, and how
much of the profiled wall time the GPU was busy (the rest is host overhead or waiting).

    python benchmarks/profile_summary.py megapar_trace_rank0.json [--iters 2] [--top 25] [--by-op]

--by-op also names, for the top kernels, the innermost CPU operator that launched them (runs
without a CUDA graph only: a graph replay launches its kernels without operators).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict

# first match wins; kernel names are matched case-insensitively
CATEGORIES = [
    ("attention", r"flash|fmha|cudnn|attention|sdpa"),
    ("gemm", r"gemm|nvjet|sm90_xmma|cutlass|ampere_|sm80_|splitk"),
    ("nccl", r"nccl"),
    ("optimizer", r"adam|multi_tensor|foreach|l2norm|amp_"),
    ("compiled (triton)", r"^triton_"),
    ("cross entropy / softmax", r"softmax|cross_entropy|log_softmax|nll"),
    ("layernorm", r"layer_norm|layernorm"),
    ("memcpy / memset", r"memcpy|memset"),
    ("reduction", r"reduce"),
    ("elementwise", r"elementwise|vectorized|unrolled|fill|copy|index"),
]


def category(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return cat
    return "other"


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total, end = total + e - s, e
        elif e > end:
            total, end = total + e - end, e
    return total


def launching_ops(events: list[dict], depth: int = 3) -> dict[int, str]:
    """correlation id -> the innermost `depth` CPU ops (outer > inner, same thread) around the
    runtime call that launched the kernel with that id, each with the shapes of its first two
    tensor inputs when the trace recorded them."""
    threads = defaultdict(list)  # (pid, tid) -> [(ts, order, end, name or correlation)]
    for e in events:
        if e.get("cat") == "cpu_op" and "dur" in e:
            dims = [d for d in e.get("args", {}).get("Input Dims", []) if d]   # traces with record_shapes
            name = e["name"] + (str(dims[:2]).replace(" ", "") if dims else "")
            threads[(e["pid"], e["tid"])].append((e["ts"], -e["dur"], e["ts"] + e["dur"], name))
        elif e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            threads[(e["pid"], e["tid"])].append((e["ts"], 1, None, e["args"]["correlation"]))
    found = {}
    for items in threads.values():
        stack = []                                                  # open ops: (end, name)
        for ts, _, end, what in sorted(items, key=lambda t: t[:2]):
            while stack and stack[-1][0] < ts:
                stack.pop()
            if end is None:
                if stack:
                    found[what] = " > ".join(name for _, name in stack[-depth:])
            else:
                stack.append((end, what))
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--iters", type=int, default=2, help="profiled iterations (to report per-iteration ms)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--by-op", action="store_true", help="name the CPU operator that launched each top kernel")
    args = p.parse_args()
    events = json.load(open(args.trace))["traceEvents"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not kernels:
        sys.exit(f"{args.trace}: no GPU kernels in the trace (was it profiled on a GPU?)")
    by_cat, by_name, count = defaultdict(float), defaultdict(float), defaultdict(int)
    launcher, callers = launching_ops(events) if args.by_op else {}, defaultdict(lambda: defaultdict(int))
    for e in kernels:
        by_cat[category(e["name"])] += e["dur"]
        by_name[e["name"]] += e["dur"]
        count[e["name"]] += 1
        callers[e["name"]][launcher.get(e.get("args", {}).get("correlation"), "?")] += 1
    first = min(e["ts"] for e in kernels)
    last = max(e["ts"] + e["dur"] for e in kernels)
    busy = busy_time([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    n = args.iters
    print(f"per iteration: GPU span {(last - first) / 1e3 / n:.2f} ms, GPU busy {busy / 1e3 / n:.2f} ms, "
          f"kernel time {sum(by_cat.values()) / 1e3 / n:.2f} ms, {len(kernels) // n} kernels")
    print("\n| category | ms/iter | share |\n|---|---|---|")
    total = sum(by_cat.values())
    for cat, t in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        print(f"| {cat} | {t / 1e3 / n:.2f} | {100 * t / total:.1f}% |")
    print("\n| top kernels | calls/iter | ms/iter |"
          + (" launched by |\n|---|---|---|---|" if args.by_op else "\n|---|---|---|"))
    for name, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:args.top]:
        row = f"| {name[:110]} | {count[name] / n:.0f} | {t / 1e3 / n:.2f} |"
        if args.by_op:
            top = sorted(callers[name].items(), key=lambda kv: -kv[1])[:3]
            row += " " + ", ".join(f"{op} ×{k}" for op, k in top) + " |"
        print(row)


if __name__ == "__main__":
    main()
