"""Pipeline schedules and p2p under gloo: 1F1B == AFAB == no pipelining (gradients), the 1F1B
activation bound, uneven microbatch counts with pp = 4, GPT-2 pp = 2 == pp = 1, no_sync only
off for the last backward, and a mismatched schedule timing out with a diagnostic.

One 4-process spawn (a module fixture) does every distributed check: the toy model with pp = 4,
then GPT-2 with pp = 2, dp = 2 and the mismatch; the serial twins run in the test process."""
import contextlib
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from distributed import run_distributed
from gpt_helpers import batch, tiny_model_config
from megapar.model import GPT2Model, Stage
from megapar.pipeline import (PipelineP2PError, PipelineTimeoutError, ScheduleConfig, average_logs, backward_step,
                              current_step,
                              forward_backward_no_pipelining, get_forward_backward_func)
from megapar.pipeline import p2p
from megapar.topology import Topology

S, B, H, LAYERS = 3, 2, 8, 8                 # toy activations [s, b, h]; 8 layers split over stages
MICROBATCHES = (1, 3, 5, 7)                  # with pp = 4: m < pp, m == pp - 1, uneven m > pp
STATE = {"alive": 0, "max": 0, "sync": []}   # per process: microbatches in flight; no_sync record


class ToyStage(nn.Module):
    """Layers [start, end) of a Linear+tanh stack; layer g is seeded by g, so any split of the
    stack holds the same parameters. The stage output ends in tanh, whose backward reads the
    output itself: a test that pseudo-freeing a sent output keeps backward correct."""

    def __init__(self, start: int, end: int):
        super().__init__()
        self.first, self.input_tensor = start == 0, None
        self.layers = nn.ModuleList()
        for g in range(start, end):
            torch.manual_seed(1000 + g)
            self.layers.append(nn.Linear(H, H))

    def set_input_tensor(self, t):
        self.input_tensor = t

    def forward(self, x):
        h = x if self.first else self.input_tensor
        for i, layer in enumerate(self.layers):
            z = layer(h)
            if i == 0 and torch.is_grad_enabled():            # count activations in flight
                STATE["alive"] += 1
                STATE["max"] = max(STATE["max"], STATE["alive"])
                z.register_hook(_on_backward)
            h = torch.tanh(z)
        return h


def _on_backward(grad):
    STATE["alive"] -= 1
    STATE["sync"].append(not STATE.get("no_sync", False))


@contextlib.contextmanager
def _no_sync():
    STATE["no_sync"] = True
    try:
        yield
    finally:
        STATE["no_sync"] = False


def toy_data(m):
    g = torch.Generator().manual_seed(m)
    return [(torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)) for _ in range(m)]


def toy_forward_step(it, model):
    x, target = next(it)
    out = model(x)

    def loss_func(o):
        loss = ((o - target) ** 2).mean()
        return loss, {"loss": loss.detach()}
    return out, loss_func


def _grads(model, offset):
    return {f"{int(n.split('.')[1]) + offset}.{n.split('.', 2)[2]}": p.grad.clone()
            for n, p in model.named_parameters()}


def _toy_body(rank, world_size):
    pp, per = world_size, LAYERS // world_size
    model = ToyStage(rank * per, (rank + 1) * per)
    cfg_kw = dict(tensor_shape=(S, B, H), prev_rank=rank - 1 if rank > 0 else None,
                  next_rank=rank + 1 if rank < pp - 1 else None, no_sync=_no_sync, p2p_timeout=30)
    out = {}
    for m in MICROBATCHES:
        cfg = ScheduleConfig(num_microbatches=m, **cfg_kw)
        for schedule in ("1f1b", "afab"):
            model.zero_grad(set_to_none=True)
            STATE.update(alive=0, max=0, sync=[])
            logs = get_forward_backward_func(pp, schedule)(toy_forward_step, iter(toy_data(m)), model, cfg)
            eval_logs = get_forward_backward_func(pp, schedule)(toy_forward_step, iter(toy_data(m)), model,
                                                                cfg, forward_only=True)
            out[m, schedule] = dict(grads=_grads(model, rank * per), max_alive=STATE["max"], alive=STATE["alive"],
                                    sync=list(STATE["sync"]), logs=[float(d["loss"]) for d in logs],
                                    eval_logs=[float(d["loss"]) for d in eval_logs],
                                    mean={k: float(v) for k, v in average_logs(logs, cfg).items()},
                                    step=current_step())
    return out


def _serial(m):
    model = ToyStage(0, LAYERS)
    STATE.update(alive=0, max=0, sync=[])
    logs = forward_backward_no_pipelining(toy_forward_step, iter(toy_data(m)), model,
                                          ScheduleConfig(num_microbatches=m, no_sync=_no_sync))
    return _grads(model, 0), [float(d["loss"]) for d in logs], list(STATE["sync"])


def test_toy_schedules_pp4(spawned):
    pp = 4
    results = [r["toy"] for r in spawned]
    for m in MICROBATCHES:
        ref_grads, ref_logs, ref_sync = _serial(m)
        assert ref_sync == [False] * (m - 1) + [True]
        for schedule in ("1f1b", "afab"):
            grads = {}
            for stage, res in enumerate(results):
                r = res[m, schedule]
                grads.update(r["grads"])
                # no_sync active for every backward but the one of the last microbatch
                assert r["sync"] == [False] * (m - 1) + [True], (m, schedule, stage)
                assert r["alive"] == 0
                # activations in flight: 1F1B holds min(pp - stage, m) <= pp; AFAB holds all m
                assert r["max_alive"] == (min(pp - stage, m) if schedule == "1f1b" else m), (m, schedule, stage)
                assert r["step"].endswith("phase finished")
                assert r["mean"] == pytest.approx({"loss": sum(ref_logs) / m}, rel=1e-6)   # on every stage
                if stage == pp - 1:
                    assert r["logs"] == pytest.approx(ref_logs, rel=1e-6)
                    assert r["eval_logs"] == pytest.approx(ref_logs, rel=1e-6)
                else:
                    assert r["logs"] == [] and r["eval_logs"] == []
            assert grads.keys() == ref_grads.keys()
            for name, g in ref_grads.items():
                # same ops in the same order: equal up to float32 rounding of the split matmuls
                assert torch.allclose(grads[name], g, rtol=1e-5, atol=1e-7), (m, schedule, name)
        for stage in range(pp):   # 1F1B and AFAB accumulate identically: bitwise equal
            a, b = results[stage][m, "1f1b"]["grads"], results[stage][m, "afab"]["grads"]
            assert all(torch.equal(a[k], b[k]) for k in a)


# ---- GPT-2 pp = 2 against pp = 1, and the mismatched-schedule timeout ----------------------------
GPT_FLAGS = ["--hidden-dropout", "0", "--attention-dropout", "0"]
GPT_M = 3


def gpt_data():
    return [batch(b=2, seed=i) for i in range(GPT_M)]


def gpt_forward_step(it, model):
    ids, labels = next(it)
    out = model(ids, labels=labels)

    def loss_func(per_token):
        loss = per_token.mean()
        return loss, {"lm loss": loss.detach()}
    return out, loss_func


def _gpt_grads(model, layer_offset):
    out = {}
    for name, p in model.named_parameters():
        m = re.match(r"(language_model\.encoder\.layers\.)(\d+)(\..*)", name)
        if m:
            name = f"{m[1]}{int(m[2]) + layer_offset}{m[3]}"
        out[name] = p.grad.clone()
    return out


def _gpt_and_timeout_body(rank, topo):
    """GPT-2 pp = 2 with dp = 2 (pipelines [0, 2] and [1, 3]), then the mismatch on [0, 2]."""
    stage = topo.coord(rank).pp
    cfg = tiny_model_config(GPT_FLAGS)
    model = GPT2Model(cfg.model, Stage.of(4, 2, stage), seed=5)
    sched = ScheduleConfig(num_microbatches=GPT_M, tensor_shape=(16, 2, 32), pp_group=topo.groups.pp,
                           prev_rank=topo.prev_rank(rank), next_rank=topo.next_rank(rank), p2p_timeout=30)
    logs = get_forward_backward_func(2, "1f1b")(gpt_forward_step, iter(gpt_data()), model, sched)
    result = {"grads": _gpt_grads(model, 2 * stage),
              "mean": {k: float(v) for k, v in average_logs(logs, sched).items()}}
    if topo.coord(rank).dp == 1:
        return result

    # Mismatch: stage 0 trains (1F1B) while stage 1 only evaluates. Stage 0 waits for a gradient
    # that never comes, stage 1 for a third activation that is never sent. Stage 1 times out
    # first; gloo then closes the pair, so stage 0 fails at once (or times out itself).
    bad = ScheduleConfig(num_microbatches=GPT_M, tensor_shape=(16, 2, 32), pp_group=topo.groups.pp,
                         label="iteration 7", p2p_timeout=2 if stage == 1 else 6,
                         prev_rank=topo.prev_rank(rank), next_rank=topo.next_rank(rank))
    start = time.monotonic()
    try:
        get_forward_backward_func(2, "1f1b")(gpt_forward_step, iter(gpt_data()), model, bad, forward_only=stage == 1)
        result["error"] = None
    except PipelineP2PError as e:
        result.update(error=str(e), timeout=isinstance(e, PipelineTimeoutError), step=current_step())
    result["waited"] = time.monotonic() - start
    return result


def _body(rank, world_size):
    toy = _toy_body(rank, world_size)
    topo = Topology(tp=1, pp=2, dp=2)
    topo.create_groups(rank)
    return {"toy": toy, "gpt": _gpt_and_timeout_body(rank, topo)}


@pytest.fixture(scope="module")
def spawned():
    """One 4-process gloo run doing every distributed check; results per rank."""
    return run_distributed(_body, world_size=4)


def _gpt_serial():
    cfg = tiny_model_config(GPT_FLAGS)
    model = GPT2Model(cfg.model, Stage.of(4, 1, 0), seed=5)
    logs = forward_backward_no_pipelining(gpt_forward_step, iter(gpt_data()), model,
                                          ScheduleConfig(num_microbatches=GPT_M))
    return _gpt_grads(model, 0), sum(float(d["lm loss"]) for d in logs) / GPT_M


def test_gpt2_pp2_matches_pp1(spawned):
    ref, ref_loss = _gpt_serial()
    for first, last in ((spawned[0]["gpt"], spawned[2]["gpt"]), (spawned[1]["gpt"], spawned[3]["gpt"])):
        _check_gpt(first, last, ref, ref_loss)


def _check_gpt(first, last, ref, ref_loss):
    emb = "language_model.embedding.word_embeddings.weight"
    grads = {**first["grads"], **last["grads"]}
    # pp = 1 ties the output layer to the input embedding; pp = 2 has a copy on the last stage
    grads[emb] = first["grads"][emb] + grads.pop("word_embeddings_for_head.weight")
    assert grads.keys() == ref.keys()
    for name, g in ref.items():
        assert torch.allclose(grads[name], g, rtol=1e-4, atol=1e-6), name   # fp32, split reductions
    assert first["mean"]["lm loss"] == pytest.approx(ref_loss, rel=1e-6)     # rank 0 can log it


def test_mismatched_schedule_times_out_with_diagnostic(spawned):
    first, last = spawned[0]["gpt"], spawned[2]["gpt"]
    assert last["timeout"] and last["error"] == (
        "pipeline p2p timeout after 2s on rank 2 (pp stage 1/2): iteration 7, schedule 1f1b, "
        "phase forward-only, microbatch 2, waiting for recv_forward from rank 0")
    assert last["step"] == ("iteration 7, schedule 1f1b, phase forward-only, microbatch 2, "
                            "waiting for recv_forward from rank 0")
    assert "on rank 0 (pp stage 0/2): iteration 7, schedule 1f1b, phase steady, microbatch 1 (forward), " \
           "0 (backward), waiting for recv_backward from rank 2" in first["error"]
    assert 1.5 < last["waited"] < 10 and first["waited"] < 10


# ---- no processes ----------------------------------------------------------------------------
def test_send_checks_shape_and_dtype():
    cfg = ScheduleConfig(num_microbatches=1, tensor_shape=(S, B, H), next_rank=1)
    with pytest.raises(ValueError, match=r"expects \(3, 2, 8\) torch.float32"):
        p2p.send_forward(torch.zeros(S, B, H + 1), cfg)
    with pytest.raises(ValueError, match="tensor is"):
        p2p.send_forward(torch.zeros(S, B, H, dtype=torch.float16), cfg)


def test_get_forward_backward_func():
    assert get_forward_backward_func(1, "afab") is forward_backward_no_pipelining
    assert get_forward_backward_func(4, "1f1b").__name__ == "forward_backward_pipelining_1f1b"
    assert get_forward_backward_func(2, "afab").__name__ == "forward_backward_pipelining_afab"
    with pytest.raises(ValueError, match="unknown pipeline schedule 'gpipe'"):
        get_forward_backward_func(2, "gpipe")


def test_pseudo_freed_output_backward():
    """A sent output keeps only a 1-element storage; backward_step still gives the true grads."""
    from megapar.pipeline.schedules import deallocate_output
    layer = ToyStage(0, 2)
    x = torch.randn(S, B, H, requires_grad=True)
    grad = torch.randn(S, B, H)
    torch.autograd.backward(layer(x), grad)
    ref = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    x.grad = None
    layer.zero_grad(set_to_none=True)
    out = layer(x)
    deallocate_output(out)
    assert out.untyped_storage().nbytes() == 4
    got = backward_step(x, out, grad, ScheduleConfig(num_microbatches=1))
    assert all(torch.equal(a, b) for a, b in zip(ref, [got] + [p.grad for p in layer.parameters()]))


# ---- NCCL on 2 GPUs (gpu marker: run on a lent multi-GPU machine) ------------------------------
def _nccl_worker(rank, port, out_dir):
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    model = ToyStage(rank * 4, rank * 4 + 4).cuda()
    kw = dict(tensor_shape=(S, B, H), device=torch.device("cuda", rank), prev_rank=None if rank == 0 else 0,
              next_rank=1 if rank == 0 else None)
    data = [(x.cuda(), t.cuda()) for x, t in toy_data(5)]
    out = {}
    for schedule in ("1f1b", "afab"):
        model.zero_grad(set_to_none=True)
        get_forward_backward_func(2, schedule)(toy_forward_step, iter(data), model,
                                               ScheduleConfig(num_microbatches=5, p2p_timeout=60, **kw))
        out[schedule] = {k: g.cpu() for k, g in _grads(model, rank * 4).items()}
    bad = ScheduleConfig(num_microbatches=3, p2p_timeout=3, label="iteration 7", **kw)
    try:
        get_forward_backward_func(2, "1f1b")(toy_forward_step, iter(data), model, bad, forward_only=rank == 1)
    except PipelineTimeoutError as e:
        out["error"] = str(e)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)                     # the stuck NCCL ops would make a clean shutdown hang


@pytest.mark.gpu
def test_nccl_two_gpus():
    import tempfile
    import torch.multiprocessing as mp
    from distributed import _free_port
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_nccl_worker, args=(_free_port(), d), nprocs=2, join=True)
        first, last = (torch.load(f"{d}/rank{r}.pt") for r in range(2))
    ref, _, _ = _serial(5)
    for schedule in ("1f1b", "afab"):
        got = {**first[schedule], **last[schedule]}
        for name, g in ref.items():
            assert torch.allclose(got[name], g, rtol=1e-4, atol=1e-6), (schedule, name)   # GPU vs CPU fp32
    assert first["error"].startswith("pipeline p2p timeout after 3s on rank 0 (pp stage 0/2): iteration 7, "
                                     "schedule 1f1b, phase steady, microbatch 1 (forward), 0 (backward), "
                                     "waiting for send_forward to rank 1 and recv_backward from rank 1")
    assert last["error"] == ("pipeline p2p timeout after 3s on rank 1 (pp stage 1/2): iteration 7, schedule 1f1b, "
                             "phase forward-only, microbatch 2, waiting for recv_forward from rank 0")
