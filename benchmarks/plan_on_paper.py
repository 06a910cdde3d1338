"""The layout planner on paper (CPU only): its cost model against the step times measured in
docs/performance.md, and its picks for the GPT-3 models on 8 to 1024 H100s.

    python benchmarks/plan_on_paper.py [--measured] [--gpt3] [--calibration calib.json]

--measured: the predicted step of each measured configuration (the defaults were fitted to these
numbers, so this checks the fit, not the model). --gpt3: GPT-3 1.3B / 6.7B / 13B / 175B (seq 2048, global
batches of 1M / 2M / 2M / 3.1M tokens as in the GPT-3 paper) on 8 / 64 / 512 / 1024 H100 80GB, 8 per
node, 2 TB host memory per node: the planner's best layout and its predicted MFU.
"""
from __future__ import annotations

import argparse
from typing import Optional

from megapar.planner.memory_estimate import GiB
from megapar.planner import calibration, cost, search

NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
GPT2_345M, GPT2_124M, SHAPE_1_3B = (24, 1024, 16), (12, 768, 12), (24, 2048, 16)
GPT3_6_7B = (32, 4096, 32)


def _layout(tp=1, pp=1, dp=1, zero=0, micro=8, sp=False, offload=False) -> cost.Layout:
    return cost.Layout(tp, pp, 1, dp, zero, offload, False, micro, "none", sp)


# (what, gpu, (layers, hidden, heads), seq, global batch, layout, measured ms, where in docs/performance.md)
MEASURED = [
    ("GPT-2 345M, micro 8", "h100", GPT2_345M, 1024, 8, _layout(), 47.2, "one H100, 2026-11-24, graphed"),
    ("GPT-2 124M, micro 16", "h100", GPT2_124M, 1024, 16, _layout(micro=16), 33.9, "one H100, 2026-11-24, graphed"),
    ("GPT-2 345M, 8 microbatches", "h200", GPT2_345M, 1024, 64, _layout(), 368.6, "several GPUs, 1 GPU, eager"),
    ("GPT-2 345M, tp 2", "h200", GPT2_345M, 1024, 8, _layout(tp=2), 33.4, "2x H200, graphed"),
    ("GPT-2 345M, tp 2, sequence parallel", "h200", GPT2_345M, 1024, 8, _layout(tp=2, sp=True), 35.9,
     "2x H200, graphed"),
    ("GPT-2 345M, dp 4", "h200", GPT2_345M, 1024, 32, _layout(dp=4), 55.9, "4x H200, eager"),
    ("GPT-2 345M, dp 4, ZeRO-1", "h200", GPT2_345M, 1024, 32, _layout(dp=4, zero=1), 52.9, "4x H200, eager"),
    ("GPT-2 345M, pp 2, 8 microbatches", "h200", GPT2_345M, 1024, 64, _layout(pp=2), 221.9, "4x H200, eager"),
    ("GPT-2 345M, pp 4, 8 microbatches", "h200", GPT2_345M, 1024, 64, _layout(pp=4), 151.4, "4x H200, eager"),
    ("1.3B shape (24 x 2048), micro 8", "h200", SHAPE_1_3B, 1024, 8, _layout(), 131.9, "1x H200, graphed"),
    ("1.3B shape, tp 2", "h200", SHAPE_1_3B, 1024, 8, _layout(tp=2), 82.8, "2x H200, graphed"),
    ("GPT-3 6.7B, ZeRO-2 + optimizer offload, micro 2, global 128", "h100", GPT3_6_7B, 2048, 128,
     _layout(zero=2, micro=2, offload=True), 25618.0, "one H100, 2026-11-24"),
]

GPT3 = [("1.3B", (24, 2048, 16), 512), ("6.7B", (32, 4096, 32), 1024), ("13B", (40, 5120, 40), 1024),
        ("175B", (96, 12288, 96), 1536)]
GPUS = [8, 64, 512, 1024]


def request(shape: tuple[int, int, int], seq: int, batch: int, gpus: int, gpu: str,
            host: Optional[float] = None, extra: Optional[dict] = None) -> search.Request:
    layers, hidden, heads = shape
    memory = {"h100": 80, "h200": 141}[gpu] * GiB
    return search.Request(layers, hidden, heads, seq, batch, gpus, min(gpus, 8), memory, host, extra=extra or {})


def measured_table(cals: dict[str, calibration.Calibration]) -> str:
    lines = ["| configuration | device | measured ms | predicted ms | predicted / measured | GPU GiB (estimator) |",
             "|---|---|---|---|---|---|"]
    for what, gpu, shape, seq, batch, lay, ms, where in MEASURED:
        req = request(shape, seq, batch, lay.tp * lay.pp * lay.dp, gpu, extra=NO_DROPOUT)
        cand = search.evaluate(req, cals[gpu], lay)
        step = cost.step_time(cals[gpu], search.model_of(req, lay.tp), lay, req.cluster).total * 1e3
        lines.append(f"| {what} | {where} | {ms:,.1f} | {step:,.1f} | {step / ms:.2f} | {cand.gpu_bytes / GiB:.1f} |")
    return "\n".join(lines)


def gpt3_table(cal: calibration.Calibration) -> str:
    lines = ["| model | H100s | global batch | best layout (tp, pp, v, dp, ZeRO, offload, micro, recompute, SP) "
             "| predicted s/step | TFLOP/s per GPU | MFU | GPU GiB |", "|---|---|---|---|---|---|---|---|"]
    for name, shape, batch in GPT3:
        for gpus in GPUS:
            plan = search.plan(request(shape, 2048, batch, gpus, "h100", host=2048 * GiB, extra=NO_DROPOUT), cal)
            if plan.best is None:
                need = min(c.gpu_bytes for c in plan.rejected if c.gpu_bytes is not None)
                lines.append(f"| {name} | {gpus} | {batch} | none fits (smallest: {need / GiB:.0f} GiB per GPU) "
                             f"| | | | |")
                continue
            best, lay = plan.best, plan.best.layout
            model = search.model_of(plan.request, lay.tp)
            mfu = cost.mfu(model, best.seconds, gpus, cal.peak_tflops)
            lines.append(f"| {name} | {gpus} | {batch} | {lay.tp}, {lay.pp}, {lay.v}, {lay.dp}, {lay.zero}, "
                         f"{lay.offload}, {lay.micro}, {lay.recompute}, {'yes' if lay.sp else 'no'} "
                         f"| {best.seconds:.2f} | {mfu * cal.peak_tflops:.0f} | {100 * mfu:.1f}% "
                         f"| {best.gpu_bytes / GiB:.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--measured", action="store_true")
    p.add_argument("--gpt3", action="store_true")
    p.add_argument("--calibration", default=None, help="a --calibrate JSON (for both GPUs)")
    args = p.parse_args()
    cals = {gpu: calibration.load_calibration(gpu, args.calibration) for gpu in calibration.DEFAULTS}
    both = not (args.measured or args.gpt3)
    if args.measured or both:
        print(measured_table(cals))
    if args.gpt3 or both:
        print(gpt3_table(cals["h100"]))


if __name__ == "__main__":
    main()
