"""Gradient-accumulation fusion: weight-grad GEMMs accumulate into the GradBuffer's fp32 main_grad."""
import contextlib
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distributed import run_distributed
from megapar.optimizer.grad_buffer import GradBuffer
from megapar.tensor_parallel.layers import ColumnParallelLinear, Init, RowParallelLinear, full_normal
from megapar.tensor_parallel.linear import add_bias
from train_helpers import TINY_TRAIN, run_training


def _microbatches(dtype, device, n=3):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(5, 2, 16, generator=gen).to(device=device, dtype=dtype) for _ in range(n)]


def _fused_vs_reference(dtype, device):
    """main_grad after 3 fused microbatches vs the same layers' fp64 gradients summed."""
    fused = dict(fused_grad_accumulation=True, device=device, dtype=dtype)
    layers = nn.Sequential(ColumnParallelLinear(16, 24, Init(1, "a"), **fused),
                           RowParallelLinear(24, 16, Init(1, "b"), **fused))
    ref = nn.Sequential(nn.Linear(16, 24), nn.Linear(24, 16)).double().to(device)
    with torch.no_grad():
        for r, l in zip(ref, layers):
            r.weight.copy_(l.weight)
            r.bias.copy_(l.bias)
    buf = GradBuffer(layers.parameters(), None)
    buf.start_step()
    for x in _microbatches(dtype, device):
        hidden = layers[0](x)
        assert type(hidden.grad_fn).__name__ == "_LinearAccumulateGradBackward"   # the fused path ran
        layers[1](hidden).square().sum().backward()
        ref(x.double()).square().sum().backward()
    for r, l in zip(ref, layers):
        assert l.weight.grad is None and l.bias.grad is None  # backward handed autograd none
        for mine, want in ((l.weight.main_grad, r.weight.grad), (l.bias.main_grad, r.bias.grad)):
            assert mine.dtype == torch.float32
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(mine.double(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_wgrad_accumulates_into_main_grad_cpu(dtype):
    _fused_vs_reference(dtype, "cpu")


def test_row_parallel_bias_joins_the_gemm_node_at_tp_1():
    """At tp 1 nothing is reduced between a row-parallel GEMM and its bias, so the bias is added in
    the GEMM's autograd node (one Python backward fewer), to the GEMM's output as a separate add
    would: the output is bit for bit F.linear(x, W) + b, and the gradients are the reference's."""
    row = RowParallelLinear(24, 16, Init(1, "b"), fused_grad_accumulation=True)
    with torch.no_grad():
        row.bias.normal_()
    buf = GradBuffer(row.parameters(), None)
    buf.start_step()
    x = torch.randn(5, 2, 24, requires_grad=True)
    y = row(x)
    assert type(y.grad_fn).__name__ == "_LinearAccumulateGradBackward"        # one node, bias included
    w, b, x_ref = (t.detach().clone().requires_grad_() for t in (row.weight, row.bias, x))
    want = F.linear(x_ref, w) + b
    assert torch.equal(y, want)
    g = torch.randn_like(y)
    y.backward(g)
    want.backward(g)
    assert row.weight.grad is None and row.bias.grad is None                    # backward handed autograd none
    torch.testing.assert_close((x.grad, row.weight.main_grad, row.bias.main_grad), (x_ref.grad, w.grad, b.grad),
                               rtol=1e-6, atol=1e-6)


def _grads_seen_by_hooks(params) -> list:
    """A post-accumulate-grad hook on each parameter that records what p.grad held when it ran."""
    seen = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: seen.append((p, p.grad)))
    return seen


def _fused_trio() -> tuple[nn.Module, nn.Module, nn.Parameter]:
    """A column-parallel GEMM, a row-parallel one (its bias in the GEMM's node at tp 1) and a bias
    added by a node of its own (`add_bias`, as at tp > 1): every fused backward."""
    fused = dict(fused_grad_accumulation=True)
    col, row = ColumnParallelLinear(16, 24, Init(1, "a"), **fused), RowParallelLinear(24, 16, Init(1, "b"), **fused)
    extra_bias = nn.Parameter(torch.randn(16, generator=torch.Generator().manual_seed(2)))
    extra_bias.fused_grad_accumulation = True
    return col, row, extra_bias


def _trio_forward(trio, x: torch.Tensor) -> torch.Tensor:
    col, row, extra_bias = trio
    y = add_bias(row(col(x)), extra_bias)
    assert type(y.grad_fn).__name__ == "_BiasAddAccumulateGradBackward"
    return y


def _trio_params(trio) -> list[nn.Parameter]:
    return [*trio[0].parameters(), *trio[1].parameters(), trio[2]]


def test_fused_parameters_get_no_gradient_but_their_hooks_run():
    """The fused backward hands autograd no gradient for the parameters it accumulated into
    main_grad, so none is allocated, stored and freed; autograd still runs each one's
    post-accumulate-grad hook once per backward (what the overlapped bucket reductions count on)."""
    trio = _fused_trio()
    params = _trio_params(trio)
    GradBuffer(params, None).start_step()
    seen = _grads_seen_by_hooks(params)
    for x in _microbatches(torch.float32, "cpu", n=2):
        _trio_forward(trio, x).square().sum().backward()
    assert sorted(id(p) for p, _ in seen) == sorted(2 * [id(p) for p in params])
    assert all(grad is None for _, grad in seen)
    assert all(p.main_grad.abs().sum() > 0 for p in params)


def test_grad_buffer_hooks_no_fused_parameter_without_overlap(monkeypatch):
    """Without an overlapped reduction (and on one data-parallel rank even when asked for one) the
    GradBuffer has nothing to do when a fused parameter's gradient arrives: it hooks only the
    others (each hook is a Python call per parameter and microbatch)."""
    from megapar.optimizer.grad_buffer import Bucket
    calls = []
    accumulate = Bucket.accumulate
    monkeypatch.setattr(Bucket, "accumulate",
                        lambda self, p, add_grad: calls.append(p) or accumulate(self, p, add_grad))
    trio, plain = _fused_trio(), nn.Parameter(torch.ones(16))
    buf = GradBuffer([*_trio_params(trio), plain], None, overlap=True)
    buf.start_step()
    (_trio_forward(trio, _microbatches(torch.float32, "cpu", n=1)[0]) * plain).sum().backward()
    assert not buf.overlap and calls == [plain]
    buf.finish()
    assert plain.main_grad.abs().sum() > 0


def _overlap_body(rank: int, world_size: int) -> dict:
    """dp 2, one bucket per parameter: with overlap every bucket's all-reduce is launched by the
    fused parameters' hooks during backward; without it, in finish(). The sums agree."""
    out = {}
    for overlap in (True, False):
        trio = _fused_trio()
        params = _trio_params(trio)
        buf = GradBuffer(params, dist.group.WORLD, bucket_numel=1, overlap=overlap)
        buf.start_step()
        x = _microbatches(torch.float32, "cpu", n=world_size)[rank]
        _trio_forward(trio, x).square().sum().backward()
        launched = [b.handle is not None for b in buf.buckets]
        buf.finish()
        out[overlap] = launched, [p.main_grad.clone() for p in params]
    return out


def test_eager_fused_gemm_skips_the_python_layer_of_function_apply(monkeypatch):
    """Eager, the fused Functions are applied through the C++ apply beneath
    torch.autograd.Function.apply (its Python layer is host time per GEMM that training does not need)."""
    calls = []
    apply = torch.autograd.Function.apply.__func__
    monkeypatch.setattr(torch.autograd.Function, "apply",
                        classmethod(lambda cls, *args: calls.append(cls) or apply(cls, *args)))
    layer = ColumnParallelLinear(16, 24, Init(1, "a"), fused_grad_accumulation=True)
    GradBuffer(layer.parameters(), None).start_step()
    y = layer(torch.randn(5, 16))
    assert type(y.grad_fn).__name__ == "_LinearAccumulateGradBackward" and calls == []
    y.sum().backward()
    assert layer.weight.main_grad.abs().sum() > 0


def test_unfused_layers_without_buffer_keep_plain_grads():
    layer = ColumnParallelLinear(16, 24, Init(1, "a"), fused_grad_accumulation=True)   # no GradBuffer -> no main_grad
    layer(torch.randn(3, 16)).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


@pytest.mark.slow  # --quick skips it (two training runs); the layer-level checks above stay
def test_training_with_and_without_fusion_match(embedded_data):
    base = TINY_TRAIN + embedded_data + ["--train-iters", "6"]
    fused = [l for _, l in run_training(base)["losses"]]
    plain = [l for _, l in run_training(base + ["--no-gradient-accumulation-fusion"])["losses"]]
    assert fused == pytest.approx(plain, rel=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_wgrad_accumulates_into_main_grad_cuda(dtype):
    _fused_vs_reference(dtype, "cuda")


def _compiled_vs_eager(device: str, dtype: torch.dtype, tol: float) -> None:
    """main_grad (weight and bias) after microbatches through torch.compile equals eager's: the
    accumulations run as custom ops while compiling, as plain calls in eager mode. The compiled
    backward, too, hands autograd no gradient for them and their hooks still run."""
    layer = ColumnParallelLinear(16, 24, Init(1, "a"), fused_grad_accumulation=True, device=device, dtype=dtype)
    buf = GradBuffer(layer.parameters(), None)
    buf.start_step()
    seen = _grads_seen_by_hooks(layer.parameters())
    compiled = torch.compile(layer)
    xs = _microbatches(dtype, device)
    for x in xs:
        compiled(x).float().square().sum().backward()
    got = layer.weight.main_grad.clone(), layer.bias.main_grad.clone()
    assert got[0].abs().sum() > 0
    assert len(seen) == 2 * len(xs) and all(grad is None for _, grad in seen)
    buf.start_step()
    for x in xs:
        layer(x).float().square().sum().backward()
    torch.testing.assert_close(got, (layer.weight.main_grad, layer.bias.main_grad), rtol=tol, atol=tol)


@pytest.mark.slow  # inductor's first compile on the CPU: ~15 s
def test_fused_wgrad_under_torch_compile_cpu():
    _compiled_vs_eager("cpu", torch.float32, 1e-6)


def test_a_layer_at_tp_1_compiles_as_one_graph():
    """--torch-compile at tp 1: the tensor-parallel mappings are identities inside the graph, not
    graph breaks (each compiled piece would pay its own guards and launches, and lose fusions)."""
    from gpt_helpers import tiny_model_config
    from megapar.model import GPT2Model, Stage
    cfg = tiny_model_config(["--hidden-dropout", "0", "--attention-dropout", "0"])
    layer = GPT2Model(cfg.model, Stage.of(4, 1, 0), seed=1).language_model.encoder.layers[0]
    x = torch.randn(16, 3, cfg.model.hidden_size, requires_grad=True)
    explained = torch._dynamo.explain(layer)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.gpu
def test_fused_wgrad_under_torch_compile_cuda():
    _compiled_vs_eager("cuda", torch.bfloat16, 1e-2)


@pytest.mark.gpu
def test_bias_grad_gemv_inside_cuda_graph():
    """The bias-gradient GEMV (used by CUDA-graphed runs) accumulates in fp32, eagerly and captured."""
    from megapar.tensor_parallel.linear import accumulate_bgrad_
    g = torch.randn(64, 48, device="cuda").to(torch.bfloat16)
    want = g.double().sum(0)
    main_grad = torch.zeros(48, device="cuda")
    accumulate_bgrad_(main_grad, g, True)                        # eager warm-up, as GraphedStep does
    torch.testing.assert_close(main_grad.double(), want, rtol=1e-5, atol=1e-4)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        accumulate_bgrad_(main_grad, g, True)
    main_grad.zero_()
    graph.replay()
    graph.replay()
    torch.testing.assert_close(main_grad.double(), 2 * want, rtol=1e-5, atol=1e-4)


def _tp_fused_body(rank, tp):
    """Fused column -> row layers at tp (x's gradient all-reduced asynchronously behind the weight
    gradient) against the serial fp64 twin: output, input gradient, this rank's main_grad slices."""
    group = dist.group.WORLD
    layers = nn.Sequential(ColumnParallelLinear(16, 24, Init(1, "a"), group, fused_grad_accumulation=True),
                           RowParallelLinear(24, 16, Init(1, "b"), group, fused_grad_accumulation=True))
    buf = GradBuffer(layers.parameters(), None)
    buf.start_step()
    w1, w2 = full_normal((24, 16), Init(1, "a")).double(), full_normal((16, 24), Init(1, "b")).double()
    errors = []
    for x in _microbatches(torch.float32, "cpu"):
        x = x.requires_grad_()
        hidden = layers[0](x)
        assert type(hidden.grad_fn).__name__ == "_LinearAccumulateGradBackward"
        y = layers[1](hidden)
        y.square().sum().backward()
        x_ref = x.detach().double().requires_grad_()
        w1.requires_grad_(), w2.requires_grad_()
        y_ref = F.linear(F.linear(x_ref, w1), w2)
        y_ref.square().sum().backward()
        errors += [(y - y_ref).abs().max().item(), (x.grad - x_ref.grad).abs().max().item()]
    errors.append((layers[0].weight.main_grad - w1.grad.chunk(tp)[rank]).abs().max().item())
    errors.append((layers[1].weight.main_grad - w2.grad.chunk(tp, dim=1)[rank]).abs().max().item())
    return errors


def _two_rank_body(rank, world_size):
    return _tp_fused_body(rank, world_size), _overlap_body(rank, world_size)


def test_tp2_fused_layers_match_serial_twin_and_dp2_overlaps():
    """Both bodies in one pair of processes (spawning them is most of the time)."""
    for errors, overlapped in run_distributed(_two_rank_body, world_size=2):
        assert max(errors) < 1e-4, errors
        assert all(overlapped[True][0]) and not any(overlapped[False][0])
        for a, b in zip(overlapped[True][1], overlapped[False][1]):
            assert torch.equal(a, b) and a.abs().sum() > 0


def _layer_main_grads(flags):
    """A transformer layer's main_grads after two microbatches through a GradBuffer (the first
    under no_sync), with gradient-accumulation fusion; the layer is not compiled."""
    from gpt_helpers import tiny_model_config
    from megapar.model.transformer import TransformerLayer
    cfg = tiny_model_config(["--hidden-dropout", "0", "--attention-dropout", "0"] + flags)
    layer = TransformerLayer(cfg.model, 0, seed=3, tp_group=None, device="cpu", dtype=torch.float32)
    buf = GradBuffer(layer.parameters(), None)
    buf.start_step()
    g = torch.Generator().manual_seed(0)
    for last in (False, True):
        x = torch.randn(16, 3, 32, generator=g)                                       # [s, b, h]
        with buf.no_sync() if not last else contextlib.nullcontext():
            layer(x).square().sum().backward()
    buf.finish()
    return {n: p.main_grad.clone() for n, p in layer.named_parameters()}


def test_queued_vector_grads_match_fused_accumulation():
    """Without fusion every gradient reaches main_grad through the GradBuffer's hooks (vectors
    queued, added in one batch per bucket, flushed early when a second microbatch repeats a
    parameter); with it backward accumulates weights and biases itself. Both give the same main_grads."""
    fused, hooked = _layer_main_grads([]), _layer_main_grads(["--no-gradient-accumulation-fusion"])
    assert hooked.keys() == fused.keys()
    for name, want in fused.items():
        assert want.abs().sum() > 0, name
        torch.testing.assert_close(hooked[name], want, rtol=1e-5, atol=1e-5, msg=name)


def test_a_torch_that_skips_the_hooks_of_parameters_without_a_gradient_is_refused(monkeypatch):
    """The overlapped and ZeRO-2/3 reductions count fused parameters through hooks that autograd must
    run although backward gives them no gradient: a torch that skips them is refused in one line,
    never left to lose those gradients."""
    from megapar.tensor_parallel import linear as lin
    from megapar.topology import ConfigError
    assert lin._hooks_run_without_gradient()                      # this torch runs them
    monkeypatch.setattr(lin, "_hooks_run_without_gradient", lambda: False)
    from megapar.optimizer.sharded_grads import ShardedGradBuffer
    layer = ColumnParallelLinear(16, 24, Init(1, "a"), fused_grad_accumulation=True)
    with pytest.raises(ConfigError, match="--no-gradient-accumulation-fusion"):
        ShardedGradBuffer([layer], [], None)                     # ZeRO-2/3: each layer's hooks count it
    GradBuffer(layer.parameters(), None)                          # one rank, no overlap: no hook counts them
