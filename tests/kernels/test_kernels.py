"""CPU tests of megapar.kernels: the PyTorch references against naive math (forward, backward,
gradcheck in float64), the no-silent-fallback rule, and an nvcc compile of every .cu file."""
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from megapar.kernels import fused_kernels_available, load_fused_kernels
from megapar.kernels.layernorm import LayerNorm, fused_add_layer_norm, layer_norm
from megapar.kernels.softmax import scaled_masked_softmax

CSRC = Path(__file__).resolve().parents[2] / "csrc"


def naive_softmax(x, scale, mask, causal):
    # row by row with Python lists of visible positions: independent of the reference's masked_fill
    b, n, sq, sk = x.shape
    out = torch.zeros_like(x, dtype=torch.float64)
    for i in range(b):
        for j in range(n):
            for r in range(sq):
                vis = [c for c in range(sk) if not (causal and c > r + sk - sq)
                       and not (mask is not None and bool(mask[i if mask.size(0) > 1 else 0, 0, r, c]))]
                if not vis:
                    continue
                v = torch.tensor([float(x[i, j, r, c]) * scale for c in vis], dtype=torch.float64)
                e = torch.exp(v - v.max())
                out[i, j, r, vis] = e / e.sum()
    return out


@pytest.mark.parametrize("causal,with_mask", [(True, False), (False, True), (True, True), (False, False)])
def test_softmax_reference_matches_naive(causal, with_mask):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 7 if not causal else 5, dtype=torch.float64)
    mask = (torch.rand(2, 1, 5, x.size(-1)) < 0.3) if with_mask else None
    if mask is not None:
        mask[1, 0, 2, :] = True  # a fully masked row gives zeros
    got = scaled_masked_softmax(x, 0.7, mask, causal, impl="torch")
    torch.testing.assert_close(got, naive_softmax(x, 0.7, mask, causal), rtol=1e-12, atol=1e-12)


def test_softmax_reference_backward_and_dtype():
    torch.manual_seed(1)
    mask = torch.rand(1, 1, 6, 6) < 0.3
    mask[0, 0, 3, :] = True
    x = torch.randn(2, 2, 6, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: scaled_masked_softmax(t, 0.5, mask, True), (x,))
    # analytic gradient: scale * y * (dy - sum(dy * y))
    y = scaled_masked_softmax(x, 0.5, mask, True)
    dy = torch.randn_like(y)
    (g,) = torch.autograd.grad(y, x, dy)
    torch.testing.assert_close(g, 0.5 * y * (dy - (dy * y).sum(-1, keepdim=True)))
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        out = scaled_masked_softmax(x.detach().to(dt), 0.5, mask, True)
        assert out.dtype == dt and torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), y.detach(), rtol=2e-2, atol=1e-2)


def test_layernorm_reference_matches_naive_and_gradcheck():
    torch.manual_seed(2)
    x = torch.randn(3, 4, 10, dtype=torch.float64, requires_grad=True)
    w = torch.randn(10, dtype=torch.float64, requires_grad=True)
    b = torch.randn(10, dtype=torch.float64, requires_grad=True)
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    naive = (x - mean) / torch.sqrt(var + 1e-5) * w + b
    torch.testing.assert_close(layer_norm(x, w, b, 1e-5), naive)
    assert torch.autograd.gradcheck(lambda a, c, d: layer_norm(a, c, d, 1e-5), (x, w, b))
    r = torch.randn(3, 4, 10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, rr, c, d: fused_add_layer_norm(a, rr, c, d, 1e-5), (x, r, w, b))
    y, s = fused_add_layer_norm(x, r, w, b, 1e-5)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(y, layer_norm(x + r, w, b, 1e-5))


def test_layernorm_module_half_inputs_use_fp32_math():
    ln = LayerNorm(64)
    assert [n for n, _ in ln.named_parameters()] == ["weight", "bias"]
    x = torch.randn(8, 64) * 100 + 1000  # large mean: fp32 math needed
    for dt in (torch.bfloat16, torch.float16):
        y = ln(x.to(dt))
        assert y.dtype == dt
        ref = torch.nn.functional.layer_norm(x.to(dt).float(), (64,))
        torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ln(x), torch.nn.functional.layer_norm(x, (64,)), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_fused_request_without_cuda_is_an_error():
    assert not fused_kernels_available()
    with pytest.raises(RuntimeError, match="fused"):
        load_fused_kernels()
    with pytest.raises(RuntimeError, match="fused"):
        LayerNorm(16, impl="fused")
    x = torch.randn(1, 1, 4, 4)
    with pytest.raises(RuntimeError, match="fused"):
        scaled_masked_softmax(x, 1.0, None, True, impl="fused")
    with pytest.raises(RuntimeError, match="fused"):
        layer_norm(torch.randn(2, 8), torch.ones(8), torch.zeros(8), 1e-5, impl="fused")
    with pytest.raises(ValueError, match="unknown"):
        layer_norm(torch.randn(2, 8), torch.ones(8), torch.zeros(8), 1e-5, impl="apex")


def _nvcc():
    return shutil.which("nvcc")


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not on PATH: the .cu syntax check needs it")
@pytest.mark.parametrize("source", [pytest.param(p.name, marks=() if p.name == "adamw.cu" else pytest.mark.slow)
                                    for p in sorted(CSRC.glob("*.cu"))])  # --quick compiles the quickest one
def test_cuda_sources_compile(source, tmp_path):
    # One arch, PTX only (-arch=compute_90 skips ptxas): checks syntax and every template
    # instantiation in a few seconds. The .cu files include no torch headers by design, but
    # torch's include dirs are passed as for the real build.
    from torch.utils.cpp_extension import include_paths

    cmd = [_nvcc(), "-c", "-std=c++17", "-O1", "-arch=compute_90", f"-I{CSRC}",
           *[f"-I{p}" for p in include_paths()], str(CSRC / source), "-o", str(tmp_path / "out.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
