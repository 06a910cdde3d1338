"""megapar.kernels.fused_mlp: the references against autograd of the plain PyTorch MLP (CPU, float64),
the custom ops' schemas and fake implementations (opcheck, torch.compile), and on a GPU the cuBLASLt
epilogue GEMMs against the references in bf16 and fp16, plus their input checks."""
import pytest
import torch
import torch.nn.functional as F

from megapar.kernels import fused_kernels_available, load_fused_kernels
from megapar.kernels.fused_mlp import (linear_dgelu_backward, linear_dgelu_backward_reference, linear_gelu_forward,
                                       linear_gelu_forward_reference)


def _mlp_inputs(t, d_in, f, d_out, dtype=torch.float64, device="cpu", seed=0):
    """x [t, d_in], w1 [f, d_in], b1 [f], w2 [d_out, f], grad [t, d_out], scaled so pre and grad_h are O(1)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d_in, generator=gen, dtype=torch.float64)
    w1 = torch.randn(f, d_in, generator=gen, dtype=torch.float64) / d_in ** 0.5
    b1 = torch.randn(f, generator=gen, dtype=torch.float64) * 0.5
    w2 = torch.randn(d_out, f, generator=gen, dtype=torch.float64) / d_out ** 0.5
    grad = torch.randn(t, d_out, generator=gen, dtype=torch.float64)
    return [a.to(device, dtype) for a in (x, w1, b1, w2, grad)]


def test_forward_reference_matches_plain_pytorch():
    x, w1, b1, _, _ = _mlp_inputs(7, 12, 16, 5)
    h, pre = linear_gelu_forward_reference(x, w1, b1)
    want_pre = F.linear(x, w1, b1)
    torch.testing.assert_close(pre, want_pre, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, F.gelu(want_pre, approximate="tanh"), rtol=1e-12, atol=1e-12)
    assert h.dtype == pre.dtype == torch.float64


def test_backward_reference_matches_autograd():
    x, w1, b1, w2, grad = _mlp_inputs(9, 12, 24, 10)
    b1.requires_grad_()
    pre = F.linear(x, w1, b1)
    pre.retain_grad()
    y = F.linear(F.gelu(pre, approximate="tanh"), w2)              # the MLP without its second bias
    y.backward(grad)
    grad_pre, bias_grad = linear_dgelu_backward_reference(grad, w2, pre.detach())
    torch.testing.assert_close(grad_pre, pre.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bias_grad, b1.grad, rtol=1e-12, atol=1e-12)
    # the same through the GELU alone: grad_h = grad @ w2
    p = pre.detach().requires_grad_()
    (g,) = torch.autograd.grad(F.gelu(p, approximate="tanh"), p, grad @ w2)
    torch.testing.assert_close(grad_pre, g, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bias_grad, g.sum(0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_dtypes_and_rounding(dtype):
    x, w1, b1, w2, grad = _mlp_inputs(33, 16, 24, 8, dtype=dtype)
    h, pre = linear_gelu_forward(x, w1, b1)                           # CPU: the reference
    grad_pre, bias_grad = linear_dgelu_backward(grad, w2, pre)
    assert h.dtype == pre.dtype == grad_pre.dtype == dtype and bias_grad.dtype == torch.float32
    assert h.shape == pre.shape == grad_pre.shape == (33, 24) and bias_grad.shape == (24,)
    if dtype != torch.float32:  # the bias gradient passes through the input dtype, as cuBLASLt stores it
        torch.testing.assert_close(bias_grad, bias_grad.to(dtype).float(), rtol=0, atol=0)
    ref_h, ref_pre = linear_gelu_forward_reference(*(t.double() for t in (x, w1, b1)))
    ref_gp, ref_bg = linear_dgelu_backward_reference(grad.double(), w2.double(), pre.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in ((h, ref_h), (pre, ref_pre), (grad_pre, ref_gp), (bias_grad, ref_bg)):
        assert (got.double() - want).norm() / want.norm() < tol


def test_custom_ops_schema_fake_and_compile():
    x, w1, b1, w2, grad = _mlp_inputs(6, 8, 16, 8, dtype=torch.float32)
    h, pre = torch.ops.megapar.linear_gelu_forward(x, w1, b1)
    grad_pre, bias_grad = torch.ops.megapar.linear_dgelu_backward(grad, w2, pre)
    torch.library.opcheck(torch.ops.megapar.linear_gelu_forward.default, (x, w1, b1))
    torch.library.opcheck(torch.ops.megapar.linear_dgelu_backward.default, (grad, w2, pre))

    def step(x, w1, b1, w2, grad):
        h, pre = linear_gelu_forward(x, w1, b1)
        return (h,) + linear_dgelu_backward(grad, w2, pre)

    got = torch.compile(step, backend="aot_eager", fullgraph=True)(x, w1, b1, w2, grad)
    for a, b in zip(got, (h, grad_pre, bias_grad)):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="2-D"):
        linear_gelu_forward(x[None], w1, b1)


# ---------------------------------------------------------------------------------------- GPU
# Fused (cuBLASLt epilogue, fp32 accumulation) against the reference run in float64 on the same
# rounded inputs and rounded as the fused outputs are: the differences are summation order, the
# epilogue's GELU arithmetic and an occasional last-bit difference of the output rounding.
TOL = {torch.bfloat16: (1.5e-2, 3e-2), torch.float16: (3e-3, 8e-3)}  # (norm-relative, max-relative)


def _close(got, want, dtype, what):
    rel_tol, max_tol = TOL[dtype]
    err = got.double() - want.double()
    rel = (err.norm() / want.double().norm()).item()
    worst = (err.abs().max() / want.double().abs().max()).item()
    assert rel < rel_tol and worst < max_tol, f"{what} ({dtype}): norm-relative error {rel:.2e} (limit {rel_tol}), " \
                                              f"max error / max |ref| {worst:.2e} (limit {max_tol})"


def _ext():
    if not fused_kernels_available():
        pytest.skip("fused CUDA kernels unavailable")
    return load_fused_kernels()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,d_in,f", [(8192, 1024, 4096), (1000, 768, 3072), (77, 100, 200), (3, 8, 8),
                                      (513, 1029, 1000)])
def test_fused_matches_reference(dtype, t, d_in, f):
    # forward x [t, d_in] -> [t, f]; backward through a second linear [d_in, f] (o2 = d_in, as in the MLP)
    ext = _ext()
    x, w1, b1, w2, grad = _mlp_inputs(t, d_in, f, d_in, dtype=dtype, device="cuda")
    h, pre = ext.linear_gelu_forward(x, w1, b1)
    assert h.dtype == pre.dtype == dtype and h.shape == pre.shape == (t, f)
    ref_h, ref_pre = linear_gelu_forward_reference(x.double(), w1.double(), b1.double())
    _close(pre, ref_pre.to(dtype), dtype, "pre")
    _close(h, ref_h.to(dtype), dtype, "h")
    grad_pre, bias_grad = ext.linear_dgelu_backward(grad, w2, pre)
    assert grad_pre.dtype == dtype and grad_pre.shape == (t, f)
    assert bias_grad.dtype == torch.float32 and bias_grad.shape == (f,)
    ref_gp, ref_bg = linear_dgelu_backward_reference(grad.double(), w2.double(), pre.double())
    _close(grad_pre, ref_gp.to(dtype), dtype, "grad_pre")
    _close(bias_grad, ref_bg.to(dtype).float(), dtype, "bias_grad")  # cuBLASLt stores it in dtype first


@pytest.mark.gpu
def test_fused_custom_ops_and_empty_batch():
    _ext()
    x, w1, b1, w2, grad = _mlp_inputs(64, 32, 128, 32, dtype=torch.bfloat16, device="cuda")
    h, pre = linear_gelu_forward(x, w1, b1)                            # CUDA bf16: the fused op
    _close(h, linear_gelu_forward_reference(x, w1, b1)[0], torch.bfloat16, "custom op h")

    def backward(grad, w2, pre):
        return linear_dgelu_backward(grad, w2, pre)

    grad_pre, bias_grad = torch.compile(backward, fullgraph=True)(grad, w2, pre)
    ref_gp, ref_bg = linear_dgelu_backward_reference(grad, w2, pre)
    _close(grad_pre, ref_gp, torch.bfloat16, "compiled grad_pre")
    _close(bias_grad, ref_bg, torch.bfloat16, "compiled bias_grad")
    h0, pre0 = linear_gelu_forward(x[:0], w1, b1)
    gp0, bg0 = linear_dgelu_backward(grad[:0], w2, pre[:0])
    assert h0.shape == pre0.shape == gp0.shape == (0, 128)
    assert bg0.dtype == torch.float32 and torch.equal(bg0, torch.zeros(128, device="cuda"))


@pytest.mark.gpu
def test_fused_rejects_bad_inputs():
    ext = _ext()
    x, w1, b1, w2, grad = _mlp_inputs(16, 64, 128, 64, dtype=torch.bfloat16, device="cuda")
    _, pre = ext.linear_gelu_forward(x, w1, b1)

    def misaligned(t):  # same values and shape, contiguous, data 2 bytes past a 16-byte boundary
        buf = torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)
        out = buf[1:1 + t.numel()].view(t.shape)
        out.copy_(t)
        return out

    fwd, bwd = ext.linear_gelu_forward, ext.linear_dgelu_backward
    cases = [
        (lambda: fwd(x.float(), w1.float(), b1.float()), "x \\[T, in\\] must be bfloat16 or float16"),
        (lambda: fwd(x, w1.half(), b1), "weight \\[out, in\\] has dtype Half but the first input has BFloat16"),
        (lambda: fwd(x.cpu(), w1, b1), "x \\[T, in\\] must be a CUDA tensor"),
        (lambda: fwd(x.t().contiguous().t(), w1, b1), "x \\[T, in\\] must be contiguous"),
        (lambda: fwd(misaligned(x), w1, b1), "x \\[T, in\\] must be 16-byte aligned"),
        (lambda: fwd(x, misaligned(w1), b1), "weight \\[out, in\\] must be 16-byte aligned"),
        (lambda: fwd(x, w1[:100].contiguous(), b1[:100].contiguous()), "out = 100 must be a multiple of 8"),
        (lambda: fwd(x, w1, b1[:64].contiguous()), "shapes do not match"),
        (lambda: fwd(x[None], w1, b1), "x \\[T, in\\] must be 2-D"),
        (lambda: bwd(grad, w2, misaligned(pre)), "pre \\[T, f\\] must be 16-byte aligned"),
        (lambda: bwd(grad, w2, pre[:8].contiguous()), "shapes do not match"),
        (lambda: bwd(grad.half(), w2, pre), "weight2 \\[o2, f\\] has dtype BFloat16 but the first input has Half"),
        (lambda: bwd(grad, w2[:, :100].contiguous(), pre[:, :100].contiguous()), "f = 100 must be a multiple of 8"),
        (lambda: bwd(grad, w2.t(), pre), "weight2 \\[o2, f\\] must be contiguous|shapes do not match"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match="megapar_kernels.linear_(gelu_forward|dgelu_backward): .*" + message):
            call()
    with pytest.raises(RuntimeError, match="16-byte aligned"):  # through the custom op too
        linear_gelu_forward(misaligned(x), w1, b1)
