"""The fused chunked LM head + loss (tensor_parallel/fused_cross_entropy.py) against its serial twin: the
unfused head (F.linear) and F.cross_entropy over the true vocabulary, mean over tokens; loss and the gradients
of the hidden state and the (padded, vocab-parallel) weight; at tp 1 and 2, with sequence parallelism, in
several chunks; and whole training runs with and without --cross-entropy-loss-fusion."""
import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed
from train_helpers import TINY_TRAIN, run_training

from megapar.tensor_parallel import fused_cross_entropy as fce
from megapar.tensor_parallel.mappings import to_tp_region

TRUE_VOCAB, PADDED, HIDDEN, S, B = 50, 64, 16, 12, 3   # 14 padded rows that must never count


def _problem(dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(S, B, HIDDEN, generator=g).to(dtype)
    weight = (torch.randn(PADDED, HIDDEN, generator=g) * 0.5).to(dtype)
    weight[TRUE_VOCAB:] = 3.0                          # large garbage in the padding rows
    target = torch.randint(0, TRUE_VOCAB, (S, B), generator=g)
    return hidden, weight, target


def _reference(hidden, weight, target):
    """Serial twin: full logits over the true vocabulary, fp32 cross entropy, mean. (loss, grad h, grad W)"""
    h = hidden.float().clone().requires_grad_()
    w = weight.float().clone().requires_grad_()
    logits = F.linear(h, w)[..., :TRUE_VOCAB]                                              # [s, b, V]
    loss = F.cross_entropy(logits.reshape(-1, TRUE_VOCAB), target.reshape(-1))
    (loss * 2.5).backward()                                                                # a non-unit grad
    return loss.detach(), h.grad, w.grad


def _err(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("chunk_elements", [1 << 26, PADDED * 5])   # one chunk; 8 chunks, the last short
def test_fused_equals_unfused_tp1(monkeypatch, chunk_elements):
    monkeypatch.setattr(fce, "CHUNK_ELEMENTS", chunk_elements)
    hidden, weight, target = _problem()
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    loss = fce.linear_cross_entropy_mean(h, w, target, TRUE_VOCAB)
    (loss * 2.5).backward()
    ref_loss, ref_h, ref_w = _reference(hidden, weight, target)
    assert _err(loss, ref_loss) < 1e-5
    assert _err(h.grad, ref_h) < 1e-6
    assert _err(w.grad, ref_w) < 1e-6
    assert w.grad[TRUE_VOCAB:].abs().max() == 0       # padding rows get no gradient


def test_fused_bf16_within_bf16_rounding(monkeypatch):
    monkeypatch.setattr(fce, "CHUNK_ELEMENTS", PADDED * 7)
    hidden, weight, target = _problem(torch.bfloat16)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    loss = fce.linear_cross_entropy_mean(h, w, target, TRUE_VOCAB)
    (loss * 2.5).backward()
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16 and loss.dtype == torch.float32
    ref_loss, ref_h, ref_w = _reference(hidden, weight, target)
    assert _err(loss, ref_loss) < 2e-2 * ref_loss.abs().item()
    assert _err(h.grad, ref_h) < 2e-2 * ref_h.abs().max().item()
    assert _err(w.grad, ref_w) < 2e-2 * ref_w.abs().max().item()


def chunk_split(t: torch.Tensor, parts: int, rank: int, dim: int) -> torch.Tensor:
    return t.chunk(parts, dim=dim)[rank].contiguous()


def _tp_body(rank, tp, sequence_parallel):
    import torch.distributed as dist
    group = dist.new_group(list(range(tp)))
    fce.CHUNK_ELEMENTS = (PADDED // tp) * 5                                               # several chunks
    hidden, weight, target = _problem()
    local_h = (chunk_split(hidden, tp, rank, 0) if sequence_parallel else hidden).clone().requires_grad_()
    local_w = chunk_split(weight, tp, rank, 0).requires_grad_()
    x = to_tp_region(local_h, group, sequence_parallel)                                  # [s, b, h]
    loss = fce.linear_cross_entropy_mean(x, local_w, target, TRUE_VOCAB, group)
    (loss * 2.5).backward()
    ref_loss, ref_h, ref_w = _reference(hidden, weight, target)
    ref_h = chunk_split(ref_h, tp, rank, 0) if sequence_parallel else ref_h
    return [_err(loss, ref_loss), _err(local_h.grad, ref_h), _err(local_w.grad, chunk_split(ref_w, tp, rank, 0))]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_fused_vocab_parallel_tp2_matches_serial(sequence_parallel):
    for errs in run_distributed(_tp_body, 2, args=(sequence_parallel,)):
        assert errs[0] < 1e-5 and errs[1] < 1e-6 and errs[2] < 1e-6, errs


def test_chunk_rows_cover_the_tokens_in_balanced_chunks():
    assert fce.chunk_rows(8192, 50304) * 7 >= 8192 > fce.chunk_rows(8192, 50304) * 6
    assert fce.chunk_rows(3, 10) == 3                 # small problems are one chunk
    assert fce.chunk_rows(10, fce.CHUNK_ELEMENTS) == 1


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(), ("--tensor-parallel", "2", "--sequence-parallel"), ("--pipeline-parallel",
                                                                                             "2")])
def test_training_with_fusion_equals_training_without(layout, embedded_data):
    """The same losses with the fused head as without, at tp 1, tp 2 with sequence parallelism and pp 2."""
    argv = [*TINY_TRAIN, *embedded_data, "--train-iters", "4", *layout]
    world = 2 if layout else 1
    plain = run_training(argv, world)["losses"]
    fused = run_training([*argv, "--cross-entropy-loss-fusion"], world)["losses"]
    assert len(plain) == len(fused) == 4
    for (i, a), (j, b) in zip(plain, fused):
        assert i == j and abs(a - b) < 1e-5 * max(1.0, abs(a)), (plain, fused)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_on_gpu_bf16_matches_unfused_at_gpt2_vocab():
    """On the GPU (the compiled elementwise passes, bf16 GEMMs, several chunks): the fused head within bf16
    rounding of the unfused one at GPT-2's padded vocabulary."""
    from megapar.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4096, 256, **bf16)
    w = torch.randn(50304, 256, **bf16) * 0.05
    t = torch.randint(0, 50257, (4096,), device="cuda")
    grads = []
    for head in ("unfused", "fused"):
        h, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        if head == "fused":
            loss = fce.linear_cross_entropy_mean(h, ww, t, 50257)
        else:
            loss = vocab_parallel_cross_entropy(F.linear(h, ww), t, 50257).mean()
        loss.backward()
        grads.append((loss.detach(), h.grad.float(), ww.grad.float()))
    (l0, h0, w0), (l1, h1, w1) = grads
    assert _err(l0, l1) < 1e-2 * l0.abs().item()
    assert _err(h0, h1) < 2e-2 * h0.abs().max().item() and _err(w0, w1) < 2e-2 * w0.abs().max().item()
