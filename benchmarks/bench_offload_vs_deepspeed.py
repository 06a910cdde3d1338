"""megapar's CPU-offloaded optimizer against DeepSpeed ZeRO-Offload at the same shape, alternating.

    python benchmarks/bench_offload_vs_deepspeed.py [--shape 6.7b] [--global-batch-size 16] [--iters 6] \
        [--rounds 1] [--ds-stage 2|3] [--out DIR] [--megapar-only | --ds-only] [--megapar-extra FLAG ...]

Each round runs (a) megapar through scripts/pretrain_gpt2.sh with `--recipe 6.7b-offload` (ZeRO-2,
the AdamW step on the CPU), the shape's model and ZeRO flags, the batch sizes given here and
benchmarks/bench_train.py's benchmark flags (dropout 0, no eval or save, GPT-2 BPE data), then (b)
DeepSpeed in a subprocess (this script again, with an internal flag): Hugging Face's GPT2LMHeadModel
at the same shape, built on the GPU in bf16, under deepspeed.initialize with ZeRO stage 2 (the
shape's stage; --ds-stage overrides), `offload_optimizer: cpu` (pinned), bf16, DeepSpeedCPUAdam
(AdamW, JIT-compiled with ninja on first use; TORCH_EXTENSIONS_DIR defaults to .gpu/torch_extensions
so a second call reuses it), gradient clipping, contiguous gradients and overlapped reduction.

The DeepSpeed run mirrors megapar's parsed flags: layers, hidden, heads, seq, micro and global batch
(gradient accumulation makes up the rest), AdamW's lr, betas, eps and weight decay (not on biases and
LayerNorm weights, as megapar), clipping, and activation recompute (Hugging Face's gradient
checkpointing, whole layers, only when megapar's flags recompute). Its vocabulary is megapar's padded
one (50304 for GPT-2 BPE), so both do the same GEMMs, and its batches are random tokens of the full
sequence length (the speed does not depend on the data). The first two steps of each system are
warm-up; the numbers are the mean of the later ones (megapar: its per-iteration log lines; DeepSpeed:
each optimizer step timed with a synchronize and perf_counter). tokens/s, TFLOP/s per GPU and MFU use
megapar's FLOP formula (megapar/run/throughput.py) and GPU peak for both rows; peak memory is
torch.cuda.max_memory_allocated (megapar's "max allocated" log field); host memory is the largest sum of
the resident memory of the run's processes (the launcher, its ranks and their children; pinned buffers
included), sampled every second, beside what the memory estimator predicts for the offloaded state. A
failed run (OOM, a compile error, a timeout) is reported in its row.

Shapes: 6.7b (GPT-3 6.7B, 1 GPU, ZeRO-2), 1.3b (24 x 2048, 16 heads, 1 GPU, ZeRO-2), 13b (40 x 5120,
40 heads, 2 GPUs, ZeRO-3 for both; DeepSpeed under torch.distributed.run, the model built inside
deepspeed.zero.Init). DeepSpeed and transformers are imported only in the DeepSpeed subprocess.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from bench_train import ITER_RE, MEM_RE, bench_flags  # benchmarks/bench_train.py
from megapar.config.build import build_config
from megapar.config.overlays import parse_flags
from megapar.config.recipes import GPT3_6_7B, GPT3_13B, GPT_1_3B, RECIPES, words
from megapar.errors import USER_ERROR_EXIT, MegaparError
from megapar.launch import _children
from megapar.run.throughput import flops_per_token
from megapar.topology import padded_vocab_size

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = "6.7b-offload"
ITERATION_RE = re.compile(r"iteration\s+(\d+)/")
WARMUP_STEPS = 2  # steps of each system left out of its mean
DS_WORKER = "--_ds-worker"  # the internal flag: run DeepSpeed from the spec file it names
LAUNCHER_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"


@dataclass(frozen=True)
class Shape:
    """A model shape, the GPUs both systems run it on, and the ZeRO stage megapar uses (DeepSpeed's default)."""
    model_flags: tuple[str, ...]
    gpus: int
    zero_stage: int


SHAPES = {"6.7b": Shape(words(GPT3_6_7B), 1, 2), "1.3b": Shape(words(GPT_1_3B), 1, 2),
          "13b": Shape(words(GPT3_13B), 2, 3)}


@dataclass(frozen=True)
class DsSpec:
    """Everything the DeepSpeed subprocess needs, taken from megapar's parsed flags."""
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int            # megapar's padded vocabulary: the LM head's width
    token_vocab: int      # the tokenizer's: random tokens are drawn below it
    micro_batch: int
    global_batch: int
    stage: int
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    clip_grad: float
    recompute: bool
    iters: int
    result_path: str
    offload: bool = True  # ZeRO-Offload with DeepSpeedCPUAdam; False: no offload, torch's fused AdamW on the GPU


def megapar_flags(shape: Shape, args) -> list[str]:
    """The flags after pretrain_gpt2.sh: the offload recipe, the shape's model and ZeRO stage, the batch
    sizes, bench_train.py's benchmark flags with a log line per iteration, and --megapar-extra."""
    bench = argparse.Namespace(iters=args.iters, log_window=1, vocab_file=args.vocab_file, merge_file=args.merge_file)
    return ["--recipe", RECIPE, *shape.model_flags, "--zero-stage", str(shape.zero_stage),
            "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(args.global_batch_size),
            *bench_flags(bench), *args.megapar_extra]


def ds_spec(flags: Sequence[str], shape: Shape, token_vocab: int, stage: Optional[int], iters: int,
            result_path: str) -> DsSpec:
    """The DeepSpeed run that matches megapar's run of `flags` (parsed as megapar parses them)."""
    cfg = build_config(parse_flags(list(flags)), shape.gpus, assume_gpus=True)
    m, t = cfg.model, cfg.train
    return DsSpec(layers=m.num_layers, hidden=m.hidden_size, heads=m.num_attention_heads, seq=m.seq_length,
                  vocab=padded_vocab_size(token_vocab, m.make_vocab_size_divisible_by, 1), token_vocab=token_vocab,
                  micro_batch=t.micro_batch_size, global_batch=t.global_batch_size,
                  stage=shape.zero_stage if stage is None else stage, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2),
                  eps=t.adam_eps, weight_decay=t.weight_decay, clip_grad=t.clip_grad,
                  recompute=m.recompute_granularity is not None, iters=iters, result_path=result_path)


def ds_config(spec: DsSpec, world_size: int) -> dict:
    """deepspeed.initialize's config: bf16, ZeRO at spec.stage and, with spec.offload, ZeRO-Offload of the
    optimizer with DeepSpeedCPUAdam (AdamW); without it no optimizer entry: the worker passes its own
    (torch's fused AdamW), as DeepSpeed's own GPU AdamW (FusedAdam) would need its CUDA ops compiled."""
    per_step = spec.micro_batch * world_size
    if spec.global_batch % per_step:
        raise ValueError(f"global batch {spec.global_batch} is not a multiple of micro batch {spec.micro_batch} "
                         f"x {world_size} GPU(s)")
    zero = {"stage": spec.stage, "contiguous_gradients": True, "overlap_comm": True, "reduce_bucket_size": int(2e8)}
    if spec.stage == 3:
        zero.update(stage3_prefetch_bucket_size=int(2e8), stage3_param_persistence_threshold=int(1e5))
    else:
        zero.update(allgather_bucket_size=int(2e8), reduce_scatter=True)
    config = {"train_batch_size": spec.global_batch, "train_micro_batch_size_per_gpu": spec.micro_batch,
              "gradient_accumulation_steps": spec.global_batch // per_step, "gradient_clipping": spec.clip_grad,
              "bf16": {"enabled": True}, "zero_optimization": zero,
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if spec.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        config["optimizer"] = {"type": "AdamW", "params": {"lr": spec.lr, "betas": list(spec.betas), "eps": spec.eps,
                                                           "weight_decay": spec.weight_decay}}
    return config


def steady_mean(step_ms: dict[int, float], warmup: int = WARMUP_STEPS) -> float:
    """Mean step time of the steps after the first `warmup` (1-based step numbers)."""
    kept = [ms for step, ms in step_ms.items() if step > warmup]
    if not kept:
        raise ValueError(f"no step after the first {warmup}: give --iters {warmup + 1} or more")
    return sum(kept) / len(kept)


def megapar_step_ms(log: str) -> dict[int, float]:
    """{iteration: ms} from megapar's per-iteration log lines (the first iteration has a line of its own)."""
    steps = {}
    for line in log.splitlines():
        hit, number = ITER_RE.search(line), ITERATION_RE.search(line)
        if hit and number:
            steps[int(number.group(1))] = float(hit.group(1))
    return steps


def table_row(system: str, ms: float, spec: DsSpec, gpus: int, peak_tflops: Optional[float],
              mem_mib: float, host_gib: float = float("nan")) -> dict:
    """ms/step -> tokens/s, TFLOP/s per GPU and MFU by megapar's formula (the same for both systems)."""
    tokens_s = spec.global_batch * spec.seq / (ms / 1e3)
    tflops = flops_per_token(spec.layers, spec.hidden, spec.seq, spec.vocab) * tokens_s / gpus / 1e12
    return {"system": system, "ms": ms, "tokens_s": tokens_s, "gpus": gpus, "tflops": tflops,
            "mfu": tflops / peak_tflops if peak_tflops else None, "mem_gib": mem_mib / 1024, "host_gib": host_gib}


def descendants(pid: int) -> list[int]:
    """The children of `pid`, theirs, and so on (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        children = _children(todo.pop())
        out += children
        todo += children
    return out


def resident_gib(pids: list[int]) -> float:
    """The resident memory of these processes together (Linux /proc/PID/statm; gone ones count 0)."""
    pages = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as f:
                pages += int(f.read().split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            pass
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30


class HostPeak:
    """The largest resident memory of process `pid` and its descendants together, sampled every
    `interval` seconds (a thread) until the block ends."""

    def __init__(self, pid: int, interval: float = 1.0):
        self.pid, self.interval, self.gib = pid, interval, 0.0
        self._stop = threading.Event()

    def __enter__(self) -> "HostPeak":
        def sample() -> None:
            while True:
                self.gib = max(self.gib, resident_gib([self.pid, *descendants(self.pid)]))
                if self._stop.wait(self.interval):
                    return
        self._thread = threading.Thread(target=sample, name="host-peak", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_logged(cmd: list[str], log_path: str, timeout: float, env: Optional[dict] = None) -> tuple[int, str, float]:
    """(exit code, output, HostPeak's GiB) of `cmd` run from the checkout root; the output also goes to
    `log_path`.
    A timeout is exit code 124 with what was printed before it; it kills the command and all its
    descendants, found by parent id: torchrun and megapar's launcher start theirs in sessions of
    their own, which a process-group kill would leave running on the GPUs."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env) as proc, \
            HostPeak(proc.pid) as host:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            for pid in [proc.pid, *descendants(proc.pid)]:  # all found before any dies and is reparented
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            stdout, stderr = proc.communicate()
            rc, stderr = 124, stderr + f"\ntimed out after {timeout:.0f} s"
    out = stdout + stderr
    with open(log_path, "w") as f:
        f.write(" ".join(cmd) + "\n" + out)
    return rc, out, host.gib


def failure(rc: int, out: str, log_path: str) -> str:
    """One line for a failed run's row: exit code, the last line that says why, the log. The report
    torch.distributed.run adds when a rank fails (its own traceback and a summary) is left out: the
    rank's error comes before it."""
    launcher = out.find(LAUNCHER_FAILED)
    if launcher >= 0:
        start = out.rfind("Traceback (most recent call last)", 0, launcher)
        out = out[:start if start >= 0 else launcher]
    lines = [ln.strip() for ln in out.strip().splitlines() if ln.strip()]
    why = next((ln for ln in reversed(lines) if re.search(r"Error|error:|out of memory|timed out|Killed", ln)),
               lines[-1] if lines else "no output")
    return f"rc={rc}: {why[:300]} (log: {log_path})"


def run_megapar(shape: Shape, flags: list[str], spec: DsSpec, peak: Optional[float], log_path: str,
                timeout: float, warmup: int = WARMUP_STEPS, system: str = "megapar") -> dict:
    """megapar's row: pretrain_gpt2.sh with `flags` (a log line per iteration), the mean of the
    iterations after `warmup`."""
    cmd = ["bash", os.path.join(ROOT, "scripts", "pretrain_gpt2.sh"), "--nproc-per-node", str(shape.gpus), *flags]
    rc, out, host = run_logged(cmd, log_path, timeout)
    steps, mems = megapar_step_ms(out), [int(m) for m in MEM_RE.findall(out)]
    if rc != 0 or not any(s > warmup for s in steps):
        return {"system": system, "error": failure(rc, out, log_path) + f"; host memory peak +{host:.0f} GiB"}
    return table_row(system, steady_mean(steps, warmup), spec, shape.gpus, peak, max(mems) if mems else float("nan"),
                     host)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(script: list[str], payload: dict, result_path: str, gpus: int, log_path: str,
               timeout: float) -> tuple[Optional[dict], str]:
    """(the result rank 0 wrote to `result_path`, "") of `script` (a path and its worker flag, given the
    path of a JSON file of `payload` last) in a subprocess: one process on one GPU (the rank variables
    set here), torch.distributed.run on several; (None, why) when it failed."""
    payload_path = os.path.splitext(result_path)[0] + "_spec.json"
    with open(payload_path, "w") as f:
        json.dump(payload, f)
    if os.path.exists(result_path):
        os.remove(result_path)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".gpu", "torch_extensions"))
    if gpus == 1:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        cmd = [sys.executable, *script, payload_path]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus),
               "--master-addr", "127.0.0.1", "--master-port", env["MASTER_PORT"], *script, payload_path]
    rc, out, host = run_logged(cmd, log_path, timeout, env)
    if rc != 0 or not os.path.exists(result_path):
        return None, failure(rc, out, log_path) + f"; host memory peak +{host:.0f} GiB"
    with open(result_path) as f:
        return {**json.load(f), "host_gib": host}, ""


def worker_row(system: str, result: dict, spec: DsSpec, gpus: int, peak: Optional[float],
               warmup: int = WARMUP_STEPS) -> dict:
    """The table row of a worker's result (its step times, from step 1, and peak memory)."""
    steps = {i + 1: ms for i, ms in enumerate(result["step_ms"])}
    return table_row(system, steady_mean(steps, warmup), spec, gpus, peak, result["max_allocated_mib"],
                     result.get("host_gib", float("nan")))


def run_deepspeed(shape: Shape, spec: DsSpec, peak: Optional[float], log_path: str, timeout: float,
                  warmup: int = WARMUP_STEPS) -> dict:
    """DeepSpeed's row: this script with DS_WORKER in a subprocess."""
    result, why = run_worker([os.path.abspath(__file__), DS_WORKER], asdict(spec), spec.result_path, shape.gpus,
                             log_path, timeout)
    if result is None:
        return {"system": f"DeepSpeed ZeRO-{spec.stage}", "error": why}
    return worker_row(f"DeepSpeed {result['version']} ZeRO-{spec.stage}", result, spec, shape.gpus, peak, warmup)


def load_spec(raw: dict) -> DsSpec:
    """The DsSpec that run_worker's JSON file holds (asdict of it)."""
    return DsSpec(**{**raw, "betas": tuple(raw["betas"])})


def ds_worker(spec_path: str) -> None:
    """One rank of the DeepSpeed run of the spec at `spec_path`; rank 0 writes the step times,
    DeepSpeed's version and the largest peak memory of the ranks to spec.result_path."""
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator
    from transformers import GPT2Config, GPT2LMHeadModel

    with open(spec_path) as f:
        spec = load_spec(json.load(f))
    deepspeed.init_distributed()
    acc = get_accelerator()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    acc.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device(acc.current_device_name())
    config = ds_config(spec, world)
    hf = GPT2Config(vocab_size=spec.vocab, n_positions=spec.seq, n_embd=spec.hidden, n_layer=spec.layers,
                    n_head=spec.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    if spec.stage == 3:  # each module's parameters partitioned as it is built
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = GPT2LMHeadModel(hf)
        init_partitioned(model, rank)
    else:  # built in bf16 on the GPU: no fp32 copy, no CPU init
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with device:
                model = GPT2LMHeadModel(hf)
        finally:
            torch.set_default_dtype(default)
    if spec.recompute:  # transformers 5 renamed it; 4.x has only the old name
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    groups = decay_groups(model)
    if spec.offload:  # DeepSpeedCPUAdam, built by DeepSpeed from the config
        engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    else:  # torch's one-launch AdamW; DeepSpeed's ZeRO optimizer steps it on its fp32 partitions
        optimizer = torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas, eps=spec.eps,
                                      weight_decay=spec.weight_decay, fused=True)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    engine.train()
    if rank == 0:
        print(f"DeepSpeed {deepspeed.__version__}: {type(engine.optimizer).__name__} over "
              f"{type(engine.basic_optimizer).__name__}, config {json.dumps(config)}", flush=True)
    accumulation = engine.gradient_accumulation_steps()
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    step_ms = []
    for step in range(1, spec.iters + 1):
        acc.synchronize()
        start = time.perf_counter()
        for _ in range(accumulation):
            tokens = torch.randint(0, spec.token_vocab, (spec.micro_batch, spec.seq), device=device, generator=gen)
            loss = engine(input_ids=tokens, labels=tokens).loss  # the model shifts the labels
            engine.backward(loss)
            engine.step()
        acc.synchronize()
        step_ms.append((time.perf_counter() - start) * 1e3)
        if rank == 0:
            print(f" DeepSpeed step {step}/{spec.iters} | ms: {step_ms[-1]:.1f} | lm loss: {loss.item():.4f}",
                  flush=True)
    peak = torch.tensor([acc.max_memory_allocated() / 2**20], device=device)
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    if rank == 0:
        with open(spec.result_path, "w") as f:
            json.dump({"step_ms": step_ms, "max_allocated_mib": peak.item(), "version": deepspeed.__version__}, f)
    torch.distributed.barrier()


def decay_groups(model) -> list[dict]:
    """AdamW's parameter groups as megapar's: no weight decay on biases and LayerNorm weights (the
    parameters of one dimension; a parameter partitioned by deepspeed.zero.Init has its shape in ds_shape)."""
    params = list(model.parameters())
    matrix = [len(getattr(p, "ds_shape", p.shape)) > 1 for p in params]
    return [{"params": [p for p, m in zip(params, matrix) if m]},
            {"params": [p for p, m in zip(params, matrix) if not m], "weight_decay": 0.0}]


def init_partitioned(model, rank: int) -> None:
    """GPT-2's initialisation (matrices normal with std 0.02, LayerNorm scales 1, biases 0) of a model
    built under deepspeed.zero.Init: each parameter was partitioned as its module was built, so the
    model's own initialisation saw empty shards."""
    import deepspeed
    import torch
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
            if rank == 0:
                if p.dim() > 1:
                    p.normal_(0.0, 0.02)
                else:
                    p.fill_(1.0 if ".ln_" in name and name.endswith("weight") else 0.0)


def gpu_peak(timeout: float = 300) -> tuple[Optional[float], str]:
    """(dense bf16 peak TFLOP/s, GPU name) as megapar reads them, asked in a subprocess so that this
    process holds no CUDA context while the runs use the GPU."""
    code = ("import torch; from megapar.run.throughput import device_peak_tflops as p; "
            "print(p(torch.device('cuda'))[0]); print(torch.cuda.get_device_name(0))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or len(lines) < 2:
        return None, f"no GPU ({(proc.stderr.strip().splitlines() or ['?'])[-1]})"
    return (None if lines[0] == "None" else float(lines[0])), lines[1]


def format_table(rows: list[tuple[int, dict]], peak_desc: str) -> str:
    """The markdown table: one row per system per round, and each round's megapar/DeepSpeed tokens/s."""
    out = [f"MFU against {peak_desc}", "",
           "| round | system | ms/step | tokens/s | TFLOP/s/GPU | MFU | max allocated GiB "
           "| host GiB (peak resident) | megapar/DS tokens/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted({r for r, _ in rows}):
        pair = [row for rr, row in rows if rr == r]
        ok = {row["system"].split()[0]: row for row in pair if "error" not in row}
        ratio = (f"{ok['megapar']['tokens_s'] / ok['DeepSpeed']['tokens_s']:.2f}x"
                 if {"megapar", "DeepSpeed"} <= set(ok) else "")
        for row in pair:
            if "error" in row:
                out.append(f"| {r} | {row['system']} | failed: {row['error']} | | | | | | |")
                continue
            mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a"
            out.append(f"| {r} | {row['system']} | {row['ms']:.0f} | {row['tokens_s']:.0f} | {row['tflops']:.1f} | "
                       f"{mfu} | {row['mem_gib']:.1f} | {row['host_gib']:.1f} | "
                       f"{ratio if row['system'] == 'megapar' else ''} |")
    return "\n".join(out)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="6.7b", choices=list(SHAPES), help="13b runs on 2 GPUs, the others on 1")
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--iters", type=int, default=6, help=f"steps per run; the first {WARMUP_STEPS} are left out")
    p.add_argument("--rounds", type=int, default=1, help="megapar / DeepSpeed pairs")
    p.add_argument("--ds-stage", type=int, choices=(2, 3), help="DeepSpeed's ZeRO stage; default the shape's")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--megapar-only", action="store_true")
    which.add_argument("--ds-only", action="store_true")
    p.add_argument("--vocab-file", default=os.path.join(ROOT, "tests", "data", "gpt2", "encoder.json"))
    p.add_argument("--merge-file", default=os.path.join(ROOT, "tests", "data", "gpt2", "vocab.bpe"))
    p.add_argument("--out", default=os.path.join(ROOT, ".gpu", "bench_offload_vs_deepspeed"),
                   help="folder for the runs' logs and the DeepSpeed spec/result files")
    p.add_argument("--timeout", type=float, default=1500, help="seconds per run before it counts as failed")
    p.add_argument("--megapar-extra", nargs=argparse.REMAINDER, default=[],
                   help="more flags for megapar's runs (last on the line; the DeepSpeed run follows their "
                        "model, batch, AdamW and recompute settings), e.g. --recompute-granularity full")
    args = p.parse_args(argv)
    if args.iters <= WARMUP_STEPS:
        p.error(f"--iters must be more than the {WARMUP_STEPS} warm-up steps")
    args.vocab_file, args.merge_file, args.out = map(os.path.abspath, (args.vocab_file, args.merge_file, args.out))
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    shape = SHAPES[args.shape]
    assert "--optimizer-cpu-offload" in RECIPES[RECIPE].flags
    os.makedirs(args.out, exist_ok=True)
    with open(args.vocab_file) as f:
        token_vocab = len(json.load(f))
    flags = megapar_flags(shape, args)
    try:  # megapar's flags checked before any run: a bad --megapar-extra is one line
        spec = ds_spec(flags, shape, token_vocab, args.ds_stage, args.iters, os.path.join(args.out, "ds_result.json"))
    except MegaparError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
    peak, gpu = gpu_peak()
    print(f"{args.shape}: {spec.layers} layers x {spec.hidden}, {spec.heads} heads, seq {spec.seq}, vocab "
          f"{spec.vocab} (megapar's padded), global batch {spec.global_batch} (micro {spec.micro_batch}), "
          f"{shape.gpus} GPU(s) ({gpu}); DeepSpeed on random tokens; mean of steps {WARMUP_STEPS + 1}-{args.iters}",
          flush=True)
    rows = []
    for r in range(args.rounds):
        if not args.ds_only:
            rows.append((r, run_megapar(shape, flags, spec, peak, os.path.join(args.out, f"megapar_{r}.log"),
                                        args.timeout)))
            print(r, rows[-1][1], flush=True)
        if not args.megapar_only:
            rows.append((r, run_deepspeed(shape, spec, peak, os.path.join(args.out, f"deepspeed_{r}.log"),
                                          args.timeout)))
            print(r, rows[-1][1], flush=True)
    print()
    print(format_table(rows, f"{gpu} dense bf16 peak {peak:.0f} TFLOP/s" if peak else gpu))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == DS_WORKER:
        ds_worker(sys.argv[2])
    else:
        main()
