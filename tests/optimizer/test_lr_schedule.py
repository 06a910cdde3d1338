"""megapar/optimizer/lr_schedule.py: warmup and decay at chosen iterations (Megatron's formulas)."""
import math

import pytest
import torch

from megapar.optimizer.lr_schedule import OptimizerParamScheduler


def test_lr_schedule_at_chosen_iterations():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    sch = OptimizerParamScheduler(opt, max_lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110,
                                  decay_style="cosine")
    seen = {}
    for step in range(0, 121):
        seen[step] = sch.get_lr()
        sch.step()
    assert seen[0] == 0.0 and seen[5] == pytest.approx(0.5) and seen[10] == pytest.approx(1.0)
    assert seen[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert seen[110] == pytest.approx(0.1) and seen[120] == pytest.approx(0.1)
    lin = OptimizerParamScheduler(opt, 1.0, 0.0, 0, 100, "linear")
    lin.step(25)
    assert lin.get_lr() == pytest.approx(0.75) and opt.param_groups[0]["lr"] == pytest.approx(0.75)


@pytest.mark.parametrize("style, at_quarter", [("linear", 0.25), ("cosine", 0.5 * (math.cos(math.pi * 0.75) + 1))])
def test_weight_decay_increment_and_its_resume(style, at_quarter):
    """--weight-decay-incr-style (Megatron's): the decayed group (the first) goes from the start
    value to the end one over the run and stays there; the other group keeps 0. A resume from the
    state dict continues it, and a checkpoint with another end value or style is named."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "weight_decay": 0.3},
              {"params": [torch.nn.Parameter(torch.zeros(1))], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=0.0)
    sch = OptimizerParamScheduler(opt, 1.0, 0.0, 0, 100, "linear", weight_decay=0.1, end_weight_decay=0.3,
                                  wd_incr_style=style, wd_incr_steps=100)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.1)            # the start value from step 0
    sch.step(25)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.1 + 0.2 * at_quarter)
    assert opt.param_groups[1]["weight_decay"] == 0.0
    state = sch.state_dict()
    sch.step(100)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.3)
    again = OptimizerParamScheduler(opt, 1.0, 0.0, 0, 100, "linear", weight_decay=0.1, end_weight_decay=0.3,
                                    wd_incr_style=style, wd_incr_steps=200)        # a longer run: the saved horizon
    again.load_state_dict(state)
    assert again.wd_incr_steps == 100 and not again.differences(state)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.1 + 0.2 * at_quarter)
    other = OptimizerParamScheduler(opt, 1.0, 0.0, 0, 100, "linear", weight_decay=0.1, end_weight_decay=0.2,
                                    wd_incr_style="linear", wd_incr_steps=100)
    named = " ".join(other.differences(state))
    assert "--end-weight-decay 0.3 (checkpoint) vs 0.2 (run)" in named
    assert ("--weight-decay-incr-style" in named) == (style != "linear")
    constant = OptimizerParamScheduler(opt, 1.0, 0.0, 0, 100, "linear", weight_decay=0.1)
    assert constant.state_dict()["end_wd"] == 0.1 and constant.state_dict()["wd_incr_style"] == "constant"
