"""The training loop: microbatches through a schedule, gradient sync, optimizer, eval,
logging, checkpoints and exit conditions. Nothing here knows how the schedule pipelines."""
from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterator, Optional

import torch
import torch.distributed as dist

from .cuda_graph import GraphedStep
from ..errors import NonFiniteLossError
from .initialize import Run, print_rank0
from ..model import VirtualStages
from ..pipeline.p2p import current_step
from ..pipeline.schedules import ScheduleConfig, average_logs, get_forward_backward_func
from ..kernels.readback import to_host, wait_host
from ..tensor_parallel.linear import use_gemv_bias_grads
from ..tensor_parallel.random import get_rng_tracker
from .throughput import device_peak_tflops, flops_per_token, memory_fields, throughput_fields
from .timers import Timers


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    skipped_iters: int = 0
    nan_iters: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)   # (iteration, lm loss) on every rank
    valid_losses: list[tuple[int, float]] = field(default_factory=list)
    exit_reason: Optional[str] = None


# ---- data -----------------------------------------------------------------------------------
def microbatches(run: Run, dataset, first_sample: int, count: int,
                 stage=None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens [b, s], labels [b, s]) for each of the `count` microbatches of one global batch,
    Megatron-style: microbatch m of dp rank d holds samples first + m*micro*dp + d*micro + [0, micro).
    Middle pipeline stages use neither and get (None, None) without touching the data.
    `stage`: the model chunk's stage (interleaved schedule), default the rank's."""
    micro, dp, device = run.cfg.train.micro_batch_size, run.topo.dp, run.device
    stage = stage or run.model.stage
    for m in range(count):
        if not (stage.is_first or stage.is_last):
            yield None, None
            continue
        start = first_sample + m * micro * dp + run.coord.dp * micro
        sample = torch.stack([torch.as_tensor(dataset[i]) for i in range(start, start + micro)]).long()
        if device.type == "cuda":  # pinned: the copy is queued, not waited for (the GPU may be busy)
            sample = sample.pin_memory()
        sample = sample.to(device, non_blocking=True)                                   # [b, s + 1]
        yield sample[:, :-1].contiguous(), sample[:, 1:].contiguous()


def data_iterators(run: Run, dataset, first_sample: int, count: int):
    """The `count` microbatches of one global batch: one iterator, or with model chunks (interleaved
    1F1B) one per chunk, each reading data only where its chunk is the first or last stage."""
    if isinstance(run.model, VirtualStages):
        return [microbatches(run, dataset, first_sample, count, chunk.stage) for chunk in run.model]
    return microbatches(run, dataset, first_sample, count)


def schedule_func(run: Run):
    """The pipeline schedule of this run (interleaved 1F1B with model chunks, ZB-H1 with --enable-zero-bubble)."""
    return get_forward_backward_func(run.topo.pp, run.cfg.parallel.pipeline_schedule,
                                     run.cfg.model.virtual_pipeline_model_parallel_size,
                                     zero_bubble=run.cfg.parallel.enable_zero_bubble)


LOG_KEYS = ("lm loss",)  # what forward_step's loss_func logs


def forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    stage = model.stage
    output = model(tokens if stage.is_first else None, labels=labels if stage.is_last else None)

    def loss_func(per_token_loss: torch.Tensor):
        loss = per_token_loss.float().mean()
        return loss, {"lm loss": loss.detach()}
    return output, loss_func


def schedule_config(run: Run, num_microbatches: int, label: str = "") -> ScheduleConfig:
    cfg = run.cfg
    return ScheduleConfig(
        p2p_timeout=60.0 * cfg.parallel.distributed_timeout_minutes, label=label,
        diagnose_hangs=cfg.parallel.pipeline_hang_diagnostics,
        num_microbatches=num_microbatches, device=run.device, dtype=next(run.model.parameters()).dtype,
        tensor_shape=(cfg.model.seq_length // (run.topo.tp if cfg.model.sequence_parallel else 1),
                      cfg.train.micro_batch_size, cfg.model.hidden_size),                  # [s(/tp), b, h]
        pp_group=run.topo.groups.pp, prev_rank=run.topo.prev_rank(run.rank), next_rank=run.topo.next_rank(run.rank),
        loss_scale=run.optimizer.loss_scale, no_sync=run.grad_buffer.no_sync, pp_grad_group=run.topo.groups.pp_grad,
        log_keys=LOG_KEYS, wgrad_store=run.wgrad_store)


def average_loss(run: Run, logs: list[dict], sched: ScheduleConfig) -> torch.Tensor:
    """Mean 'lm loss' over microbatches (broadcast from the last stage to the whole pipeline)
    and over data-parallel ranks: the same value on every rank, so rank 0 can log it.
    A 0-dim float64 device tensor (read back once per step, after the optimizer is launched)."""
    loss = average_logs(logs, sched).get("lm loss")
    if loss is None:
        loss = torch.zeros((), dtype=torch.float64, device=run.device)
    if run.topo.dp > 1:
        dist.all_reduce(loss, group=run.topo.groups.dp)
        loss = loss / run.topo.dp
    return loss


# ---- one step ---------------------------------------------------------------------------------
def queue_step(run: Run, data: Iterator, count: int, label: str, timers: Timers) -> tuple[bool, torch.Tensor]:
    """Queue one global batch of `count` microbatches: zero the gradient buffer, forward/backward of
    every microbatch, gradient reduction, clipping, optimizer. Returns (applied, [lm loss, grad norm]
    as a float64 device tensor). Nothing is read back to the host (except fp16's overflow check), so
    the whole step can be queued ahead of the GPU, or captured as a CUDA graph."""
    run.grad_buffer.start_step()
    timers.start("forward-backward")
    schedule = schedule_func(run)
    sched = schedule_config(run, count, label)
    logs = schedule(forward_step, data, run.model, sched)
    timers.stop("forward-backward")
    empty_unused_memory(run, 1)
    timers.start("grads-sync")
    run.grad_buffer.finish(before_late=lambda: _allreduce_embedding_grads(run))
    timers.stop("grads-sync")
    timers.start("optimizer")
    applied, grad_norm = run.optimizer.step()
    timers.stop("optimizer")
    empty_unused_memory(run, 2)
    return applied, torch.stack([average_loss(run, logs, sched), grad_norm.double()])


def empty_unused_memory(run: Run, level: int) -> None:
    """--empty-unused-memory-level >= level: hand the caching allocator's unused blocks back to the
    GPU (Megatron's places: 1 after forward-backward and each evaluation batch, 2 also after the
    optimizer). Not inside a CUDA graph capture, whose memory is the graph's own pool."""
    if (run.cfg.train.empty_unused_memory_level >= level and run.device.type == "cuda"
            and not torch.cuda.is_current_stream_capturing()):
        torch.cuda.empty_cache()


def graphed_step(run: Run) -> Optional[GraphedStep]:
    """--enable-cuda-graph: the step as one CUDA graph (after --cuda-graph-warmup-steps eager ones)."""
    if not run.cfg.train.enable_cuda_graph:
        return None
    use_gemv_bias_grads(p for p in run.model.parameters() if p.ndim == 1)  # faster when graphed (linear.py)
    untimed = Timers(0, run.device)  # timers synchronise the device, which a capture forbids
    return GraphedStep(lambda batches: queue_step(run, _iterators(batches), run.cfg.num_microbatches, "cuda graph",
                                                  untimed)[1],
                       run.cfg.train.cuda_graph_warmup_steps, run.device, get_rng_tracker().generators())


def _lists(data):
    """data_iterators' microbatches as lists (a graph copies them into its own tensors)."""
    return [list(chunk) for chunk in data] if isinstance(data, list) else list(data)


def _iterators(batches):
    """_lists' inverse: what the schedule reads."""
    return [iter(chunk) for chunk in batches] if batches and isinstance(batches[0], list) else iter(batches)


def train_step(run: Run, dataset, state: TrainState, timers: Timers,
               graph: Optional[GraphedStep] = None) -> tuple[bool, torch.Tensor]:
    """Queue one global batch (eagerly or as a graph replay). Returns (applied, [lm loss, grad
    norm] on the device); nothing waits for the GPU."""
    run.model.train()
    count = run.cfg.microbatches_at(state.consumed_samples)  # --global-batch-size, or its ramp-up's
    data = data_iterators(run, dataset, state.consumed_samples, count)
    if graph is None:
        return queue_step(run, data, count, f"iteration {state.iteration + 1}", timers)
    timers.start("step (cuda graph)")
    out = graph(None if graph.prefetched == state.consumed_samples else _lists(data))
    timers.stop("step (cuda graph)")
    if run.cfg.train.fp16:  # an overflow skipped the update on the device; the loss scale moves on the host
        following = state.consumed_samples + run.cfg.train.global_batch_size
        if state.iteration + 1 < run.cfg.total_iters:  # load the next batch while this step runs
            graph.prefetch(_lists(data_iterators(run, dataset, following, count)), key=following)
        return run.optimizer.settle_overflow(out[1].item()), out
    return True, out


def _allreduce_embedding_grads(run: Run) -> None:
    """pp > 1: sum the tied word-embedding gradient of the first and last stage."""
    if run.topo.pp == 1 or not (run.model.stage.is_first or run.model.stage.is_last):
        return
    weight = run.model.output_embedding_weight()
    dist.all_reduce(weight.main_grad, group=run.topo.groups.embedding)


def evaluate(run: Run, dataset, iters: int, split: str = "val") -> float:
    """Mean lm loss over the first `iters` global batches of `dataset` (forward only).

    Progress is printed as Megatron's `Evaluating iter i/N` line (with the `split` and the time per
    batch) after the first batch, every --log-interval batches and after the last, so that a long
    evaluation is never silent."""
    cfg, losses = run.cfg, []
    run.optimizer.finish_pending()  # --delayed-param-update: evaluate the last step's weights
    run.model.eval()
    schedule = schedule_func(run)
    start = time.time()
    with torch.no_grad():
        for i in range(iters):
            data = data_iterators(run, dataset, i * cfg.train.global_batch_size, cfg.num_microbatches)
            sched = schedule_config(run, cfg.num_microbatches, f"evaluation batch {i}")
            logs = schedule(forward_step, data, run.model, sched, forward_only=True)
            losses.append(average_loss(run, logs, sched).item())
            empty_unused_memory(run, 1)
            done = i + 1
            if done in (1, iters) or done % cfg.log.log_interval == 0:
                print_rank0(f" Evaluating iter {done}/{iters} ({split} data) | elapsed time per batch (ms): "
                            f"{1000 * (time.time() - start) / done:.1f}")
    run.model.train()
    return sum(losses) / max(1, len(losses))


def log_eval(label: str, loss: float) -> None:
    """Megatron's validation line, e.g. label='validation loss at iteration 100'."""
    ppl = math.exp(min(20.0, loss))
    line = f" {label} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
    print_rank0("-" * len(line) + "\n" + line + "\n" + "-" * len(line))


# ---- exit conditions ------------------------------------------------------------------------------
class SignalHandler:
    """--exit-signal-handler: SIGTERM or a first Ctrl-C (SIGINT) is recorded; the loop finishes the
    iteration, saves, names the signal and exits 0. A second Ctrl-C aborts at once (KeyboardInterrupt,
    no save; the last saved checkpoint stays intact: saves are atomic). `close()` restores the
    previous handlers."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, enabled: bool, rank: int = 0):
        self.received = 0  # the first signal's number, 0 = none
        self.rank, self.previous = rank, {}
        if enabled:
            for sig in self.SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C
        self.received = self.received or signum
        if self.rank == 0:  # os.write: print() is not safe inside a signal handler
            name = signal.Signals(signum).name
            again = "; Ctrl-C again aborts without saving" if signum == signal.SIGINT else ""
            os.write(1, f"> {name} received: finishing the iteration, then saving and exiting{again}\n".encode())

    def close(self) -> None:
        for sig, previous in self.previous.items():
            signal.signal(sig, previous)
        self.previous = {}


def any_rank(flag: bool, device: torch.device) -> bool:
    return max_over_ranks(1 if flag else 0, device) > 0


def max_over_ranks(value: int, device: torch.device) -> int:
    t = torch.tensor([float(value)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def exit_reason(run: Run, state: TrainState, handler: SignalHandler, start_time: float) -> Optional[str]:
    t = run.cfg.train
    if t.exit_signal_handler:
        signum = max_over_ranks(handler.received, run.device)  # every rank stops at the same iteration
        if signum:
            return f"exiting after {signal.Signals(signum).name} at iteration {state.iteration} (--exit-signal-handler)"
    if t.exit_interval and state.iteration % t.exit_interval == 0:
        return f"exiting at iteration {state.iteration} (--exit-interval {t.exit_interval})"
    if t.exit_duration_in_mins is not None:
        late = (time.time() - start_time) / 60.0 > t.exit_duration_in_mins
        if any_rank(late, run.device):
            return f"exiting after {t.exit_duration_in_mins} minutes (--exit-duration-in-mins)"
    return None


class Profiler:
    """torch.profiler over iterations [--profile-step-start, --profile-step-end) (0-based)."""

    def __init__(self, run: Run):
        self.run, self.prof = run, None
        self.start, self.end = run.cfg.log.profile_step_start, run.cfg.log.profile_step_end

    def before(self, iteration: int) -> None:
        if iteration == self.start:
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.run.device.type == "cuda" else [])
            self.prof = profile(activities=acts, record_shapes=True)  # shapes: benchmarks/profile_summary.py --by-op
            self.prof.__enter__()

    def after(self, iteration: int, excluded: Callable[[], ContextManager]) -> None:
        """Stop at the end iteration and write the trace, inside `excluded()` (seconds for a large
        trace, left out of the iteration times; the profiled steps' GPU work is not)."""
        if self.prof is None or iteration != self.end:
            return
        if self.run.device.type == "cuda":
            torch.cuda.synchronize()
        with excluded():
            self.prof.__exit__(None, None, None)
            if self.run.rank == 0:
                key = "cuda_time_total" if self.run.device.type == "cuda" else "cpu_time_total"
                print(self.prof.key_averages().table(sort_by=key, row_limit=30), flush=True)
                path = os.path.join(self.run.cfg.log.tensorboard_dir or ".", "megapar_trace_rank0.json")
                self.prof.export_chrome_trace(path)
                print(f"> profile of iterations {self.start}..{self.end - 1}: trace written to {path}", flush=True)
        self.prof = None


# ---- the loop ------------------------------------------------------------------------------------
def check_finite(state: TrainState, iteration: int, loss: float, applied: bool, grad_norm: float,
                 scaler=None) -> None:
    if not applied:  # fp16 overflow: skipped on every rank, the scaler backs off
        state.skipped_iters += 1
        if scaler is not None and scaler.diverged:  # the same on every rank: the overflow flag is all-reduced
            raise NonFiniteLossError(
                f"fp16 training diverged: {scaler.overflows_at_min} steps in a row up to iteration {iteration} "
                f"overflowed (inf/NaN gradients) at the minimum loss scale {scaler.scale:g} "
                f"({'--loss-scale' if not hasattr(scaler, 'min_scale') else '--min-loss-scale'}); stopped "
                f"without saving this state; lower --lr, use --bf16, or resume from the last checkpoint")
        return
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        state.nan_iters += 1
        raise NonFiniteLossError(f"NaN/Inf at iteration {iteration}: lm loss {loss}, grad norm {grad_norm}; "
                                 f"lower --lr, use --bf16 or --fp16 loss scaling, or check the data")


@dataclass
class LaunchedStep:
    """A queued step whose results are on their way to the host."""
    iteration: int
    consumed_samples: int
    global_batch: int                  # its samples (--global-batch-size, or its ramp-up's)
    out: torch.Tensor                  # [lm loss, grad norm(, params norm)], float64, on the host once `ready`
    ready: Optional[torch.cuda.Event]  # None on CPU
    applied: bool
    lr: float
    launched_at: float                 # StepLog.clock() when queued (on CPU: when it finished)


class StepLog:
    """Reads back launched steps in order: checks them, keeps the losses, and prints Megatron's
    iteration line every --log-interval. Times are between step completions on a clock that leaves
    out evaluation, checkpoint saves and profile writing (Megatron stops its interval timer around
    them). A GPU step completes when its read-back lands; a CPU step when train_step returned (it
    is read back one step later, so the read-back time would log each step under its predecessor)."""

    def __init__(self, run: Run, state: TrainState, total: int, timers: Timers, writer=None):
        cfg = run.cfg
        self.run, self.state, self.total, self.timers, self.writer = run, state, total, timers, writer
        self.fpt = flops_per_token(cfg.model.num_layers, cfg.model.hidden_size, cfg.model.seq_length,
                                   cfg.model.padded_vocab_size)
        self.peak, self.peak_desc = device_peak_tflops(run.device)
        self.excluded_s = 0.0
        self.window_start, self.window_iters, self.window_loss, self.window_samples = self.clock(), 0, 0.0, 0
        # the completion event of the step that closed the last window, and excluded_s then
        self.window_event: Optional[torch.cuda.Event] = None
        self.window_excluded = 0.0
        self.first = state.iteration + 1  # this run's first iteration: it gets a line of its own
        self.first_s: Optional[float] = None  # the first iteration's seconds, left out of the first ETA

    def clock(self) -> float:
        """time.perf_counter() that stands still during excluded work."""
        return time.perf_counter() - self.excluded_s

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Leave the host work inside (evaluation, a checkpoint save, writing a profile) out of the
        iteration times."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.excluded_s += time.perf_counter() - start

    def record(self, step: LaunchedStep) -> None:
        loss, grad_norm, *params_norm = wait_host(step.out, step.ready).tolist()  # this step only
        done = step.launched_at if step.ready is None else self.clock()
        state, log = self.state, self.run.cfg.log
        check_finite(state, step.iteration, loss, step.applied, grad_norm, self.run.optimizer.scaler)
        state.losses.append((step.iteration, loss))
        self.window_iters, self.window_loss = self.window_iters + 1, self.window_loss + loss
        self.window_samples += step.global_batch
        if self.writer is not None:
            self.writer.add_scalar("lm loss", loss, step.iteration)
            self.writer.add_scalar("learning rate", step.lr, step.iteration)
        if self.logs_at(step.iteration):
            seconds = self._window_seconds(step, done)
            elapsed = seconds / self.window_iters
            steady = (seconds - self.first_s) / (self.window_iters - 1) if self.first_s and self.window_iters > 1 \
                else elapsed   # the ETA leaves out the first iteration (compilation, warm-up)
            self.first_s = None
            print_rank0(self._line(step, elapsed, self.window_loss / self.window_iters, grad_norm, *params_norm,
                                   eta_s=steady))
            if self.writer is not None and params_norm:
                self.writer.add_scalar("params-norm", params_norm[0], step.iteration)
            if step.iteration == min(self.total, log.log_interval):
                _print_memory(self.run)
            self.window_start, self.window_iters, self.window_loss, self.window_samples = done, 0, 0.0, 0
            self.window_event, self.window_excluded = step.ready, self.excluded_s
        elif step.iteration == self.first:  # a first sign of life (the window goes on: Megatron's lines stay)
            self.first_s = done - self.window_start
            print_rank0(self._first_line(step, self.first_s, loss))

    def logs_at(self, iteration: int) -> bool:
        """Whether `iteration` gets an iteration line (every --log-interval, and the last)."""
        return iteration % self.run.cfg.log.log_interval == 0 or iteration == self.total

    def _window_seconds(self, step: LaunchedStep, done: float) -> float:
        """Seconds from the completion of the step that closed the last window to this step's, less the
        excluded work between. On the GPU the two completion events' own timestamps: a host clock read
        when a step is recorded would also count the launch of the step queued behind it, which the
        last window of a run lacks (it read a host-bound run's last window a step too short). The first
        window (and CPU runs) use the host clock."""
        if self.window_event is None or step.ready is None:
            return done - self.window_start
        gpu = self.window_event.elapsed_time(step.ready) / 1e3
        return max(gpu - (self.excluded_s - self.window_excluded), 1e-6)

    def _first_line(self, step: LaunchedStep, elapsed: float, loss: float) -> str:
        interval = self.run.cfg.log.log_interval
        next_line = min(self.total, (step.iteration // interval + 1) * interval)
        return (f" iteration {step.iteration:8d}/{self.total:8d} | first iteration (ms): {elapsed * 1000:.1f} | "
                f"learning rate: {step.lr:.3E} | lm loss: {loss:.6E} | "
                f"ETA: {eta(elapsed, self.total - step.iteration)} "
                f"| next line at iteration {next_line} (--log-interval {interval})")

    def _line(self, step: LaunchedStep, elapsed: float, loss: float, grad_norm: float,
              params_norm: Optional[float] = None, eta_s: Optional[float] = None) -> str:
        cfg, state = self.run.cfg, self.state
        tokens = self.window_samples / self.window_iters * cfg.model.seq_length  # per iteration of the window
        line = (f" iteration {step.iteration:8d}/{self.total:8d} | consumed samples: {step.consumed_samples:12d} | "
                f"elapsed time per iteration (ms): {elapsed * 1000:.1f} | learning rate: {step.lr:.3E} | "
                f"global batch size: {step.global_batch:5d} | lm loss: {loss:.6E} | "
                f"loss scale: {self.run.optimizer.scaler.scale:.1f} | grad norm: {grad_norm:.3f} | "
                f"{'' if params_norm is None else f'params norm: {params_norm:.3f} | '}"
                f"number of skipped iterations: {state.skipped_iters:3d} | number of nan iterations: "
                f"{state.nan_iters:3d} | "
                f"{throughput_fields(tokens, elapsed, self.fpt, self.run.topo.world_size, self.peak)} | "
                f"ETA: {eta(elapsed if eta_s is None else eta_s, self.total - step.iteration)} |")
        nvme = self.run.optimizer.nvme
        if nvme is not None:  # the last step's state transfers, at their rate while in flight
            line += f" nvme I/O (GB/s): {nvme.last_stats.gb_per_s:.2f} |"
        timing = self.timers.report(self.window_iters)
        return line + ("\n " + timing if timing else "")


def eta(seconds_per_iter: float, iters_left: int) -> str:
    """Time left at `seconds_per_iter` (evaluation and saves not counted), e.g. 1h02m, 4m05s, 42s."""
    s = max(0, round(seconds_per_iter * iters_left))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _evaluates_at(cfg, iteration: int) -> bool:
    return bool(cfg.log.eval_interval) and iteration % cfg.log.eval_interval == 0


def _saves_at(cfg, iteration: int) -> bool:
    return bool(cfg.ckpt.save and cfg.ckpt.save_interval) and iteration % cfg.ckpt.save_interval == 0


def runs_ahead(cfg, iteration: int, total: int) -> bool:
    """May the next step be queued before this one's results are read? Not when this iteration
    evaluates, saves or may exit: those need the step finished and recorded. Never when a step
    waits for the device itself (fp16's overflow check, the offloaded optimizer): the next step
    would gain nothing, and this one's read-back, hence its logged time, would wait for it."""
    t = cfg.train
    if t.fp16 or cfg.parallel.optimizer_cpu_offload or cfg.parallel.optimizer_nvme_offload is not None:
        return False
    return not (iteration == total or _evaluates_at(cfg, iteration) or _saves_at(cfg, iteration)
                or (t.exit_interval and iteration % t.exit_interval == 0)
                or t.exit_signal_handler or t.exit_duration_in_mins is not None)


def train(run: Run, train_ds, valid_ds, state: TrainState, writer=None) -> TrainState:
    """Train until --train-iters (or an exit condition); evaluate and save as configured.
    Step i + 1 is queued before step i's loss is read back, so the GPU never waits for the host
    between steps (except around evaluation, checkpoints and exit checks)."""
    handler, start_time = SignalHandler(run.cfg.train.exit_signal_handler, run.rank), time.time()
    try:
        return _train_loop(run, train_ds, valid_ds, state, writer, handler, start_time)
    finally:
        handler.close()


def _train_loop(run: Run, train_ds, valid_ds, state: TrainState, writer, handler: SignalHandler,
                start_time: float) -> TrainState:
    cfg, total = run.cfg, run.cfg.total_iters
    timers = Timers(cfg.log.timing_log_level, run.device)
    steps = StepLog(run, state, total, timers, writer)
    print_rank0(f"> training {total} iterations from iteration {state.iteration}; MFU against {steps.peak_desc}")
    profiler = Profiler(run) if cfg.log.profile else None
    graph = graphed_step(run)
    pending: Optional[LaunchedStep] = None
    while state.iteration < total:
        if profiler:
            profiler.before(state.iteration)
        try:
            applied, out = train_step(run, train_ds, state, timers, graph)
        except Exception:  # e.g. a collective timeout: say where this rank was
            print(f"[rank {run.rank}] step failed at iteration {state.iteration + 1}; "
                  f"pipeline position: {current_step() or 'outside the schedule'}", flush=True)
            raise
        if profiler:
            profiler.after(state.iteration + 1, steps.excluded)
        batch = cfg.global_batch_at(state.consumed_samples)
        state.iteration += 1
        state.consumed_samples += batch
        if cfg.log.log_params_norm and steps.logs_at(state.iteration):  # read back with the loss
            out = torch.cat([out, run.optimizer.params_norm().double().reshape(1)])
        launched = LaunchedStep(state.iteration, state.consumed_samples, batch, *to_host(out), applied,
                                run.scheduler.get_lr(), steps.clock())
        if applied:  # Megatron: a skipped (fp16 overflow) step does not advance the LR schedule
            run.scheduler.step(batch if cfg.schedule_in_samples else 1)
        if pending is not None:
            steps.record(pending)
        pending = launched
        if not runs_ahead(cfg, state.iteration, total) or state.iteration == steps.first:  # first: log it now
            steps.record(pending)
            pending = None
        if valid_ds is not None and _evaluates_at(cfg, state.iteration):
            with steps.excluded():
                state.valid_losses.append((state.iteration, evaluate(run, valid_ds, cfg.log.eval_iters)))
            log_eval(f"validation loss at iteration {state.iteration}", state.valid_losses[-1][1])
        if _saves_at(cfg, state.iteration):
            with steps.excluded():
                run.checkpointer.save(state.iteration, state.consumed_samples)
        reason = exit_reason(run, state, handler, start_time)
        if reason:
            if cfg.ckpt.save and not _saves_at(cfg, state.iteration):
                run.checkpointer.save(state.iteration, state.consumed_samples)
            print_rank0(reason)
            state.exit_reason = reason
            break
    run.optimizer.finish_pending()  # the model leaves training with its last step's weights
    return state


def _print_memory(run: Run) -> None:
    """Memory after the first logged iterations, from dp rank 0 of every (tp, pp) position."""
    c = run.coord
    if c.dp == 0:
        optim = run.optimizer.optimizer_state_bytes()
        print(f"[rank {run.rank}] (tp {c.tp}, pp {c.pp}) {memory_fields(run.device)} | optimizer state (MB): "
              f"{optim / 2**20:.1f}", flush=True)
