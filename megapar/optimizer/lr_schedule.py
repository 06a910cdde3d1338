"""Learning-rate schedule: a warmup, then linear/cosine decay to --min-lr (Megatron's
OptimizerParamScheduler, counted in iterations).

The warmup rises from --lr-warmup-init (default 0) to --lr: linearly (Megatron's: a fraction n / warmup
of the way after n steps) or by a log curve (DeepSpeed's WarmupLR default, which most DeepSpeed
configs get by leaving `warmup_type` out: ln(n) / ln(warmup) of the way, so the first two steps
run at the start value and most of the rise comes early)."""
from __future__ import annotations

import math

import torch


class OptimizerParamScheduler:
    def __init__(self, optimizer, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int,
                 decay_style: str = "cosine", weight_decay: float = 0.0, override_opt_param_scheduler: bool = False,
                 use_checkpoint_opt_param_scheduler: bool = False, warmup_style: str = "linear",
                 warmup_init: float = 0.0):
        if decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown --lr-decay-style {decay_style!r}")
        if warmup_style not in WARMUP_STYLES:
            raise ValueError(f"unknown --lr-warmup-style {warmup_style!r}")
        if not 0 <= min_lr <= max_lr:
            raise ValueError(f"need 0 <= --min-lr ({min_lr}) <= --lr ({max_lr})")
        if not 0 <= warmup_init <= max_lr:
            raise ValueError(f"need 0 <= --lr-warmup-init ({warmup_init}) <= --lr ({max_lr})")
        self.optimizer, self.max_lr, self.min_lr = optimizer, max_lr, min_lr
        self.warmup_steps, self.decay_steps = warmup_steps, max(decay_steps, warmup_steps)
        self.decay_style, self.weight_decay, self.warmup_style = decay_style, weight_decay, warmup_style
        self.warmup_init = warmup_init
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

    def step(self, increment: int = 1) -> float:
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):  # a captured optimizer reads it in place
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        return lr

    def state_dict(self) -> dict:
        return {"max_lr": self.max_lr, "min_lr": self.min_lr, "lr_warmup_steps": self.warmup_steps,
                "lr_decay_steps": self.decay_steps, "lr_decay_style": self.decay_style,
                "num_steps": self.num_steps, "start_wd": self.weight_decay, "end_wd": self.weight_decay,
                "wd_incr_style": "constant", "lr_warmup_style": self.warmup_style, "lr_warmup_init": self.warmup_init}

    def differences(self, state: dict) -> list[str]:
        """The schedule settings of a saved `state_dict()` that differ from this schedule's, each
        as '--flag SAVED (checkpoint) vs RUN (run)' (settings the state lacks are not compared)."""
        out = []
        for key, attr, flag in SETTINGS:
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
            if self.optimizer.param_groups:  # the first param group is the decayed one (optimizer/base.py)
                self.optimizer.param_groups[0]["weight_decay"] = self.weight_decay
        self.num_steps = int(state["num_steps"])
        self.step(0)


# (state_dict key, attribute, the flag that sets it): the settings a resume compares (Megatron's
# OptimizerParamScheduler checks the same ones when it loads).
SETTINGS = (("max_lr", "max_lr", "--lr"), ("min_lr", "min_lr", "--min-lr"),
            ("lr_warmup_steps", "warmup_steps", "--lr-warmup-iters"),
            ("lr_decay_steps", "decay_steps", "--lr-decay-iters"),
            ("lr_decay_style", "decay_style", "--lr-decay-style"),
            ("start_wd", "weight_decay", "--weight-decay"), ("lr_warmup_style", "warmup_style", "--lr-warmup-style"),
            ("lr_warmup_init", "warmup_init", "--lr-warmup-init"))
WARMUP_STYLES = ("linear", "log")
