"""Learning-rate schedule: a warmup, then linear/cosine decay to --min-lr, and the weight decay held
at --weight-decay or moved from --start-weight-decay to --end-weight-decay (Megatron's
OptimizerParamScheduler, counted in iterations, or in samples with its sample-based flags).

The warmup rises from --lr-warmup-init (default 0) to --lr: linearly (Megatron's: a fraction n / warmup
of the way after n steps) or by a log curve (DeepSpeed's WarmupLR default, which most DeepSpeed
configs get by leaving `warmup_type` out: ln(n) / ln(warmup) of the way, so the first two steps
run at the start value and most of the rise comes early)."""
from __future__ import annotations

import math
from typing import Optional

import torch


class OptimizerParamScheduler:
    def __init__(self, optimizer, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int,
                 decay_style: str = "cosine", weight_decay: float = 0.0, override_opt_param_scheduler: bool = False,
                 use_checkpoint_opt_param_scheduler: bool = False, warmup_style: str = "linear",
                 warmup_init: float = 0.0, end_weight_decay: Optional[float] = None, wd_incr_style: str = "constant",
                 wd_incr_steps: int = 0):
        """weight_decay: the decay of the decayed param group (the first), at the start of a
        wd_incr_style other than "constant" (which holds it), ending at end_weight_decay after
        wd_incr_steps; the other groups keep theirs (0)."""
        if decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown --lr-decay-style {decay_style!r}")
        if warmup_style not in WARMUP_STYLES:
            raise ValueError(f"unknown --lr-warmup-style {warmup_style!r}")
        if not 0 <= min_lr <= max_lr:
            raise ValueError(f"need 0 <= --min-lr ({min_lr}) <= --lr ({max_lr})")
        if not 0 <= warmup_init <= max_lr:
            raise ValueError(f"need 0 <= --lr-warmup-init ({warmup_init}) <= --lr ({max_lr})")
        if wd_incr_style not in WD_INCR_STYLES:
            raise ValueError(f"unknown --weight-decay-incr-style {wd_incr_style!r}")
        self.optimizer, self.max_lr, self.min_lr = optimizer, max_lr, min_lr
        self.warmup_steps, self.decay_steps = warmup_steps, max(decay_steps, warmup_steps)
        self.decay_style, self.weight_decay, self.warmup_style = decay_style, weight_decay, warmup_style
        self.warmup_init = warmup_init
        self.end_weight_decay = weight_decay if end_weight_decay is None else end_weight_decay
        self.wd_incr_style, self.wd_incr_steps = wd_incr_style, wd_incr_steps
        # On resume (checkpointing.restore_scheduler): whose settings win when they differ, if anyone's.
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.num_steps = 0
        self.step(0)

    def get_lr(self) -> float:
        n = self.num_steps
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return self.warmup_init + (self.max_lr - self.warmup_init) * self.warmup_fraction(n)
        if self.decay_style == "constant":
            return self.max_lr
        if n > self.decay_steps:
            return self.min_lr
        ratio = (n - self.warmup_steps) / max(1, self.decay_steps - self.warmup_steps)
        coeff = 1.0 - ratio if self.decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def warmup_fraction(self, n: int) -> float:
        """The fraction of the warmup's rise done after n of its steps. log is DeepSpeed's WarmupLR:
        ln(n) / ln(warmup) (its step counter lags ours by one, hence ln(n) and not ln(n + 1); it
        also never divides by ln(1), taking a warmup of at least 2 steps for the denominator)."""
        if self.warmup_style == "log":
            return math.log(max(n, 1)) / math.log(max(2, self.warmup_steps))
        return n / self.warmup_steps

    def get_wd(self) -> float:
        """Megatron's weight-decay increment: from the start value to the end one over wd_incr_steps,
        linearly or along a half cosine; the end value after them."""
        if self.wd_incr_style == "constant" or self.num_steps > self.wd_incr_steps:
            return self.end_weight_decay
        ratio = self.num_steps / max(1, self.wd_incr_steps)
        coeff = ratio if self.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.weight_decay + coeff * (self.end_weight_decay - self.weight_decay)

    def step(self, increment: int = 1) -> float:
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):  # a captured optimizer reads it in place
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        if self.wd_incr_style != "constant" and self.optimizer.param_groups:
            self.optimizer.param_groups[0]["weight_decay"] = self.get_wd()  # the decayed group (optimizer/base.py)
        return lr

    def state_dict(self) -> dict:
        return {"max_lr": self.max_lr, "min_lr": self.min_lr, "lr_warmup_steps": self.warmup_steps,
                "lr_decay_steps": self.decay_steps, "lr_decay_style": self.decay_style,
                "num_steps": self.num_steps, "start_wd": self.weight_decay, "end_wd": self.end_weight_decay,
                "wd_incr_steps": self.wd_incr_steps, "wd_incr_style": self.wd_incr_style,
                "lr_warmup_style": self.warmup_style, "lr_warmup_init": self.warmup_init}

    def differences(self, state: dict) -> list[str]:
        """The schedule settings of a saved `state_dict()` that differ from this schedule's, each
        as '--flag SAVED (checkpoint) vs RUN (run)' (settings the state lacks are not compared)."""
        constant = self.wd_incr_style == state.get("wd_incr_style", "constant") == "constant"
        out = []
        for key, attr, flag in SETTINGS:
            if key == "end_wd" and constant:  # a constant decay: the end is the start (--weight-decay)
                continue
            if key == "start_wd" and self.wd_incr_style != "constant":
                flag = "--start-weight-decay"
            if key in state and state[key] != getattr(self, attr):
                out.append(f"{flag} {state[key]} (checkpoint) vs {getattr(self, attr)} (run)")
        return out

    def load_state_dict(self, state: dict, use_checkpoint_settings: bool = True) -> None:
        """Resume at the saved step count (Megatron's num_steps). The settings (SETTINGS) come from
        the checkpoint, or stay this run's with `use_checkpoint_settings=False`
        (--override-opt_param-scheduler). Refusing a mismatch is the caller's job (`differences`)."""
        if use_checkpoint_settings:
            for key, attr, _ in SETTINGS:
                if key in state:
                    setattr(self, attr, state[key])
            # not compared (a longer run's default differs), but continued: past the saved horizon the
            # weight decay stays at its end value, as the LR stays at --min-lr past its decay
            self.wd_incr_steps = state.get("wd_incr_steps", self.wd_incr_steps)
        self.num_steps = int(state["num_steps"])
        if self.optimizer.param_groups:  # the first param group is the decayed one (optimizer/base.py)
            self.optimizer.param_groups[0]["weight_decay"] = self.get_wd()
        self.step(0)


# (state_dict key, attribute, the flag that sets it): the settings a resume compares (Megatron's
# OptimizerParamScheduler checks the same ones when it loads).
SETTINGS = (("max_lr", "max_lr", "--lr"), ("min_lr", "min_lr", "--min-lr"),
            ("lr_warmup_steps", "warmup_steps", "--lr-warmup-iters"),
            ("lr_decay_steps", "decay_steps", "--lr-decay-iters"),
            ("lr_decay_style", "decay_style", "--lr-decay-style"),
            ("start_wd", "weight_decay", "--weight-decay"),
            ("end_wd", "end_weight_decay", "--end-weight-decay"),
            ("wd_incr_style", "wd_incr_style", "--weight-decay-incr-style"),
            ("lr_warmup_style", "warmup_style", "--lr-warmup-style"),
            ("lr_warmup_init", "warmup_init", "--lr-warmup-init"))
WARMUP_STYLES = ("linear", "log")
WD_INCR_STYLES = ("constant", "linear", "cosine")
