"""Training runs shared by the GPU tests (test_cuda_graph.py, test_fused_adamw.py).

Each test names the runs it reads with `Run(...)` objects in a `training_runs` marker and fetches
their results from the session fixture `gpu_runs` (conftest.py): `gpu_runs.get(run)` -> {"loss",
"norm", "valid": {iteration: value}, "out": log text, "save": checkpoint dir or None}.

- One run per distinct configuration and session: flags are kept sorted and `--adam-impl auto` is
  written out as what it resolves to, so test_cuda_graph's default-optimizer runs and
  test_fused_adamw's explicit `--adam-impl fused` runs are the same runs when the csrc kernels are
  built (they are on GPU machines; then auto picks them).
- A resume is a continuation of an uninterrupted run: `Run(..., save=True)` checkpoints at
  iteration SAVE_AT (--save-interval) and trains on to the end; its `.resumed()` loads that
  checkpoint and trains to the end again, so the two runs' losses after SAVE_AT must agree (two
  runs instead of uninterrupted + stopped + resumed).
- The first GPU test of a session starts every run the selected tests name, several at a time over
  the visible GPUs (MEGAPAR_GPU_TEST_JOBS at once, default 3 per GPU); a 2-GPU run takes both. Runs
  of one --torch-compile configuration and a resume with its checkpointing run go one after the
  other (the later ones reuse Inductor's cache), longest chains first. The tests themselves
  (moved to the end of the session by conftest.py) then wait for their runs' results.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, replace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_ITERS, SAVE_AT = 8, 4
GPU_TRAIN = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
             "--micro-batch-size", "4", "--global-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout",
             "0", "--lr", "1e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "linear", "--min-lr", "0",
             "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1", "--split", "98,2,0",
             "--train-iters", str(TRAIN_ITERS), "--cuda-graph-warmup-steps", "2"]
LOSS_RE = re.compile(r" iteration +(\d+)/ *\d+ .*? lm loss: ([-\d.E+]+) .*? grad norm: ([\d.]+)")
VALID_RE = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([-\d.E+]+)")
RUN_TIMEOUT_S = int(os.environ.get("MEGAPAR_GPU_RUN_TIMEOUT", "480"))  # a hung NCCL run fails, not stalls


@functools.cache
def _auto_adam_impl() -> str:
    import torch

    from megapar.optimizer.base import resolve_adam_impl
    return resolve_adam_impl("auto", torch.device("cuda"))


def _options(argv) -> tuple[str, ...]:
    """["--tensor-parallel", "2", "--bf16"] -> ("--bf16", "--tensor-parallel 2"), --adam-impl written out."""
    opts, i = [], 0
    while i < len(argv):
        takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        opts.append(f"{argv[i]} {argv[i + 1]}" if takes_value else argv[i])
        i += 2 if takes_value else 1
    if not any(o.startswith("--adam-impl ") for o in opts):   # an offloaded optimizer steps on the CPU: torch's
        offload = any(o.startswith(("--optimizer-cpu-offload", "--optimizer-nvme-offload")) for o in opts)
        opts.append(f"--adam-impl {'torch' if offload else _auto_adam_impl()}")
    return tuple(sorted(set(opts)))


@dataclass(frozen=True)
class Run:
    """GPU_TRAIN + the GPT-2 data flags + `extra` on `gpus` GPUs (torchrun, scripts/pretrain_gpt2.sh).
    save: also checkpoint at iteration SAVE_AT; resume: continue from the save=True run's checkpoint."""
    extra: tuple[str, ...] = ()
    gpus: int = 1
    save: bool = False
    resume: bool = False

    def key(self) -> tuple:
        return (_options(self.extra), self.gpus, self.save, self.resume)

    def resumed(self) -> "Run":
        assert self.save and not self.resume
        return replace(self, save=False, resume=True)

    def source(self) -> "Run":
        """The run whose checkpoint a resume loads."""
        return replace(self, save=True, resume=False)

    def compiled(self) -> bool:
        return "--torch-compile" in self.extra

    def family(self) -> tuple:
        """Runs that go one after another: one compile configuration (graph or not, saving or
        resuming), or a resume with its checkpointing run."""
        if self.compiled():
            return tuple(o for o in self.key()[0] if o != "--enable-cuda-graph"), self.gpus
        return self.source().key() if self.resume or self.save else self.key()

    def name(self) -> str:
        text = "_".join(o.lstrip("-").replace(" ", "") for o in self.key()[0])
        return f"{self.gpus}gpu_{text}{'_save' if self.save else ''}{'_resume' if self.resume else ''}"


def uses(*runs: Run):
    """Marker naming the runs a test reads, so the session starts them before the test waits."""
    return pytest.mark.training_runs(*runs)


def runs_of(items) -> list[Run]:
    out = []
    for item in items:
        for mark in item.iter_markers("training_runs"):
            out += [r for r in mark.args if r not in out]
    return out


class GpuRuns:
    def __init__(self, data_flags: list[str], workdir: str):
        import torch
        self.data, self.workdir = list(data_flags), workdir
        self.gpu_count = torch.cuda.device_count()
        per_gpu = max(1, min(3, (os.cpu_count() or 4) // max(1, 4 * self.gpu_count)))
        jobs = int(os.environ.get("MEGAPAR_GPU_TEST_JOBS", per_gpu * max(1, self.gpu_count)))
        self.pool = cf.ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="gpu-run")
        self.futures: dict[tuple, cf.Future] = {}
        self.lock = threading.Lock()
        self.busy = [0] * max(1, self.gpu_count)       # 1-GPU runs in flight per GPU
        self.t0 = time.time()
        self.procs: set[subprocess.Popen] = set()      # runs in flight
        self.closing = False

    # ---- scheduling -----------------------------------------------------------------------------
    def start(self, runs) -> None:
        """Start `runs` (and the checkpointing runs their resumes need) in chains of runs that go
        one after another, longest chains first."""
        wanted: dict[tuple, Run] = {}
        for r in runs:
            if r.gpus <= self.gpu_count:
                for x in ([r.source()] if r.resume else []) + [r]:
                    wanted.setdefault(x.key(), x)
        chains: dict[tuple, list[Run]] = {}
        with self.lock:
            for key, r in wanted.items():
                if key not in self.futures:
                    chains.setdefault(r.family(), []).append(r)
        order = sorted(chains.values(), key=lambda c: (-len(c) - 2 * c[0].compiled(), -c[0].gpus))
        for chain in order:
            chain.sort(key=lambda r: (r.resume, r.save))          # eager, then graph (saving), then resume
            self._submit(chain)

    def _submit(self, chain: list[Run]) -> None:
        with self.lock:
            chain = [r for r in chain if r.key() not in self.futures]
            for r in chain:
                self.futures[r.key()] = cf.Future()
        if chain:
            self.pool.submit(self._run_chain, chain)

    def get(self, run: Run) -> dict:
        if run.gpus > self.gpu_count:
            pytest.skip(f"needs {run.gpus} GPUs")
        with self.lock:
            fut = self.futures.get(run.key())
        if fut is None:
            self.start([run])
            fut = self.futures[run.key()]
        return fut.result()

    def close(self) -> None:
        """End of the session: no test reads a run any more; stop what still runs (after -x, say)."""
        with self.lock:
            self.closing = True
            for proc in self.procs:
                _signal(proc, signal.SIGTERM)
        self.pool.shutdown(wait=True, cancel_futures=True)
        for fut in self.futures.values():
            if not fut.done():
                fut.set_exception(RuntimeError("the test session ended before this run started"))

    # ---- running --------------------------------------------------------------------------------
    def _run_chain(self, chain: list[Run]) -> None:
        for r in chain:
            fut = self.futures[r.key()]
            try:
                if self.closing:
                    raise RuntimeError("the test session ended before this run started")
                fut.set_result(self._run(r))
            except BaseException as e:  # noqa: BLE001 -- reported by the test that reads it
                fut.set_exception(e)

    def _gpus_for(self, run: Run) -> tuple[list[int], bool]:
        with self.lock:
            if run.gpus > 1:
                return list(range(run.gpus)), False
            gpu = min(range(len(self.busy)), key=lambda g: self.busy[g])
            self.busy[gpu] += 1
            return [gpu], True

    @staticmethod
    def _visible(gpus: list[int]) -> str:
        """CUDA_VISIBLE_DEVICES for these indices of the GPUs this process sees."""
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = seen.split(",") if seen else [str(g) for g in range(max(gpus) + 1)]
        return ",".join(ids[g] for g in gpus)

    def _run(self, run: Run) -> dict:
        argv = GPU_TRAIN + self.data + [t for o in run.key()[0] for t in o.split(" ", 1)]
        save_dir = os.path.join(self.workdir, run.source().name() + "_ckpt")
        if run.save:
            argv += ["--save", save_dir, "--save-interval", str(SAVE_AT)]
        if run.resume:
            self.futures[run.source().key()].result()            # raises if the checkpointing run failed
            load_dir = os.path.join(self.workdir, run.name() + "_load")
            it = f"iter_{SAVE_AT:07d}"
            shutil.rmtree(load_dir, ignore_errors=True)
            shutil.copytree(os.path.join(save_dir, it), os.path.join(load_dir, it))
            with open(os.path.join(load_dir, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(SAVE_AT))
            argv += ["--load", load_dir]
        gpus, counted = self._gpus_for(run)
        start = time.time()
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": self._visible(gpus),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
        proc = None
        try:  # own process group, so that a run past its time can be stopped with its torchrun workers
            proc = subprocess.Popen(["bash", "scripts/pretrain_gpt2.sh", "--nproc-per-node", str(run.gpus), *argv],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
                                    process_group=0)
            with self.lock:
                self.procs.add(proc)
                if self.closing:
                    _signal(proc, signal.SIGTERM)
            try:
                out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                # torchrun stops its workers (each in a session of its own) on SIGTERM, not on SIGKILL
                _signal(proc, signal.SIGTERM)
                try:
                    out, _ = proc.communicate(timeout=60)
                except subprocess.TimeoutExpired:
                    _signal(proc, signal.SIGKILL)
                    out, _ = proc.communicate()
                out += f"\n[gpu_runs] stopped after {RUN_TIMEOUT_S} s"
            rc = proc.returncode
        finally:
            with self.lock:
                if proc is not None:
                    self.procs.discard(proc)
                if counted:
                    self.busy[gpus[0]] -= 1
        with open(os.path.join(self.workdir, run.name() + ".log"), "w") as f:  # header: when and how long
            f.write(f"# started at +{start - self.t0:.0f} s on GPUs {gpus}, took {time.time() - start:.0f} s, "
                    f"rc {rc}\n{out}")
        assert rc == 0, f"{run.name()} exited with {rc}:\n{out[-3000:]}"
        return {"loss": {int(i): float(l) for i, l, _ in LOSS_RE.findall(out)},
                "norm": {int(i): float(n) for i, _, n in LOSS_RE.findall(out)},
                "valid": {int(i): float(l) for i, l in VALID_RE.findall(out)}, "out": out,
                "save": save_dir if run.save else None}


def _signal(proc: subprocess.Popen, sig: int) -> None:
    """Signal the run's process group (bash exec's torchrun, which leads it)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def assert_close(a: dict, b: dict, rel: float) -> None:
    assert a.keys() == b.keys() and a, (a, b)
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=rel), (k, a, b)


def after(losses: dict, iteration: int = SAVE_AT) -> dict:
    return {k: v for k, v in losses.items() if k > iteration}
