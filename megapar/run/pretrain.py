"""The training run behind `python -m megapar.pretrain_gpt2`, once its flags passed: the process
groups (with a heartbeat that names a peer that stopped answering), the data, the model and
optimizer, a checkpoint to resume from, training, the closing evaluation and save, and the commands
to run next (the resume and "train longer" commands among them)."""
from __future__ import annotations

import contextlib
import os
import shlex
import socket
import sys
import time
from datetime import timedelta
from typing import Callable, Iterator, Optional, Sequence

import torch.distributed as dist

from ..checkpoint import SaveDirLock, check_save_space, check_tracked_iteration, iter_dir, read_tracker
from ..config.megatron import noted_line
from ..config.settings import Config
from ..errors import MegaparError
from ..config.command import Processes, command_line, training_command
from ..optimizer.nvme import check_nvme_offload
from ..pipeline.p2p import current_step
from ..topology import Topology
from .heartbeat import Heartbeat, is_timeout, timeout_error
from .initialize import build_run, init_distributed, print_rank0
from .scalar_writer import build_writer
from .training import TrainState, evaluate, log_eval, train

EMBEDDED_DIR = os.path.join("data_cache", "embedded")   # the embedded default's corpus and tokenizer


def on_rank0_for_all(check: Callable[[], object], rank: int) -> None:
    """Run a check that reads files once, on rank 0, and raise its user error on every rank (each
    rank would otherwise read the same files, and the others would wait for rank 0 in a collective)."""
    failure = None
    if rank == 0:
        try:
            check()
        except MegaparError as e:
            failure = e
    box = [failure]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise box[0]


def every_rank_for_all(check: Callable[[], object]) -> None:
    """Run a check that differs by rank (its host's disk, its own folder) on every rank; the first
    rank's user error, if any rank has one, is raised on every rank (none waits for a peer that stopped)."""
    failure = None
    try:
        check()
    except MegaparError as e:
        failure = e
    boxes: list = [None] * dist.get_world_size()
    dist.all_gather_object(boxes, failure)
    first = next((e for e in boxes if e is not None), None)
    if first is not None:
        raise first


@contextlib.contextmanager
def holding_save_dir(save: Optional[str], rank: int) -> Iterator[None]:
    """One job per --save directory: rank 0 takes its lock (megapar/checkpoint/guard.py; every rank
    fails with the same line if another job holds it) and removes it when the run ends -- normally,
    by an error, Ctrl-C or SIGTERM."""
    if not save:
        yield
        return
    lock = SaveDirLock(save, shlex.join(sys.argv)) if rank == 0 else None
    on_rank0_for_all(lambda: lock.acquire(), rank)
    restore = lock.release_on_sigterm() if lock else lambda: None
    try:
        yield
    finally:
        restore()
        if lock:
            lock.release()


def prepare_data(cfg: Config, rank: int) -> None:
    """Embedded default: build the corpus + tokenizer + .bin/.idx (rank 0 first, others reuse)."""
    if cfg.data.data_path:
        return
    from ..data.embedded import prepare_embedded_dataset

    out_dir = cfg.data.data_cache_path or EMBEDDED_DIR
    print_rank0(f"> no --data-path: preparing the embedded default dataset (Python stdlib docstrings) in {out_dir}")
    info = None
    for turn in (0, 1):  # rank 0 builds, then everyone else reuses the finished files
        if (rank == 0) == (turn == 0):
            info = prepare_embedded_dataset(out_dir, cfg.data.vocab_file, cfg.data.merge_file)
        dist.barrier()
    cfg.data.data_path = [info["data_prefix"]]
    for k in ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model"):
        setattr(cfg.data, k, info.get(k))


def check_same_data_on_every_rank(data_path) -> None:
    """Every rank reads the files rank 0 checked (node-local copies can differ): one all-gather of
    each rank's sizes, the first rank of each node adding the hash of its copy (fingerprint); the
    same DatasetError on every rank when one differs."""
    from ..data.gpt_dataset import check_same_data, fingerprint
    if dist.get_world_size() == 1:
        return
    mine = fingerprint(data_path, hash_files=int(os.environ.get("LOCAL_RANK", "0")) == 0)
    prints: list = [None] * dist.get_world_size()
    dist.all_gather_object(prints, (socket.gethostname(), mine))
    check_same_data(prints)


def build_datasets(cfg: Config, vocab_size: Optional[int] = None):
    from ..data.gpt_dataset import build_train_valid_test_datasets

    total, gbs, log = cfg.total_iters, cfg.train.global_batch_size, cfg.log
    eval_runs = (total // log.eval_interval + 1) if log.eval_interval else 1
    counts = (total * gbs, eval_runs * log.eval_iters * gbs, log.eval_iters * gbs)
    return build_train_valid_test_datasets(cfg.data.data_path, cfg.data.split, cfg.model.seq_length,
                                           cfg.train.seed, counts, cache_dir=cfg.data.data_cache_path,
                                           vocab_size=vocab_size)


def build_tokenizer_for(cfg: Config):
    from ..data.tokenizer import build_tokenizer

    d = cfg.data
    return build_tokenizer(d.tokenizer_type, vocab_file=d.vocab_file, merge_file=d.merge_file,
                           tokenizer_model=d.tokenizer_model)


def pretrain(cfg: Config, argv: Optional[Sequence[str]] = None, state: Optional[TrainState] = None) -> TrainState:
    """Run training in an initialised process group; returns the final TrainState (`state`, when
    given, is filled in as training goes). `argv` (the flags as given) lets the closing "train
    longer" command repeat them."""
    rank, world, device = init_distributed(cfg.parallel.distributed_backend, cfg.parallel.distributed_timeout_minutes)
    with holding_save_dir(cfg.ckpt.save, rank):
        return _with_groups(cfg, rank, world, device, argv, state if state is not None else TrainState())


def _with_groups(cfg: Config, rank: int, world: int, device, argv: Optional[Sequence[str]],
                 state: TrainState) -> TrainState:
    """The process groups, a heartbeat, and a collective timeout turned into one line naming the peer."""
    p = cfg.parallel
    topo = Topology(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size)
    with Heartbeat(rank, world, p.distributed_timeout_minutes) as heartbeat:
        try:
            topo.create_groups(rank, timedelta(minutes=p.distributed_timeout_minutes))
            return _pretrain(cfg, topo, rank, device, argv, state)
        except RuntimeError as e:  # a peer that stopped answering: one line naming it, not a traceback
            if not is_timeout(e):
                raise
            raise timeout_error(e, heartbeat, topo, p.distributed_timeout_minutes, current_step()) from None


def _pretrain(cfg: Config, topo: Topology, rank: int, device, argv: Optional[Sequence[str]],
              state: TrainState) -> TrainState:
    """pretrain() once the process groups exist."""
    world = topo.world_size
    chunks = cfg.model.virtual_pipeline_model_parallel_size
    print_rank0(f"> megapar: world size {world} = tensor {topo.tp} x pipeline {topo.pp} x data {topo.dp} "
                + (f"({chunks} model chunks per pipeline rank, interleaved 1F1B) " if chunks else "")
                + f"on {device.type} ({dist.get_backend()}); {cfg.num_microbatches} microbatches of "
                f"{cfg.train.micro_batch_size}; precision {cfg.train.params_dtype_name}; "
                f"attention {cfg.model.attention_backend}, layernorm {cfg.model.layernorm_impl}")
    for line in cfg.deepspeed.summary(cfg) if cfg.deepspeed is not None else ():
        print_rank0(line)
    if cfg.megatron_noted:
        print_rank0(noted_line(cfg.megatron_noted))
    if "fused" in (cfg.model.attention_backend, cfg.model.layernorm_impl, cfg.train.adam_impl):
        from ..kernels import fused_kernels_source, load_fused_kernels
        load_fused_kernels()  # an explicit request never falls back: this raises without CUDA/nvcc
        print_rank0(f"> fused kernels: {fused_kernels_source()}")
    from ..data.gpt_dataset import check_cache_dir
    on_rank0_for_all(lambda: check_cache_dir(cfg.data.data_cache_path), rank)  # before anything is cached there
    prepare_data(cfg, rank)
    if cfg.total_iters > 0:  # a broken or empty .bin/.idx pair stops here, before the model
        from ..data.gpt_dataset import check_datasets
        on_rank0_for_all(lambda: check_datasets(cfg.data.data_path), rank)
        check_same_data_on_every_rank(cfg.data.data_path)
    tokenizer = build_tokenizer_for(cfg)
    if cfg.total_iters > 0:  # token ids the model's embedding table has no row for
        from ..data.gpt_dataset import check_token_ids
        on_rank0_for_all(lambda: check_token_ids(cfg.data.data_path, tokenizer.vocab_size), rank)
    if cfg.ckpt.save and cfg.total_iters > 0:  # before the model is built: a run that cannot save stops here
        on_rank0_for_all(lambda: check_save_space(cfg, tokenizer.vocab_size), rank)
    if cfg.parallel.optimizer_nvme_offload is not None:  # the state files' folder and room, on every host
        every_rank_for_all(lambda: check_nvme_offload(cfg, tokenizer.vocab_size, rank))
    run = build_run(cfg, topo, rank, device, tokenizer.vocab_size)
    try:
        return _load_and_train(cfg, run, argv, state, tokenizer.vocab_size)
    finally:
        run.optimizer.close()


def _load_and_train(cfg: Config, run, argv: Optional[Sequence[str]], state: TrainState,
                    vocab_size: int) -> TrainState:
    """pretrain() once the model and optimizer are built (`vocab_size`: the tokenizer's, which bounds
    every token id the datasets hand out)."""
    saved = read_tracker(cfg.ckpt.load) if cfg.ckpt.load and not cfg.ckpt.finetune else None
    if isinstance(saved, int) and saved >= cfg.total_iters > 0:
        check_tracked_iteration(cfg.ckpt.load, saved, iter_dir(cfg.ckpt.load, saved))
        # at (or past) the end: nothing to train or save, and no schedule to compare (a rerun of the first command
        # after a "train longer" one must not trip on the longer run's LR schedule)
        print_rank0(f"> nothing to do: the checkpoint in {cfg.ckpt.load} is at iteration {saved} and this "
                    f"run ends at iteration {cfg.total_iters}; give a larger --train-iters to train longer")
        return state
    if cfg.ckpt.load:
        state.iteration, state.consumed_samples = run.checkpointer.load()
    if cfg.total_iters == 0:
        print_rank0("> --train-iters 0: model built, exiting without training")
        return state
    train_ds, valid_ds, test_ds = build_datasets(cfg, vocab_size)
    run.checkpointer.reserve()
    start = time.time()
    writer = build_writer(cfg, run.rank)  # TensorBoard and/or W&B on rank 0, as the flags ask
    try:
        state = train(run, train_ds, valid_ds, state, writer)
        if state.exit_reason is None:
            _finish(run, state, valid_ds, test_ds)
    except Exception:
        run.checkpointer.close()    # a background save is published (or removed) before an error ends the run
        raise
    finally:
        if writer is not None:
            writer.close()
    run.checkpointer.wait()
    print_rank0(f"> training done in {time.time() - start:.1f} s at iteration {state.iteration}")
    _print_next_steps(cfg, run.scheduler, argv, stopped=state.exit_reason is not None)
    return state


def _finish(run, state: TrainState, valid_ds, test_ds) -> None:
    cfg = run.cfg
    for name, ds in (("val", valid_ds), ("test", test_ds)):
        if ds is not None and cfg.log.eval_iters > 0:
            just_done = name == "val" and state.valid_losses and state.valid_losses[-1][0] == state.iteration
            loss = state.valid_losses[-1][1] if just_done else evaluate(run, ds, cfg.log.eval_iters, name)
            log_eval(f"validation loss at the end of training for {name} data", loss)
    if cfg.ckpt.save and not (cfg.ckpt.save_interval and state.iteration % cfg.ckpt.save_interval == 0):
        run.checkpointer.save(state.iteration, state.consumed_samples)


def _print_next_steps(cfg: Config, scheduler, argv: Optional[Sequence[str]], stopped: bool) -> None:
    if not cfg.ckpt.save:
        return
    p = cfg.parallel
    other_tp = 2 if p.tensor_model_parallel_size == 1 else 1
    go_on = resume_command(cfg, argv) if stopped else train_longer_command(cfg, scheduler, argv)
    convert = ["--load-dir", cfg.ckpt.save]
    if cfg.ckpt.ckpt_format == "torch_dist":
        convert = command_line("python tools/checkpoint_util.py", convert + [
            "--save-dir", f"{cfg.ckpt.save}_legacy", "--target-tensor-parallel-size", p.tensor_model_parallel_size,
            "--target-pipeline-parallel-size", p.pipeline_model_parallel_size],
            "Megatron's legacy files (torch_dist loads at any layout)")
    else:
        convert = command_line("python tools/checkpoint_util.py", convert + [
            "--save-dir", f"{cfg.ckpt.save}_tp{other_tp}", "--target-tensor-parallel-size", other_tp,
            "--target-pipeline-parallel-size", p.pipeline_model_parallel_size])
    sample = command_line("bash scripts/generate_text.sh", ["--load", cfg.ckpt.save], "sample text from the checkpoint")
    print_rank0("> next steps:\n" + "".join(f"    {line}\n" for line in (sample, go_on, convert)).rstrip("\n"))


def _without(argv: Optional[Sequence[str]], valued: set[str], switches: frozenset[str] | set[str] = frozenset()
             ) -> list[str]:
    """`argv` without the flags in `valued` (with their values, `--f v` or `--f=v`) and `switches`."""
    kept, skip = [], False
    for a in (argv or []):
        name = a.split("=", 1)[0]
        if skip or name in switches:
            skip = False
            continue
        if name in valued:
            skip = "=" not in a
            continue
        kept.append(a)
    return kept


def _continued(cfg: Config, argv: Optional[Sequence[str]], valued: set[str], switches: set[str]) -> list[str]:
    """This run's flags (`argv` without `valued` and `switches`) set to continue from its own --save:
    --load and --save at it, without --finetune (that would restart at iteration 0 with a fresh
    optimizer, and is refused with --save equal to --load), and loading the optimizer and RNG
    states unless this run did not save them."""
    switches = switches | {"--finetune"}
    switches |= {"--no-load-optim"} if not cfg.ckpt.no_save_optim else set()
    switches |= {"--no-load-rng"} if not cfg.ckpt.no_save_rng else set()
    kept = _without(argv, valued | {"--load", "--save"}, switches)
    return kept + ["--load", cfg.ckpt.save, "--save", cfg.ckpt.save]


def train_longer_command(cfg: Config, scheduler, argv: Optional[Sequence[str]],
                         procs: Optional[Processes] = None) -> str:
    """The command that trains this run's checkpoint as long again: this run's flags and processes
    (`procs`, default: this run's), continuing from its --save, with twice the iterations. The
    resume keeps the saved LR schedule (a changed one is refused) by passing --lr-decay-iters at the
    old horizon: past it the LR stays at --min-lr. A schedule that ends at LR 0 would train nothing
    more, so then the schedule is stretched over the longer run instead
    (--override-opt_param-scheduler: the LR rises again). A schedule in samples (Megatron's
    sample-based flags) does the same with --train-samples and --lr-decay-samples."""
    unit, length, decay = (("sample", "--train-samples", "--lr-decay-samples") if cfg.schedule_in_samples else
                           ("iteration", "--train-iters", "--lr-decay-iters"))
    horizon = cfg.schedule_horizon
    valued = {"--train-iters", "--train-samples", "--lr-decay-iters", "--lr-decay-samples"}
    ends_at_zero = scheduler.min_lr == 0 and scheduler.decay_style != "constant" and scheduler.decay_steps <= horizon
    switches = {"--override-opt_param-scheduler", "--override-opt-param-scheduler"}
    if ends_at_zero:
        switches |= {"--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"}
    total = 2 * max(1, horizon)
    kept = _continued(cfg, argv, valued, switches) + [length, str(total)]
    if ends_at_zero:
        kept.append("--override-opt_param-scheduler")
        why = f"train longer: the LR schedule stretched over {total} {unit}s (it ended at LR 0)"
    else:
        kept += [decay, str(scheduler.decay_steps)]
        why = f"train longer at the saved LR schedule (--min-lr {scheduler.min_lr} after {unit} " \
              f"{scheduler.decay_steps})"
    return training_command(kept, procs or Processes.of_this_run(), why)


def resume_command(cfg: Config, argv: Optional[Sequence[str]], procs: Optional[Processes] = None) -> str:
    """The command that finishes a run stopped early (signal, --exit-interval, time limit): this
    run's flags and processes, continuing from its --save; the same length and LR schedule."""
    return training_command(_continued(cfg, argv, set(), set()), procs or Processes.of_this_run(),
                            "resume where this run stopped")
