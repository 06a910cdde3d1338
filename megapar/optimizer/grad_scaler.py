"""Loss scalers for fp16 (Megatron semantics).

Dynamic: start at --initial-loss-scale (2^32); an overflow on any rank skips the step on all
ranks and, once `hysteresis` overflows have been seen, halves the scale (never below
--min-loss-scale); `loss_scale_window` clean steps in a row double it (and reset hysteresis).

Divergence: `hysteresis` overflows in a row with the scale already at its minimum (a constant
scale is always at its minimum) mean the gradients overflow however little they are scaled: the
run has diverged (`diverged` turns True; training stops). DeepSpeed's dynamic scaler stops at the
minimum scale in the same way; Megatron's would skip every step from then on.
"""
from __future__ import annotations


class _OverflowsAtMinimum:
    """Counts the overflows in a row seen at the minimum scale (`diverged` after `hysteresis`)."""

    def __init__(self, hysteresis: int):
        self.hysteresis, self.overflows_at_min = hysteresis, 0

    def _count(self, found_inf: bool, at_min: bool) -> None:
        self.overflows_at_min = self.overflows_at_min + 1 if found_inf and at_min else 0

    @property
    def diverged(self) -> bool:
        return self.overflows_at_min >= self.hysteresis


class ConstantGradScaler(_OverflowsAtMinimum):
    def __init__(self, scale: float = 1.0, hysteresis: int = 2):
        super().__init__(hysteresis)
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        self._count(found_inf, at_min=True)

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler(_OverflowsAtMinimum):
    def __init__(self, initial_scale: float = 2.0**32, min_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        if not (min_scale > 0 and initial_scale >= min_scale and growth_interval > 0 and hysteresis > 0):
            raise ValueError("loss scaler: need 0 < --min-loss-scale <= --initial-loss-scale, "
                             "--loss-scale-window > 0 and --hysteresis > 0")
        super().__init__(hysteresis)
        self.scale, self.min_scale = float(initial_scale), float(min_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.growth_tracker, self.hysteresis_tracker = 0, hysteresis

    def update(self, found_inf: bool) -> None:
        self._count(found_inf, at_min=self.scale <= self.min_scale)
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state.get("growth_tracker", 0))
        self.hysteresis_tracker = int(state.get("hysteresis_tracker", self.hysteresis))
