"""Async TP micro-benchmark: is overlapping the sequence-parallel collectives with the GEMMs worth it?

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_async_tp.py

For the four linears of a GPT-2 345M layer at tp 2 (8192 tokens, bf16), times the path megapar
takes with --sequence-parallel (NCCL all-gather then GEMM; GEMM then NCCL reduce-scatter) against
torch's symmetric-memory fused ops (the GEMM split into chunks that start as each chunk arrives),
eager and captured in a CUDA graph (megapar captures its training step). Prints max |difference|
and microseconds per call. 2x H200 (2026-11-21): graphed, the fused all-gather GEMMs saved 23-30 µs,
the fused reduce-scatter GEMMs -10 to +4 µs; eager they were 3-5x slower (docs/performance.md).
"""
from __future__ import annotations

import os
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory  # noqa: F401  (registers torch.ops.symm_mem)

from gpu_timing import capture, cuda_us  # benchmarks/gpu_timing.py

# (name, tokens, in features, out features per rank) at 345M tp 2
ALL_GATHER_GEMMS = [("qkv: all-gather + GEMM", 8192, 1024, 1536), ("fc1: all-gather + GEMM", 8192, 1024, 2048)]
GEMM_REDUCE_SCATTERS = [("attention out: GEMM + reduce-scatter", 8192, 512, 1024),
                        ("fc2: GEMM + reduce-scatter", 8192, 2048, 1024)]


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
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    group = dist.group.WORLD.group_name
    torch.manual_seed(rank)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    rows = []
    for name, tokens, k, n in ALL_GATHER_GEMMS:
        shard, w = torch.randn(tokens // world, k, **bf16), torch.randn(k, n, **bf16) / k ** 0.5
        full = torch.empty(tokens, k, **bf16)

        def nccl(shard=shard, w=w, full=full):
            dist.all_gather_into_tensor(full, shard)                     # [T/tp, k] -> [T, k]
            return full @ w

        def fused(shard=shard, w=w):
            return torch.ops.symm_mem.fused_all_gather_matmul(shard, [w], 0, group)[1][0]

        rows.append(row(name, nccl, fused, lambda full=full, w=w: full @ w))
    for name, tokens, k, n in GEMM_REDUCE_SCATTERS:
        a, w = torch.randn(tokens, k, **bf16), torch.randn(k, n, **bf16) / k ** 0.5
        out = torch.empty(tokens // world, n, **bf16)

        def nccl(a=a, w=w, out=out):
            dist.reduce_scatter_tensor(out, a @ w)                       # [T, n] -> [T/tp, n]
            return out

        def fused(a=a, w=w):
            return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, w, "sum", 0, group)

        rows.append(row(name, nccl, fused, lambda a=a, w=w: a @ w))
    if rank == 0:
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, tp {world}")
        print("| op | max diff | GEMM alone µs | NCCL path µs | fused µs | NCCL graphed µs | fused graphed µs |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print("| " + " | ".join(f"{x:.1f}" if isinstance(x, float) else str(x) for x in r) + " |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
