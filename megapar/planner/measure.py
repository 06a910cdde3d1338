"""`--calibrate`: measure the cost model's constants on the machine at hand (one CUDA GPU or more) and
write them as a calibration JSON (minutes at most; docs/performance.md#the-layout-planner-on-paper).

    bf16 GEMM TFLOP/s         torch.matmul at 8 shapes from 2 to 1100 GFLOP        -> gemm_tflops
    attention TFLOP/s         causal SDPA forward and backward, head dim 64 and 128 -> attn_fwd/bwd_tflops
    HBM bandwidth             a 1 GiB device-to-device copy (read + write counted)  -> hbm_gbps
    NCCL                      all-reduce, all-gather, reduce-scatter from 64 KiB to 256 MiB over 2 and all
                              visible GPUs (spawned workers), send/recv between 2   -> intra_node
                              (with one GPU: skipped, the defaults kept, a note says so; inter_node is never
                              measured here: it needs two nodes)
    PCIe                      pinned 1 GiB host <-> device copies                   -> pcie_h2d/d2h_gbps
    CPU AdamW                 torch.optim.AdamW(fused=True) on 200M fp32 CPU params -> cpu_adam_gparams_s
The overlap factors and overheads keep their defaults (they need whole training steps to measure).
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict
from typing import Callable, Optional

from ..topology import ConfigError
from .calibration import DEFAULTS, Calibration, Link, gpu_kind

GEMM_SHAPES = [(2048, 1024, 512), (4096, 1024, 1024), (8192, 1024, 1024), (8192, 3072, 1024), (8192, 4096, 2048),
               (8192, 6144, 2048), (16384, 8192, 4096), (16384, 16384, 2048)]
ATTENTION = [(8, 16, 1024, 64), (4, 16, 2048, 128), (2, 32, 2048, 128), (4, 8, 4096, 128)]  # (b, heads, s, d)
NCCL_SIZES = [64 * 2**10, 2**20, 16 * 2**20, 256 * 2**20]
NCCL_REPS = {64 * 2**10: 50, 2**20: 50, 16 * 2**20: 20, 256 * 2**20: 5}   # the same on every rank


def cuda_seconds(fn: Callable[[], None], min_time: float = 0.05, warmup: int = 3, reps: Optional[int] = None
                 ) -> float:
    """Median of 3 samples of the seconds of one call of `fn`, timed with CUDA events; each sample runs
    `reps` calls (default: as many as take `min_time`). Collectives must pass `reps`: every rank has to
    make the same number of calls."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if reps is None:
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        reps = max(1, int(min_time / max(start.elapsed_time(end) / 1e3, 1e-6)))
    samples = []
    for _ in range(3):
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(samples)


def gemm_table() -> tuple[list[list[float]], list[str]]:
    import torch
    points, notes = {}, []
    for m, n, k in GEMM_SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        s = cuda_seconds(lambda: torch.matmul(a, b))
        gflop = 2 * m * n * k / 1e9
        points[round(gflop, 3)] = gflop / s / 1e3
        notes.append(f"GEMM {m}x{n}x{k}: {gflop:.1f} GFLOP, {gflop / s / 1e3:.0f} TFLOP/s")
    return [[g, round(t, 1)] for g, t in sorted(points.items())], notes


def attention() -> tuple[float, float, list[str]]:
    import torch
    import torch.nn.functional as F
    fwd, bwd, notes = [], [], []
    for b, heads, s, d in ATTENTION:
        q, k, v = (torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        grad = torch.randn_like(out)
        flops = 2.0 * b * s * s * heads * d            # causal forward: half of 4 b s² h
        t_fwd = cuda_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        t_both = cuda_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad))
        t_bwd = max(t_both - t_fwd, 1e-9)
        fwd.append(flops / t_fwd / 1e12)
        bwd.append(2 * flops / t_bwd / 1e12)
        notes.append(f"attention b{b} heads {heads} s{s} d{d}: forward {fwd[-1]:.0f}, backward {bwd[-1]:.0f} TFLOP/s")
    return statistics.mean(fwd), statistics.mean(bwd), notes


def hbm_gbps() -> float:
    import torch
    x = torch.empty(2**29, device="cuda", dtype=torch.bfloat16)   # 1 GiB
    y = torch.empty_like(x)
    return 2 * x.numel() * 2 / cuda_seconds(lambda: y.copy_(x)) / 1e9


def pcie() -> tuple[float, float]:
    import torch
    host = torch.empty(2**28, dtype=torch.float32, pin_memory=True)  # 1 GiB
    dev = torch.empty(2**28, dtype=torch.float32, device="cuda")
    h2d = cuda_seconds(lambda: dev.copy_(host, non_blocking=True), warmup=1)
    d2h = cuda_seconds(lambda: host.copy_(dev, non_blocking=True), warmup=1)
    return 2**30 / h2d / 1e9, 2**30 / d2h / 1e9


def cpu_adam(numel: int = 200_000_000, tensors: int = 1, steps: int = 2, **impl) -> float:
    """G parameters per second of torch's CPU AdamW (all cores) over `numel` parameters split into
    `tensors` tensors; impl: the AdamW implementation flag (default fused=True, as offload uses)."""
    import torch
    params = [torch.nn.Parameter(torch.zeros(numel // tensors)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **(impl or {"fused": True}))
    opt.step()  # state allocation
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return steps * numel / (time.perf_counter() - start) / 1e9


# ---- NCCL, in spawned workers -----------------------------------------------------------------------
def cpu_seconds(fn: Callable[[], None], reps: int, warmup: int = 1) -> float:
    """Median of 3 samples of the wall seconds of one call of `fn` (gloo collectives on CPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        samples.append((time.perf_counter() - start) / reps)
    return statistics.median(samples)


def _nccl_worker(rank: int, world: int, port: int, out_path: str, backend: str, sizes: list[int],
                 reps: dict[int, int], p2p_bytes: int) -> None:
    """One rank: every collective at every size (the same calls on every rank), then send/recv when
    world is 2; rank 0 writes the results. backend gloo runs on CPU tensors (tests)."""
    import torch
    import torch.distributed as dist
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)  # the parent's (nccl() below)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)

    def seconds_of(fn, n):
        return cuda_seconds(fn, reps=n) if device.type == "cuda" else cpu_seconds(fn, reps=n)
    results = []
    for size in sizes:
        n = size // 2 // world * world
        full = torch.zeros(n, device=device, dtype=torch.bfloat16)   # zeros: repeated sums stay finite
        shard = torch.zeros(n // world, device=device, dtype=torch.bfloat16)
        ops = {"all_reduce": (lambda: dist.all_reduce(full), 2.0),
               "all_gather": (lambda: dist.all_gather_into_tensor(full, shard), 1.0),
               "reduce_scatter": (lambda: dist.reduce_scatter_tensor(shard, full), 1.0)}
        for op, (fn, factor) in ops.items():
            dist.barrier()
            seconds = seconds_of(fn, reps[size])
            bus = factor * (world - 1) / world * size / seconds / 1e9
            results.append({"op": op, "bytes": size, "group": world, "seconds": seconds, "bus_gbps": bus})
    if world == 2:   # point to point between the two
        x = torch.zeros(p2p_bytes // 2, device=device, dtype=torch.bfloat16)

        def exchange():
            if rank == 0:
                dist.send(x, 1)
            else:
                dist.recv(x, 0)
        dist.barrier()
        seconds = seconds_of(exchange, 10)
        results.append({"op": "p2p", "bytes": p2p_bytes, "group": 2, "seconds": seconds,
                        "bus_gbps": p2p_bytes / seconds / 1e9})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def nccl(gpus: int, backend: str = "nccl", sizes: Optional[list[int]] = None, reps: Optional[dict[int, int]] = None,
         p2p_bytes: int = 256 * 2**20) -> tuple[Link, list[str]]:
    """The intra-node Link from spawned workers over 2 and `gpus` GPUs: bus bandwidth = the slowest
    collective at the largest size over the most GPUs, latency = the slowest smallest all-reduce,
    p2p = the send/recv rate between two."""
    import torch.distributed as dist
    import torch.multiprocessing as mp
    sizes, reps = sizes or NCCL_SIZES, reps or NCCL_REPS
    results = []
    for world in sorted({2, gpus}):
        # the rendezvous store listens here, on a port the OS picked, before any worker starts: no
        # port is chosen first and bound later (another process could take it in between)
        store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "nccl.json")
            mp.spawn(_nccl_worker, args=(world, store.port, path, backend, sizes, reps, p2p_bytes), nprocs=world,
                     join=True)
            with open(path) as f:
                results += json.load(f)
        del store
    largest = [r for r in results if r["bytes"] == sizes[-1] and r["op"] != "p2p"]
    bus = min(r["bus_gbps"] for r in largest if r["group"] == max(x["group"] for x in largest))
    small = [r for r in results if r["bytes"] == sizes[0] and r["op"] == "all_reduce"]
    latency = max(r["seconds"] for r in small) * 1e6
    p2p = [r["bus_gbps"] for r in results if r["op"] == "p2p"]
    notes = [f"{backend.upper()} {r['op']} {r['bytes'] / 2**20:g} MiB over {r['group']}: {r['seconds'] * 1e6:.0f} us, "
             f"{r['bus_gbps']:.1f} GB/s" for r in results]
    return Link(bus_gbps=round(bus, 3), latency_us=round(latency, 1), p2p_gbps=round(p2p[0] if p2p else bus, 3)), notes


def calibrate(gpu: str, log: Callable[[str], None] = print) -> Calibration:
    """Measure everything above on this machine (the defaults of `gpu` fill what cannot be measured)."""
    import torch
    if not torch.cuda.is_available():
        raise ConfigError("--calibrate needs a CUDA GPU; planning works without one")
    from ..run.throughput import PEAK_BF16_TFLOPS
    name = torch.cuda.get_device_name(0)
    base = DEFAULTS[gpu_kind(name, gpu)]
    peak = next((p for key, p in PEAK_BF16_TFLOPS.items() if key in name), base.peak_tflops)
    started = time.perf_counter()
    notes = [f"measured on {name} by --calibrate, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"]
    log("calibrating: GEMMs")
    gemms, more = gemm_table()
    notes += more
    log("calibrating: attention")
    attn_fwd, attn_bwd, more = attention()
    notes += more
    log("calibrating: HBM, PCIe")
    hbm = hbm_gbps()
    h2d, d2h = pcie()
    notes += [f"HBM copy {hbm:.0f} GB/s", f"PCIe pinned H2D {h2d:.1f} GB/s, D2H {d2h:.1f} GB/s"]
    intra = base.intra_node
    gpus = torch.cuda.device_count()
    if gpus > 1:
        log(f"calibrating: NCCL over {gpus} GPUs")
        intra, more = nccl(gpus)
        notes += more
    else:
        notes.append("NCCL: one GPU visible, intra_node kept at the defaults")
    notes.append("inter_node: not measured (needs two nodes), kept at the defaults")
    log("calibrating: CPU AdamW")
    adam = cpu_adam()
    notes.append(f"CPU fused AdamW {adam:.2f} G params/s on {os.cpu_count()} cores")
    notes.append(f"calibration took {time.perf_counter() - started:.0f} s")
    values = {**asdict(base), "name": name, "peak_tflops": peak, "gemm_tflops": gemms,
              "attn_fwd_tflops": round(attn_fwd, 1), "attn_bwd_tflops": round(attn_bwd, 1), "hbm_gbps": round(hbm, 1),
              "pcie_h2d_gbps": round(h2d, 2), "pcie_d2h_gbps": round(d2h, 2), "cpu_adam_gparams_s": round(adam, 3),
              "notes": notes}
    values["intra_node"], values["inter_node"] = intra, base.inter_node
    return Calibration(**values)
