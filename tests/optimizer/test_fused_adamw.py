"""--adam-impl fused: the PyTorch reference of csrc's AdamW against torch.optim.AdamW (CPU), both
optimizers' fused route with the reference standing in for the kernel (CPU), the kernel against
the reference over aligned and unaligned views (GPU), and training with it against training with
torch's AdamW (GPU, also under a CUDA graph, with ZeRO-1 and a resume)."""
import pytest
import torch

from gpu_runs import Run, after, assert_close, uses
from megapar.kernels import fused_kernels_available
from megapar.kernels.adamw import MultiTensorAdamW, _check, adamw_reference
from megapar.optimizer.base import resolve_adam_impl

BETAS, EPS, WDS = (0.9, 0.95), 1e-8, (0.1, 0.0)


def _entries(device, sizes, param_dtype, offset=0):
    """(master, grad, exp_avg, exp_avg_sq, param) per size; views start `offset` elements into
    flat buffers, so offset 1 makes every pointer unaligned."""
    total = sum(sizes) + offset
    flats = [torch.zeros(total, device=device) for _ in range(4)]
    flats[0].normal_()
    flats[1].normal_()
    low = torch.zeros(total, device=device, dtype=param_dtype) if param_dtype is not None else None
    out, at = [], offset
    for n in sizes:
        views = [f[at:at + n] for f in flats]
        out.append((*views, None if low is None else low[at:at + n]))
        at += n
    return out


def _clone(entries):
    return [tuple(None if t is None else t.clone() for t in e) for e in entries]


def test_reference_matches_torch_adamw():
    torch.manual_seed(0)
    groups = [_entries("cpu", [5, 12], torch.bfloat16), _entries("cpu", [3], torch.bfloat16)]
    masters = [[e[0].clone().requires_grad_() for e in g] for g in groups]
    adam = torch.optim.AdamW([{"params": m, "weight_decay": wd} for m, wd in zip(masters, WDS)],
                             lr=1e-2, betas=BETAS, eps=EPS, foreach=False)
    step, scale = torch.zeros(()), torch.tensor(3.0)
    for it in range(4):
        for g, ms in zip(groups, masters):
            for e, m in zip(g, ms):
                e[1].normal_()
                m.grad = e[1] / scale
        adam.step()
        step += 1
        adamw_reference(list(zip(groups, WDS)), [1e-2, 1e-2], step, scale, *BETAS, EPS)
    for g, ms in zip(groups, masters):
        for e, m in zip(g, ms):
            torch.testing.assert_close(e[0], m.detach(), rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(e[2], adam.state[m]["exp_avg"], rtol=1e-6, atol=1e-7)
            assert torch.equal(e[4], e[0].to(torch.bfloat16))


def test_auto_picks_torch_without_a_gpu():
    assert resolve_adam_impl("auto", torch.device("cpu")) == "torch"
    assert resolve_adam_impl("fused", torch.device("cpu")) == "fused"  # an explicit choice stays (and fails loudly)


def test_table_entries_are_checked():
    good = _entries("cpu", [8], torch.bfloat16)[0]
    _check(good, torch.device("cpu"))
    with pytest.raises(ValueError, match="exp_avg must be a contiguous float32 tensor .* with 8 elements"):
        _check((good[0], good[1], good[2].double(), good[3], good[4]), torch.device("cpu"))
    with pytest.raises(ValueError, match="model parameter must be a contiguous bf16/fp16 tensor"):
        _check((*good[:4], good[4][:4]), torch.device("cpu"))


@pytest.mark.skipif(fused_kernels_available(), reason="checks the error on a machine without the kernels")
def test_fused_adamw_without_kernels_says_what_to_do():
    with pytest.raises(RuntimeError, match="--adam-impl torch"):
        MultiTensorAdamW([(_entries("cpu", [4], None), 0.0)], BETAS, EPS, torch.zeros(()))


# ---- GPU --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16, None])
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("lr_tensor", [False, True])
def test_kernel_matches_reference(param_dtype, offset, lr_tensor):
    torch.manual_seed(0)
    sizes = [[1024 * 1024 + 3, 7, 65536], [50000, 1]]  # chunk boundaries, tails, tiny tensors
    groups = [_entries("cuda", s, param_dtype, offset) for s in sizes]
    ref = [_clone(g) for g in groups]
    fused = MultiTensorAdamW(list(zip(groups, WDS)), BETAS, EPS, torch.zeros((), device="cuda"))
    ref_step = torch.zeros(())
    lrs = [torch.tensor(1e-3, device="cuda"), torch.tensor(2e-3, device="cuda")] if lr_tensor else [1e-3, 2e-3]
    for it in range(3):
        scale = torch.tensor(2.0 + it, device="cuda") if it != 1 else None
        wds = [wd * (it + 1) for wd in WDS]  # --weight-decay-incr-style: a new decay each step
        fused.step(lrs, scale, weight_decays=wds)
        ref_step += 1
        adamw_reference(list(zip(ref, wds)), lrs, ref_step, scale, *BETAS, EPS)
    assert fused.step_count.item() == 3
    for g, r in zip(groups, ref):
        for e, f in zip(g, r):
            torch.testing.assert_close(e[0], f[0], rtol=2e-5, atol=2e-6)   # masters
            torch.testing.assert_close(e[2], f[2], rtol=2e-5, atol=1e-7)   # exp_avg
            torch.testing.assert_close(e[3], f[3], rtol=2e-5, atol=1e-9)   # exp_avg_sq
            assert torch.equal(e[1], f[1])                                 # grads are not written
            if param_dtype is not None:
                assert torch.equal(e[4], e[0].to(param_dtype))


@pytest.mark.gpu
def test_kernel_skips_the_update_on_found_inf():
    """found_inf nonzero: nothing written and the step number kept; zero: the update of a run that never
    saw the flag (the flag is read on the device, as a captured fp16 step needs)."""
    torch.manual_seed(0)
    groups = [_entries("cuda", [70000, 5], torch.float16)]
    ref = [_clone(g) for g in groups]
    fused = MultiTensorAdamW(list(zip(groups, WDS)), BETAS, EPS, torch.zeros((), device="cuda"))
    plain = MultiTensorAdamW(list(zip(ref, WDS)), BETAS, EPS, torch.zeros((), device="cuda"))
    scale = torch.tensor(4.0, device="cuda")
    for found in (0.0, 1.0, 0.0):
        before = [t.clone() for e in groups[0] for t in e if t is not None]
        fused.step([1e-3], scale, torch.tensor(found, device="cuda"))
        if found:
            assert all(torch.equal(a, b) for a, b in zip(before, (t for e in groups[0] for t in e if t is not None)))
        else:
            plain.step([1e-3], scale)
    assert fused.step_count.item() == plain.step_count.item() == 2
    for e, f in zip(groups[0], ref[0]):
        assert all(torch.equal(a, b) for a, b in zip(e, f) if a is not None)


TRAINING = {"fp32": ([], 2e-5, 1), "bf16-graph-resume": (["--bf16", "--enable-cuda-graph"], 2e-3, 1),
            "bf16-zero1-dp2": (["--bf16", "--use-distributed-optimizer"], 2e-3, 2)}


def _training_runs(extra, gpus):
    """torch's AdamW, the fused one and, for the graphed case, the fused run resumed from its
    checkpoint at iteration 4. tests/gpu_runs.py shares them with test_cuda_graph.py where the
    flags agree (--adam-impl auto is the fused one on a machine with the kernels built)."""
    torch_run = Run((*extra, "--adam-impl", "torch"), gpus)
    graphed = "--enable-cuda-graph" in extra
    fused = Run((*extra, "--adam-impl", "fused"), gpus, save=graphed)
    return (torch_run, fused) + ((fused.resumed(),) if graphed else ())


@pytest.mark.gpu
@pytest.mark.parametrize("extra, rel, gpus", [pytest.param(extra, rel, gpus, marks=uses(*_training_runs(extra, gpus)),
                                                           id=name) for name, (extra, rel, gpus) in TRAINING.items()])
def test_training_matches_torch_adamw(gpu_runs, extra, rel, gpus):
    torch_run, fused, *resumed = (gpu_runs.get(r) for r in _training_runs(extra, gpus))  # skips without the GPUs
    assert "AdamW (csrc fused" in fused["out"] and "AdamW (torch" in torch_run["out"]
    assert_close(fused["loss"], torch_run["loss"], rel)
    assert_close(fused["norm"], torch_run["norm"], 10 * rel)
    if resumed:  # saved at 4 on the way to 8 and resumed from there: moments and step count come back
        # Two runs of one bf16 command already differ by up to 8e-6 (H100: the attention backward
        # sums dQ with atomics); a resume that lost the optimizer state (--no-load-optim, this
        # config, fp32 on CPU) is 3e-3 to 7e-3 off at iterations 6-8.
        assert_close(resumed[0]["loss"], after(fused["loss"]), 1e-4)


class _ReferenceKernel:
    """MultiTensorAdamW's interface computed by adamw_reference: lets the CPU tests drive the
    optimizers' --adam-impl fused plumbing (tables of masters, moments, grads and the params to
    write); the kernel itself is checked against the reference on GPUs below."""

    def __init__(self, groups, betas, eps, step):
        self.groups, self.betas, self.eps, self.step_count = groups, betas, eps, step

    def step(self, lrs, grad_scale=None, found_inf=None, weight_decays=None):
        if weight_decays is not None:
            self.groups = [(entries, wd) for (entries, _), wd in zip(self.groups, weight_decays)]
        if found_inf is not None and found_inf.item():
            return
        self.step_count.add_(1)
        adamw_reference(self.groups, lrs, self.step_count, grad_scale, *self.betas, self.eps)


@pytest.mark.parametrize("zero1", [False, True], ids=["full", "zero1"])
def test_optimizers_route_fused_updates(monkeypatch, zero1):
    """Both optimizers with --adam-impl fused (reference kernel) against --adam-impl torch, bf16
    model on CPU: the same masters, and the fused path writes the bf16 params itself (ZeRO-1: the
    owned ranges of its param buffer, published without the master copy)."""
    from gpt_helpers import tiny_model_config
    from megapar.config.settings import TrainConfig
    from megapar.model import GPT2Model, Stage
    from megapar.optimizer.distrib_optimizer import DistributedOptimizer
    from megapar.optimizer.grad_buffer import GradBuffer
    from megapar.optimizer.grad_scaler import ConstantGradScaler
    from megapar.optimizer.optimizer import MixedPrecisionOptimizer
    monkeypatch.setattr("megapar.kernels.adamw.MultiTensorAdamW", _ReferenceKernel)

    def build(impl):
        cfg = tiny_model_config(["--hidden-dropout", "0", "--attention-dropout", "0"])
        model = GPT2Model(cfg.model, Stage.of(4, 1, 0), seed=3, dtype=torch.bfloat16)
        buf = GradBuffer(model.parameters(), None, mode="reduce_scatter" if zero1 else "all_reduce")
        train = TrainConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5, adam_impl=impl)
        opt = (DistributedOptimizer(model, buf, train, ConstantGradScaler(), tp_rank=0, dp_group=None)
               if zero1 else MixedPrecisionOptimizer(model, buf, train, ConstantGradScaler(), 0, None))
        return model, buf, opt

    runs = [build("torch"), build("fused")]
    for it in range(3):
        grads = torch.randn(runs[0][1].data.numel(), generator=torch.Generator().manual_seed(it))
        for model, buf, opt in runs:
            buf.data.copy_(grads)
            opt.param_groups[0]["weight_decay"] = 0.1 * (it + 1)  # as --weight-decay-incr-style moves it
            applied, _ = opt.step()
            assert applied
    (m_torch, _, o_torch), (m_fused, _, o_fused) = runs
    assert o_fused.fused_adam is not None and o_torch.fused_adam is None
    for (name, p_t), p_f in zip(m_torch.named_parameters(), m_fused.parameters()):
        torch.testing.assert_close(p_f.float(), p_t.float(), rtol=1e-2, atol=1e-5, msg=name)
    for a, b in zip(o_fused.masters, o_torch.masters):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for p, m in zip(o_fused.params, o_fused.masters):  # the fused path wrote the bf16 params from its masters
        assert p is not None and torch.equal(p.reshape(-1), m.reshape(-1).to(torch.bfloat16))
