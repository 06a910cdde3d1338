"""Interleaved 1F1B (virtual pipeline stages): the same losses as the serial run, the schedule's
activation bound and chunk order, and checkpoints in Megatron's model0/model1 convention that
convert to and from the plain layout."""
import pytest
import torch

from train_helpers import TINY_TRAIN, run_training

VIRTUAL = ["--virtual-pipeline-model-parallel-size", "2"]


def losses(result):
    return [l for _, l in result["losses"]]


def test_pp2_v2_matches_serial(embedded_data):
    """4 layers over pp 2 x 2 chunks (one layer each: rank 0 holds layers 0 and 2), 4 microbatches."""
    base = TINY_TRAIN + embedded_data + ["--train-iters", "4"]
    serial = losses(run_training(base, 1))
    interleaved = losses(run_training(base + ["--pipeline-parallel", "2", *VIRTUAL], 2))
    assert interleaved == pytest.approx(serial, rel=2e-5), (serial, interleaved)


# ---- the schedule alone, on test_pipeline's toy stack: pp 4 x v 2 chunks of one layer ------------------
def _toy_interleaved_body(rank, world_size, v, microbatches):
    from megapar.pipeline import ScheduleConfig, average_logs, current_step, get_forward_backward_func
    from test_pipeline import LAYERS, STATE, ToyStage, _grads, _no_sync, toy_data, toy_forward_step
    pp, per = world_size, LAYERS // (world_size * v)
    chunks = [ToyStage((j * pp + rank) * per, (j * pp + rank + 1) * per) for j in range(v)]
    schedule = get_forward_backward_func(pp, "1f1b", virtual=v)
    out = {}
    for m in microbatches:
        stats = {}
        cfg = ScheduleConfig(num_microbatches=m, tensor_shape=(3, 2, 8), prev_rank=rank - 1 if rank else None,
                             next_rank=rank + 1 if rank < pp - 1 else None, no_sync=_no_sync, p2p_timeout=30,
                             stats=stats)
        for c in chunks:
            c.zero_grad(set_to_none=True)
        STATE.update(alive=0, max=0, sync=[])
        logs = schedule(toy_forward_step, [iter(toy_data(m)) for _ in chunks], chunks, cfg)
        peak = stats["peak_live_outputs"]
        grads = {}
        for j, c in enumerate(chunks):
            grads.update(_grads(c, (j * pp + rank) * per))
        eval_logs = schedule(toy_forward_step, [iter(toy_data(m)) for _ in chunks], chunks, cfg, forward_only=True)
        out[m] = dict(grads=grads, peak=peak, alive=STATE["alive"], sync=list(STATE["sync"]),
                      logs=[float(d["loss"]) for d in logs], eval_logs=[float(d["loss"]) for d in eval_logs],
                      mean=float(average_logs(logs, cfg)["loss"]), step=current_step())
    return out


def test_interleaved_schedule_grads_order_and_activation_bound():
    """pp 4, v 2, m = pp (all forwards are warmup) and m = 2 pp: gradients and per-microbatch
    losses equal the serial run's; at most warmup + 1 chunk outputs are alive on a rank (rank 0:
    2 (pp - 1) + (v - 1) pp + 1 = 11 chunk outputs of one layer each, 5.5 stages' worth for
    m = 8, against 1F1B's 4 stages); the data-parallel sync runs on the last backward only."""
    from megapar.pipeline.interleaved import num_warmup
    from test_pipeline import _serial
    pp, v, ms = 4, 2, (4, 8)
    results = run_distributed_toy(pp, v, ms)
    for m in ms:
        serial_grads, serial_logs, _ = _serial(m)
        grads = {k: g for r in results for k, g in r[m]["grads"].items()}
        assert grads.keys() == serial_grads.keys()
        for k in grads:
            torch.testing.assert_close(grads[k], serial_grads[k], rtol=1e-5, atol=1e-6)
        assert results[-1][m]["logs"] == pytest.approx(serial_logs, rel=1e-6)
        assert results[-1][m]["eval_logs"] == pytest.approx(serial_logs, rel=1e-6)
        for rank, r in enumerate(results):
            bound = min(m * v, num_warmup(pp, rank, v, m) + 1)
            assert r[m]["peak"] <= bound, (m, rank, r[m]["peak"], bound)
            assert r[m]["alive"] == 0
            assert r[m]["sync"] == [False] * (m * v - 1) + [True], (m, rank)   # one backward per chunk microbatch
            assert r[m]["mean"] == pytest.approx(sum(serial_logs) / m, rel=1e-6)
            assert r[m]["step"].endswith("phase finished")                     # no stale microbatch / chunk
        if m > pp:   # the bound is reached on rank 0, and it is below holding every microbatch
            assert results[0][m]["peak"] == num_warmup(pp, 0, v, m) + 1 < m * v


def run_distributed_toy(pp, v, ms):
    from distributed import run_distributed
    return run_distributed(_toy_interleaved_body, pp, args=(v, ms))
