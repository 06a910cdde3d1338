"""Each TP layer against its serial PyTorch twin, forward and backward, for tp in {1, 2, 4}."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed import run_distributed
from megapar.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megapar.tensor_parallel.layers import (ColumnParallelLinear, Init, RowParallelLinear, VocabParallelEmbedding,
                                            full_normal)
from megapar.tensor_parallel.mappings import gather_from_sp, gather_from_tp, reduce_scatter_to_sp, scatter_to_sp

TOL = dict(rtol=1e-5, atol=1e-6)  # fp32; only summation order differs between tp sizes


def _err(a, b):
    return (a - b).abs().max().item()


def _column(rank, tp, group, gather):
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)
    layer = ColumnParallelLinear(16, 24, Init(7, "col"), group, gather_output=gather)
    with torch.no_grad():
        layer.bias.copy_(torch.arange(24.0).chunk(tp)[rank])
    y = layer(x)
    full_w = full_normal((24, 16), Init(7, "col")).requires_grad_()
    full_b = torch.arange(24.0).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y_ref = F.linear(x_ref, full_w, full_b)
    out = y if gather else gather_from_tp(y, group)
    (out * torch.linspace(-1, 1, 24)).sum().backward()
    (y_ref * torch.linspace(-1, 1, 24)).sum().backward()
    return [_err(out, y_ref), _err(x.grad, x_ref.grad), _err(layer.weight.grad, full_w.grad.chunk(tp)[rank]),
            _err(layer.bias.grad, full_b.grad.chunk(tp)[rank])]


def _row(rank, tp, group, input_is_parallel):
    x_full = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1))
    x = (x_full.chunk(tp, dim=-1)[rank] if input_is_parallel else x_full).clone().requires_grad_()
    layer = RowParallelLinear(16, 12, Init(7, "row"), group, input_is_parallel=input_is_parallel)
    with torch.no_grad():
        layer.bias.copy_(torch.arange(12.0))
    y = layer(x)
    full_w = full_normal((12, 16), Init(7, "row")).requires_grad_()
    x_ref = x_full.clone().requires_grad_()
    y_ref = F.linear(x_ref, full_w, torch.arange(12.0))
    (y * torch.linspace(-1, 1, 12)).sum().backward()
    (y_ref * torch.linspace(-1, 1, 12)).sum().backward()
    x_grad_ref = x_ref.grad.chunk(tp, dim=-1)[rank] if input_is_parallel else x_ref.grad
    return [_err(y, y_ref), _err(x.grad, x_grad_ref), _err(layer.weight.grad, full_w.grad.chunk(tp, dim=1)[rank]),
            _err(layer.bias.grad, torch.linspace(-1, 1, 12) * 15)]


def _embedding(rank, tp, group):
    ids = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(2))
    emb = VocabParallelEmbedding(64, 8, Init(3, "emb"), group)
    full = full_normal((64, 8), Init(3, "emb")).requires_grad_()
    y, y_ref = emb(ids), F.embedding(ids, full)
    (y * y).sum().backward()
    (y_ref * y_ref).sum().backward()
    return [_err(y, y_ref), _err(emb.weight.grad, full.grad.chunk(tp)[rank])]


def _cross_entropy(rank, tp, group):
    true_vocab, padded = 50, 64                       # 14 padded columns that must never count
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 7, padded, generator=g) * 3
    logits[..., true_vocab:] = 30.0                   # large garbage in the padding
    target = torch.randint(0, true_vocab, (6, 7), generator=g)
    local = logits.chunk(tp, dim=-1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, true_vocab, group)
    ref_in = logits[..., :true_vocab].clone().requires_grad_()
    ref = F.cross_entropy(ref_in.reshape(-1, true_vocab), target.reshape(-1), reduction="none").view(6, 7)
    w = torch.rand(6, 7, generator=g)
    (loss * w).sum().backward()
    (ref * w).sum().backward()
    grad_ref = torch.cat([ref_in.grad, torch.zeros(6, 7, padded - true_vocab)], dim=-1).chunk(tp, dim=-1)[rank]
    return [_err(loss, ref), _err(local.grad, grad_ref)]


def _sequence_parallel(rank, tp, group):
    """Column (input: my sequence part, all-gathered) -> row (output: reduce-scattered) at sequence
    parallelism, with and without fused grad accumulation (main_grad), against the serial twin."""
    x_full = torch.randn(8, 3, 16, generator=torch.Generator().manual_seed(5))               # [s, b, h]
    col = ColumnParallelLinear(16, 24, Init(7, "col"), group, sequence_parallel=True, fused_grad_accumulation=True)
    row = RowParallelLinear(24, 16, Init(7, "row"), group, sequence_parallel=True, fused_grad_accumulation=True)
    w1 = full_normal((24, 16), Init(7, "col")).requires_grad_()
    w2 = full_normal((16, 24), Init(7, "row")).requires_grad_()
    x_ref = x_full.clone().requires_grad_()
    y_ref = F.linear(F.linear(x_ref, w1), w2)                                                 # biases are 0
    weight = torch.linspace(-1, 1, 16)
    (y_ref * weight).sum().backward()
    errors = []
    for fused in (False, True):
        for p in (*col.parameters(), *row.parameters()):
            if fused:
                p.main_grad = torch.zeros_like(p)
            p.grad = None
        x = scatter_to_sp(x_full.clone().requires_grad_(), group)                              # [s/tp, b, h]
        x.retain_grad()
        y = row(col(x))                                                                       # [s/tp, b, h]
        (y * weight).sum().backward()
        w1g = col.weight.main_grad if fused else col.weight.grad
        w2g, b2g = (row.weight.main_grad, row.bias.main_grad) if fused else (row.weight.grad, row.bias.grad)
        b2g = b2g.clone()
        dist.all_reduce(b2g, group=group)               # a sequence_parallel bias: summed over TP by training
        errors += [_err(y, y_ref.chunk(tp)[rank]), _err(x.grad, x_ref.grad.chunk(tp)[rank]),
                   _err(w1g, w1.grad.chunk(tp)[rank]), _err(w2g, w2.grad.chunk(tp, dim=1)[rank]),
                   _err(b2g, weight * 24)]
        for p in (*col.parameters(), *row.parameters()):
            if fused:
                del p.main_grad
    return errors


def _sp_mappings(rank, tp, group):
    """gather_from_sp / reduce_scatter_to_sp against plain tensor algebra, forward and backward."""
    full = torch.randn(4 * tp, 2, 3, generator=torch.Generator().manual_seed(6))
    mine = full.chunk(tp)[rank].clone().requires_grad_()
    gathered = gather_from_sp(mine, group)
    (gathered * full).sum().backward()                  # every rank: d/dmine = tp * my slice of full
    partial = (full * (rank + 1)).requires_grad_()
    reduced = reduce_scatter_to_sp(partial, group)      # sum over ranks of (r + 1) * full, my slice
    reduced.sum().backward()
    total = sum(range(1, tp + 1))
    return [_err(gathered, full), _err(mine.grad, tp * full.chunk(tp)[rank]),
            _err(reduced, total * full.chunk(tp)[rank]), _err(partial.grad, torch.ones_like(full))]


def _all_layers_body(rank, world_size):
    group = dist.group.WORLD
    return {"sequence_parallel": _sequence_parallel(rank, world_size, group),
            "sp_mappings": _sp_mappings(rank, world_size, group),
            "column": _column(rank, world_size, group, False), "column_gather": _column(rank, world_size, group, True),
            "row_parallel_in": _row(rank, world_size, group, True), "row_scatter": _row(rank, world_size, group, False),
            "embedding": _embedding(rank, world_size, group), "cross_entropy": _cross_entropy(rank, world_size, group)}


@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_tp_layers_match_serial_twins(tp):
    for rank, result in enumerate(run_distributed(_all_layers_body, world_size=tp)):
        for name, errors in result.items():
            assert max(errors) < 1e-5, (tp, rank, name, errors)


def test_cross_entropy_padding_never_changes_loss():
    logits = torch.randn(4, 50)
    target = torch.randint(0, 50, (4,))
    padded = torch.cat([logits, torch.full((4, 14), 1e4)], dim=-1)
    assert torch.allclose(vocab_parallel_cross_entropy(padded, target, 50),
                          F.cross_entropy(logits, target, reduction="none"), **TOL)


def test_init_is_layout_invariant():
    """The tp=4 shards of a column-parallel weight are exactly the rows of the tp=1 weight."""
    full = full_normal((32, 8), Init(11, "w"))
    assert torch.equal(torch.cat([full_normal((32, 8), Init(11, "w")).chunk(4)[r] for r in range(4)]), full)
    assert not torch.equal(full, full_normal((32, 8), Init(11, "other")))
