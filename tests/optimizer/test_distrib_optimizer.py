"""ZeRO-1 DistributedOptimizer against plain single-process torch.optim.AdamW (CPU, gloo).

One dp=4 run (compared with AdamW step by step, saves a checkpoint at step 3, keeps training),
one dp=2 run (compared with AdamW; bf16 masters and fp16 overflow with hand-set gradients;
loads the dp=4 checkpoint and continues), and a dp=1 resume in this process. The reference
sees the whole global batch, so its gradient is the mean the DP reduce-scatter computes; the
comparisons differ only in summation order (fp32 rounding, amplified a little by Adam).
"""
import argparse
import math
import os

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from gpt_helpers import batch, tiny_model_config
from megapar.config.settings import TrainConfig
from megapar.checkpoint import DISTRIB_OPTIM_FILE, load_checkpoint, save_checkpoint
from megapar.model import GPT2Model, Stage
from megapar.optimizer.distrib_optimizer import DistributedOptimizer
from megapar.optimizer.grad_buffer import GradBuffer
from megapar.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megapar.optimizer.optimizer import MixedPrecisionOptimizer
from megapar.topology import Topology

GLOBAL_BATCH, SEED, SAVE_AT, STEPS = 4, 5, 3, 6
TRAIN = dict(lr=3e-3, weight_decay=1.0, clip_grad=0.5, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)
PARAM_ATOL = 5e-6      # fp32 rounding reaches ~1.5e-6 after 6 steps; one step moves weights by ~lr = 3e-3
                       # and a wrong weight-decay group by lr * wd * |w| >= 3e-5


def _model(dtype=torch.float32, device=None):
    cfg = tiny_model_config(["--hidden-dropout", "0", "--attention-dropout", "0"])
    return GPT2Model(cfg.model, Stage.of(4, 1, 0), seed=SEED, dtype=dtype, device=device)


def _zero1(group, bucket_numel, dtype=torch.float32, scaler=None, device=None, overlap=False, **train):
    model = _model(dtype, device)
    buf = GradBuffer(model.parameters(), group, mode="reduce_scatter", bucket_numel=bucket_numel, overlap=overlap)
    cfg = TrainConfig(**{**TRAIN, **train})
    opt = DistributedOptimizer(model, buf, cfg, scaler or ConstantGradScaler(), tp_rank=0, dp_group=group,
                               norm_group=group)
    return model, buf, opt


class Reference:
    """Plain AdamW on the full model and the full global batch; no decay for 1-D params."""

    def __init__(self, dtype=torch.float32, device=None):
        self.model = _model(torch.float32, device)
        if dtype != torch.float32:          # start from the same (rounded) weights as the model
            with torch.no_grad():
                for p in self.model.parameters():
                    p.copy_(p.to(dtype).float())
        params = list(self.model.named_parameters())
        self.adam = torch.optim.AdamW(
            [{"params": [p for _, p in params if p.ndim >= 2], "weight_decay": TRAIN["weight_decay"]},
             {"params": [p for _, p in params if p.ndim < 2], "weight_decay": 0.0}],
            lr=TRAIN["lr"], betas=(TRAIN["adam_beta1"], TRAIN["adam_beta2"]), eps=TRAIN["adam_eps"],
            foreach=False)

    def step(self, it=None, grads=None) -> tuple[float, float]:
        loss = float("nan")
        if grads is None:
            ids, labels = (t.to(self.model.output_embedding_weight().device)
                           for t in batch(b=GLOBAL_BATCH, seed=100 + it))
            loss_t = self.model(ids, labels=labels).mean()
            loss_t.backward()
            loss = loss_t.item()
        else:
            for n, p in self.model.named_parameters():
                p.grad = grads[n].clone()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), TRAIN["clip_grad"]).item()
        self.adam.step()
        self.adam.zero_grad()
        return loss, norm


def _train_step(model, buf, opt, it, dp, dp_rank, group) -> tuple[float, float]:
    """One global batch split over dp ranks; returns (global mean loss, grad norm)."""
    ids, labels = (t.to(next(model.parameters()).device) for t in batch(b=GLOBAL_BATCH, seed=100 + it))
    rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
    buf.start_step()
    loss = model(ids[rows], labels=labels[rows]).mean()
    loss.backward()
    buf.finish()
    applied, norm = opt.step()
    assert applied
    loss = loss.detach().clone()
    if group is not None:
        dist.all_reduce(loss, group=group)
    return loss.item() / dp, norm


def _max_diff(model, ref_model) -> float:
    ref = dict(ref_model.named_parameters())
    return max((p.detach().float() - ref[n].detach()).abs().max().item() for n, p in model.named_parameters())


def _compare_steps(model, buf, opt, ref, steps, dp, dp_rank, group) -> dict:
    out = {"diffs": [], "norms": [], "ref_norms": [], "losses": [], "ref_losses": []}
    for it in steps:
        loss, norm = _train_step(model, buf, opt, it, dp, dp_rank, group)
        ref_loss, ref_norm = ref.step(it)
        out["diffs"].append(_max_diff(model, ref.model))
        out["norms"].append(norm), out["ref_norms"].append(ref_norm)
        out["losses"].append(loss), out["ref_losses"].append(ref_loss)
    return out


def _ckpt_args():
    return argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              consumed_train_samples=SAVE_AT * GLOBAL_BATCH)


def _check_against_reference(res: dict) -> None:
    assert max(res["diffs"]) < PARAM_ATOL, res["diffs"]
    for a, b in zip(res["norms"], res["ref_norms"]):
        assert math.isclose(a, b, rel_tol=1e-5), (a, b)
    for a, b in zip(res["losses"], res["ref_losses"]):
        assert math.isclose(a, b, rel_tol=1e-5), (a, b)
    assert any(n > TRAIN["clip_grad"] for n in res["norms"]), "clipping never triggered; lower clip_grad"


def _numel() -> int:
    return sum(p.numel() for p in _model().parameters())


# ---- dp = 4: compare with AdamW, save at step 3, keep going ---------------------------------------
def _dp4_body(rank, world_size, ckpt_dir):
    group = dist.group.WORLD
    model, buf, opt = _zero1(group, bucket_numel=5000)
    ref = Reference()
    res = _compare_steps(model, buf, opt, ref, range(SAVE_AT), world_size, rank, group)
    save_checkpoint(ckpt_dir, SAVE_AT, model, opt, None, _ckpt_args(), model.cfg, Topology(1, 1, world_size), rank)
    after = _compare_steps(model, buf, opt, ref, range(SAVE_AT, STEPS), world_size, rank, group)
    for k in res:
        res[k] += after[k]
    res.update(bytes=opt.optimizer_state_bytes(), report=opt.memory_report(), n_buckets=len(buf.buckets),
               resumed_losses=after["losses"],
               final={n: p.detach().clone() for n, p in model.named_parameters()})
    return res


@pytest.fixture(scope="module")
def dp4_run(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("zero1_ckpt"))
    return ckpt, run_distributed(_dp4_body, world_size=4, args=(ckpt,))


def test_dp4_matches_adamw_with_clipping_and_quarter_state(dp4_run):
    ckpt, results = dp4_run
    numel = _numel()
    for res in results:
        assert res["n_buckets"] > 2          # parameters straddle bucket and shard boundaries
        _check_against_reference(res)
        # owned shard of every bucket (padding to a multiple of dp adds < dp elements per bucket)
        assert 12 * numel / 4 <= res["bytes"] <= 12 * (numel / 4 + res["n_buckets"])
    assert "dp=4" in results[0]["report"]
    assert os.path.isfile(os.path.join(ckpt, "iter_0000003", "mp_rank_00", DISTRIB_OPTIM_FILE))


# ---- dp = 2: compare with AdamW; bf16 masters; fp16 overflow; resume from the dp=4 checkpoint -----
def _hand_grads(model, scale=1.0) -> dict:
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(p.shape, generator=g) * 0.05 * scale for n, p in model.named_parameters()}


def _set_grads(model, buf, opt, grads):
    buf.start_step()
    for n, p in model.named_parameters():
        p.main_grad.copy_(grads[n])
    buf.finish()
    return opt.step()


def _bf16_and_fp16(rank, group) -> dict:
    """bf16 params with fp32 master shards; fp16 loss scaling, overflow on one rank skips all."""
    scaler = DynamicGradScaler(initial_scale=1024.0, hysteresis=1)
    model, buf, opt = _zero1(group, bucket_numel=3000, dtype=torch.bfloat16, scaler=scaler, fp16=True)
    ref = Reference(torch.bfloat16)
    grads = _hand_grads(model)
    applied, norm = _set_grads(model, buf, opt, {n: g * 1024.0 for n, g in grads.items()})
    _, ref_norm = ref.step(grads=grads)
    saved = opt.state_for_save()
    out = {"applied": applied, "norm": norm, "ref_norm": ref_norm, "bf16_diff": 0.0, "master_diff": 0.0}
    ref_params = dict(ref.model.named_parameters())
    for n, p in model.named_parameters():
        out["bf16_diff"] = max(out["bf16_diff"], (p.float() - ref_params[n].detach().to(torch.bfloat16).float())
                               .abs().max().item())
        if saved is not None:
            out["master_diff"] = max(out["master_diff"], (saved["state"][n]["master_param"] - ref_params[n].detach())
                                     .abs().max().item())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    bad = {n: g * 1024.0 for n, g in grads.items()}
    if rank == 1:   # element 0 of the buffer lies in rank 0's shard: the inf arrives there only
        first = next(n for n, p in model.named_parameters() if buf.param_range[id(p)][0] == 0)
        bad[first] = bad[first].clone()
        bad[first].view(-1)[0] = float("inf")
    out["overflow_applied"], _ = _set_grads(model, buf, opt, bad)
    out["unchanged"] = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    out["scale"] = scaler.scale
    return out


def _dp2_body(rank, world_size, ckpt_dir):
    group = dist.group.WORLD
    model, buf, opt = _zero1(group, bucket_numel=None)        # one bucket: the buffer cut in 2
    res = _compare_steps(model, buf, opt, Reference(), range(SAVE_AT), world_size, rank, group)
    res.update(bytes=opt.optimizer_state_bytes(), mixed=_bf16_and_fp16(rank, group))
    model, buf, opt = _zero1(group, bucket_numel=4000)
    it, _ = load_checkpoint(ckpt_dir, model, opt, None, model.cfg, Topology(1, 1, world_size), rank)
    res["resumed_from"] = it
    res["resumed_losses"] = [_train_step(model, buf, opt, i, world_size, rank, group)[0]
                             for i in range(SAVE_AT, STEPS)]
    res["final"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return res


def _check_resumed(res, uninterrupted) -> None:
    for a, b in zip(res["resumed_losses"], uninterrupted["resumed_losses"]):
        assert math.isclose(a, b, rel_tol=1e-5), (res["resumed_losses"], uninterrupted["resumed_losses"])
    for n, p in uninterrupted["final"].items():
        assert torch.allclose(res["final"][n], p, atol=PARAM_ATOL, rtol=0), n


def test_dp2_matches_adamw_mixed_precision_and_resumes_from_dp4(dp4_run):
    ckpt, dp4 = dp4_run
    results = run_distributed(_dp2_body, world_size=2, args=(ckpt,))
    numel = _numel()
    for rank, res in enumerate(results):
        _check_against_reference(res)
        assert 12 * numel / 2 <= res["bytes"] <= 12 * (numel / 2 + 1)
        m = res["mixed"]
        assert m["applied"] and math.isclose(m["norm"], m["ref_norm"], rel_tol=1e-5)
        assert m["bf16_diff"] <= 2 ** -7 * 0.2            # at most one bf16 rounding step of |w| < 0.2
        if rank == 0:
            assert m["master_diff"] < PARAM_ATOL           # fp32 masters match fp32 AdamW
        assert not m["overflow_applied"] and m["unchanged"] and m["scale"] == 512.0
        assert res["resumed_from"] == SAVE_AT
        _check_resumed(res, dp4[0])


# ---- dp = 1 (no torch.distributed): resume from the dp=4 checkpoint; non-sharded optimizer ------
def test_dp1_resumes_from_dp4_checkpoint(dp4_run):
    ckpt, dp4 = dp4_run
    model, buf, opt = _zero1(None, bucket_numel=2000)
    assert load_checkpoint(ckpt, model, opt, None, model.cfg, Topology(1, 1, 1), 0)[0] == SAVE_AT
    res = {"resumed_losses": [_train_step(model, buf, opt, i, 1, 0, None)[0] for i in range(SAVE_AT, STEPS)],
           "final": {n: p.detach().clone() for n, p in model.named_parameters()}}
    _check_resumed(res, dp4[0])
    assert opt.optimizer_state_bytes() == 12 * _numel()


def test_non_sharded_optimizer_trains_and_state_bytes():
    model = _model()
    buf = GradBuffer(model.parameters(), None, mode="all_reduce")
    opt = MixedPrecisionOptimizer(model, buf, TrainConfig(**TRAIN), ConstantGradScaler(), 0, None)
    losses = [_train_step(model, buf, opt, 0, 1, 0, None)[0] for _ in range(5)]
    assert losses[-1] < losses[0] - 0.1, losses
    assert opt.optimizer_state_bytes() == 12 * _numel()
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["weight_decay"] == 0.0


# ---- CUDA / NCCL (run on a lent GPU machine with >= 2 GPUs) -----------------------------------------
def _nccl_worker(rank, world_size, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    try:
        torch.save(_nccl_body(rank, world_size), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _nccl_body(rank, world_size):
    """fp32 with overlapped bucket reduce-scatter and fused AdamW vs AdamW; bf16 replicas agree."""
    group, dev = dist.group.WORLD, torch.device("cuda", rank)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model, buf, opt = _zero1(group, bucket_numel=5000, device=dev, overlap=True)
    res = _compare_steps(model, buf, opt, Reference(device=dev), range(4), world_size, rank, group)
    res["fused"] = bool(opt.adam.defaults.get("fused"))
    model, buf, opt = _zero1(group, bucket_numel=5000, dtype=torch.bfloat16, device=dev, overlap=True)
    res["bf16_losses"] = [_train_step(model, buf, opt, 0, world_size, rank, group)[0] for _ in range(4)]
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    parts = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(parts, flat)
    res["replicas_equal"] = all(torch.equal(parts[0], q) for q in parts)
    saved = opt.state_for_save()
    res["masters_match_params"] = saved is None or all(
        torch.equal(saved["state"][n]["master_param"].to(torch.bfloat16), p.detach().cpu())
        for n, p in model.named_parameters())
    return res


@pytest.mark.gpu
def test_zero1_nccl_matches_adamw():
    import tempfile
    import torch.multiprocessing as mp
    from distributed import _free_port
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_nccl_worker, args=(2, _free_port(), out), nprocs=2, join=True)
        results = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    for res in results:
        assert res["fused"]
        assert max(res["diffs"]) < 1e-5, res["diffs"]      # fused vs for-loop Adam, GPU reductions
        for a, b in zip(res["losses"], res["ref_losses"]):
            assert math.isclose(a, b, rel_tol=1e-5)
        assert res["replicas_equal"] and res["masters_match_params"]
        assert res["bf16_losses"][-1] < res["bf16_losses"][0]


@pytest.mark.gpu
def test_zero1_cuda_dp1_fused_matches_adamw():
    """One GPU, no torch.distributed: fused AdamW over shard views with pre-seeded state."""
    dev = torch.device("cuda", 0)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model, buf, opt = _zero1(None, bucket_numel=5000, device=dev, overlap=True)
    assert opt.adam.defaults.get("fused")
    res = _compare_steps(model, buf, opt, Reference(device=dev), range(4), 1, 0, None)
    assert max(res["diffs"]) < 1e-5, res["diffs"]
    saved = opt.state_for_save()
    model2, buf2, opt2 = _zero1(None, bucket_numel=3000, device=dev)
    opt2.load_saved_state(saved)
    assert opt2._step_count() == 4
    a = [_train_step(model, buf, opt, 9, 1, 0, None)[0] for _ in range(2)]
    b = [_train_step(model2, buf2, opt2, 9, 1, 0, None)[0] for _ in range(2)]
    assert a == pytest.approx(b, rel=1e-6)
    model3, buf3, opt3 = _zero1(None, bucket_numel=5000, dtype=torch.bfloat16, device=dev)
    losses = [_train_step(model3, buf3, opt3, 0, 1, 0, None)[0] for _ in range(4)]
    assert losses[-1] < losses[0]


def _deferred_gather_body(rank, world_size, stage):
    """ZeRO-1 or -2 at dp 2 with the all-gathers deferred to the next forward (forward_units, as build_zero gives
    on GPUs): each forward sees the last step's weights (the losses equal AdamW's on the whole batch), the weights
    a rank does not own stay old until a forward or `finish_pending` gathers them."""
    from megapar.optimizer.sharded_grads import ShardedGradBuffer
    from megapar.optimizer.zero import forward_units, layers_and_rest
    group = dist.group.WORLD
    model = _model()
    if stage == 1:
        buf = GradBuffer(model.parameters(), group, mode="reduce_scatter", bucket_numel=3000)
    else:
        buf = ShardedGradBuffer(*layers_and_rest(model), group)
    opt = DistributedOptimizer(model, buf, TrainConfig(**TRAIN), ConstantGradScaler(), tp_rank=0, dp_group=group,
                               norm_group=group, stage=stage, forward_units=forward_units(model))
    ref = Reference()
    res = {"losses": [], "ref_losses": [], "stale": [], "diffs": [], "buckets": len(buf.buckets), "gathers": 0}
    start_gathers = opt._start_gathers

    def counted(buckets):
        res["gathers"] += 1
        start_gathers(buckets)
    opt._start_gathers = counted
    for it in range(4):
        res["losses"].append(_train_step(model, buf, opt, it, world_size, rank, group)[0])
        res["ref_losses"].append(ref.step(it)[0])
        res["stale"].append(_max_diff(model, ref.model))    # the gathers wait for the next forward
    opt.finish_pending()
    res["diffs"].append(_max_diff(model, ref.model))
    return res


@pytest.mark.parametrize("stage", [1, 2])
def test_gathers_deferred_to_the_next_forward_match_adamw(stage):
    for res in run_distributed(_deferred_gather_body, world_size=2, args=(stage,)):
        assert res["buckets"] > 2
        assert res["gathers"] == 3 + 1   # in each forward after a step (not again in the step), finish_pending
        for a, b in zip(res["losses"], res["ref_losses"]):
            assert math.isclose(a, b, rel_tol=1e-5), (a, b)
        assert min(res["stale"]) > 10 * PARAM_ATOL, res["stale"]
        assert res["diffs"][0] < PARAM_ATOL, res["diffs"]
