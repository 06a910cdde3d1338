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
