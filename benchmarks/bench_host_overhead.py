"""Host time per layer per microbatch: megapar's training forward + backward against nanoGPT's.

    python benchmarks/bench_host_overhead.py --nanogpt-dir .gpu/nanogpt [--layers 12] [--rounds 5]
        [--dropout 0 0.1] [--device cpu] [--compile] [--profile]

At a tiny width (hidden 64, 4 heads, 16 tokens, one sequence) the arithmetic costs next to nothing, so
a step's time is what the host spends launching it: Python, autograd, the dispatcher, hooks. This is
the cost that makes small layers, pipeline stages and interleaving host-bound on fast GPUs. megapar's
step is its real one (the model and gradient buffer of `build_run`, with their hooks and the fused
weight-gradient accumulation); nanoGPT's `GPT` (github.com/karpathy/nanoGPT's model.py, never
committed: put it in a git-ignored folder and name it with --nanogpt-dir) at the same shape, with
biases. Rounds alternate between the two; each prints the median of its timed steps, and the table
gives the median over rounds of the time per layer. `--compile` adds megapar with `--torch-compile`
(each layer compiled, as training compiles it). `--profile` adds cProfile's top functions of
megapar's step.
"""
from __future__ import annotations

import argparse
import cProfile
import importlib.util
import os
import pstats
import statistics
import time
from typing import Callable

import torch

HIDDEN, HEADS, SEQ, VOCAB = 64, 4, 16, 256


def median_step(step: Callable[[], None], steps: int = 30, warmup: int = 5) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def nanogpt_module(nanogpt_dir: str):
    """nanoGPT's model.py (its GPT, GPTConfig), loaded from the folder it was copied to."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", os.path.join(nanogpt_dir, "model.py"))
    nano = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nano)
    return nano


def nanogpt_step(nanogpt_dir: str, layers: int, dropout: float, device: str) -> Callable[[], None]:
    nano = nanogpt_module(nanogpt_dir)
    cfg = nano.GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=layers, n_head=HEADS, n_embd=HIDDEN,
                         dropout=dropout, bias=True)
    gpt = nano.GPT(cfg).to(device)
    x = torch.randint(0, VOCAB, (1, SEQ), device=device)

    def step() -> None:
        _, loss = gpt(x, x)
        loss.backward()
        sync(device)
    return step


def megapar_step(layers: int, dropout: float, device: str, compiled: bool = False) -> Callable[[], None]:
    from megapar.config.build import parse_config
    from megapar.run.initialize import build_run
    from megapar.topology import Topology
    cfg = parse_config(["--num-layers", str(layers), "--hidden-size", str(HIDDEN), "--num-attention-heads",
                        str(HEADS), "--seq-length", str(SEQ), "--micro-batch-size", "1", "--global-batch-size", "1",
                        "--train-iters", "1", "--hidden-dropout", str(dropout), "--attention-dropout", str(dropout),
                        "--make-vocab-size-divisible-by", "1", *(["--torch-compile"] if compiled else [])],
                       world_size=1)
    topo = Topology(1, 1, 1)
    topo.create_groups(0)
    run = build_run(cfg, topo, 0, torch.device(device), vocab_size=VOCAB)
    tokens = torch.randint(0, VOCAB, (1, SEQ), device=device)
    run.grad_buffer.start_step()

    def step() -> None:
        run.model(tokens, labels=tokens).float().mean().backward()
        sync(device)
    return step


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nanogpt-dir", required=True)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.1])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--compile", action="store_true", help="also megapar with --torch-compile")
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=0, world_size=1)
    rows = []
    for dropout in a.dropout:
        steps = {"nanoGPT": nanogpt_step(a.nanogpt_dir, a.layers, dropout, a.device),
                 "megapar": megapar_step(a.layers, dropout, a.device)}
        if a.compile:
            steps["megapar compiled"] = megapar_step(a.layers, dropout, a.device, compiled=True)
        per_layer: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(a.rounds):
            for name, step in steps.items():
                per_layer[name].append(median_step(step) / a.layers)
        rows.append((dropout, *(statistics.median(per_layer[n]) for n in steps)))
        if a.profile:
            prof = cProfile.Profile()
            prof.runcall(lambda: [steps["megapar"]() for _ in range(10)])
            pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    print(f"\nhost time per layer per microbatch ({a.device}, {torch.get_num_threads()} thread, hidden {HIDDEN}, "
          f"{HEADS} heads, {SEQ} tokens, {a.layers} layers; median of {a.rounds} alternating rounds)")
    names = ["nanoGPT", "megapar"] + (["megapar compiled"] if a.compile else [])
    print("| dropout | " + " | ".join(f"{n} ms/layer" for n in names) + " | " +
          " | ".join(f"{n} / nanoGPT" for n in names[1:]) + " |")
    print("|---" * (2 * len(names)) + "|")
    for dropout, nano, *mine in rows:
        print(f"| {dropout:g} | {nano * 1e3:.3f} | " + " | ".join(f"{m * 1e3:.3f}" for m in mine) + " | " +
              " | ".join(f"{m / nano:.2f}" for m in mine) + " |")


if __name__ == "__main__":
    main()
