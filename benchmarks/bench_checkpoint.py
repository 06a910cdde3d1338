"""Checkpoint benchmark: save time of the legacy format, torch_dist and torch_dist with --async-save
(the training stall, the write time and peak host memory), then the step-time cost of async saves
every --every iterations against the same run without saves; last, a resume of the torch_dist
checkpoint at another layout (its first loss beside the saving run's next).

    python benchmarks/bench_checkpoint.py --gpus 2 --shape 1.3b --workdir /tmp/ckbench

Each run goes through scripts/pretrain_gpt2.sh on the embedded default corpus (built on first use).
Times come from when the run prints its save lines (this script timestamps every output line); host
memory is the largest resident set of the training processes, sampled every 50 ms.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {"1.3b": ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16"],
          "345m": ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16"],
          "tiny": ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"]}
ITER_MS = re.compile(r"elapsed time per iteration \(ms\): ([\d.]+)")
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*lm loss: ([\d.E+-]+)")


def _tree_rss(pid: int) -> int:
    """Resident bytes of `pid`'s children's children (the training ranks under torchrun), summed."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != pid and not _descends(ppid, pid):
                continue
            with open(f"/proc/{entry}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    return total


def _descends(pid: int, root: int, depth: int = 4) -> bool:
    for _ in range(depth):
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid == root:
            return True
    return False


def run(name: str, flags: list[str], args) -> dict:
    """One training run: its timestamped lines, peak host memory, return code."""
    cmd = ["bash", os.path.join(ROOT, "scripts", "pretrain_gpt2.sh"), "--nproc-per-node", str(args.gpus),
           *SHAPES[args.shape], "--seq-length", str(args.seq), "--micro-batch-size", str(args.micro), "--bf16",
           "--global-batch-size", str(args.micro * args.gpus), "--eval-interval", "0", "--eval-iters", "0",
           "--lr", "1e-4", "--lr-warmup-iters", "5", "--hidden-dropout", "0", "--attention-dropout", "0",
           "--data-cache-path", os.path.join(args.workdir, "data"), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    peak, lines, done = [0], [], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for line in proc.stdout:
        lines.append((time.monotonic(), line.rstrip("\n")))
    proc.wait()
    done.set()
    with open(os.path.join(args.workdir, f"{name}.log"), "w") as f:
        f.write(" ".join(cmd) + "\n" + "\n".join(f"{t:.3f} {l}" for t, l in lines))
    return {"name": name, "rc": proc.returncode, "lines": lines, "peak_rss_gb": peak[0] / 2**30}


def _first(lines, text: str, after: float = 0.0) -> float:
    return next((t for t, l in lines if text in l and t >= after), float("nan"))


def save_times(r: dict) -> tuple[float, float]:
    """(training stall, until published) of the run's first save, in seconds."""
    start = _first(r["lines"], "saving checkpoint at iteration")
    stall = min(_first(r["lines"], "successfully saved checkpoint", start),
                _first(r["lines"], "copied the state of iteration", start))
    return stall - start, _first(r["lines"], "successfully saved checkpoint", start) - start


def mean_iter_ms(r: dict) -> float:
    ms = [float(m) for _, l in r["lines"] for m in ITER_MS.findall(l)][1:]   # the first window warms up
    return sum(ms) / len(ms) if ms else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--shape", choices=list(SHAPES), default="1.3b")
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--every", type=int, default=50, help="async save interval of the overhead runs")
    p.add_argument("--overhead-iters", type=int, default=150)
    p.add_argument("--workdir", default="/tmp/ckbench")
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    zero = ["--zero-stage", "1"] if args.gpus > 1 else []
    rows = []
    saved = {}
    for name, fmt in (("legacy", ["--ckpt-format", "torch", "--save-interval", "10"]),   # goes on to 12: the reference
                      ("torch_dist", ["--ckpt-format", "torch_dist", "--exit-interval", "10"]),
                      ("async", ["--ckpt-format", "torch_dist", "--async-save", "--exit-interval", "10"])):
        ck = os.path.join(args.workdir, name)
        r = saved[name] = run(name, zero + fmt + ["--train-iters", "12", "--log-interval", "1", "--save", ck], args)
        stall, total = save_times(r)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ck) for f in fs) / 2**30
        rows.append((name, r["rc"], stall, total, size, r["peak_rss_gb"]))
        if name != "torch_dist":
            shutil.rmtree(ck, ignore_errors=True)
    base = run("no_save", zero + ["--train-iters", str(args.overhead_iters), "--log-interval", "10", "--save", ""],
               args)
    asy = run("async_every", zero + ["--train-iters", str(args.overhead_iters), "--log-interval", "10", "--save",
                                     os.path.join(args.workdir, "every"), "--save-interval", str(args.every),
                                     "--ckpt-format", "torch_dist", "--async-save"], args)
    stalls = [t2 - t1 for (t1, l1), (t2, l2) in zip(asy["lines"], asy["lines"][1:])
              if "saving checkpoint at iteration" in l1 and "copied the state" in l2]
    shutil.rmtree(os.path.join(args.workdir, "every"), ignore_errors=True)
    other = ["--tensor-model-parallel-size", str(args.gpus)] if args.gpus > 1 else []
    resumed = run("resume_other_layout", other + ["--train-iters", "12", "--log-interval", "1", "--load",
                                                  os.path.join(args.workdir, "torch_dist"), "--save", ""], args)
    print(f"\ncheckpoint saves, {args.shape}, {args.gpus} GPU(s), bf16, ZeRO-{1 if zero else 0}")
    print(f"| format | rc | training stall (s) | saved after (s) | size (GiB) | peak host RSS, all ranks (GiB) |")
    print("|---|---|---|---|---|---|")
    for name, rc, stall, total, size, rss in rows:
        print(f"| {name} | {rc} | {stall:.1f} | {total:.1f} | {size:.1f} | {rss:.1f} |")
    b, a = mean_iter_ms(base), mean_iter_ms(asy)
    n_saves = len(stalls)
    cost = (a - b) / b * 100 + sum(stalls) * 1000 / (args.overhead_iters * b) * 100
    print(f"\nasync saves every {args.every} iterations over {args.overhead_iters}: {n_saves} saves, stalls "
          f"{', '.join(f'{s:.2f}' for s in stalls)} s; iteration {b:.1f} ms without saves, {a:.1f} ms with "
          f"(rc {base['rc']}/{asy['rc']}): step-time overhead {cost:.1f}%")
    losses = lambda r: [(int(i), float(v)) for _, l in r["lines"] for i, v in LOSS.findall(l)][-2:]  # noqa: E731
    print(f"torch_dist checkpoint of iteration 10 resumed at tp {args.gpus} (rc {resumed['rc']}): losses "
          f"{losses(resumed)}; the saving layout went on to {losses(saved['legacy'])}")


if __name__ == "__main__":
    main()
