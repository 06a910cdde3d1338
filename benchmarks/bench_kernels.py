"""Build, check and time megapar's fused CUDA kernels (one script for a lent GPU).

  python benchmarks/bench_kernels.py [--quick] [--parity-only] [--bench-only] [--out DIR]

1. Loads the extension (AOT module or JIT build; MEGAPAR_FORCE_JIT=1 forces the JIT path).
2. Parity: fresh random inputs (never zeros), every output poisoned with NaN first, forward and
   backward against a float64 reference, fp32/fp16/bf16, non-power-of-two shapes. Error =
   ||out - ref|| / ||ref||, also shown for torch eager in the same dtype as a yardstick.
3. Benchmark (median of triton.testing.do_bench, L2 flushed between repeats) against torch
   eager and torch.compile: µs, GB/s (bytes: LayerNorm 4 B/elem fwd, 6 bwd at bf16; causal
   softmax reads the lower triangle and writes the full row) and % of the measured
   device-to-device copy bandwidth. The table is printed last and saved to --out.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from megapar.kernels import fused_kernels_source, load_fused_kernels
from megapar.kernels.layernorm import fused_add_layer_norm, layer_norm
from megapar.kernels.softmax import scaled_masked_softmax, scaled_masked_softmax_reference

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
FAILURES: List[str] = []
COMPILE_SIZES = (1024, 8192)  # torch.compile baselines only here: each compile costs ~10 s of lease


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("nan")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def poison() -> None:
    """Fill freed allocator blocks with NaN so that unwritten outputs show up."""
    junk = torch.full((64 * 1024 * 1024,), float("nan"), device="cuda")
    del junk


def report(name: str, errs: Dict[str, float], yard: Dict[str, float], dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    bad = [k for k, v in errs.items() if not (v <= tol)]
    status = "ok" if not bad else "FAIL(" + ",".join(bad) + ")"
    if bad:
        FAILURES.append(name)
    parts = " ".join(f"{k}={v:.2e}(torch {yard.get(k, float('nan')):.1e})" for k, v in errs.items())
    print(f"  {status:8s} {name:58s} {parts}", flush=True)


# ----------------------------------------------------------------------------- parity
def parity_softmax(dtype: torch.dtype, b: int, np_: int, sq: int, sk: int, mode: str) -> None:
    g = torch.Generator(device="cuda").manual_seed(sq * 1000 + sk)
    scores = torch.randn(b, np_, sq, sk, device="cuda", generator=g) * 3
    scale = 0.37
    mask = None
    if mode == "mask":
        mask = torch.rand(b, 1, sq, sk, device="cuda", generator=g) < 0.3
        mask[0, 0, 0, :] = True  # one fully masked row -> zeros
    causal = mode == "causal"
    dy = torch.randn(b, np_, sq, sk, device="cuda", generator=g)
    x64 = scores.double().requires_grad_()
    ref = scaled_masked_softmax_reference(x64, scale, mask, causal)
    ref.backward(dy.double())
    xl = scores.to(dtype).clone().requires_grad_()  # clone: fp32 .to() would alias the leaves
    poison()
    out = scaled_masked_softmax(xl, scale, mask, causal, impl="fused")
    poison()
    out.backward(dy.to(dtype))
    xt = scores.to(dtype).clone().requires_grad_()
    outt = scaled_masked_softmax_reference(xt, scale, mask, causal)
    outt.backward(dy.to(dtype))
    errs = {"fwd": rel(out, ref), "bwd": rel(xl.grad, x64.grad)}
    if causal:
        upper = torch.ones(sq, sk, dtype=torch.bool, device="cuda").triu(1)
        if out[..., upper].abs().max().item() != 0 or xl.grad[..., upper].abs().max().item() != 0:
            errs["upper_zero"] = float("inf")
    report(f"softmax-{mode} {str(dtype)[6:]} [{b},{np_},{sq},{sk}]", errs,
           {"fwd": rel(outt, ref), "bwd": rel(xt.grad, x64.grad)}, dtype)


def parity_layernorm(dtype: torch.dtype, rows: int, h: int, fused_add: bool) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows * 7 + h)
    x = torch.randn(rows, h, device="cuda", generator=g) * 2 + 0.5
    res = torch.randn(rows, h, device="cuda", generator=g)
    w = torch.randn(h, device="cuda", generator=g) * 0.5 + 1
    b = torch.randn(h, device="cuda", generator=g) * 0.1
    dy = torch.randn(rows, h, device="cuda", generator=g)
    ds = torch.randn(rows, h, device="cuda", generator=g)
    eps = 1e-5

    def run(xx, rr, ww, bb, impl):
        leaves = [t.detach().clone().requires_grad_() for t in (xx, rr, ww, bb)]
        if fused_add:
            y, s = fused_add_layer_norm(leaves[0], leaves[1], leaves[2], leaves[3], eps, impl=impl)
            torch.autograd.backward([y, s], [dy.to(y.dtype), ds.to(y.dtype)])
            outs = {"y": y, "sum": s}
        else:
            y = layer_norm(leaves[0], leaves[2], leaves[3], eps, impl=impl)
            y.backward(dy.to(y.dtype))
            outs = {"y": y}
        outs.update({"dx": leaves[0].grad, "dw": leaves[2].grad, "db": leaves[3].grad})
        if fused_add:
            outs["dres"] = leaves[1].grad
        return outs

    # The float64 reference normalizes the dtype-rounded sum, as the kernel does.
    x64 = x.to(dtype).double()
    r64 = res.to(dtype).double()
    ref = run(x64.clone(), r64.clone(), w.to(dtype).double(), b.to(dtype).double(), "torch")
    poison()
    out = run(x.to(dtype), res.to(dtype), w.to(dtype), b.to(dtype), "fused")
    yard = run(x.to(dtype), res.to(dtype), w.to(dtype), b.to(dtype), "torch")
    name = f"{'add+' if fused_add else ''}layernorm {str(dtype)[6:]} [{rows},{h}]"
    report(name, {k: rel(out[k], ref[k]) for k in ref}, {k: rel(yard[k], ref[k]) for k in ref}, dtype)


def parity(quick: bool) -> None:
    print("== parity vs float64 (error = ||out-ref||/||ref||; torch eager in the same dtype for scale)", flush=True)
    soft_shapes = [(2, 3, 17, 17), (1, 2, 100, 100), (1, 2, 256, 256)]
    ln_shapes = [(7, 768), (33, 1000), (16, 1024)]
    if not quick:
        soft_shapes += [(1, 2, 1000, 1000), (2, 2, 1024, 1024), (1, 1, 2048, 2048), (1, 1, 4096, 4096),
                        (1, 1, 3000, 3000)]
        ln_shapes += [(64, 2048), (50, 4096), (37, 5120), (64, 8192), (16, 1536), (9, 2056)]
    for name, dtype in DTYPES.items():
        for b, n, sq, sk in soft_shapes:
            parity_softmax(dtype, b, n, sq, sk, "causal")
        for b, n, sq, sk in ([(2, 2, 17, 33), (2, 3, 64, 1000)] + ([] if quick else [(2, 2, 128, 4096)])):
            parity_softmax(dtype, b, n, sq, sk, "mask")
        for rows, h in ln_shapes:
            parity_layernorm(dtype, rows, h, fused_add=False)
        for rows, h in ln_shapes[:4]:
            parity_layernorm(dtype, rows, h, fused_add=True)


# ----------------------------------------------------------------------------- bench
def bench_us(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    n = 512 * 1024 * 1024  # bytes
    src = torch.randn(n // 4, device="cuda")
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src))
    return 2 * n / us / 1e3  # GB/s


ROWS: List[dict] = []


def add_row(op: str, shape: str, impl: str, us: float, nbytes: float, copy_gbs: float, target: Optional[float]) -> None:
    gbs = nbytes / us / 1e3
    ROWS.append(dict(op=op, shape=shape, impl=impl, us=us, gbs=gbs, pct=100 * gbs / copy_gbs, target=target))
    tgt = f"target {target:.0f}%" if target and impl == "fused" else ""
    print(f"  {op:14s} {shape:22s} {impl:8s} {us:9.1f} us {gbs:8.0f} GB/s {100 * gbs / copy_gbs:6.1f}% {tgt}",
          flush=True)


def bench_layernorm(copy_gbs: float, hs: List[int], only_bwd: bool = False) -> None:
    ext = load_fused_kernels()
    rows, dt = 8192, torch.bfloat16
    for h in hs:
        x = torch.randn(rows, h, device="cuda", dtype=dt)
        w = torch.randn(h, device="cuda", dtype=dt)
        b = torch.randn(h, device="cuda", dtype=dt)
        dy = torch.randn(rows, h, device="cuda", dtype=dt)
        shape = f"{rows}x{h} bf16"
        target = 80.0 if h >= 2048 else 65.0
        if not only_bwd:
            nb = 4 * rows * h
            add_row("ln_fwd", shape, "fused", bench_us(lambda: ext.layer_norm_forward(x, None, w, b, 1e-5)), nb,
                    copy_gbs, target)
            add_row("ln_fwd", shape, "eager", bench_us(lambda: F.layer_norm(x, (h,), w, b, 1e-5)), nb, copy_gbs, target)
            if h in COMPILE_SIZES:
                comp = torch.compile(lambda t: F.layer_norm(t, (h,), w, b, 1e-5), dynamic=False)
                add_row("ln_fwd", shape, "compile", bench_us(lambda: comp(x)), nb, copy_gbs, target)
        _, mean, rstd = ext.layer_norm_forward(x, None, w, b, 1e-5)
        nb = 6 * rows * h
        add_row("ln_bwd", shape, "fused", bench_us(lambda: ext.layer_norm_backward(dy, x, mean, rstd, w, None)), nb,
                copy_gbs, target)
        m2, r2 = mean.view(rows, 1), rstd.view(rows, 1)
        add_row("ln_bwd", shape, "eager", bench_us(lambda: torch.ops.aten.native_layer_norm_backward(
            dy, x, [h], m2, r2, w, b, [True, True, True])), nb, copy_gbs, target)

        def manual_bwd(dy_, x_, m_, r_, w_):
            xhat = (x_.float() - m_) * r_
            wdy = dy_.float() * w_.float()
            dx = r_ * (wdy - wdy.mean(-1, keepdim=True) - xhat * (wdy * xhat).mean(-1, keepdim=True))
            return dx.to(dy_.dtype), (dy_.float() * xhat).sum(0).to(w_.dtype), dy_.float().sum(0).to(w_.dtype)

        if h not in COMPILE_SIZES:
            continue
        comp_b = torch.compile(manual_bwd, dynamic=False)
        add_row("ln_bwd", shape, "compile", bench_us(lambda: comp_b(dy, x, m2, r2, w)), nb, copy_gbs, target)
        x = dy = None  # free before the next size (a del confuses pyflakes: the lambdas above read them)


def bench_softmax(copy_gbs: float, seqs: List[int]) -> None:
    ext = load_fused_kernels()
    dt = torch.bfloat16
    for s in seqs:
        b, n = 8, 16 * 1024 // s if s > 1024 else 16
        shape = f"{b}x{n}x{s}x{s} bf16"
        x = torch.randn(b, n, s, s, device="cuda", dtype=dt)
        dy = torch.randn(b, n, s, s, device="cuda", dtype=dt)
        scale = 1 / math.sqrt(64)
        tri = s * (s + 1) // 2
        heads = b * n
        nb_f = heads * (tri + s * s) * 2
        nb_b = heads * (2 * tri + s * s) * 2
        upper = torch.ones(s, s, dtype=torch.bool, device="cuda").triu(1)

        def eager_fwd(t):
            return torch.softmax((t * scale).masked_fill(upper, float("-inf")), dim=-1)

        add_row("causal_fwd", shape, "fused", bench_us(lambda: ext.scaled_masked_softmax_forward(x, scale, None, True)),
                nb_f, copy_gbs, 85.0)
        add_row("causal_fwd", shape, "eager", bench_us(lambda: eager_fwd(x)), nb_f, copy_gbs, 85.0)
        if s in COMPILE_SIZES:
            comp = torch.compile(eager_fwd, dynamic=False)
            add_row("causal_fwd", shape, "compile", bench_us(lambda: comp(x)), nb_f, copy_gbs, 85.0)
        y = ext.scaled_masked_softmax_forward(x, scale, None, True)
        add_row("causal_bwd", shape, "fused", bench_us(lambda: ext.scaled_masked_softmax_backward(dy, y, scale, True)),
                nb_b, copy_gbs, 85.0)

        def eager_bwd(dy_, y_):
            return torch.ops.aten._softmax_backward_data(dy_, y_, -1, dt) * scale

        add_row("causal_bwd", shape, "eager", bench_us(lambda: eager_bwd(dy, y)), nb_b, copy_gbs, 85.0)
        if s not in COMPILE_SIZES:
            continue

        def softmax_bwd(dy_, y_):
            return (y_.float() * (dy_.float() - (dy_.float() * y_.float()).sum(-1, keepdim=True)) * scale).to(dt)

        comp_b = torch.compile(softmax_bwd, dynamic=False)
        add_row("causal_bwd", shape, "compile", bench_us(lambda: comp_b(dy, y)), nb_b, copy_gbs, 85.0)
        x = dy = y = None  # free before the next size


def print_table(copy_gbs: float, out: Path) -> None:
    lines = [f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | {time.strftime('%Y-%m-%d')} | "
             f"copy {copy_gbs / 1000:.2f} TB/s (read+write)",
             "| op | shape | fused µs | GB/s | % copy | target | eager µs (%) | compile µs (%) |",
             "|---|---|---|---|---|---|---|---|"]
    keys = []
    for r in ROWS:
        if (r["op"], r["shape"]) not in keys:
            keys.append((r["op"], r["shape"]))
    for op, shape in keys:
        d = {r["impl"]: r for r in ROWS if r["op"] == op and r["shape"] == shape}
        f = d.get("fused")
        if f is None:
            continue
        ok = "✓" if f["pct"] >= f["target"] else "✗"
        e, c = d.get("eager"), d.get("compile")
        lines.append(f"| {op} | {shape} | {f['us']:.1f} | {f['gbs']:.0f} | {f['pct']:.0f}% | {f['target']:.0f}% {ok} | "
                     + (f"{e['us']:.1f} ({e['pct']:.0f}%)" if e else "-") + " | "
                     + (f"{c['us']:.1f} ({c['pct']:.0f}%)" if c else "-") + " |")
    text = "\n".join(lines)
    (out / "bench_table.md").write_text(text + "\n")
    (out / "bench_rows.json").write_text(json.dumps(ROWS, indent=1))
    print("\n" + text, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small parity shapes only (for compute-sanitizer)")
    ap.add_argument("--parity-only", action="store_true")
    ap.add_argument("--bench-only", action="store_true")
    ap.add_argument("--ln-bwd-only", action="store_true", help="benchmark only the LayerNorm backward")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    load_fused_kernels()
    print(f"extension: {fused_kernels_source()} (load {time.time() - t0:.1f} s) on {torch.cuda.get_device_name()}",
          flush=True)
    if not args.bench_only:
        parity(args.quick)
        print(f"parity: {'ALL OK' if not FAILURES else 'FAILURES: ' + ', '.join(FAILURES)}", flush=True)
    if not args.parity_only:
        copy_gbs = copy_bandwidth()
        print(f"== benchmark (copy {copy_gbs:.0f} GB/s)", flush=True)
        if args.ln_bwd_only:
            bench_layernorm(copy_gbs, [1024, 2048, 4096, 8192], only_bwd=True)
        else:
            bench_layernorm(copy_gbs, [1024, 2048, 4096, 8192])
            bench_softmax(copy_gbs, [1024, 2048, 4096])
        print_table(copy_gbs, out)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
