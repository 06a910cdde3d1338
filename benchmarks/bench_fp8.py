"""--fp8-format on one Hopper/Ada GPU, in one pass (about 6-8 minutes on an H100):

  1. accuracy: one transformer layer (hidden 2048, 16 heads, seq 2048, micro-batch 4) forward and
     backward in fp8 (hybrid and e4m3) against the same layer in bf16 on random data: relative
     error of the attention and MLP outputs, of the gradients reaching their inputs and of the four
     GEMM weights' gradients, with bounds; and the layer's eager fwd+bwd time in each precision;
  2. throughput: the recipes 1.3b-compile and 1.3b-fp8 through benchmarks/bench_train.py (GPT-3
     1.3B shape, seq 2048, micro-batch 8, --torch-compile): ms/step, tokens/s, MFU, memory, ratio;
  3. loss: GPT-2 345M at seq 1024 on the embedded corpus with GPT-2 BPE, --loss-iters iterations
     in bf16 and in --fp8-format hybrid from the same seed: logged losses side by side and the final
     relative difference.

    pip install --no-deps .gpu/wheels/torchao-*.whl
    python benchmarks/bench_fp8.py [--vocab-file gpt2/encoder.json --merge-file gpt2/vocab.bpe] [--skip loss]

Every table is printed again at the end; logs go to --log-dir. Exits 1 if an accuracy bound or a run failed.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import time

import torch

from bench_train import ITER_RE, bench_flags, run_config  # a sibling: `python benchmarks/bench_fp8.py` finds it

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOSS_RE = re.compile(r" iteration +(\d+)/ *\d+ .*? lm loss: ([-\d.E+]+)")
BPE_DIRS = [os.path.join(ROOT, ".gpu"), os.path.join(ROOT, "tests", "data", "gpt2")]
# relative-error bounds of the layer check (fp8 e4m3 keeps 3 mantissa bits, e5m2 2)
BOUNDS = {"out": 0.08, "grad into": 0.15, "weight grads": 0.25}
LAYER_SHAPE = dict(hidden=2048, heads=16, seq=2048, micro=4)


# ---- 1. one layer, fp8 against bf16 ------------------------------------------------------------------
def _layer(fmt, device):
    from megapar.config.build import parse_config
    from megapar.model.transformer import TransformerLayer
    s = LAYER_SHAPE
    cfg = parse_config(["--num-layers", "24", "--hidden-size", str(s["hidden"]), "--num-attention-heads",
                        str(s["heads"]), "--seq-length", str(s["seq"]), "--micro-batch-size", str(s["micro"]),
                        "--bf16", "--hidden-dropout", "0", "--attention-dropout", "0"], world_size=1).model
    cfg = dataclasses.replace(cfg, fp8_format=fmt)
    return TransformerLayer(cfg, 0, 1234, None, device, torch.bfloat16)  # same seed: the same weights


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _fwd_bwd(layer, x, dy, capture: bool = False):
    """Forward and backward of the layer. capture: also return, per branch (attention, MLP), its
    output and the gradient reaching its input (the LayerNorm output), which the residual path
    does not dilute, and the four GEMM weights' gradients."""
    x = x.detach().requires_grad_()
    for p in layer.parameters():
        p.grad = None
    seen, handles = {}, []
    if capture:
        def keep(name, kind):
            def hook(module, args, out):
                if kind == "out":
                    seen[f"{name} out"] = out.detach()
                else:
                    out.register_hook(lambda g: seen.__setitem__(f"grad into {name}", g.detach()))
            return hook
        handles = [layer.self_attention.register_forward_hook(keep("attention", "out")),
                   layer.mlp.register_forward_hook(keep("mlp", "out")),
                   layer.input_layernorm.register_forward_hook(keep("attention", "grad")),
                   layer.post_attention_layernorm.register_forward_hook(keep("mlp", "grad"))]
    layer(x).backward(dy)
    for h in handles:
        h.remove()
    weights = {n: p.grad for n, p in layer.named_parameters() if p.dim() == 2}
    return seen, weights


def _time_ms(layer, x, dy, iters: int = 10) -> float:
    if x.device.type != "cuda":
        return float("nan")
    for _ in range(3):
        _fwd_bwd(layer, x, dy)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        _fwd_bwd(layer, x, dy)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def layer_check(device: torch.device) -> list[dict]:
    s = LAYER_SHAPE
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(s["seq"], s["micro"], s["hidden"], device=device, dtype=torch.bfloat16, generator=g)
    dy = torch.randn(x.shape, device=device, dtype=torch.bfloat16, generator=g)
    ref_layer = _layer(None, device)
    ref, ref_w = _fwd_bwd(ref_layer, x, dy, capture=True)
    rows = [{"precision": "bf16", "ms": _time_ms(ref_layer, x, dy)}]
    for fmt in ("hybrid", "e4m3"):
        layer = _layer(fmt, device)
        assert all(torch.equal(a, b) for a, b in zip(layer.state_dict().values(), ref_layer.state_dict().values()))
        got, got_w = _fwd_bwd(layer, x, dy, capture=True)
        errs = {k: _rel(got[k], ref[k]) for k in ref}
        errs["weight grads"] = max(_rel(got_w[n], ref_w[n]) for n in ref_w)
        rows.append({"precision": f"fp8 {fmt}", "ms": _time_ms(layer, x, dy), "errs": errs,
                     "ok": all(v < BOUNDS[_bound(k)] for k, v in errs.items())})
        print(rows[-1], flush=True)
    return rows


def _bound(key: str) -> str:
    return "weight grads" if key == "weight grads" else "grad into" if key.startswith("grad into") else "out"


def layer_table(rows: list[dict]) -> str:
    s = LAYER_SHAPE
    keys = list(next(r["errs"] for r in rows if "errs" in r))
    lines = [f"one transformer layer, eager, [s {s['seq']}, b {s['micro']}, h {s['hidden']}], fwd+bwd; relative "
             f"error vs bf16 of each branch's output, the gradient into it, the worst GEMM weight gradient "
             f"(bounds: {BOUNDS})",
             "| precision | ms fwd+bwd | " + " | ".join(keys) + " | within bounds |",
             "|---|---|" + "---|" * len(keys) + "---|"]
    for r in rows:
        if "errs" in r:
            cells = " | ".join(f"{r['errs'][k]:.4f}" for k in keys)
            lines.append(f"| {r['precision']} | {r['ms']:.2f} | {cells} | {'yes' if r['ok'] else 'NO'} |")
        else:
            lines.append(f"| {r['precision']} | {r['ms']:.2f} | " + " | ".join("-" for _ in keys) + " | reference |")
    return "\n".join(lines)


# ---- 2. throughput at 1.3B ------------------------------------------------------------------------
def throughput(args) -> list[dict]:
    rows = []
    for name in ("1.3b-compile", "1.3b-fp8"):
        rows.append(run_config(name, args))
        print(rows[-1], flush=True)
    return rows


def throughput_table(rows: list[dict]) -> str:
    lines = ["1.3B (24 layers, hidden 2048, 16 heads, seq 2048, micro-batch 8, --torch-compile), 1 GPU",
             "| recipe | ms/step | tokens/s | TFLOP/s | MFU | max alloc GiB | vs bf16 |",
             "|---|---|---|---|---|---|---|"]
    base = rows[0].get("tokens_s")
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error']} |")
            continue
        ratio = f"{r['tokens_s'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['name']} | {r['ms']:.1f} | {r['tokens_s']} | {r['tflops']:.1f} | {r['mfu']} | "
                     f"{r['mem_gb']:.1f} | {ratio} |")
    return "\n".join(lines)


# ---- 3. loss: 345M, bf16 vs fp8 -------------------------------------------------------------------
LOSS_MODEL = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
              "--max-position-embeddings", "1024", "--micro-batch-size", "8", "--global-batch-size", "8", "--bf16"]


def loss_run(fmt, args) -> dict:
    name = f"345m-loss-{fmt or 'bf16'}"
    flags = bench_flags(argparse.Namespace(**{**vars(args), "iters": args.loss_iters, "log_window": 10}))
    cmd = ["bash", os.path.join(ROOT, "scripts", "pretrain_gpt2.sh"), "--nproc-per-node", "1", *LOSS_MODEL, *flags,
           "--lr-warmup-iters", "20", "--min-lr", "3e-5", *(["--fp8-format", fmt] if fmt else [])]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=args.workdir, timeout=args.run_timeout)
    out = proc.stdout + proc.stderr
    with open(os.path.join(args.log_dir, f"{name}.log"), "w") as f:
        f.write(" ".join(cmd) + "\n" + out)
    losses = {int(i): float(l) for i, l in LOSS_RE.findall(out)}
    iters = ITER_RE.findall(out)
    if proc.returncode != 0 or not losses:
        return {"name": name, "error": f"rc={proc.returncode}: {out.strip().splitlines()[-1:]}"}
    return {"name": name, "losses": losses, "ms": float(iters[-1][0]) if iters else float("nan"),
            "wall": time.time() - start}


def loss_table(bf16: dict, fp8: dict) -> str:
    if "error" in bf16 or "error" in fp8:
        return f"345M loss comparison failed: {bf16.get('error') or fp8.get('error')}"
    its = sorted(set(bf16["losses"]) & set(fp8["losses"]))
    lines = ["GPT-2 345M, seq 1024, micro-batch 8, eager, embedded corpus (GPT-2 BPE), lm loss per logged window",
             "| iteration | bf16 | fp8 hybrid | relative difference |", "|---|---|---|---|"]
    for i in its:
        a, b = bf16["losses"][i], fp8["losses"][i]
        lines.append(f"| {i} | {a:.4f} | {b:.4f} | {(b - a) / a:+.4f} |")
    last = its[-1]
    lines.append(f"final (iteration {last}): relative difference "
                 f"{(fp8['losses'][last] - bf16['losses'][last]) / bf16['losses'][last]:+.4f}; "
                 f"eager ms/step bf16 {bf16['ms']:.1f}, fp8 {fp8['ms']:.1f}")
    return "\n".join(lines)


def _default_bpe(name: str) -> str:
    for d in BPE_DIRS:
        if os.path.exists(os.path.join(d, name)):
            return os.path.join(d, name)
    return os.path.join(BPE_DIRS[0], name)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab-file", default=_default_bpe("encoder.json"))
    p.add_argument("--merge-file", default=_default_bpe("vocab.bpe"))
    p.add_argument("--iters", type=int, default=30, help="iterations of each 1.3B throughput run")
    p.add_argument("--log-window", type=int, default=10)
    p.add_argument("--loss-iters", type=int, default=150, help="iterations of each 345M loss run")
    p.add_argument("--skip", nargs="*", default=[], choices=("layer", "throughput", "loss"))
    p.add_argument("--workdir", default=".")
    p.add_argument("--log-dir", default=os.environ.get("OUT", "."))
    p.add_argument("--run-timeout", type=int, default=240, help="seconds per training run")
    args = p.parse_args()
    args.extra = []
    args.vocab_file, args.merge_file = os.path.abspath(args.vocab_file), os.path.abspath(args.merge_file)
    os.makedirs(args.log_dir, exist_ok=True)
    from importlib.metadata import version
    print(f"torch {torch.__version__}, torchao {version('torchao')}, {torch.cuda.get_device_name(0)} "
          f"(capability {torch.cuda.get_device_capability(0)})", flush=True)
    tables, ok, t0 = [], True, time.time()
    if "layer" not in args.skip:
        rows = layer_check(torch.device("cuda"))
        ok &= all(r.get("ok", True) for r in rows)
        tables.append(layer_table(rows))
        print(tables[-1], flush=True)
    if "throughput" not in args.skip:
        rows = throughput(args)
        ok &= not any("error" in r for r in rows)
        tables.append(throughput_table(rows))
        print(tables[-1], flush=True)
    if "loss" not in args.skip:
        bf16, fp8 = loss_run(None, args), loss_run("hybrid", args)
        ok &= "error" not in bf16 and "error" not in fp8
        tables.append(loss_table(bf16, fp8))
    print(f"\n==== bench_fp8 summary ({time.time() - t0:.0f} s) ====")
    print("\n\n".join(tables))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
