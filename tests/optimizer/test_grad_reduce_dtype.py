"""--grad-reduce-dtype (DeepSpeed's communication_data_type): gradients summed over data parallelism
in bf16 or fp16 (gloo, 2 CPU processes); the fp32 gradient buffers stay.

A probe proves the sum travels in that dtype: 1 + 2^-9 survives a mean taken in fp32 or fp16 but
not in bf16 (8 significant bits), while the result still lands in the fp32 buffer. Training at
ZeRO-2 with bf16 sums stays within bf16 rounding of the fp32 run."""
import pytest
import torch

from distributed import run_distributed
from train_helpers import TINY_TRAIN, run_training

PROBE = 1 + 2**-9


CASES = [(mode, dtype) for mode in ("all_reduce", "reduce_scatter") for dtype in ("fp32", "fp16", "bf16")]


def _reduce_body(rank, world_size):
    """Each case's reduced buffer part on this rank (one spawn for all cases: spawning dominates)."""
    import torch.distributed as dist
    from megapar.optimizer.grad_buffer import REDUCE_DTYPES, GradBuffer
    out = {}
    for mode, dtype in CASES:
        p = torch.nn.Parameter(torch.zeros(4))
        buf = GradBuffer([p], dist.group.WORLD, mode=mode, reduce_dtype=REDUCE_DTYPES[dtype])
        buf.start_step()
        p.main_grad.copy_(torch.tensor([PROBE, 1.0 + rank, 3.0, 4.0]))
        buf.finish()
        assert buf.data.dtype == torch.float32
        lo, hi = (0, 4) if mode == "all_reduce" else buf.buckets[0].shard(rank, world_size)
        out[mode, dtype] = buf.data[lo:hi].tolist()
    return out


def test_gradients_are_summed_in_the_chosen_dtype():
    """The mean over 2 ranks of [1 + 2^-9, 1 + rank, 3, 4] is [probe, 1.5, 3, 4] (probe: 1 + 2^-9 in fp32
    and fp16, 1.0 in bf16), all-reduced (every rank holds it) or reduce-scattered (rank d holds half d)."""
    ranks = run_distributed(_reduce_body, 2)
    for mode, dtype in CASES:
        mean = [1.0 if dtype == "bf16" else PROBE, 1.5, 3.0, 4.0]
        want = [mean, mean] if mode == "all_reduce" else [mean[:2], mean[2:]]
        assert [r[mode, dtype] for r in ranks] == want, (mode, dtype)


@pytest.mark.slow
def test_training_with_bf16_sums_stays_close_to_fp32(embedded_data):
    """ZeRO-2 (the per-layer reduce-scatters and the edge bucket's): close to fp32, not equal to it."""
    base = TINY_TRAIN + embedded_data + ["--train-iters", "4", "--log-interval", "1", "--zero-stage", "2"]
    reference = [loss for _, loss in run_training(base, 2)["losses"]]
    got = [loss for _, loss in run_training(base + ["--grad-reduce-dtype", "bf16"], 2)["losses"]]
    assert got == pytest.approx(reference, rel=5e-3) and got != reference, (reference, got)
