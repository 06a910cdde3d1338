"""ZeRO stages 2 and 3 and CPU offload (gloo): every stage and layout trains exactly like the
serial run (within float32 rounding), and a ZeRO-3 checkpoint resumes at any stage and layout."""
import pytest

from distributed import run_distributed
from gpu_runs import Run, uses
from train_helpers import TINY_TRAIN, run_training

RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]


def losses(result):
    return [loss for _, loss in result["losses"]]


@pytest.fixture(scope="module")
def serial(embedded_data):
    base = TINY_TRAIN + embedded_data + ["--train-iters", "8", "--log-interval", "1"]
    return base, losses(run_training(base, 1))


@pytest.mark.parametrize("stage,world,extra", [
    (2, 2, []), (3, 2, []), (3, 1, []),
    pytest.param(2, 4, [], marks=pytest.mark.slow), pytest.param(3, 4, [], marks=pytest.mark.slow),
    pytest.param(3, 4, ["--tensor-parallel", "2", "--sequence-parallel"], marks=pytest.mark.slow),
    pytest.param(2, 4, ["--pipeline-parallel", "2"], marks=pytest.mark.slow),
    pytest.param(3, 4, ["--pipeline-parallel", "2"], marks=pytest.mark.slow),
    pytest.param(3, 4, ["--pipeline-parallel", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
                 marks=pytest.mark.slow),
    (3, 2, RECOMPUTE), pytest.param(2, 2, RECOMPUTE, marks=pytest.mark.slow),
    pytest.param(3, 4, ["--tensor-parallel", "2"] + RECOMPUTE, marks=pytest.mark.slow),
], ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_zero_stage_matches_serial(serial, stage, world, extra):
    """8 iterations of stage 2 / 3 at dp 1, 2 and 4, with tp 2 (and sequence parallelism), pp 2 (and
    the interleaved schedule's chunks) and recompute == the (1, 1, 1) plain data-parallel run."""
    base, reference = serial
    got = losses(run_training(base + ["--zero-stage", str(stage)] + extra, world))
    assert got == pytest.approx(reference, rel=2e-5), (reference, got)


def _offload_body(rank, world_size, argv, param_offload):
    """Train with the offload code paths on: refused for a CPU-only run at the command line (there
    is nothing to offload from), so switched on after validation to test the same arithmetic."""
    from megapar.pretrain_gpt2 import parse
    from megapar.run.pretrain import pretrain
    cfg = parse(argv, world_size)
    cfg.parallel.optimizer_cpu_offload = True
    cfg.parallel.param_cpu_offload = param_offload
    return {"losses": pretrain(cfg).losses}


@pytest.mark.parametrize("stage,world", [(1, 2), (2, 2), (3, 2)])
def test_optimizer_offload_matches_no_offload(serial, stage, world):
    """Masters and moments in host buffers, gradients copied out, torch's fused CPU AdamW, the
    new weights copied back (and at stage 3 the parameter shards in host memory) == no offload."""
    base, reference = serial
    argv = base + ["--zero-stage", str(stage)]
    got = losses(run_distributed(_offload_body, world, args=(argv, stage == 3))[0])
    assert got == pytest.approx(reference, rel=2e-5), (reference, got)


def test_zero3_frees_layer_weights_and_gradients_between_uses():
    """After forward + backward of a microbatch no layer holds its full weights or its fp32
    gradient bucket: only the owned shards persist, and the model's forward output equals the
    unsharded model's."""
    import torch
    from gpt_helpers import batch, tiny_model_config
    from megapar.model import GPT2Model, Stage
    from megapar.optimizer.sharded_grads import ShardedGradBuffer
    from megapar.optimizer.sharded_params import ShardedParams

    cfg = tiny_model_config(["--hidden-dropout", "0", "--attention-dropout", "0"])
    sharded = ShardedParams(None)
    model = GPT2Model(cfg.model, Stage.of(4, 1, 0), seed=3, on_layer_built=sharded.shard_layer)
    plain = GPT2Model(cfg.model, Stage.of(4, 1, 0), seed=3)
    layers = list(model.language_model.encoder.layers)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    buf = ShardedGradBuffer(layers, [p for p in model.parameters() if id(p) not in in_layers], None,
                            on_layer_reduced=lambda i: sharded.units[i].release())
    assert all(u.full.untyped_storage().nbytes() == 0 for u in sharded.units)        # built as shards
    tokens, labels = batch()
    buf.start_step()
    loss = model(tokens, labels=labels)
    assert torch.equal(loss, plain(tokens, labels=labels))
    assert all(u.full.untyped_storage().nbytes() == 0 for u in sharded.units)        # released after forward
    loss.mean().backward()
    assert all(u.full.untyped_storage().nbytes() == 0 for u in sharded.units)        # and after backward
    assert all(b.data.untyped_storage().nbytes() == 0 for b in buf.buckets[:-1])     # buckets freed
    buf.finish()
    plain.zero_grad()
    plain(tokens, labels=labels).mean().backward()
    for name, p in plain.named_parameters():
        start, end = buf.param_range[id(dict(model.named_parameters())[name])]
        assert torch.allclose(buf.owned_grad(start, end).view_as(p), p.grad, atol=1e-6), name


def test_zero3_checkpoint_resumes_at_any_stage_and_layout(serial, tmp_path):
    """ZeRO-3 at dp 4 saves after 4 of 8 iterations (the legacy layout: full-over-dp weights and
    distrib_optim.pt); it resumes at stage 1 dp 2, at stage 0 dp 1, and, resharded with
    checkpoint_util to (tp, pp, dp) = (2, 1, 1) without the distributed optimizer, at stage 0 on
    tp 2: every continuation gives the serial run's losses for iterations 5-8."""
    from megapar.cli import checkpoint_util
    base, reference = serial
    ck = tmp_path / "zero3"
    first = run_training(base + ["--zero-stage", "3", "--exit-interval", "4", "--save", str(ck)], 4)
    assert first["iteration"] == 4 and losses(first) == pytest.approx(reference[:4], rel=2e-5)
    assert (ck / "iter_0000004" / "mp_rank_00" / "distrib_optim.pt").is_file()
    for extra, world in ((["--zero-stage", "1"], 2), ([], 1)):
        got = losses(run_training(base + extra + ["--load", str(ck)], world))
        assert got == pytest.approx(reference[4:], rel=2e-5), (extra, got, reference[4:])
    tp2 = tmp_path / "tp2"
    assert checkpoint_util.main(["--load-dir", str(ck), "--save-dir", str(tp2), "--target-tensor-parallel-size", "2",
                                 "--target-pipeline-parallel-size", "1", "--target-data-parallel-size", "1",
                                 "--no-distributed-optimizer"]) == 0
    got = losses(run_training(base + ["--tensor-parallel", "2", "--load", str(tp2)], 2))
    assert got == pytest.approx(reference[4:], rel=2e-5), (got, reference[4:])


# ---- GPU: the same equalities with NCCL, bf16, the fused kernels, torch.compile and real offload ----

GPU_ZERO = {
    "stage1": ("--zero-stage", "1"),
    "stage2": ("--zero-stage", "2"),
    "stage3": ("--zero-stage", "3"),
    "stage2-offload": ("--zero-stage", "2", "--optimizer-cpu-offload"),
    "stage3-offload": ("--zero-stage", "3", "--optimizer-cpu-offload", "--param-cpu-offload"),
    "stage3-compile-recompute": ("--zero-stage", "3", "--torch-compile", "--recompute-granularity", "full"),
}
GPU_BASE = Run(("--bf16",))
GPU_RECOMPUTE_BASE = Run(("--bf16", "--torch-compile", "--recompute-granularity", "full"))


@pytest.mark.gpu
@pytest.mark.parametrize("name", [pytest.param(n, marks=uses(GPU_BASE, GPU_RECOMPUTE_BASE, Run(("--bf16", *f))))
                                  for n, f in GPU_ZERO.items()])
def test_zero_stages_on_gpu_match_plain_data_parallel(gpu_runs, name):
    """bf16 on one GPU: every stage and offload gives the plain run's losses (rel 2e-3: bf16, and
    torch's fused CPU AdamW against the GPU's)."""
    flags = GPU_ZERO[name]
    base = gpu_runs.get(GPU_RECOMPUTE_BASE if "--torch-compile" in flags else GPU_BASE)
    got = gpu_runs.get(Run(("--bf16", *flags)))
    assert f"ZeRO-{flags[1]}" in got["out"]
    for it, loss in base["loss"].items():
        assert got["loss"][it] == pytest.approx(loss, rel=2e-3), (name, it, got["loss"], base["loss"])
