"""--mlp-impl fused: the MLP with GELU in its GEMM epilogues (tensor_parallel/fused_mlp.py) against
the serial fp64 twin, at tp 1 and tp 2 (with and without sequence parallelism) on CPU, where the
epilogue GEMMs run as their PyTorch references; on GPUs, training with it against training without."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed import run_distributed
from megapar.kernels import fused_kernels_available
from megapar.optimizer.grad_buffer import GradBuffer
from megapar.tensor_parallel.fused_mlp import can_fuse, gelu_mlp
from megapar.tensor_parallel.layers import ColumnParallelLinear, Init, RowParallelLinear, full_normal
from megapar.tensor_parallel.mappings import gather_from_sp, scatter_to_sp
from test_cuda_graph import GPU_TRAIN, _assert_close, _train, gpu_data  # noqa: F401 (fixture)
from train_helpers import TINY_TRAIN, run_training

H, F4 = 16, 64


def _mlp_vs_twin(rank: int, tp: int, sp: bool, device="cpu", dtype=torch.float32) -> list[float]:
    """3 microbatches through the fused MLP: errors of output, input gradient and every main_grad
    (this rank's shard) against F.linear -> tanh GELU -> F.linear in float64."""
    group = dist.group.WORLD if tp > 1 else None
    kw = dict(fused_grad_accumulation=True, sequence_parallel=sp, device=device, dtype=dtype)
    fc1 = ColumnParallelLinear(H, F4, Init(3, "fc1"), group, **kw)
    fc2 = RowParallelLinear(F4, H, Init(3, "fc2"), group, **kw)
    with torch.no_grad():  # non-zero biases, the same on every rank
        fc1.bias.copy_(torch.linspace(-1, 1, F4).chunk(tp)[rank])
        fc2.bias.copy_(torch.linspace(1, -1, H))
    buf = GradBuffer([*fc1.parameters(), *fc2.parameters()], None)
    buf.start_step()
    w1, w2 = full_normal((F4, H), Init(3, "fc1")).double(), full_normal((H, F4), Init(3, "fc2")).double()
    b1, b2 = torch.linspace(-1, 1, F4).double(), torch.linspace(1, -1, H).double()
    for t in (w1, w2, b1, b2):
        t.requires_grad_()
    gen, errors = torch.Generator().manual_seed(0), []
    for _ in range(3):
        x_full = torch.randn(8, 2, H, generator=gen)                                   # [s, b, h]
        x = (scatter_to_sp(x_full, group) if sp else x_full).to(device, dtype).clone().requires_grad_()
        assert can_fuse(fc1, fc2)
        y = fc2.reduce_and_bias(gelu_mlp(x, fc1, fc2))
        y.float().square().sum().backward()  # under SP each rank's part of the sequence: the loss is their sum
        y_full = gather_from_sp(y.detach(), group) if sp else y
        x_ref = x_full.double().requires_grad_()
        y_ref = F.linear(F.gelu(F.linear(x_ref, w1, b1), approximate="tanh"), w2, b2)
        y_ref.square().sum().backward()
        x_grad_ref = x_ref.grad.chunk(tp)[rank] if sp else x_ref.grad
        errors += [(y_full.double().cpu() - y_ref).abs().max().item() / y_ref.abs().max().item(),
                   (x.grad.double().cpu() - x_grad_ref).abs().max().item() / x_grad_ref.abs().max().item()]
    if sp:  # LayerNorm-style TP sum of the replicated bias's gradient (GradBuffer tp_summed does it in training)
        dist.all_reduce(fc2.bias.main_grad, group=group)
    for mine, want in ((fc1.weight.main_grad, w1.grad.chunk(tp)[rank]), (fc1.bias.main_grad, b1.grad.chunk(tp)[rank]),
                       (fc2.weight.main_grad, w2.grad.chunk(tp, dim=1)[rank]), (fc2.bias.main_grad, b2.grad)):
        assert mine.dtype == torch.float32
        errors.append((mine.double().cpu() - want).abs().max().item() / want.abs().max().item())
    return errors


def test_fused_mlp_matches_serial_twin_tp1():
    assert max(_mlp_vs_twin(0, 1, False)) < 1e-5


@pytest.mark.parametrize("sp", [False, True])
def test_fused_mlp_matches_serial_twin_tp2(sp):
    for errors in run_distributed(_mlp_vs_twin, world_size=2, args=(sp,)):
        assert max(errors) < 1e-5, errors


@pytest.mark.skipif(fused_kernels_available(), reason="checks the error on a machine without the kernels")
def test_fused_mlp_flag_without_kernels_says_what_to_do(embedded_data):
    with pytest.raises(Exception, match="--mlp-impl torch"):
        run_training(TINY_TRAIN + embedded_data + ["--train-iters", "1", "--mlp-impl", "fused"])


# ---- GPU --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_mlp_matches_serial_twin_cuda(dtype):
    assert max(_mlp_vs_twin(0, 1, False, "cuda", dtype)) < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [["--bf16"], ["--bf16", "--torch-compile", "--enable-cuda-graph"]])
def test_training_matches_unfused_mlp(gpu_data, extra):
    argv = GPU_TRAIN + gpu_data + extra
    plain, fused = _train(argv), _train(argv + ["--mlp-impl", "fused"])
    _assert_close(fused["loss"], plain["loss"], 2e-3)
    _assert_close(fused["norm"], plain["norm"], 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [["--tensor-parallel", "2"], ["--tensor-parallel", "2", "--sequence-parallel"]])
def test_training_matches_unfused_mlp_two_gpus(gpu_data, layout):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    argv = GPU_TRAIN + gpu_data + ["--bf16", "--torch-compile", "--enable-cuda-graph"] + layout
    plain, fused = _train(argv, gpus=2), _train(argv + ["--mlp-impl", "fused"], gpus=2)
    _assert_close(fused["loss"], plain["loss"], 2e-3)
