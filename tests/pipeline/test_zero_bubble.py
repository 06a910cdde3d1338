"""ZB-H1 (--enable-zero-bubble): the weight-gradient store defers exactly the fused GEMMs; the schedule
gives 1F1B's and the serial run's gradients and losses, runs in ZB-H1's order (the held-back W's fill
the cooldown: unit-time makespan 3m + p - 1 against 1F1B's 3m + 3(p - 1)) within 1F1B's activation
bound; GPT-2 with tp + sequence parallel, dp + ZeRO-1, recompute and a resume trains as the serial run."""
import contextlib

import pytest
import torch
import torch.nn as nn

from distributed import run_distributed
from megapar.optimizer.grad_buffer import GradBuffer
from megapar.tensor_parallel.layers import ColumnParallelLinear, Init, RowParallelLinear
from megapar.tensor_parallel.wgrad_store import WeightGradStore
from test_pipeline import B, H, LAYERS, S, toy_data, toy_forward_step  # the toy pipeline of 1F1B's tests
from train_helpers import TINY_TRAIN, run_training

ZB = ["--enable-zero-bubble"]


# ---- the store -------------------------------------------------------------------------------------------------
def _two_layers():
    fused = dict(fused_grad_accumulation=True)
    layers = nn.Sequential(ColumnParallelLinear(16, 24, Init(1, "a"), **fused),
                           RowParallelLinear(24, 16, Init(1, "b"), **fused))
    buf = GradBuffer(layers.parameters(), None)
    buf.start_step()
    return layers, buf


def test_store_defers_only_the_weight_gemms():
    """Inside deferring(): the input and bias gradients at once, the weights' main_grad untouched until
    run_oldest(); then every main_grad equals the undeferred backward's. Outside: nothing is queued."""
    ref, _ = _two_layers()
    x = torch.randn(5, 2, 16)
    xr = x.clone().requires_grad_()
    ref(xr).square().sum().backward()

    layers, _ = _two_layers()
    store = WeightGradStore.attach(layers.parameters())
    assert all(hasattr(l.weight, "wgrad_store") and not hasattr(l.bias, "wgrad_store") for l in layers)
    xd = x.clone().requires_grad_()
    with store.deferring():
        layers(xd).square().sum().backward()
    assert store.pending == 1
    torch.testing.assert_close(xd.grad, xr.grad)
    for mine, want in zip(layers, ref):
        assert mine.weight.main_grad.abs().sum() == 0                       # W not run yet
        torch.testing.assert_close(mine.bias.main_grad, want.bias.main_grad)  # biases in B
    store.run_oldest()
    assert store.pending == 0
    for mine, want in zip(layers, ref):
        torch.testing.assert_close(mine.weight.main_grad, want.weight.main_grad)

    layers(x.clone().requires_grad_()).square().sum().backward()            # outside B: accumulated at once
    assert store.pending == 0
    for mine, want in zip(layers, ref):
        torch.testing.assert_close(mine.weight.main_grad, 2 * want.weight.main_grad)


def test_store_is_not_reentrant():
    store = WeightGradStore()
    with store.deferring():
        with pytest.raises(RuntimeError, match="not reentrant"):
            with store.deferring():
                pass


# ---- the schedule on a toy stack of fused linears, pp 4 ----------------------------------------------------
STATE = {"sync": []}


class ToyStage(nn.Module):
    """Layers [start, end) of a stack of fused column-parallel linears with tanh; layer g seeded by g."""

    def __init__(self, start: int, end: int, **grad_buffer):
        super().__init__()
        self.first, self.input_tensor = start == 0, None
        self.layers = nn.ModuleList(ColumnParallelLinear(H, H, Init(1000 + g, f"l{g}", 0.5),
                                                         fused_grad_accumulation=True) for g in range(start, end))
        self.buf = GradBuffer(self.parameters(), grad_buffer.pop("dp_group", None), **grad_buffer)

    def set_input_tensor(self, t):
        self.input_tensor = t

    def forward(self, x):
        h = x if self.first else self.input_tensor
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h


@contextlib.contextmanager
def _no_sync():
    STATE["sync"].append(False)
    yield


def _main_grads(model, offset):
    return {f"{int(n.split('.')[1]) + offset}.{n.split('.', 2)[2]}": p.main_grad.clone()
            for n, p in model.named_parameters()}


def _toy_body(rank, world_size, microbatches):
    from megapar.pipeline import ScheduleConfig, get_forward_backward_func
    pp, per = world_size, LAYERS // world_size
    model = ToyStage(rank * per, (rank + 1) * per)
    store = WeightGradStore.attach(model.parameters())
    out = {}
    for m in microbatches:
        for name, zb in (("1f1b", False), ("zb", True)):
            stats = {}
            cfg = ScheduleConfig(num_microbatches=m, tensor_shape=(S, B, H), prev_rank=rank - 1 if rank else None,
                                 next_rank=rank + 1 if rank < pp - 1 else None, no_sync=_no_sync, p2p_timeout=30,
                                 stats=stats, wgrad_store=store if zb else None)
            model.buf.start_step()
            STATE["sync"] = []
            logs = get_forward_backward_func(pp, "1f1b", zero_bubble=zb)(toy_forward_step, iter(toy_data(m)),
                                                                         model, cfg)
            out[m, name] = dict(grads=_main_grads(model, rank * per), logs=[float(d["loss"]) for d in logs],
                                stats=stats, no_sync=len(STATE["sync"]), pending=store.pending)
    return out


def _serial(m):
    from megapar.pipeline import ScheduleConfig, forward_backward_no_pipelining
    model = ToyStage(0, LAYERS)
    model.buf.start_step()
    logs = forward_backward_no_pipelining(toy_forward_step, iter(toy_data(m)), model, ScheduleConfig(m))
    return _main_grads(model, 0), [float(d["loss"]) for d in logs]


def one_f_one_b(p, s, m):
    """1F1B's (pass, microbatch) order on stage s, the backward whole."""
    warmup = min(p - s - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


def makespan(orders, times):
    """Finish time of the pipeline when every pass takes times[kind], transfers are free, F needs the
    previous stage's F, B (or BW, a whole backward) the next stage's B (the last stage's: its own F),
    W its own B."""
    p, clock, done, at = len(orders), [0] * len(orders), {}, [0] * len(orders)
    while any(at[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while at[s] < len(orders[s]):
                kind, i = orders[s][at[s]]
                need = {"F": [("F", s - 1, i)] if s else [], "W": [("B", s, i)],
                        "B": [("B", s + 1, i)] if s < p - 1 else [("F", s, i)]}[kind[0]]
                if any(n not in done for n in need):
                    break
                clock[s] = max([clock[s]] + [done[n] for n in need]) + times[kind]
                done[kind[0], s, i] = clock[s]
                at[s] += 1
                moved = True
        assert moved, "the orders deadlock"
    return max(clock)


MICROBATCHES = (2, 4, 8)  # with pp 4: m < pp, m = pp, m > pp


@pytest.fixture(scope="module")
def toy_pp4():
    return run_distributed(_toy_body, 4, args=(MICROBATCHES,))


@pytest.mark.parametrize("m", MICROBATCHES)
def test_toy_pp4_gradients_equal_1f1b_and_serial(toy_pp4, m):
    serial, serial_logs = _serial(m)
    zb = {k: v for r in toy_pp4 for k, v in r[m, "zb"]["grads"].items()}
    f1b = {k: v for r in toy_pp4 for k, v in r[m, "1f1b"]["grads"].items()}
    assert zb.keys() == serial.keys()
    for k in serial:
        torch.testing.assert_close(zb[k], f1b[k], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(zb[k], serial[k], rtol=1e-5, atol=1e-6)
    assert toy_pp4[-1][m, "zb"]["logs"] == pytest.approx(serial_logs, rel=1e-6)
    for r, res in enumerate(toy_pp4):
        assert res[m, "zb"]["pending"] == 0
        assert res[m, "zb"]["no_sync"] == 2 * m               # every B and every W: the caller reduces after


@pytest.mark.parametrize("m", MICROBATCHES)
def test_toy_pp4_order_is_zb_h1(toy_pp4, m):
    """Per stage s: F and B in 1F1B's order; W(i) after B(i), first in first out; after each B the W's
    run down to s pending (stage s holds back s), so min(s + 1, m) W's follow the last B; activations
    within 1F1B's bound p - s, microbatches begun and not finished within p. With unit F, B, W the
    deferred W's fill the cooldown: makespan 3m + p - 1 (m >= p), 1F1B's 3m + 3(p - 1)."""
    p = len(toy_pp4)
    orders = [res[m, "zb"]["stats"]["order"] for res in toy_pp4]
    for s, order in enumerate(orders):
        assert [op for op in order if op[0] != "W"] == one_f_one_b(p, s, m)
        assert [i for kind, i in order if kind == "W"] == list(range(m))
        for i in range(m):
            assert order.index(("W", i)) > order.index(("B", i))
        pending = 0
        for kind, _ in order:
            pending += {"B": 1, "W": -1, "F": 0}[kind]
            if kind == "F":
                assert pending <= s
        last_b = max(k for k, op in enumerate(order) if op[0] == "B")
        assert len(order) - 1 - last_b == min(s + 1, m)
        stats = toy_pp4[s][m, "zb"]["stats"]
        assert stats["peak_live_outputs"] == min(p - s, m)
        assert stats["peak_unfinished"] <= p
    zb_time = makespan(orders, {"F": 1, "B": 1, "W": 1})
    f1b_time = makespan([[("BW" if k == "B" else k, i) for k, i in one_f_one_b(p, s, m)] for s in range(p)],
                        {"F": 1, "BW": 2})
    if m >= p:
        assert (zb_time, f1b_time) == (3 * m + p - 1, 3 * m + 3 * (p - 1))
    assert zb_time < f1b_time


def _overlap_body(rank, world_size, m):
    """pp 2 x dp 2 (rank = 2 pp_rank + dp_rank), GradBuffer reduce-scattering (ZeRO-1) with the
    overlapped, hook-triggered bucket reduction of GPUs, one bucket per parameter."""
    import torch.distributed as dist
    from megapar.pipeline import ScheduleConfig, get_forward_backward_func
    pp_rank, dp_rank = divmod(rank, 2)
    pp_groups = [dist.new_group([d, 2 + d]) for d in range(2)]
    dp_groups = [dist.new_group([2 * p, 2 * p + 1]) for p in range(2)]
    per = LAYERS // 2
    model = ToyStage(pp_rank * per, (pp_rank + 1) * per, dp_group=dp_groups[pp_rank], mode="reduce_scatter",
                     overlap=True, bucket_numel=1)
    store = WeightGradStore.attach(model.parameters())
    out = {}
    for name, zb in (("1f1b", False), ("zb", True)):
        cfg = ScheduleConfig(num_microbatches=m, tensor_shape=(S, B, H), pp_group=pp_groups[dp_rank],
                             prev_rank=rank - 2 if pp_rank else None, next_rank=rank + 2 if not pp_rank else None,
                             no_sync=model.buf.no_sync, p2p_timeout=30, wgrad_store=store if zb else None)
        model.buf.start_step()
        get_forward_backward_func(2, "1f1b", zero_bubble=zb)(toy_forward_step, iter(toy_data(m + 10 * dp_rank)),
                                                             model, cfg)
        model.buf.finish()
        out[name] = [model.buf.data[lo:hi].clone() for lo, hi, _ in model.buf.layout.ranges()]
    return out


def test_overlapped_zero1_reduction_sees_the_deferred_weight_gradients():
    """With the GPU's overlapped reduction (a bucket reduced once its parameters' hooks ran in the last
    backward) the fused weights' hooks run in B, before their W: ZB-H1 runs B and W under no_sync and
    the reduction happens in finish(), so the owned, reduced shards equal 1F1B's."""
    for res in run_distributed(_overlap_body, 4, args=(3,)):
        assert len(res["zb"]) > 1
        for zb, f1b in zip(res["zb"], res["1f1b"]):
            torch.testing.assert_close(zb, f1b, rtol=1e-6, atol=1e-7)


# ---- GPT-2 through pretrain ------------------------------------------------------------------------------------
def losses(result):
    return [l for _, l in result["losses"]]


def _base(data, m, iters=3):
    return TINY_TRAIN + data + ["--train-iters", str(iters), "--global-batch-size", str(2 * m)]


@pytest.mark.parametrize("m", [1, 2, 4])
def test_gpt2_pp2_matches_1f1b_and_serial(embedded_data, m):
    """pp 2 with m < pp, m = pp, m > pp microbatches (micro-batch 2): the serial run's losses; at m = 4
    also 1F1B's, and an evaluation (forward only) between steps."""
    base = _base(embedded_data, m)
    if m == 4:
        base += ["--eval-interval", "2", "--eval-iters", "1"]
    serial = run_training(base, 1)
    zb = run_training(base + ["--pipeline-parallel", "2", *ZB], 2)
    assert losses(zb) == pytest.approx(losses(serial), rel=2e-5), (serial, zb)
    if m == 4:
        f1b = run_training(base + ["--pipeline-parallel", "2"], 2)
        assert losses(zb) == pytest.approx(losses(f1b), rel=1e-6), (f1b, zb)
        assert [l for _, l in zb["valid_losses"]] == pytest.approx([l for _, l in serial["valid_losses"]], rel=2e-5)


def test_gpt2_pp2_bf16_matches_1f1b(embedded_data):
    """bf16 weights, fp32 main_grad: the deferred GEMMs accumulate as the undeferred ones do."""
    base = _base(embedded_data, 4) + ["--pipeline-parallel", "2", "--bf16"]
    f1b = losses(run_training(base, 2))
    zb = losses(run_training(base + ZB, 2))
    assert zb == pytest.approx(f1b, rel=1e-6), (f1b, zb)


@pytest.mark.parametrize("recompute", [["--recompute-granularity", "full"], ["--recompute-activations"]],
                         ids=["full", "selective"])
def test_gpt2_pp2_recompute(embedded_data, recompute):
    base = _base(embedded_data, 4)
    serial = losses(run_training(base, 1))
    zb = losses(run_training(base + ["--pipeline-parallel", "2", *ZB, *recompute], 2))
    assert zb == pytest.approx(serial, rel=2e-5), (serial, zb)


@pytest.mark.parametrize("m", [2, 4, 8])
def test_gpt2_pp4_matches_serial(embedded_data, m):
    """pp 4 (one layer per stage) with m < pp, m = pp, m > pp; at m = 8 also 1F1B's losses."""
    base = _base(embedded_data, m)
    serial = losses(run_training(base, 1))
    zb = losses(run_training(base + ["--pipeline-parallel", "4", *ZB], 4))
    assert zb == pytest.approx(serial, rel=2e-5), (serial, zb)
    if m == 8:
        f1b = losses(run_training(base + ["--pipeline-parallel", "4"], 4))
        assert zb == pytest.approx(f1b, rel=1e-6), (f1b, zb)


@pytest.mark.parametrize("layout", [["--tensor-parallel", "2", "--sequence-parallel", "--pipeline-parallel", "2"],
                                    ["--tensor-parallel", "2", "--pipeline-parallel", "2",
                                     "--recompute-granularity", "full"],
                                    ["--pipeline-parallel", "2", "--use-distributed-optimizer"]],
                         ids=["tp2-sp-pp2", "tp2-pp2-recompute", "dp2-zero1-pp2"])
def test_gpt2_layouts_match_serial(embedded_data, layout):
    """tp 2 with sequence parallelism, tp 2 with full recompute, dp 2 with ZeRO-1 (4 microbatches per step)."""
    base = _base(embedded_data, 4)
    serial = losses(run_training(base, 1))
    zb = losses(run_training(base + layout + ZB, 4))
    assert zb == pytest.approx(serial, rel=2e-5), (serial, zb)


def test_gpt2_save_and_resume(embedded_data, tmp_path):
    """Saved after 2 of 4 steps with ZB-H1 (ZeRO-1 at dp 1), resumed with it and without it: the
    uninterrupted run's last losses."""
    base = _base(embedded_data, 2, iters=4) + ["--pipeline-parallel", "2", "--use-distributed-optimizer", *ZB]
    whole = losses(run_training(base, 2))
    first = run_training(base + ["--exit-interval", "2", "--save", str(tmp_path / "ck")], 2)
    assert first["iteration"] == 2
    resumed = losses(run_training(base + ["--load", str(tmp_path / "ck")], 2))
    assert resumed == pytest.approx(whole[2:], rel=1e-6), (whole, resumed)
    plain = [a for a in base if a not in ZB]                       # the checkpoint is 1F1B's too
    resumed_1f1b = losses(run_training(plain + ["--load", str(tmp_path / "ck")], 2))
    assert resumed_1f1b == pytest.approx(whole[2:], rel=1e-6), (whole, resumed_1f1b)


def test_flag_picks_the_schedule():
    from megapar.config.build import parse_config
    from megapar.pipeline import forward_backward_pipelining_zb_h1, get_forward_backward_func
    cfg = parse_config(["--pipeline-parallel", "2", *ZB], 2)
    assert cfg.parallel.enable_zero_bubble
    assert get_forward_backward_func(2, "1f1b", None, zero_bubble=True) is forward_backward_pipelining_zb_h1
    with pytest.raises(ValueError, match="zero-bubble"):
        get_forward_backward_func(2, "afab", zero_bubble=True)


@pytest.mark.slow  # torch.compile on the CPU: about a minute
def test_gpt2_pp2_compiled(embedded_data):
    """Compiled layers: the deferring linears run eagerly inside them (a graph break each)."""
    base = _base(embedded_data, 2)
    serial = losses(run_training(base, 1))
    zb = losses(run_training(base + ["--pipeline-parallel", "2", "--torch-compile", *ZB], 2))
    assert zb == pytest.approx(serial, rel=2e-5), (serial, zb)


def test_cuda_graph_takes_the_flag(monkeypatch):
    """--enable-cuda-graph with --enable-zero-bubble passes the configuration's checks (on GPUs)."""
    from megapar.config.build import parse_config
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    parse_config(["--enable-cuda-graph", "--hidden-dropout", "0", "--attention-dropout", "0",
                  "--pipeline-parallel", "2", *ZB], 2)


# ---- GPU (NCCL, 2 GPUs): ZB-H1 == 1F1B, eager and as one CUDA graph ----------------------------------------
PP2 = ("--pipeline-model-parallel-size", "2")
GPU_LAYOUTS = {"fp32": ((), 2e-5), "bf16-compiled": (("--bf16", "--torch-compile"), 2e-3),
               "bf16-zero1-recompute": (("--bf16", "--use-distributed-optimizer", "--recompute-granularity", "full"),
                                        2e-3)}


def _gpu_runs(extra):
    from gpu_runs import Run
    return (Run((*PP2, *extra), gpus=2), Run((*PP2, *extra, *ZB), gpus=2),
            Run((*PP2, *extra, *ZB, "--enable-cuda-graph"), gpus=2))


def _uses(extra):
    from gpu_runs import uses
    return uses(*_gpu_runs(extra))


@pytest.mark.gpu
@pytest.mark.parametrize("extra, rel", [pytest.param(extra, rel, marks=_uses(extra), id=name)
                                        for name, (extra, rel) in GPU_LAYOUTS.items()])
def test_gpu_zb_matches_1f1b_eager_and_graphed(gpu_runs, extra, rel):
    from gpu_runs import assert_close
    f1b, zb, graph = (gpu_runs.get(r) for r in _gpu_runs(extra))   # skips with fewer than 2 GPUs
    assert "captured the training step as a CUDA graph" in graph["out"]
    assert_close(zb["loss"], f1b["loss"], rel)
    assert_close(graph["loss"], zb["loss"], rel)
    assert_close(graph["norm"], zb["norm"], 10 * rel)
