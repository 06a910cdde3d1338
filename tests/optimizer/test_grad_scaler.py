"""megapar/optimizer/grad_scaler.py: the dynamic loss scale (growth, back-off, hysteresis, its floor)
and the divergence rule of both scalers."""
from megapar.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler


def test_loss_scaler_grows_and_backs_off():
    s = DynamicGradScaler(initial_scale=2.0**10, min_scale=2.0, growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale == 2.0**10                      # first overflow absorbed by hysteresis
    s.update(True)
    assert s.scale == 2.0**9                       # second one halves
    for _ in range(3):
        s.update(False)
    assert s.scale == 2.0**10 and s.hysteresis_tracker == 2
    for _ in range(20):
        s.update(True)
    assert s.scale == 2.0                          # never below --min-loss-scale


def test_loss_scaler_diverges_after_hysteresis_overflows_in_a_row_at_its_minimum():
    s = DynamicGradScaler(initial_scale=8.0, min_scale=2.0, hysteresis=2)
    for _ in range(3):
        s.update(True)                             # 8 -> 8 -> 4 -> 2: not yet at the minimum when they came
    assert s.scale == 2.0 and not s.diverged
    s.update(True)
    s.update(False)                                # a clean step resets the count
    s.update(True)
    assert not s.diverged
    s.update(True)
    assert s.diverged                              # two in a row at the minimum
    c = ConstantGradScaler(1024.0, hysteresis=3)   # a static scale is always at its minimum
    for _ in range(2):
        c.update(True)
    assert not c.diverged
    c.update(True)
    assert c.diverged
