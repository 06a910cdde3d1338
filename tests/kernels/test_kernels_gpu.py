"""GPU parity of the fused kernels against float64 (run on a lent GPU: scripts/gpu_kernel_checks.sh)."""
import pytest
import torch

from megapar.kernels.layernorm import fused_add_layer_norm, layer_norm
from megapar.kernels.softmax import scaled_masked_softmax, scaled_masked_softmax_reference

pytestmark = pytest.mark.gpu
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,mode", [((2, 3, 17, 17), "causal"), ((1, 2, 1000, 1000), "causal"),
                                        ((2, 2, 40, 1000), "mask"), ((1, 2, 64, 2048), "mask")])
def test_softmax_parity(dtype, shape, mode):
    x = torch.randn(shape, device="cuda") * 3
    mask = torch.rand(shape[0], 1, shape[2], shape[3], device="cuda") < 0.3 if mode == "mask" else None
    dy = torch.randn(shape, device="cuda")
    x64 = x.double().requires_grad_()
    ref = scaled_masked_softmax_reference(x64, 0.3, mask, mode == "causal")
    ref.backward(dy.double())
    xl = x.to(dtype).clone().requires_grad_()
    out = scaled_masked_softmax(xl, 0.3, mask, mode == "causal", impl="fused")
    out.backward(dy.to(dtype))
    assert out.dtype == dtype
    assert rel(out, ref) < TOL[dtype] and rel(xl.grad, x64.grad) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,h", [(7, 768), (33, 1000), (64, 4096), (16, 8192)])
@pytest.mark.parametrize("fused_add", [False, True])
def test_layernorm_parity(dtype, rows, h, fused_add):
    x, r, dy = (torch.randn(rows, h, device="cuda") for _ in range(3))
    w, b = torch.randn(h, device="cuda") + 1, torch.randn(h, device="cuda")

    def run(impl, dt):
        leaves = [t.detach().to(dt).clone().requires_grad_() for t in (x, r, w, b)]
        if fused_add:
            y, s = fused_add_layer_norm(leaves[0], leaves[1], leaves[2], leaves[3], 1e-5, impl=impl)
            torch.autograd.backward([y, s], [dy.to(dt), dy.to(dt)])
        else:
            y = layer_norm(leaves[0], leaves[2], leaves[3], 1e-5, impl=impl)
            y.backward(dy.to(dt))
        return [y, leaves[0].grad, leaves[2].grad, leaves[3].grad]

    for got, want in zip(run("fused", dtype), run("torch", torch.float64)):
        assert rel(got, want) < TOL[dtype]
