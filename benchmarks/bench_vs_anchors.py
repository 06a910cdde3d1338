"""megapar against DeepSpeed ZeRO and PyTorch FSDP2 at data parallel 2 on GPT-2 345M or GPT-3's 1.3B
shape, alternating.

    python benchmarks/bench_vs_anchors.py [--shape {345m,1.3b}] [--stages 2 3] \
        [--systems megapar deepspeed fsdp2] [--megapar-variants graph compile] [--iters 30] [--warmup 10] \
        [--rounds 1] [--timeout 420] [--budget SECONDS] [--nanogpt-dir .gpu/nanogpt] [--fsdp2-eager] \
        [--gpus {1,2}] [--fsdp2-profile] [--out DIR]

The shape (--shape): 345m is GPT-2 345M (24 layers, hidden 1024, 16 heads), 1.3b GPT-3's 1.3B (24
layers, hidden 2048, 16 heads); both at seq 1024, bf16, the padded vocabulary (50304), dropout 0, on 2
GPUs with the micro-batch of megapar's recipes (8 per GPU, global batch 16: no accumulation). For each
ZeRO stage each round runs, one after the other on the same two GPUs (--gpus 1: the same harness on
one GPU, global batch 8, against megapar's one-GPU recipes `<shape>-graph` / `<shape>-compile`, so
that each system's own scaling from one GPU to two is visible):

- megapar: scripts/pretrain_gpt2.sh with the recipe `<shape>-dp2-zero<stage>-graph` (compiled layers,
  the whole step one CUDA graph, csrc's AdamW; --megapar-variants compile adds the non-graphed
  `<shape>-dp2-zero<stage>`) and benchmarks/bench_train.py's benchmark flags, a log line per iteration;
- DeepSpeed (benchmarks/bench_offload_vs_deepspeed.py's worker, without offload): Hugging Face's
  GPT2LMHeadModel at the same shape under ZeRO stage 2 or 3, bf16, torch's fused AdamW as the client
  optimizer (DeepSpeed's own GPU AdamW would need its CUDA ops compiled), overlapped reduction,
  contiguous gradients, clipping;
- FSDP2 (torch.distributed.fsdp.fully_shard, the worker below): nanoGPT's GPT (its model.py from a
  git-ignored folder, never committed) with biases, fp32 parameters and a bf16 MixedPrecisionPolicy
  (fp32 gradient reduction), each block compiled and then sharded, then the root;
  reshard_after_forward=False is the ZeRO-2-like row, True the ZeRO-3-like one; torch's fused AdamW.
  Timed as megapar is: CUDA events around each step and no host synchronisation inside the timed
  steps (the loss is read once, after them); --fsdp2-profile also writes a torch.profiler trace of
  two steps after the warm-up (summarise it with benchmarks/profile_summary.py).

The anchors take the model, batch and AdamW settings (lr, betas, eps, weight decay off biases and
LayerNorm weights, clipping) from megapar's parsed flags (bench_offload_vs_deepspeed.ds_spec) and
train on random tokens (the speed does not depend on the data). megapar's step and DeepSpeed's end in a host
synchronisation (megapar's per-iteration log line, DeepSpeed's synchronize and perf_counter), FSDP2's do not
(CUDA events); the first --warmup steps of each run (compilation, graph capture, allocator growth) are left
out of its mean. tokens/s, TFLOP/s per GPU and MFU use megapar's FLOP formula and GPU peak for every row;
memory is torch.cuda.max_memory_allocated, the larger of the two ranks for the anchors, megapar's "max
allocated" log field (dp rank 0, after its first iteration) for megapar. The last table gives, per stage and
round, megapar's tokens/s per GPU over each anchor's. A failed or timed-out run is a "failed: ..." row;
--budget skips the runs that would start after it is spent, so that the tables still print inside a caller's
time limit.

DeepSpeed and transformers are imported only in DeepSpeed's worker, nanoGPT's model only in FSDP2's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Optional, Sequence

from bench_offload_vs_deepspeed import (ROOT, DsSpec, Shape, decay_groups, ds_spec, gpu_peak, load_spec,
                                        run_deepspeed, run_megapar, run_worker, worker_row)
from bench_host_overhead import nanogpt_module  # benchmarks/bench_host_overhead.py
from bench_train import bench_flags  # benchmarks/bench_train.py
from megapar.config.recipes import GPT2_345M, GPT_1_3B, words
from megapar.errors import USER_ERROR_EXIT, MegaparError

# --shape: its model flags, also the prefix of megapar's recipes
MODELS = {"345m": words(GPT2_345M), "1.3b": words(GPT_1_3B)}
VARIANTS = {"graph": "{shape}-dp2-zero{stage}-graph", "compile": "{shape}-dp2-zero{stage}"}  # megapar's recipes
ONE_GPU_VARIANTS = {"graph": "{shape}-graph", "compile": "{shape}-compile"}                    # at --gpus 1
SYSTEMS = ("megapar", "deepspeed", "fsdp2")
FSDP2_WORKER = "--_fsdp2-worker"  # the internal flag: run FSDP2 from the payload file it names
MIN_RUN_S = 60  # --budget: a run that would get less than this is skipped


@dataclass(frozen=True)
class StagePlan:
    """One ZeRO stage's runs: the shape, megapar's flags per recipe and the anchors' spec (from megapar's flags)."""
    shape: Shape  # the model flags of --shape, the GPUs, the ZeRO stage
    megapar: dict[str, list[str]]  # recipe name -> the flags after pretrain_gpt2.sh
    spec: DsSpec

    @property
    def stage(self) -> int:
        return self.shape.zero_stage


def model_size(model_flags: Sequence[str]) -> tuple[int, int, int]:
    """(layers, hidden, heads) of MODELS' flags."""
    values = dict(zip(model_flags[::2], model_flags[1::2]))
    return tuple(int(values[f]) for f in ("--num-layers", "--hidden-size", "--num-attention-heads"))


def stage_plan(stage: int, args: argparse.Namespace, token_vocab: int) -> StagePlan:
    """The runs of `stage` at args.shape, megapar's flags parsed as megapar parses them (MegaparError,
    e.g. for an unknown recipe, before anything runs)."""
    shape = Shape(MODELS[args.shape], args.gpus, stage)
    bench = argparse.Namespace(iters=args.iters, log_window=1, vocab_file=args.vocab_file, merge_file=args.merge_file)
    variants = VARIANTS if args.gpus == 2 else ONE_GPU_VARIANTS
    megapar = {name: ["--recipe", name, *bench_flags(bench)]
               for name in (variants[v].format(shape=args.shape, stage=stage) for v in args.megapar_variants)}
    specs = {ds_spec(flags, shape, token_vocab, stage, args.iters, os.path.join(args.out, f"result_zero{stage}.json"))
             for flags in megapar.values()}
    assert len(specs) == 1, f"megapar's ZeRO-{stage} recipes differ in model, batch or AdamW: {specs}"
    spec = specs.pop()
    assert (spec.layers, spec.hidden, spec.heads) == model_size(shape.model_flags), \
        f"megapar's recipes {list(megapar)} are not the {args.shape} shape"
    return StagePlan(shape, megapar, replace(spec, offload=False))


def fsdp2_payload(spec: DsSpec, nanogpt_dir: str, compile_blocks: bool, device: str = "cuda", warmup: int = 0,
                  profile_path: Optional[str] = None, blocks_per_unit: int = 1) -> dict:
    """What FSDP2's worker reads: the run, nanoGPT's folder, whether each block is compiled, the device,
    where to write a trace of the two steps after `warmup` (None: no trace), and how many consecutive
    blocks share one FSDP2 unit (one all-gather and one reduce-scatter, one set of hooks)."""
    return {"spec": asdict(spec), "nanogpt_dir": nanogpt_dir, "compile": compile_blocks, "device": device,
            "warmup": warmup, "profile_path": profile_path, "blocks_per_unit": blocks_per_unit}


def run_fsdp2(spec: DsSpec, payload: dict, gpus: int, peak: Optional[float], log_path: str, timeout: float,
              warmup: int) -> dict:
    """FSDP2's row: this script with FSDP2_WORKER in a subprocess (torch.distributed.run)."""
    system = f"FSDP2 reshard_after_forward={spec.stage == 3}, {payload['blocks_per_unit']} block(s) per unit"
    result, why = run_worker([os.path.abspath(__file__), FSDP2_WORKER], payload, spec.result_path, gpus, log_path,
                             timeout)
    if result is None:
        return {"system": system, "error": why}
    return worker_row(f"{system} (torch {result['version']})", result, spec, gpus, peak, warmup)


def fsdp2_worker(payload_path: str) -> None:
    """One rank of the FSDP2 run of the payload at `payload_path` (fsdp2_payload); rank 0 writes the
    step times, torch's version and the larger peak memory of the ranks to the spec's result_path.
    The weights are drawn from one seed on every rank before fully_shard keeps each rank's shard. Each
    step is timed by CUDA events recorded around it; nothing waits for the GPU until the last step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with open(payload_path) as f:
        payload = json.load(f)
    spec = load_spec(payload["spec"])
    nano = nanogpt_module(payload["nanogpt_dir"])
    GPT, GPTConfig = nano.GPT, nano.GPTConfig

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if payload["device"] == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(0)
    config = GPTConfig(block_size=spec.seq, vocab_size=spec.vocab, n_layer=spec.layers, n_head=spec.heads,
                       n_embd=spec.hidden, dropout=0.0, bias=True)
    with device:
        model = GPT(config)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    reshard = spec.stage == 3
    blocks, per_unit = model.transformer.h, payload.get("blocks_per_unit", 1)
    for i in range(len(blocks)):
        if payload["compile"]:  # compiled first, then sharded: FSDP2's hooks stay outside the compiled code
            blocks[i] = torch.compile(blocks[i])
    for first in range(0, len(blocks), per_unit):  # a list of modules is one unit: one gather, one set of hooks
        unit = [blocks[i] for i in range(first, min(first + per_unit, len(blocks)))]
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    optimizer = torch.optim.AdamW(decay_groups(model), lr=spec.lr, betas=spec.betas, eps=spec.eps,
                                  weight_decay=spec.weight_decay, fused=True)
    accumulation = spec.global_batch // (spec.micro_batch * world)
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    clock = StepClock(device)
    profiler = None
    for step in range(1, spec.iters + 1):
        if payload.get("profile_path") and step == payload["warmup"] + 1:
            profiler = torch.profiler.profile(record_shapes=True)
            profiler.start()
        clock.start()
        for micro in range(accumulation):
            model.set_requires_gradient_sync(micro == accumulation - 1)  # reduce once, after the last
            tokens = torch.randint(0, spec.token_vocab, (spec.micro_batch, spec.seq + 1), device=device,
                                   generator=gen)
            _, loss = model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
            (loss / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.stop()
        if profiler is not None and step == payload["warmup"] + 2:
            profiler.stop()
            if rank == 0:
                profiler.export_chrome_trace(payload["profile_path"])
            profiler = None
    step_ms = clock.step_ms()
    if rank == 0:
        for step, ms in enumerate(step_ms, 1):
            print(f" FSDP2 step {step}/{spec.iters} | ms: {ms:.1f}", flush=True)
        print(f" FSDP2 last lm loss: {loss.item():.4f}", flush=True)
    peak_mib = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0
    peak = torch.tensor([peak_mib], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(spec.result_path, "w") as f:
            json.dump({"step_ms": step_ms, "max_allocated_mib": peak.item(), "version": torch.__version__}, f)
    dist.barrier()
    dist.destroy_process_group()


class StepClock:
    """Step times without waiting for the GPU between steps: a CUDA event before and after each step
    on the current stream, all read after the last (host time on CPU, where nothing runs ahead)."""

    def __init__(self, device) -> None:
        import torch
        self.cuda = device.type == "cuda"
        self.event = (lambda: torch.cuda.Event(enable_timing=True)) if self.cuda else None
        self.marks: list = []

    def start(self) -> None:
        self.marks.append([self._mark(), None])

    def stop(self) -> None:
        self.marks[-1][1] = self._mark()

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = self.event()
        event.record()
        return event

    def step_ms(self) -> list[float]:
        if not self.cuda:
            return [(b - a) * 1e3 for a, b in self.marks]
        self.marks[-1][1].synchronize()
        return [a.elapsed_time(b) for a, b in self.marks]


def run_limit(timeout: float, deadline: Optional[float]) -> float:
    """The next run's time limit in seconds: `timeout`, less where the time.monotonic() `deadline` comes
    first; 0 (skip the run) when less than MIN_RUN_S is left."""
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    return min(timeout, left) if left >= MIN_RUN_S else 0


def run_stage(plan: StagePlan, args: argparse.Namespace, rnd: int, peak: Optional[float],
              timeout: Callable[[], float]) -> list[dict]:
    """One round's rows of one stage, in the order of --systems; `timeout()` is the next run's limit in
    seconds (0: skip it)."""
    rows = []

    def add(kind: str, system: str, run: Callable[[float], dict]) -> None:
        limit = timeout()
        row = run(limit) if limit > 0 else {"system": system, "error": "skipped: --budget spent"}
        rows.append({"round": rnd, "stage": plan.stage, "kind": kind, "label": system, **row})
        print(json.dumps(rows[-1]), flush=True)

    for kind in args.systems:
        log = os.path.join(args.out, f"{kind}_zero{plan.stage}_{rnd}.log")
        if kind == "megapar":
            for name, flags in plan.megapar.items():
                add(kind, f"megapar {name}",
                    lambda t, name=name, flags=flags: run_megapar(
                        plan.shape, flags, plan.spec, peak, os.path.join(args.out, f"{name}_{rnd}.log"), t,
                        args.warmup, f"megapar {name}"))
        elif kind == "deepspeed":
            add(kind, f"DeepSpeed ZeRO-{plan.stage}",
                lambda t: run_deepspeed(plan.shape, plan.spec, peak, log, t, args.warmup))
        else:
            for per_unit in args.fsdp2_blocks_per_unit:
                name = f"fsdp2_zero{plan.stage}_b{per_unit}_{rnd}"
                trace = os.path.join(args.out, f"{name}_trace.json") if args.fsdp2_profile else None
                payload = fsdp2_payload(plan.spec, args.nanogpt_dir, not args.fsdp2_eager, warmup=args.warmup,
                                        profile_path=trace, blocks_per_unit=per_unit)
                add(kind, f"FSDP2 reshard_after_forward={plan.stage == 3}, {per_unit} block(s) per unit",
                    lambda t, payload=payload, name=name: run_fsdp2(
                        plan.spec, payload, plan.shape.gpus, peak, os.path.join(args.out, f"{name}.log"), t,
                        args.warmup))
    return rows


def format_runs(rows: list[dict], peak_desc: str) -> str:
    """The markdown table of every run."""
    out = [f"MFU against {peak_desc}", "",
           "| round | ZeRO stage | system | ms/step | tokens/s | tokens/s per GPU | TFLOP/s per GPU | MFU "
           "| max allocated GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        head = f"| {row['round']} | {row['stage']} | {row['system']} |"
        if "error" in row:
            out.append(f"{head} failed: {row['error']} | | | | | |")
            continue
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a"
        out.append(f"{head} {row['ms']:.1f} | {row['tokens_s']:.0f} | {row['tokens_s'] / row['gpus']:.0f} | "
                   f"{row['tflops']:.1f} | {mfu} | {row['mem_gib']:.1f} |")
    return "\n".join(out)


def ratios(rows: list[dict]) -> list[tuple[int, str, str, list[Optional[float]]]]:
    """(stage, megapar's system, the anchor's, [megapar's tokens/s per GPU over the anchor's, per
    round; None where either failed]) for each megapar recipe and anchor run of each stage. An anchor
    run is its row's "label" (the system asked for, without the version a successful run names), its
    kind where it has none."""
    rounds = sorted({row["round"] for row in rows})
    base = lambda row: row.get("label", row["kind"])  # noqa: E731
    out = []
    for stage in dict.fromkeys(row["stage"] for row in rows):
        at = [row for row in rows if row["stage"] == stage]
        ours = list(dict.fromkeys(row["system"] for row in at if row["kind"] == "megapar"))
        for anchor in dict.fromkeys(base(row) for row in at if row["kind"] != "megapar"):
            theirs = [row for row in at if row["kind"] != "megapar" and base(row) == anchor]
            name = next((row["system"] for row in theirs if "error" not in row), theirs[0]["system"])
            for system in ours:
                per_round = []
                for r in rounds:
                    a = next((row for row in at if row["system"] == system and row["round"] == r), None)
                    b = next((row for row in theirs if row["round"] == r), None)
                    ok = a is not None and b is not None and "error" not in a and "error" not in b
                    per_round.append(a["tokens_s"] / a["gpus"] / (b["tokens_s"] / b["gpus"]) if ok else None)
                out.append((stage, system, name, per_round))
    return out


def format_ratios(rows: list[dict]) -> str:
    """The markdown table of ratios(rows)."""
    out = ["| ZeRO stage | megapar | anchor | megapar tokens/s per GPU over the anchor's (by round) |",
           "|---|---|---|---|"]
    for stage, ours, theirs, per_round in ratios(rows):
        cells = ", ".join(f"{x:.2f}x" if x is not None else "n/a" for x in per_round)
        out.append(f"| {stage} | {ours} | {theirs} | {cells} |")
    return "\n".join(out)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="345m", choices=list(MODELS),
                   help="the model: 345m GPT-2 345M, 1.3b GPT-3's 1.3B shape (megapar's <shape>-dp2-* recipes)")
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=(2, 3))
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS, help="run in this order")
    p.add_argument("--megapar-variants", nargs="+", default=["graph"], choices=list(VARIANTS),
                   help="megapar's recipes: " + ", ".join(f"{k}: {v}" for k, v in VARIANTS.items()))
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10, help="steps of each run left out of its mean")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--timeout", type=float, default=420, help="seconds per run before it counts as failed")
    p.add_argument("--budget", type=float, help="seconds for all runs: a run starts only with a minute left")
    p.add_argument("--nanogpt-dir", default=os.path.join(ROOT, ".gpu", "nanogpt"),
                   help="a folder with nanoGPT's model.py (github.com/karpathy/nanoGPT; git-ignored)")
    p.add_argument("--fsdp2-eager", action="store_true", help="FSDP2's blocks not compiled")
    p.add_argument("--fsdp2-blocks-per-unit", type=int, nargs="+", default=[1],
                   help="FSDP2 runs with this many consecutive blocks per fully_shard unit (a sweep: one row each; "
                        "fewer units, fewer hooks and larger collectives, less overlap)")
    p.add_argument("--fsdp2-profile", action="store_true",
                   help="also write a torch.profiler trace of FSDP2's two steps after --warmup to --out")
    p.add_argument("--gpus", type=int, default=2, choices=(1, 2),
                   help="2: data parallel 2 (megapar's <shape>-dp2-* recipes); 1: the same harness on one GPU "
                        "(megapar's <shape>-graph / <shape>-compile)")
    p.add_argument("--vocab-file", default=os.path.join(ROOT, "tests", "data", "gpt2", "encoder.json"))
    p.add_argument("--merge-file", default=os.path.join(ROOT, "tests", "data", "gpt2", "vocab.bpe"))
    p.add_argument("--out", default=os.path.join(ROOT, ".gpu", "bench_vs_anchors"), help="folder for the logs")
    args = p.parse_args(argv)
    if args.iters <= args.warmup:
        p.error(f"--iters must be more than --warmup ({args.warmup})")
    if "fsdp2" in args.systems and not os.path.isfile(os.path.join(args.nanogpt_dir, "model.py")):
        p.error(f"--nanogpt-dir {args.nanogpt_dir} has no model.py; copy nanoGPT's model.py there "
                f"(a git-ignored folder) or leave fsdp2 out of --systems")
    args.vocab_file, args.merge_file, args.out, args.nanogpt_dir = map(
        os.path.abspath, (args.vocab_file, args.merge_file, args.out, args.nanogpt_dir))
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    with open(args.vocab_file) as f:
        token_vocab = len(json.load(f))
    try:  # every stage's flags checked before any run: an unknown recipe is one line
        plans = [stage_plan(stage, args, token_vocab) for stage in args.stages]
    except MegaparError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
    os.makedirs(args.out, exist_ok=True)
    deadline = None if args.budget is None else time.monotonic() + args.budget
    peak, gpu = gpu_peak()
    s = plans[0].spec
    print(f"{s.layers} layers x {s.hidden}, {s.heads} heads, seq {s.seq}, vocab {s.vocab}, micro-batch "
          f"{s.micro_batch} x {args.gpus} GPUs ({gpu}), global batch {s.global_batch}; mean of steps "
          f"{args.warmup + 1}-{args.iters}", flush=True)
    rows = []
    for rnd in range(args.rounds):
        for plan in plans:
            rows += run_stage(plan, args, rnd, peak, lambda: run_limit(args.timeout, deadline))
    print()
    print(format_runs(rows, f"{gpu} dense bf16 peak {peak:.0f} TFLOP/s" if peak else gpu))
    print()
    print(format_ratios(rows))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == FSDP2_WORKER:
        fsdp2_worker(sys.argv[2])
    else:
        main()
