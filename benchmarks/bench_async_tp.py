"""Async TP micro-benchmark: is overlapping the sequence-parallel collectives with the GEMMs worth it?

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_async_tp.py [--shape 1.3b]

For the four linears of a GPT-2 345M layer (or the 1.3B shape's, hidden 2048) at tp 2 (8192
tokens, bf16), times the path megapar takes with --sequence-parallel (NCCL all-gather then GEMM;
GEMM then NCCL reduce-scatter) against torch's symmetric-memory fused ops (the GEMM split into
chunks that start as each chunk arrives), eager and captured in a CUDA graph (megapar captures its
training step), and the row-parallel GEMMs with the all-reduce that replaces their reduce-scatter
without sequence parallelism, whole and in 2 or 4 chunks whose all-reduces travel while the next
chunk's GEMM runs. Prints max |difference| and microseconds per call (results:
docs/benchmarks/tp2-fsdp2_h100_20261127.md).
"""
from __future__ import annotations

import argparse
import os
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory  # noqa: F401  (registers torch.ops.symm_mem)

from gpu_timing import capture, cuda_us  # benchmarks/gpu_timing.py

HIDDEN = {"345m": 1024, "1.3b": 2048}
TOKENS = 8192


def all_gather_gemms(h: int, tp: int) -> list[tuple[str, int, int, int]]:
    """(name, tokens, in features, out features per rank) of the column-parallel linears."""
    return [("qkv: all-gather + GEMM", TOKENS, h, 3 * h // tp), ("fc1: all-gather + GEMM", TOKENS, h, 4 * h // tp)]


def gemm_reduce_scatters(h: int, tp: int) -> list[tuple[str, int, int, int]]:
    """(name, tokens, in features per rank, out features) of the row-parallel linears."""
    return [("attention out: GEMM + reduce-scatter", TOKENS, h // tp, h),
            ("fc2: GEMM + reduce-scatter", TOKENS, 4 * h // tp, h)]


def timed(fn: Callable, iters: int = 50, graph: bool = False) -> float:
    """Microseconds per call of fn (replayed from a CUDA graph with graph=True)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return cuda_us(capture(fn).replay if graph else fn, iters, before=dist.barrier)


def attempt(fn: Callable):
    """fn(), or the reason it failed (a capture may be unsupported: report it, on every rank alike)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return f"failed: {type(e).__name__}: {str(e)[:80]}"


def row(name: str, nccl: Callable, fused: Callable, gemm: Callable) -> tuple:
    return (name, attempt(lambda: (nccl() - fused()).abs().max().item()), attempt(lambda: timed(gemm)),
            attempt(lambda: timed(nccl)), attempt(lambda: timed(fused)),
            attempt(lambda: timed(nccl, graph=True)), attempt(lambda: timed(fused, graph=True)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="345m", choices=list(HIDDEN))
    h = HIDDEN[p.parse_args().shape]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    group = dist.group.WORLD.group_name
    torch.manual_seed(rank)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    rows, reduced = [], []
    for name, tokens, k, n in all_gather_gemms(h, world):
        shard, w = torch.randn(tokens // world, k, **bf16), torch.randn(k, n, **bf16) / k ** 0.5
        full = torch.empty(tokens, k, **bf16)

        def nccl(shard=shard, w=w, full=full):
            dist.all_gather_into_tensor(full, shard)                     # [T/tp, k] -> [T, k]
            return full @ w

        def fused(shard=shard, w=w):
            return torch.ops.symm_mem.fused_all_gather_matmul(shard, [w], 0, group)[1][0]

        rows.append(row(name, nccl, fused, lambda full=full, w=w: full @ w))
    for name, tokens, k, n in gemm_reduce_scatters(h, world):
        a, w = torch.randn(tokens, k, **bf16), torch.randn(k, n, **bf16) / k ** 0.5
        out = torch.empty(tokens // world, n, **bf16)

        def nccl(a=a, w=w, out=out):
            dist.reduce_scatter_tensor(out, a @ w)                       # [T, n] -> [T/tp, n]
            return out

        def fused(a=a, w=w):
            return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, w, "sum", 0, group)

        rows.append(row(name, nccl, fused, lambda a=a, w=w: a @ w))

        def all_reduced(a=a, w=w):  # the path without sequence parallelism: [T, n] summed in place
            y = a @ w
            dist.all_reduce(y)
            return y

        def chunked(a=a, w=w, chunks=2):  # each chunk's all-reduce travels while the next chunk's GEMM runs
            y = a.new_empty(a.shape[0], w.shape[1])
            works = []
            for rows in torch.arange(a.shape[0]).chunk(chunks):
                part = y[rows[0]:rows[-1] + 1]
                torch.mm(a[rows[0]:rows[-1] + 1], w, out=part)
                works.append(dist.all_reduce(part, async_op=True))
            for work in works:
                work.wait()
            return y

        reduced.append((name.replace("reduce-scatter", "all-reduce, no SP"), attempt(lambda: timed(all_reduced)),
                        attempt(lambda: timed(all_reduced, graph=True)),
                        *(attempt(lambda c=c: timed(lambda: chunked(chunks=c), graph=True)) for c in (2, 4)),
                        attempt(lambda: (chunked(chunks=4) - all_reduced()).abs().max().item())))
    if rank == 0:
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, tp {world}")
        print("| op | max diff | GEMM alone µs | NCCL path µs | fused µs | NCCL graphed µs | fused graphed µs |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print("| " + " | ".join(f"{x:.1f}" if isinstance(x, float) else str(x) for x in r) + " |", flush=True)
        print("| op | µs | graphed µs | 2 chunks graphed µs | 4 chunks graphed µs | max diff |")
        print("|---|---|---|---|---|---|")
        for r in reduced:
            print("| " + " | ".join(f"{x:.1f}" if isinstance(x, float) else str(x) for x in r) + " |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
