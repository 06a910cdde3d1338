"""--fp8-format (megapar/fp8.py): refusals before any process group; on CPU, the fp8 layers through
torchao's emulated GEMMs (fp8 casts, high-precision matmuls): gradients close to bf16, the weight's
gradient on the unfused path, per-TP-shard scales, bf16 state dicts. GPU: fp8 runs train like bf16."""
from __future__ import annotations

import importlib.util
import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpt_helpers import batch, tiny_model_config
from gpu_runs import SAVE_AT, TRAIN_ITERS, Run, after, assert_close, uses
from megapar.config.build import build_config
from megapar.config.overlays import parse_flags
from megapar.config.settings import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TORCHAO = importlib.util.find_spec("torchao") is not None
needs_torchao = pytest.mark.skipif(not TORCHAO, reason="torchao not installed (pip install -e .[fp8])")
FP8 = ["--fp8-format", "hybrid", "--bf16", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
       "4", "--seq-length", "64", "--micro-batch-size", "2"]


def _parse(argv, world_size=1, gpus=True):
    return build_config(parse_flags(argv), world_size, assume_gpus=gpus)


def _refused(argv, *fragments, world_size=1, gpus=True):
    with pytest.raises(ConfigError) as e:
        _parse(argv, world_size, gpus)
    msg = str(e.value)
    assert "\n" not in msg and all(f in msg for f in fragments), msg
    return msg


# ---- validation -------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, fragments", [
    (["--fp16"], ["--fp16 and --bf16 were both given"]),
    (["--hidden-size", "72", "--num-attention-heads", "4"], ["multiples of 16", "--hidden-size 72"]),
    (["--ffn-hidden-size", "200"], ["multiples of 16", "--ffn-hidden-size 200"]),
    (["--seq-length", "63", "--micro-batch-size", "1"], ["multiples of 16", "tokens per GEMM"]),
    (["--tensor-model-parallel-size", "8", "--num-attention-heads", "8"],
     ["--hidden-size 64 / --tensor-model-parallel-size 8 = 8"]),
    (["--fp8-recipe", "rowwise"], ["--fp8-recipe rowwise", "use --fp8-format e4m3"]),
    (["--distributed-backend", "gloo"], ["no CUDA GPU (or uses gloo)"]),
])
def test_bad_fp8_settings_are_refused_in_one_line(extra, fragments, monkeypatch):
    monkeypatch.setattr("megapar.config.checks._gpu_capability", lambda: (9, 0))
    monkeypatch.setattr("megapar.fp8.torchao_installed", lambda: True)
    world = 8 if "--tensor-model-parallel-size" in extra else 1
    _refused(FP8 + extra, *fragments, world_size=world)


def test_fp8_without_bf16_is_refused():
    argv = [a for a in FP8 if a != "--bf16"]
    _refused(argv, "--fp8-format hybrid needs --bf16")
    _refused(argv + ["--fp16"], "not --fp16", "use --bf16 instead of --fp16")


def test_fp8_on_a_cpu_run_is_refused():
    _refused(FP8, "no CUDA GPU", "drop --fp8-format", gpus=torch.cuda.is_available())


def test_fp8_on_a_gpu_without_fp8_is_refused(monkeypatch):
    monkeypatch.setattr("megapar.fp8.torchao_installed", lambda: True)
    monkeypatch.setattr("megapar.config.checks._gpu_capability", lambda: (8, 0))   # A100
    _refused(FP8, "compute capability >= 8.9", "this one is 8.0")
    monkeypatch.setattr("megapar.config.checks._gpu_capability", lambda: (8, 9))   # L4 / RTX 4090
    assert _parse(FP8).model.fp8_format == "hybrid"


def test_fp8_without_torchao_is_refused(monkeypatch):
    monkeypatch.setattr("megapar.config.checks._gpu_capability", lambda: (9, 0))
    monkeypatch.setattr("megapar.fp8.torchao_installed", lambda: False)
    _refused(FP8, "needs the torchao package", "pip install torchao")


def test_fp8_recipe_needs_a_format_and_defaults_to_tensorwise(monkeypatch):
    _refused(["--fp8-recipe", "rowwise"], "--fp8-recipe rowwise is a setting of the fp8 GEMMs")
    monkeypatch.setattr("megapar.config.checks._gpu_capability", lambda: (9, 0))
    monkeypatch.setattr("megapar.fp8.torchao_installed", lambda: True)
    cfg = _parse(FP8)
    assert (cfg.model.fp8_format, cfg.model.fp8_recipe) == ("hybrid", "tensorwise")
    cfg = _parse(FP8[:1] + ["e4m3"] + FP8[2:] + ["--fp8-recipe", "rowwise"])
    assert (cfg.model.fp8_format, cfg.model.fp8_recipe) == ("e4m3", "rowwise")


def test_generation_turns_fp8_off():
    from megapar.inference.generation import inference_config
    cfg = tiny_model_config(["--bf16"]).model
    cfg.fp8_format = "hybrid"
    assert inference_config(cfg, torch.device("cpu")).fp8_format is None


QUIET_IMPORTS = """
import logging, warnings
from megapar.fp8 import _import_torchao, torchao_quietly
_import_torchao()
with torchao_quietly():
    import transformers
    transformers.GPT2LMHeadModel, transformers.AutoTokenizer
logging.getLogger("torchao").warning("a later torchao warning")
warnings.warn("a warning of megapar's")
"""


def test_torchao_quietly_silences_only_its_loggers_and_only_inside(caplog):
    from megapar.fp8 import TORCHAO_IMPORT_LOGGERS, torchao_quietly
    with torchao_quietly():
        for name in TORCHAO_IMPORT_LOGGERS:
            logging.getLogger(name).warning("import-time noise")
        logging.getLogger("megapar").warning("inside, megapar's")
    logging.getLogger("torchao").warning("after, torchao's")
    assert [r.getMessage() for r in caplog.records] == ["inside, megapar's", "after, torchao's"]


@pytest.mark.slow  # a fresh Python importing torch, torchao and transformers; the test above is the cheap sibling
@needs_torchao
def test_torchao_imports_quietly_and_later_warnings_still_show():
    """torchao's import-time log lines (extensions skipped, torch's pytree deprecation) are silenced,
    also when transformers imports it; a later warning of any logger, and Python warnings, still print."""
    pytest.importorskip("transformers", reason="pip install -r requirements-dev.txt")
    proc = subprocess.run([sys.executable, "-c", QUIET_IMPORTS], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert [line for line in lines if "warning" not in line] == [], proc.stderr
    assert "a later torchao warning" in proc.stderr and "UserWarning: a warning of megapar's" in proc.stderr


# ---- the fp8 layers on CPU (torchao's emulation) -------------------------------------------------------
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@needs_torchao
@pytest.mark.parametrize("fmt, recipe", [("hybrid", "tensorwise"), ("e4m3", "tensorwise"), ("e4m3", "rowwise")])
def test_fp8_formats_map_to_torchao_dtypes(fmt, recipe):
    from megapar.fp8 import fp8_gemm
    c = fp8_gemm(fmt, recipe).config
    assert c.cast_config_input.target_dtype == c.cast_config_weight.target_dtype == torch.float8_e4m3fn
    grad = torch.float8_e5m2 if fmt == "hybrid" else torch.float8_e4m3fn
    assert c.cast_config_grad_output.target_dtype == c.cast_config_grad_output_for_grad_weight.target_dtype == grad
    assert c.cast_config_weight.scaling_granularity.value == ("tensorwise" if recipe == "tensorwise" else "axiswise")


@needs_torchao
@pytest.mark.parametrize("layer", ["column", "row"])
def test_fp8_linear_matches_bf16_and_takes_the_unfused_weight_gradient(layer):
    from megapar.fp8 import fp8_gemm
    from megapar.tensor_parallel.layers import ColumnParallelLinear, Init, RowParallelLinear
    cls = ColumnParallelLinear if layer == "column" else RowParallelLinear
    kw = dict(dtype=torch.bfloat16, fused_grad_accumulation=True)
    ref, fp8 = (cls(64, 128, Init(1, "w"), **kw, fp8=f) for f in (None, fp8_gemm("hybrid", emulate=True)))
    assert ref.weight.fused_grad_accumulation and not fp8.weight.fused_grad_accumulation
    assert fp8.bias.fused_grad_accumulation        # the bias keeps the fused path (add_bias)
    with torch.no_grad():
        ref.bias.normal_()
        fp8.bias.copy_(ref.bias)
    x = torch.randn(32, 2, 64, dtype=torch.bfloat16)
    outs, grads = [], []
    for m in (ref, fp8):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.float().square().sum().backward()
        outs.append(y)
        grads.append((xi.grad, m.weight.grad, m.bias.grad))
    assert outs[1].dtype == torch.bfloat16
    assert _rel(outs[1], outs[0]) < 0.08
    for g_fp8, g_ref in zip(grads[1], grads[0]):
        assert g_fp8.dtype == torch.bfloat16 and _rel(g_fp8, g_ref) < 0.15


@needs_torchao
def test_each_tp_shard_is_scaled_by_its_own_amax():
    """Column-parallel tp 2: rank r's GEMM uses the scale of its own weight shard (local by design):
    its output is exactly what one fp8 GEMM of that shard alone gives, and the shards' scales differ."""
    from torchao.float8.float8_utils import tensor_to_scale

    from megapar.fp8 import fp8_gemm, weight_scale
    from megapar.tensor_parallel.layers import ColumnParallelLinear, Init
    fp8 = fp8_gemm("hybrid", emulate=True)
    full = ColumnParallelLinear(64, 128, Init(1, "w"), dtype=torch.bfloat16, fp8=fp8, bias=False)
    with torch.no_grad():
        full.weight[64:] *= 8          # rank 1's shard has 8x the amax of rank 0's
    shards = full.weight.detach().chunk(2, dim=0)
    scales = [weight_scale(w, fp8) for w in shards]
    assert scales[0].item() == pytest.approx(8 * scales[1].item(), rel=0.02)
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    e4m3 = torch.float8_e4m3fn

    def dequant(t, scale):
        return (t.float() * scale).clamp(-448, 448).to(e4m3).float() / scale

    sx = tensor_to_scale(x, e4m3)
    for w, s in zip(shards, scales):
        shard = ColumnParallelLinear(64, 64, Init(1, "w"), dtype=torch.bfloat16, fp8=fp8, bias=False)
        with torch.no_grad():
            shard.weight.copy_(w)
        expected = (dequant(x, sx) @ dequant(w, s).t()).to(torch.bfloat16)
        torch.testing.assert_close(shard(x), expected, rtol=1e-2, atol=1e-2)


def _tp2_fp8_body(rank, tp, sp):
    """Column- then row-parallel fp8 layers (emulated, fp32) at tp 2 under gloo (sp: with sequence
    parallelism): this rank's weight scales, the output and the input gradient (gathered under sp)."""
    import torch.distributed as dist

    from megapar.fp8 import fp8_gemm, weight_scale
    from megapar.tensor_parallel.layers import ColumnParallelLinear, Init, RowParallelLinear
    group, fp8 = dist.group.WORLD, fp8_gemm("hybrid", emulate=True)
    col = ColumnParallelLinear(64, 128, Init(1, "col"), group, fp8=fp8, sequence_parallel=sp)
    row = RowParallelLinear(128, 64, Init(1, "row"), group, fp8=fp8, sequence_parallel=sp)
    with torch.no_grad():
        col.weight.mul_(1 + 7 * rank)        # rank 1's shards have 8x the amax of rank 0's
        row.weight.mul_(1 + 7 * rank)
    x_full = torch.randn(32, 2, 64, generator=torch.Generator().manual_seed(0))
    x = (x_full.chunk(tp)[rank] if sp else x_full).clone().requires_grad_()
    y = row(col(x))
    y.square().sum().backward()
    y, dx = y.detach(), x.grad
    if sp:  # this rank's part of the sequence: gather both
        parts = [[torch.empty_like(t) for _ in range(tp)] for t in (y, dx)]
        dist.all_gather(parts[0], y.contiguous())
        dist.all_gather(parts[1], dx.contiguous())
        y, dx = torch.cat(parts[0]), torch.cat(parts[1])
    return {"scales": [weight_scale(col.weight, fp8).item(), weight_scale(row.weight, fp8).item()],
            "amax": [col.weight.abs().max().item(), row.weight.abs().max().item()], "y": y, "dx": dx}


@needs_torchao
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tp2_ranks_scale_their_own_shards_and_match_bf16(sp):
    from distributed import run_distributed

    from megapar.tensor_parallel.layers import Init, full_normal
    results = run_distributed(_tp2_fp8_body, world_size=2, args=(sp,))
    for r in results:   # each rank's scale is e4m3's max over its own shard's amax
        assert r["scales"] == pytest.approx([448.0 / a for a in r["amax"]], rel=1e-5)
    assert all(a > 4 * b for a, b in zip(results[0]["scales"], results[1]["scales"]))
    # both ranks end with the same (all-reduced) output and input gradient, close to the unsharded fp32 layers'
    assert torch.equal(results[0]["y"], results[1]["y"]) and torch.equal(results[0]["dx"], results[1]["dx"])
    scale = torch.tensor([1.0] * 64 + [8.0] * 64)
    w_col = full_normal((128, 64), Init(1, "col")) * scale[:, None]
    w_row = full_normal((64, 128), Init(1, "row")) * scale[None, :]
    x = torch.randn(32, 2, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    y = torch.nn.functional.linear(torch.nn.functional.linear(x, w_col), w_row)
    y.square().sum().backward()
    assert _rel(results[0]["y"], y) < 0.1 and _rel(results[0]["dx"], x.grad) < 0.2


@needs_torchao
def test_fp8_model_trains_close_to_bf16_and_saves_bf16_weights():
    from megapar.model.gpt2 import GPT2Model, Stage
    cfgs = []
    for fmt in (None, "hybrid"):
        cfg = tiny_model_config(["--bf16", "--hidden-size", "64", "--hidden-dropout", "0",
                                 "--attention-dropout", "0"]).model
        cfg.fp8_format = fmt
        cfgs.append(cfg)
    models = [GPT2Model(c, Stage.of(c.num_layers, 1, 0), seed=3, dtype=torch.bfloat16) for c in cfgs]
    tokens, labels = batch(b=2, s=16)
    pos = torch.arange(16).expand(2, 16)
    losses = []
    for m in models:
        loss = m(tokens, pos, labels).float().mean()
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=0.01)
    ref, fp8 = (dict(m.named_parameters()) for m in models)
    for name, p in fp8.items():
        assert p.grad is not None and _rel(p.grad, ref[name].grad) < 0.25, name
    # the state dict is the bf16 model's: same keys, dtypes and tensors, nothing fp8 in it
    state = models[1].state_dict()
    assert state.keys() == models[0].state_dict().keys()
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    fresh = GPT2Model(cfgs[1], Stage.of(cfgs[1].num_layers, 1, 0), seed=4, dtype=torch.bfloat16)
    fresh.load_state_dict(loaded)
    for k, t in fresh.state_dict().items():
        assert t.dtype == state[k].dtype and torch.equal(t, state[k]), k


# ---- the training loop on CPU with emulated fp8 -------------------------------------------------------
def _emulated_fp8_train_body(rank, world_size, argv):
    """megapar.pretrain_gpt2 with --fp8-format on CPU: the GPU checks are skipped and the fp8
    layers emulate (torchao casts to fp8, multiplies in high precision)."""
    import megapar.config.checks
    from train_helpers import _pretrain_body
    megapar.config.checks._check_fp8 = lambda cfg, gpus: None
    return _pretrain_body(rank, world_size, argv)


def _train(argv, world_size):
    from distributed import run_distributed
    return run_distributed(_emulated_fp8_train_body, world_size, args=(list(argv),))[0]


@needs_torchao
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_emulated_fp8_training_follows_bf16_and_resumes_exactly(embedded_data, tmp_path, tp):
    """The whole loop (gradient buffer with the fp8 weights' unfused gradients, optimizer,
    checkpoint) with fp8 layers: losses close to bf16's; stopped at iteration 3, saved and resumed,
    iterations 4-6 repeat the uninterrupted fp8 run's (the checkpoint holds bf16 weights only)."""
    from train_helpers import TINY_TRAIN
    base = TINY_TRAIN + embedded_data + ["--bf16", "--train-iters", "6", "--tensor-parallel", str(tp)]
    fp8 = base + ["--fp8-format", "hybrid"]
    bf16, full = _train(base, tp), _train(fp8, tp)
    losses = {name: [l for _, l in r["losses"]] for name, r in (("bf16", bf16), ("fp8", full))}
    assert len(losses["fp8"]) == 6 and losses["fp8"] == pytest.approx(losses["bf16"], rel=0.02), losses
    assert losses["fp8"] != losses["bf16"]          # the fp8 casts ran
    ck = tmp_path / "ck"
    assert _train(fp8 + ["--exit-interval", "3", "--save", str(ck)], tp)["iteration"] == 3
    files = list(ck.rglob("model_optim_rng.pt"))
    assert files
    for f in files:
        state = torch.load(f, weights_only=False, map_location="cpu")
        tensors = [t for t in state["model"]["language_model"]["encoder"].values() if torch.is_tensor(t)]
        assert tensors and all(t.dtype == torch.bfloat16 for t in tensors)
    resumed = _train(fp8 + ["--load", str(ck)], tp)
    assert [l for _, l in resumed["losses"]] == pytest.approx(losses["fp8"][3:], rel=1e-5)


# ---- GPU: fp8 training runs (tests/gpu_runs.py) --------------------------------------------------------
BF16 = ("--bf16",)
FP8_RUNS = {"hybrid": ("--bf16", "--fp8-format", "hybrid"), "e4m3": ("--bf16", "--fp8-format", "e4m3"),
            "hybrid-compiled": ("--bf16", "--fp8-format", "hybrid", "--torch-compile")}


@pytest.mark.gpu
@needs_torchao
@pytest.mark.parametrize("name", [pytest.param(n, marks=uses(Run(BF16), Run(f)), id=n) for n, f in FP8_RUNS.items()])
def test_fp8_run_trains_close_to_bf16(gpu_runs, name):
    bf16, fp8 = gpu_runs.get(Run(BF16)), gpu_runs.get(Run(FP8_RUNS[name]))
    assert len(fp8["loss"]) == TRAIN_ITERS
    assert fp8["loss"][TRAIN_ITERS] < fp8["loss"][1]          # it learns
    assert_close(fp8["loss"], bf16["loss"], 0.02)               # 8 iterations of a 4-layer model


@pytest.mark.gpu
@needs_torchao
@pytest.mark.parametrize("layout", [pytest.param(f, marks=uses(Run(("--bf16", *f), gpus=2),
                                                                Run(("--bf16", "--fp8-format", "hybrid", *f), gpus=2)),
                                                 id=" ".join(f))
                                    for f in (("--tensor-parallel", "2"), ("--tensor-parallel", "2",
                                                                           "--sequence-parallel"))])
def test_fp8_tensor_parallel_run_trains_close_to_bf16(gpu_runs, layout):
    bf16 = gpu_runs.get(Run(("--bf16", *layout), gpus=2))           # skips with fewer than 2 GPUs
    fp8 = gpu_runs.get(Run(("--bf16", "--fp8-format", "hybrid", *layout), gpus=2))
    assert_close(fp8["loss"], bf16["loss"], 0.02)


SAVING = Run(FP8_RUNS["hybrid"], save=True)


@pytest.mark.gpu
@needs_torchao
@uses(SAVING, SAVING.resumed())
def test_fp8_checkpoint_resumes_the_run(gpu_runs):
    """The checkpoint holds bf16 weights (no fp8 state): a resume repeats the run's losses."""
    saved, resumed = gpu_runs.get(SAVING), gpu_runs.get(SAVING.resumed())
    ckpt = torch.load(f"{saved['save']}/iter_{SAVE_AT:07d}/mp_rank_00/model_optim_rng.pt", weights_only=False,
                      map_location="cpu")
    enc = ckpt["model"]["language_model"]["encoder"]
    assert all(t.dtype in (torch.bfloat16, torch.float32) for t in enc.values() if torch.is_tensor(t))
    assert_close(resumed["loss"], after(saved["loss"]), 1e-4)
