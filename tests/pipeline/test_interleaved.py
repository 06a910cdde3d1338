"""Interleaved 1F1B (virtual pipeline stages): the same losses as the serial run, the schedule's
activation bound and chunk order, and checkpoints in Megatron's model0/model1 convention that
convert to and from the plain layout."""
import re

import pytest
import torch

from train_helpers import TINY_TRAIN, run_training

VIRTUAL = ["--virtual-pipeline-model-parallel-size", "2"]


def losses(result):
    return [l for _, l in result["losses"]]


def test_pp2_v2_matches_serial(embedded_data):
    """4 layers over pp 2 x 2 chunks (one layer each: rank 0 holds layers 0 and 2), 4 microbatches;
    evaluation (the forward-only interleaved schedule) too."""
    base = TINY_TRAIN + embedded_data + ["--train-iters", "4", "--eval-interval", "2", "--eval-iters", "2"]
    serial = run_training(base, 1)
    interleaved = run_training(base + ["--pipeline-parallel", "2", *VIRTUAL], 2)
    assert losses(interleaved) == pytest.approx(losses(serial), rel=2e-5), (serial, interleaved)
    assert len(serial["valid_losses"]) == 2
    assert [l for _, l in interleaved["valid_losses"]] == pytest.approx([l for _, l in serial["valid_losses"]],
                                                                        rel=2e-5)


# ---- the schedule alone, on test_pipeline's toy stack: pp 4 x v 2 chunks of one layer ------------------
def _toy_interleaved_body(rank, world_size, v, microbatches):
    from megapar.pipeline import ScheduleConfig, average_logs, current_step, get_forward_backward_func
    from test_pipeline import LAYERS, STATE, ToyStage, _grads, _no_sync, toy_data, toy_forward_step
    import torch.distributed as dist
    pp, per = world_size, LAYERS // (world_size * v)
    grad_group = dist.new_group(list(range(pp))) if pp == 2 else None   # Topology's pp_grad group
    chunks = [ToyStage((j * pp + rank) * per, (j * pp + rank + 1) * per) for j in range(v)]
    schedule = get_forward_backward_func(pp, "1f1b", virtual=v)
    out = {}
    for m in microbatches:
        stats = {}
        cfg = ScheduleConfig(num_microbatches=m, tensor_shape=(3, 2, 8), prev_rank=rank - 1 if rank else None,
                             next_rank=rank + 1 if rank < pp - 1 else None, no_sync=_no_sync, p2p_timeout=30,
                             stats=stats, pp_grad_group=grad_group)
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


def test_interleaved_schedule_pp2():
    """pp 2 (the ring sends activations and gradients between the same two ranks: gradients go on
    their own group) with v 4 chunks, m = 2, 4, 6: the serial gradients and losses."""
    from test_pipeline import _serial
    results = run_distributed_toy(2, 4, (2, 4, 6))
    for m in (2, 4, 6):
        serial_grads, serial_logs, _ = _serial(m)
        grads = {k: g for r in results for k, g in r[m]["grads"].items()}
        assert grads.keys() == serial_grads.keys()
        for k in grads:
            torch.testing.assert_close(grads[k], serial_grads[k], rtol=1e-5, atol=1e-6)
        assert results[-1][m]["logs"] == pytest.approx(serial_logs, rel=1e-6)


def run_distributed_toy(pp, v, ms):
    from distributed import run_distributed
    return run_distributed(_toy_interleaved_body, pp, args=(v, ms))


@pytest.mark.slow  # 4-process runs; test_pp2_v2_matches_serial is the quick representative
def test_tp2_pp2_v2_and_zero1_dp2_pp2_v2_match_serial(embedded_data):
    """tp 2 x pp 2 x v 2, and pp 2 x dp 2 x v 2 with ZeRO-1 (2 microbatches = pp: every forward
    is warmup), equal the serial losses."""
    base = TINY_TRAIN + embedded_data + ["--train-iters", "4"]
    serial = losses(run_training(base, 1))
    tp2 = losses(run_training(base + ["--tensor-parallel", "2", "--pipeline-parallel", "2", *VIRTUAL], 4))
    assert tp2 == pytest.approx(serial, rel=2e-5), (serial, tp2)
    zero1 = losses(run_training(base + ["--pipeline-parallel", "2", "--use-distributed-optimizer", *VIRTUAL], 4))
    assert zero1 == pytest.approx(serial, rel=2e-5), (serial, zero1)


# ---- checkpoints -----------------------------------------------------------------------------------------
def _shard(root, pp_rank, it=2):
    return torch.load(root / f"iter_{it:07d}" / f"mp_rank_00_{pp_rank:03d}" / "model_optim_rng.pt",
                      map_location="cpu", weights_only=False)


def _convert(src, dst, *extra):
    from megapar.cli import checkpoint_util
    assert checkpoint_util.main(["--load-dir", str(src), "--save-dir", str(dst), *map(str, extra)]) == 0


def test_v2_checkpoint_converts_to_v1_and_resumes_with_the_same_losses(embedded_data, tmp_path):
    """Save at pp 2 x v 2 with ZeRO-1 after 2 of 4 iterations: each shard holds model0 / model1
    (layer indices local to the chunk) and args.virtual_pipeline_model_parallel_size = 2. Resuming
    it at v 2, or converted to v 1 (plain pp 2), gives the serial run's last 2 losses; converting
    v 1 back to v 2 gives the original shards bitwise; generation loads it as plain stages."""
    from megapar.checkpoint import flatten_model_states
    base = TINY_TRAIN + embedded_data + ["--train-iters", "4", "--pipeline-parallel", "2",
                                         "--use-distributed-optimizer"]
    ck, ck1, ck2 = tmp_path / "v2", tmp_path / "v1", tmp_path / "v2again"
    first = run_training(base + VIRTUAL + ["--exit-interval", "2", "--save", str(ck)], 2)
    assert first["iteration"] == 2
    shards = [_shard(ck, p) for p in range(2)]
    assert all("model" not in s and {"model0", "model1"} <= s.keys() for s in shards)
    assert shards[0]["args"].virtual_pipeline_model_parallel_size == 2
    layers = [{k.split(".")[4] for k in flatten_model_states(s) if ".layers." in k} for s in shards]
    assert layers == [{"0"}, {"0"}]                                        # one layer per chunk, local index 0
    assert "model0.language_model.embedding.word_embeddings.weight" in flatten_model_states(shards[0])
    assert "model1.word_embeddings_for_head.weight" in flatten_model_states(shards[1])

    _convert(ck, ck1, "--target-virtual-pipeline-parallel-size", 1)
    plain = _shard(ck1, 0)
    assert "model" in plain and plain["args"].virtual_pipeline_model_parallel_size is None
    _convert(ck1, ck2, "--target-num-layers-per-virtual-pipeline-stage", 1)
    for p in range(2):
        a, b = _shard(ck, p), _shard(ck2, p)
        fa, fb = flatten_model_states(a), flatten_model_states(b)
        assert fa.keys() == fb.keys()
        for k in fa:
            if "word_embeddings" not in k:                                 # dummy vocabulary rows: zeros in b
                assert torch.equal(fa[k], fb[k]), k

    from megapar.inference.generation import read_model_state   # inference regroups the chunks into plain stages
    for p in range(2):
        _, state = read_model_state(str(ck), 1, 2, 0, p)
        want = flatten_model_states(_shard(ck1, p))
        assert state.keys() == want.keys()
        assert all(torch.equal(state[k], want[k]) for k in want if "word_embeddings" not in k)

    serial = losses(run_training(TINY_TRAIN + embedded_data + ["--train-iters", "4"], 1))
    resumed_v1 = losses(run_training(base + ["--load", str(ck1)], 2))
    resumed_v2 = losses(run_training(base + VIRTUAL + ["--load", str(ck)], 2))
    assert resumed_v1 == pytest.approx(serial[2:], rel=2e-5), (serial, resumed_v1)
    assert resumed_v2 == pytest.approx(serial[2:], rel=2e-5), (serial, resumed_v2)


def test_resuming_another_chunk_count_is_refused():
    import argparse

    from megapar.config.settings import ModelConfig
    from megapar.checkpoint import CheckpointError, check_compatible, read_saved_config
    from megapar.topology import Topology
    saved = read_saved_config({"args": argparse.Namespace(num_layers=4, tensor_model_parallel_size=1,
                                                          pipeline_model_parallel_size=2,
                                                          virtual_pipeline_model_parallel_size=2)})
    with pytest.raises(CheckpointError, match=r"holds 2 model chunk\(s\) per pipeline rank .* this run 1; .*"
                                              r"--target-virtual-pipeline-parallel-size 1"):
        check_compatible(saved, ModelConfig(num_layers=4), Topology(1, 2, 1), "ck")
    check_compatible(saved, ModelConfig(num_layers=4, virtual_pipeline_model_parallel_size=2), Topology(1, 2, 1), "ck")


def test_chunk_layout_and_keys():
    """Canonical names <-> shard keys of interleaved stages (8 layers, pp 2, v 2: rank 0 holds
    blocks 0 and 2, i.e. layers 0-1 and 4-5)."""
    from megapar.config.settings import ModelConfig
    from megapar.checkpoint.layout import HEAD, WORD, canonical_key, chunk_layout, stage_keys, stage_of
    layout = chunk_layout(ModelConfig(num_layers=8, virtual_pipeline_model_parallel_size=2), 2)
    assert layout == [[("model0.", 0, 2), ("model1.", 4, 6)], [("model0.", 2, 4), ("model1.", 6, 8)]]
    ln = "language_model.encoder.layers.5.input_layernorm.weight"
    assert stage_of(ln, layout) == (0, "model1.language_model.encoder.layers.1.input_layernorm.weight")
    assert canonical_key("model1.language_model.encoder.layers.1.input_layernorm.weight", layout[0]) == ln
    assert stage_of("language_model.encoder.final_layernorm.weight", layout)[1].startswith("model1.")
    assert stage_of(WORD, layout) == (0, "model0." + WORD)
    assert ("model1." + HEAD, WORD) in stage_keys([WORD], layout, 1)


def _mismatch_body(rank, world_size):
    """Rank 0 trains while rank 1 only evaluates: rank 1 times out first (2 s), naming the chunk."""
    import torch.distributed as dist
    from megapar.pipeline import PipelineP2PError, ScheduleConfig, current_step, get_forward_backward_func
    from test_pipeline import ToyStage, toy_data, toy_forward_step
    pp_group, grad_group = dist.new_group([0, 1]), dist.new_group([0, 1])   # the default group stays usable
    chunks = [ToyStage(j * 2 + rank, j * 2 + rank + 1) for j in range(2)]
    cfg = ScheduleConfig(num_microbatches=4, tensor_shape=(3, 2, 8), pp_group=pp_group, pp_grad_group=grad_group,
                         prev_rank=None if rank == 0 else 0, next_rank=1 if rank == 0 else None,
                         p2p_timeout=2 if rank == 1 else 6, label="iteration 7")
    try:
        get_forward_backward_func(2, "1f1b", virtual=2)(toy_forward_step, [iter(toy_data(4)) for _ in chunks],
                                                         chunks, cfg, forward_only=rank == 1)
        return None
    except PipelineP2PError as e:
        return str(e), current_step()


def test_hang_diagnostic_names_the_chunk():
    from distributed import run_distributed
    _, last = run_distributed(_mismatch_body, 2)
    error, step = last
    assert re.fullmatch(r"pipeline p2p timeout after 2s on rank 1 \(pp stage 1/2\): iteration 7, schedule "
                        r"interleaved-1f1b, phase warmup, microbatch \d+, chunk \d, waiting for recv_forward "
                        r"from rank 0", error), error
    assert step == error.split(": ", 1)[1]


def test_memory_estimate_counts_chunk_activations():
    """tools/estimate_memory.py: rank r keeps warmup + 1 chunk outputs of num_layers / (pp v) layers."""
    from megapar.config.build import parse_config
    from megapar.planner.memory_estimate import estimate
    from megapar.model.build import set_vocab
    argv = ["--num-layers", "8", "--pipeline-parallel", "2", "--global-batch-size", "32", "--micro-batch-size", "4"]
    plain, chunked = parse_config(argv, 2), parse_config(argv + VIRTUAL, 2)
    for cfg in (plain, chunked):
        set_vocab(cfg.model, 50257, 1, log=lambda _: None)
    a, b = estimate(plain), estimate(chunked)
    per_layer = a[1].activation_bytes / 4                      # plain last stage: 1 microbatch x 4 layers
    assert [r.activation_bytes / per_layer for r in a] == pytest.approx([8, 4])
    # (2 + 2 + 1), (0 + 2 + 1) chunks
    assert [r.activation_bytes / per_layer for r in b] == pytest.approx([2 * 5, 2 * 3])


# ---- NCCL on 2 GPUs (gpu marker: run on a lent multi-GPU machine) ------------------------------
def _nccl_worker(rank, port, out_dir):
    import os

    import torch.distributed as dist
    from megapar.pipeline import ScheduleConfig, get_forward_backward_func
    from test_pipeline import ToyStage, _grads, toy_data, toy_forward_step
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    grad_group = dist.new_group([0, 1])                       # Topology's pp_grad group at pp 2
    v, per = 4, 1
    chunks = [ToyStage((j * 2 + rank) * per, (j * 2 + rank + 1) * per).cuda() for j in range(v)]
    cfg = ScheduleConfig(num_microbatches=6, tensor_shape=(3, 2, 8), device=torch.device("cuda", rank),
                         prev_rank=None if rank == 0 else 0, next_rank=1 if rank == 0 else None,
                         pp_grad_group=grad_group, p2p_timeout=60)
    data = [(x.cuda(), t.cuda()) for x, t in toy_data(6)]
    get_forward_backward_func(2, "1f1b", virtual=v)(toy_forward_step, [iter(data) for _ in chunks], chunks, cfg)
    grads = {}
    for j, c in enumerate(chunks):
        grads.update({k: g.cpu() for k, g in _grads(c, (j * 2 + rank) * per).items()})
    torch.save(grads, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.gpu
def test_nccl_pp2_interleaved_two_gpus():
    """pp 2 x v 4 on NCCL, where only the second group keeps activations and gradients apart."""
    import tempfile

    import torch.multiprocessing as mp
    from distributed import _free_port
    from test_pipeline import _serial
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_nccl_worker, args=(_free_port(), d), nprocs=2, join=True)
        got = {**torch.load(f"{d}/rank0.pt"), **torch.load(f"{d}/rank1.pt")}
    ref, _, _ = _serial(6)
    for name, g in ref.items():
        assert torch.allclose(got[name], g, rtol=1e-4, atol=1e-6), name   # GPU vs CPU fp32


def test_flags_resolve_to_one_chunk_count():
    """Either flag gives both fields; v 1 (or N = layers / pp) means no chunks."""
    from megapar.config.build import parse_config
    base = ["--num-layers", "8", "--pipeline-parallel", "2", "--global-batch-size", "8", "--micro-batch-size", "2"]
    for extra, want in ((["--num-layers-per-virtual-pipeline-stage", "1"], (4, 1)),
                        (["--virtual-pipeline-model-parallel-size", "2"], (2, 2)),
                        (["--virtual-pipeline-model-parallel-size", "2",
                          "--num-layers-per-virtual-pipeline-stage", "2"], (2, 2)),
                        (["--virtual-pipeline-model-parallel-size", "1"], (None, None)),
                        (["--num-layers-per-virtual-pipeline-stage", "4"], (None, None))):
        m = parse_config(base + extra, 2).model
        assert (m.virtual_pipeline_model_parallel_size, m.num_layers_per_virtual_pipeline_stage) == want, extra
