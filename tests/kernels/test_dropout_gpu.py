"""kernels/dropout.py: the keep mask drawn four elements per Philox call, and the dropout compiled
layers use on GPUs (model/transformer.py: sp_dropout), against what dropout must be."""
import pytest
import torch

from megapar.kernels import dropout as fast

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_triton_gpu():
    if not torch.cuda.is_available() or fast.triton is None:
        pytest.skip("needs a GPU and Triton")


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_mask_drops_each_element_with_probability_p(p):
    n = 1 << 23
    keep = fast.keep_mask(torch.Size([n]), p, torch.device("cuda"))
    assert keep.dtype == torch.bool and keep.shape == (n,)
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs((1 - keep.float().mean().item()) - p) < 6 * sigma
    # the four words of a Philox call and neighbouring calls are independent: every position mod 8 alike
    by_lane = 1 - keep.view(-1, 8).float().mean(0)
    assert (by_lane - p).abs().max().item() < 6 * (p * (1 - p) / (n / 8)) ** 0.5


def test_mask_follows_the_generator_and_odd_sizes():
    shape = torch.Size([3, 5, 7])                                       # 105 elements: a partial block
    torch.cuda.manual_seed(1234)
    a, b = (fast.keep_mask(shape, 0.3, torch.device("cuda")) for _ in range(2))
    torch.cuda.manual_seed(1234)
    a2 = fast.keep_mask(shape, 0.3, torch.device("cuda"))
    assert torch.equal(a, a2) and not torch.equal(a, b)                # same stream, same mask; next call, new one


def test_compiled_dropout_backward_uses_the_forward_mask():
    from megapar.model.transformer import sp_dropout
    x = torch.randn(64, 4, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    f = torch.compile(lambda t: sp_dropout(t, 0.1, True, False))
    y = f(x)
    (y.float() * 3).sum().backward()
    kept = y != 0
    assert 0.85 < kept.float().mean().item() < 0.95
    torch.testing.assert_close(y[kept], (x[kept] / 0.9).to(y.dtype))
    expected = torch.where(kept, torch.full_like(x, 3 / 0.9), torch.zeros_like(x))
    torch.testing.assert_close(x.grad, expected)


def test_graph_replays_draw_new_masks():
    """As in the graphed training step: a compiled layer's forward and backward captured, replayed."""
    from megapar.model.transformer import sp_dropout
    x = torch.ones(64, 4, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    f = torch.compile(lambda t: sp_dropout(t, 0.5, True, False))
    out = torch.empty_like(x)

    def step():
        y = f(x)
        out.copy_(y.detach())
        return torch.autograd.grad(y.sum(), x)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    torch.cuda.current_stream().wait_stream(side)
    masks = []
    for _ in range(3):
        graph.replay()
        masks.append(out != 0)
        assert 0.45 < masks[-1].float().mean().item() < 0.55
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
