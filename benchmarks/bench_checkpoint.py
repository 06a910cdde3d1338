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
          "6.7b": ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
                   "--max-position-embeddings", "2048"],
          "tiny": ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"]}
# --parts scale: saved with ZeRO-3 and the optimizer on the CPU, resumed at tensor-parallel size --gpus (ZeRO-1)
SCALE_SAVE = ["--zero-stage", "3", "--optimizer-cpu-offload"]
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
    with open(os.path.join(args.log_dir or args.workdir, f"{name}.log"), "w") as f:
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--shape", choices=list(SHAPES), default="1.3b")
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--every", type=int, default=50, help="async save interval of the overhead runs")
    p.add_argument("--overhead-iters", type=int, default=150)
    p.add_argument("--overhead-global-batch", type=int, default=64)
    p.add_argument("--parts", nargs="+", default=["formats", "overhead", "resume"],
                   choices=["formats", "overhead", "resume", "scale"])
    p.add_argument("--workdir", default="/tmp/ckbench", help="checkpoints and the data cache")
    p.add_argument("--log-dir", default=None, help="each run's timestamped output (default: --workdir)")
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    zero = ["--zero-stage", "1"] if args.gpus > 1 else []
    saved, rows = {}, []
    for name, fmt in (("legacy", ["--ckpt-format", "torch", "--save-interval", "10"]),   # goes on to 12: the reference
                      ("torch_dist", ["--ckpt-format", "torch_dist", "--exit-interval", "10"]),
                      ("async", ["--ckpt-format", "torch_dist", "--async-save", "--exit-interval", "10"])):
        if "formats" not in args.parts:
            break
        ck = os.path.join(args.workdir, name)
        r = saved[name] = run(name, zero + fmt + ["--train-iters", "12", "--log-interval", "1", "--save", ck], args)
        stall, total = save_times(r)
        first = os.path.join(ck, "iter_0000010")
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(first) for f in fs) / 2**30
        rows.append((name, r["rc"], stall, total, size, r["peak_rss_gb"]))
        if name != "torch_dist":
            shutil.rmtree(ck, ignore_errors=True)
    if "overhead" in args.parts:
        every = ["--train-iters", str(args.overhead_iters), "--log-interval", "10",
                 "--global-batch-size", str(args.overhead_global_batch)]
        base = run("no_save", zero + every + ["--save", ""], args)
        asy = run("async_every", zero + every + ["--save", os.path.join(args.workdir, "every"), "--save-interval",
                                                 str(args.every), "--ckpt-format", "torch_dist", "--async-save"],
                  args)
        shutil.rmtree(os.path.join(args.workdir, "every"), ignore_errors=True)
    if "resume" in args.parts:
        other = ["--tensor-model-parallel-size", str(args.gpus)] if args.gpus > 1 else []
        resumed = run("resume_other_layout", other + ["--train-iters", "12", "--log-interval", "1", "--load",
                                                      os.path.join(args.workdir, "torch_dist"), "--save", ""], args)
    if "scale" in args.parts:   # reference run, the same run saving at iteration 2, the resume at another layout
        ck = os.path.join(args.workdir, "scale")
        scale = [run("scale_reference", SCALE_SAVE + ["--train-iters", "3", "--log-interval", "1", "--save", ""], args),
                 run("scale_save", SCALE_SAVE + ["--train-iters", "3", "--exit-interval", "2", "--log-interval", "1",
                                                 "--save", ck, "--ckpt-format", "torch_dist"], args),
                 run("scale_resume", ["--tensor-model-parallel-size", str(args.gpus), "--zero-stage", "1",
                                      "--optimizer-cpu-offload", "--train-iters", "3", "--log-interval", "1",
                                      "--load", ck, "--save", ""], args)]
        first = os.path.join(ck, "iter_0000002")
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(first) for f in fs) / 2**30
        stall, _ = save_times(scale[1])
        load = _first(scale[2]["lines"], "successfully loaded checkpoint") - \
            _first(scale[2]["lines"], "> optimizer: AdamW")
        loss = lambda r: [(int(i), float(v)) for _, l in r["lines"] for i, v in LOSS.findall(l)]  # noqa: E731
        print(f"\n{args.shape}, {args.gpus} GPUs, ZeRO-3 + optimizer offload, torch_dist (rc "
              f"{[r['rc'] for r in scale]}): save {stall:.1f} s, {size:.1f} GiB, "
              f"peak host RSS {scale[1]['peak_rss_gb']:.1f} GiB (no-save run: {scale[0]['peak_rss_gb']:.1f}); "
              f"loaded at tp {args.gpus} ZeRO-1 offload in {load:.1f} s; "
              f"losses {loss(scale[0])} uninterrupted, {loss(scale[1])} + {loss(scale[2])} saved and resumed")
    if rows:
        print(f"\ncheckpoint saves, {args.shape}, {args.gpus} GPU(s), bf16, ZeRO-{1 if zero else 0}")
        print("| format | rc | training stall (s) | saved after (s) | size of one save (GiB) "
              "| peak host RSS, all ranks (GiB) |")
        print("|---|---|---|---|---|---|")
        for name, rc, stall, total, size, rss in rows:
            print(f"| {name} | {rc} | {stall:.1f} | {total:.1f} | {size:.1f} | {rss:.1f} |")
    if "overhead" in args.parts:
        b, a = loop_seconds(base), loop_seconds(asy)
        print(f"\nasync saves every {args.every} iterations, global batch {args.overhead_global_batch} (rc "
              f"{base['rc']}/{asy['rc']}): stalls {', '.join(f'{x:.2f}' for x in stalls(asy))} s; iterations "
              f"10..{args.overhead_iters} took {b:.1f} s without saves, {a:.1f} s with: overhead "
              f"{(a / b - 1) * 100:.1f}%")
    if "resume" in args.parts:
        losses = lambda r: [(int(i), float(v)) for _, l in r["lines"] for i, v in LOSS.findall(l)][-2:]  # noqa: E731
        reference = losses(saved["legacy"]) if "legacy" in saved else "not run"
        print(f"torch_dist checkpoint of iteration 10 resumed at tp {args.gpus} (rc {resumed['rc']}): losses "
              f"{losses(resumed)}; the saving layout went on to {reference}")


def stalls(r: dict) -> list[float]:
    """Per async save: from 'saving checkpoint at iteration N' to 'copied the state of iteration N'."""
    out = []
    for t, line in r["lines"]:
        m = re.search(r"saving checkpoint at iteration\s+(\d+)", line)
        if m:
            out.append(_first(r["lines"], f"copied the state of iteration {int(m.group(1)):7d}", t) - t)
    return out


def loop_seconds(r: dict) -> float:
    """Wall time from the first logged window (iteration 10) to the last iteration line."""
    its = [t for t, line in r["lines"] if ITER_MS.search(line)]
    return its[-1] - its[0] if len(its) > 1 else float("nan")


if __name__ == "__main__":
    main()
