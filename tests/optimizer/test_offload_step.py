"""The offloaded optimizer step (in this process, dp 1, ZeRO-1 and ZeRO-2 gradient buffers): stepped
chunk by chunk with each chunk's weights sent back behind it, it equals one AdamW step over the
whole host state bit for bit; the delayed parameter update equals the exact update applied to
gradients of the weights one update older, bit for bit."""
import os

import pytest
import torch

from gpt_helpers import batch
from test_distrib_optimizer import TRAIN, _model

STEPS = 4


def _build(stage: int, dtype=torch.float32, device: str = "cpu", train=None, scaler=None, **kw):
    from megapar.config.settings import TrainConfig
    from megapar.optimizer.distrib_optimizer import DistributedOptimizer
    from megapar.optimizer.grad_buffer import GradBuffer
    from megapar.optimizer.grad_scaler import ConstantGradScaler
    from megapar.optimizer.sharded_grads import ShardedGradBuffer
    model = _model(dtype, torch.device(device))
    if stage == 1:
        buf = GradBuffer(model.parameters(), None, mode="reduce_scatter", bucket_numel=3000)
    else:
        layers = list(model.language_model.encoder.layers)
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        buf = ShardedGradBuffer(layers, [p for p in model.parameters() if id(p) not in in_layers], None)
    opt = DistributedOptimizer(model, buf, train or TrainConfig(**TRAIN), scaler or ConstantGradScaler(), tp_rank=0,
                               dp_group=None, offload=True, stage=stage, **kw)
    return model, buf, opt


def _train_step(model, buf, opt, it: int) -> float:
    ids, labels = (t.to(buf.device) for t in batch(b=2, seed=it))
    buf.start_step()
    loss = model(ids, labels=labels).mean()
    loss.backward()
    buf.finish()
    assert opt.step()[0]
    return loss.item()


def _state(model, opt) -> list[torch.Tensor]:
    return [opt.master_shard, opt.exp_avg, opt.exp_avg_sq, *model.parameters()]


@pytest.mark.parametrize("stage,dtype", [(1, torch.float32), (2, torch.float32), (1, torch.bfloat16)],
                         ids=["zero1", "zero2", "zero1-bf16"])
def test_chunked_step_is_bit_identical_to_one_adamw_step(stage, dtype, device="cpu"):
    """Chunks of at most 1000 elements (several per bucket; a larger part alone), each stepped and
    sent to the model's shard in turn == torch's AdamW over every master at once, then the copy."""
    from megapar.optimizer.base import BaseOptimizer
    chunked, whole = _build(stage, dtype, device), _build(stage, dtype, device)
    opt = chunked[2]
    opt.chunks = opt._plan_chunks(1000)
    assert len(opt.chunks) > len(opt.shards)
    whole[2]._apply_update = lambda: BaseOptimizer._apply_update(whole[2])     # the one-step path
    for it in range(STEPS):
        assert _train_step(*chunked, it) == _train_step(*whole, it)
    for a, b in zip(_state(chunked[0], opt), _state(whole[0], whole[2])):
        assert torch.equal(a, b)


@pytest.mark.parametrize("stage", [1, 2])
def test_delayed_update_is_the_exact_update_of_one_update_older_gradients(stage, dtype=torch.float32, device="cpu"):
    """--delayed-param-update: step k's gradients come from the weights of update k - 2 (the
    first two from the initial weights), and the update itself is exact: equal, bit for bit, to a
    synchronous run fed those weights for its forward and backward. A pending update is applied by
    `finish_pending`, and the step count then agrees."""
    delayed, exact = _build(stage, dtype, device, delayed=True), _build(stage, dtype, device)
    model = exact[0]
    published = [[p.detach().clone() for p in model.parameters()]]          # [k]: the weights of update k
    for it in range(STEPS):
        with torch.no_grad():                                                # step it + 1 sees update it - 1
            for p, w in zip(model.parameters(), published[max(0, it - 1)]):
                p.copy_(w)
        assert _train_step(*delayed, it) == _train_step(*exact, it)         # (exact: from its own masters)
        published.append([p.detach().clone() for p in model.parameters()])
    opt = delayed[2]
    opt.finish_pending()
    assert opt._step_count() == STEPS and opt.pending is None and not opt.unpublished
    for a, b in zip(_state(delayed[0], opt), _state(model, exact[2])):
        assert torch.equal(a, b)
    opt.close()


def test_fp16_gradients_stream_to_the_host_still_scaled():
    """ZeRO-2 offload with fp16 and a loss scale of 1024: each layer's gradient shard goes to the host
    during backward still scaled (AdamW divides the scale out with the clipping), bit for bit what
    copying every shard after backward gives; an inf skips the step on both and changes nothing."""
    from megapar.config.settings import TrainConfig
    from megapar.optimizer.grad_scaler import ConstantGradScaler
    cfg = TrainConfig(**TRAIN, fp16=True)
    runs = [_build(2, torch.float16, train=cfg, scaler=ConstantGradScaler(1024.0)) for _ in range(2)]
    streamed, (model, buf, copied) = [], runs[1]
    opt = runs[0][2]
    buf.on_shard_final = None                              # the reference copies every shard after backward
    runs[0][1].on_shard_final = lambda i: (streamed.append(i), opt._copy_out(i))

    def step(model, buf, opt, it, inf=False):
        ids, labels = batch(b=2, seed=it)
        buf.start_step()
        (model(ids, labels=labels).float().mean() * opt.loss_scale).backward()
        buf.finish()
        if inf:
            opt.grads[0].view(-1)[0] = float("inf")
        return opt.step()[0]
    for it in range(2):
        assert [step(*r, it) for r in runs] == [True, True]
    assert streamed, "no gradient shard was streamed during backward"
    before = [t.clone() for t in _state(*runs[0][::2])]
    assert [step(*r, 2, inf=True) for r in runs] == [False, False]
    assert all(torch.equal(a, b) for a, b in zip(before, _state(*runs[0][::2])))
    for a, b in zip(_state(runs[0][0], opt), _state(model, copied)):
        assert torch.equal(a, b)


def test_delayed_update_uses_the_learning_rate_of_its_own_step():
    """The LR schedule writes the param groups right after step() returns, while the update may not
    have started: it must use the values of the step that launched it."""
    import threading
    delayed, exact = _build(1, delayed=True), _build(1)
    opt, release = delayed[2], threading.Event()
    opt.worker.submit(release.wait)                   # the update queues behind this
    _train_step(*delayed, 0)
    for g in opt.param_groups:
        g["lr"] = 123.0
    release.set()
    opt.finish_pending()
    _train_step(*exact, 0)
    assert torch.equal(opt.master_shard, exact[2].master_shard)
    opt.close()


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [1, 2])
def test_offloaded_steps_on_a_gpu(stage):
    """The same equalities with a bf16 model on the GPU: pinned host state, the gradients streamed
    out on a side stream (stage 2), each chunk's weights sent through the device buffer and cast there."""
    test_chunked_step_is_bit_identical_to_one_adamw_step(stage, torch.bfloat16, "cuda")
    test_delayed_update_is_the_exact_update_of_one_update_older_gradients(stage, torch.bfloat16, "cuda")


@pytest.mark.slow  # four dp-2 training runs: ~35 s
def test_delayed_update_through_training_saves_and_resumes(embedded_data, tmp_path):
    """dp 2, ZeRO-2, NVMe offload (the offload a CPU run may use) with --delayed-param-update, saving
    at iteration 2: the first two losses are the exact run's (the first update has LR 0 in the
    warm-up, so both see the initial weights twice), the third too (the save applied the pending
    update), the fourth not (its weights lack update 3); a run stopped and saved at iteration 2
    resumes into the losses of the one that saved there and went on."""
    from test_nvme_offload import train
    from train_helpers import TINY_TRAIN
    folder = tmp_path / "nvme"
    folder.mkdir()
    base = TINY_TRAIN + embedded_data + ["--train-iters", "4", "--zero-stage", "2"]
    exact = train(base, nvme=folder)["losses"]
    delayed = base + ["--delayed-param-update"]
    full = train(delayed + ["--save", str(tmp_path / "full"), "--save-interval", "2"], nvme=folder)["losses"]
    assert full[:3] == exact[:3] and full[3] != exact[3]
    ck = str(tmp_path / "ck")
    first = train(delayed + ["--save", ck, "--exit-interval", "2"], nvme=folder)
    second = train(delayed + ["--load", ck], nvme=folder)
    assert first["losses"] + second["losses"] == full
    assert os.listdir(folder) == []


def test_the_optimizer_log_line_names_the_delayed_update_and_the_nvme_io():
    from types import SimpleNamespace
    from megapar.run.initialize import offload_text
    cpu = SimpleNamespace(optimizer_cpu_offload=True, optimizer_nvme_offload=None, delayed_param_update=True)
    nvme = SimpleNamespace(optimizer_cpu_offload=False, optimizer_nvme_offload="/nvme", delayed_param_update=True)
    assert offload_text(cpu).startswith(", CPU offload, delayed parameter update")
    assert offload_text(nvme).startswith(", NVMe offload to /nvme, delayed parameter update")
    assert offload_text(nvme, "buffered I/O").startswith(", NVMe offload to /nvme via buffered I/O, delayed")
    assert "delayed" not in offload_text(SimpleNamespace(**{**vars(cpu), "delayed_param_update": False}))


def test_host_buffers_off_the_gpu_are_plain_memory():
    """CPU runs: no page-locking at any size, zero-filled when asked (megapar/pinned.py)."""
    from megapar.pinned import EXACT_ABOVE_BYTES, host_buffer
    for numel in (10, EXACT_ABOVE_BYTES // 4 + 1):
        t = host_buffer(numel, torch.float32, pinned=False, zero=True)
        assert t.shape == (numel,) and t.dtype == torch.float32 and not t.any()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.gpu
def test_large_pinned_host_buffers_take_their_exact_size():
    """A pinned buffer above EXACT_ABOVE_BYTES is page-locked at its own size (PyTorch's pinned allocator
    would round 160 MiB + 4 B up to 256 MiB), zero-filled, usable for asynchronous copies both ways, and
    unregistered when freed (the same pages can be locked again)."""
    from megapar.pinned import EXACT_ABOVE_BYTES, host_buffer
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    torch.cuda.init()
    numel = 40 * 2**20 + 1                               # 160 MiB + 4 B of fp32
    assert numel * 4 > EXACT_ABOVE_BYTES
    before = _rss()
    host = host_buffer(numel, torch.float32, pinned=True)
    grown = _rss() - before
    assert host.is_pinned() and not host.any()
    assert grown < numel * 4 * 1.1, f"{grown / 2**20:.0f} MiB resident for a {numel * 4 / 2**20:.0f} MiB buffer"
    dev = torch.arange(numel, dtype=torch.float32, device="cuda")
    host.copy_(dev, non_blocking=True)
    back = torch.empty_like(dev).copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, dev) and host[-1].item() == numel - 1
    del host
    for _ in range(3):                                   # registering and freeing repeatedly leaks nothing
        assert host_buffer(numel, torch.float32, pinned=True).is_pinned()
