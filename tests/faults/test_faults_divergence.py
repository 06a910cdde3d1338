"""A run that diverges: fp16 with a learning rate so large that the weights overflow. Before, every
later step was skipped (38 of 40), the run exited 0 and saved checkpoints of inf weights.

Now the run stops with one `error:` line once steps keep overflowing at the minimum loss scale
(--hysteresis of them in a row), and a save of NaN/Inf weights is refused with one line that keeps
the checkpoint already in --save (the tracker still names it, and it loads).
"""
from __future__ import annotations

import os

import torch

from harness import refused
from test_faults_launch import PYTHON, TRACKER, data  # noqa: F401 (data: the fixture)

DIVERGING = ["--fp16", "--lr", "1e10", "--train-iters", "60"]


def test_fp16_overflowing_at_the_minimum_loss_scale_stops(data, tmp_path):  # noqa: F811
    (tmp_path / "keep.txt").write_text("user data")
    refused([*PYTHON, *data, *DIVERGING], fault_class="divergence",
            case="fp16, --lr 1e10: every step overflows at the minimum loss scale",
            expect=["fp16 training diverged", "steps in a row", "minimum loss scale 1 (--min-loss-scale)"],
            watch=[tmp_path])


def test_a_save_of_inf_weights_is_refused_and_the_last_checkpoint_kept(data, tmp_path):  # noqa: F811
    """--save-interval 1: the steps before the weights overflow are saved; the first save of inf
    weights is refused, and the checkpoint before it stays the one the tracker names."""
    ck = tmp_path / "ck"
    out = refused([*PYTHON, *data, *DIVERGING, "--save", ck, "--save-interval", "1"], fault_class="divergence",
                  case="fp16, --lr 1e10, --save-interval 1: no save of inf weights, the last checkpoint kept",
                  expect=["refusing to save iteration", "NaN/Inf", "the checkpoint already there (iteration",
                          ") is kept"],
                  watch=[], allow_new=[ck])
    last = int((ck / TRACKER).read_text())
    refused_at = int(out.output.split("refusing to save iteration ")[1].split()[0])
    assert last == refused_at - 1, (last, refused_at)
    state = torch.load(ck / f"iter_{last:07d}" / "mp_rank_00" / "model_optim_rng.pt", map_location="cpu",
                       weights_only=False)
    weights = list(_tensors(state["model"]))
    assert weights and all(torch.isfinite(t.float()).all() for t in weights)


def test_async_save_in_flight_is_published_before_the_refusal_exits(data, tmp_path):  # noqa: F811
    """--async-save: the save in flight when the weights overflow is finished (published) before the
    refusal ends the run, and the tracker names a complete iteration, the one the line says is kept."""
    ck = tmp_path / "ck"
    out = refused([*PYTHON, *data, *DIVERGING, "--save", ck, "--save-interval", "1", "--ckpt-format", "torch_dist",
                   "--async-save"], fault_class="divergence",
                  case="fp16, --lr 1e10, --async-save: the save in flight published, the last checkpoint kept",
                  expect=["refusing to save iteration", "NaN/Inf", ") is kept"], watch=[], allow_new=[ck])
    last = int((ck / TRACKER).read_text())
    assert f"the checkpoint already there (iteration {last}) is kept" in out.output
    folder = ck / f"iter_{last:07d}"
    assert {"common.pt", ".metadata"} <= set(os.listdir(folder)) and not list(ck.glob("*.partial"))


def _tensors(obj):
    """Every tensor inside nested dicts."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
