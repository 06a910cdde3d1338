"""The tensor-parallel RNG tracker and the activation checkpoint that replays it (CPU; the CUDA
generators are exercised by the graphed dropout runs of test_cuda_graph.py)."""
import pytest
import torch
import torch.nn.functional as F

from megapar.tensor_parallel.random import MODEL_PARALLEL_RNG, RNGStatesTracker, checkpoint, get_rng_tracker, \
    seed_everything


def test_fork_draws_from_the_named_stream_and_leaves_the_default_one():
    tracker = RNGStatesTracker()
    tracker.reset()
    tracker.add("a", 7)
    torch.manual_seed(1)
    expected_default = torch.rand(3)
    torch.manual_seed(1)
    with tracker.fork("a"):
        first = torch.rand(3)
    assert torch.equal(torch.rand(3), expected_default)           # the default stream did not move
    with tracker.fork("a"):
        second = torch.rand(3)                                     # the named stream went on
    torch.manual_seed(7)
    assert torch.equal(first, torch.rand(3)) and torch.equal(second, torch.rand(3))
    with pytest.raises(KeyError, match="never added"):
        with tracker.fork("b"):
            pass


def test_states_round_trip():
    tracker = RNGStatesTracker()
    tracker.reset()
    tracker.add("a", 3)
    saved = tracker.get_states()
    with tracker.fork("a"):
        drawn = torch.rand(4)
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(4), drawn)


def _layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = F.dropout(x @ w, 0.5)
    with get_rng_tracker().fork():
        return F.dropout(torch.tanh(h), 0.5)


def test_recompute_replays_both_streams():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    seed_everything(1, tp_rank=0, pp_rank=0)
    _layer(x, w).sum().backward()
    plain = w.grad.clone()
    seed_everything(1, tp_rank=0, pp_rank=0)
    w.grad = None
    out = checkpoint(_layer, x, w)
    torch.rand(5)                                                 # the streams move on before the backward
    with get_rng_tracker().fork(MODEL_PARALLEL_RNG):
        torch.rand(5)
    out.sum().backward()
    assert torch.equal(w.grad, plain)


def test_recompute_without_rng_never_reads_an_rng_state(monkeypatch):
    """rng=False (no dropout inside): nothing is saved or restored, as a CUDA graph capture needs."""
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    (torch.tanh(x @ w) ** 2).sum().backward()
    plain, w.grad = w.grad.clone(), None

    def forbidden(*args):
        raise AssertionError("read an RNG state")
    monkeypatch.setattr(torch, "get_rng_state", forbidden)
    monkeypatch.setattr(torch, "set_rng_state", forbidden)
    (checkpoint(lambda a, b: torch.tanh(a @ b), x, w, rng=False) ** 2).sum().backward()
    assert torch.allclose(w.grad, plain, rtol=1e-6, atol=1e-7)
