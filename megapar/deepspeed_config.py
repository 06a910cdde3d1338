"""`--deepspeed-config ds_config.json`: a DeepSpeed JSON config mapped onto megapar's flags.

    bash scripts/pretrain_gpt2.sh --deepspeed --deepspeed_config ds_config.json [megapar flags]

The config is read once, before validation, where `arguments.parse_flags` expands recipes, so
training, the launcher (which validates at the world size it will start) and
tools/estimate_memory.py all take it. Each key either sets a flag (KEY_TO_FLAG, the table in
docs/guide.md), is accepted but not acted on (NOT_ACTED_ON: megapar has no such knob; the keys are
printed once, with why), or is refused with one ConfigError naming the key path and a fix.

Rules:
  * `"auto"` means "not set here": the command line's flag, or megapar's default, applies;
  * a key absent from the config sets nothing, except inside `scheduler.params`, where DeepSpeed's
    defaults define the schedule (warmup_num_steps 1000, warmup_type "log", ...);
  * a flag set both on the command line and in the config must have the same value;
  * the batch triple train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps
    x data-parallel size needs the world size: `resolve_batch` completes it in
    `arguments.config_from_namespace`.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from .topology import _fail

AUTO = "auto"

# key path -> (flag dest, type) for the keys that map one to one.
KEY_TO_FLAG: dict[str, tuple[str, type]] = {
    "train_batch_size": ("global_batch_size", int),
    "train_micro_batch_size_per_gpu": ("micro_batch_size", int),
    "gradient_clipping": ("clip_grad", float),
    "steps_per_print": ("log_interval", int),
    "fp16.loss_scale_window": ("loss_scale_window", int),
    "fp16.hysteresis": ("hysteresis", int),
    "fp16.min_loss_scale": ("min_loss_scale", float),
    "optimizer.params.lr": ("lr", float),
    "optimizer.params.eps": ("adam_eps", float),
    "optimizer.params.weight_decay": ("weight_decay", float),
    "zero_optimization.stage": ("zero_stage", int),
}

# Accepted, not acted on: key path -> why.
_OWN_COMMS = "megapar schedules its own gradient and parameter communication, per layer, without buckets"
NOT_ACTED_ON: dict[str, str] = {
    "zero_allow_untested_optimizer": "megapar has one optimizer, AdamW",
    "memory_breakdown": "megapar logs memory after its first iterations anyway",
    "optimizer.params.torch_adam": "--adam-impl chooses the AdamW implementation",
    "zero_optimization.overlap_comm": _OWN_COMMS,
    "zero_optimization.contiguous_gradients": "megapar's gradients always live in contiguous fp32 buffers "
                                              "(one flat buffer; per-layer buckets and one shard at stages 2-3)",
    "zero_optimization.reduce_scatter": "megapar reduce-scatters gradients at --zero-stage >= 1, all-reduces at 0",
    "zero_optimization.reduce_bucket_size": _OWN_COMMS,
    "zero_optimization.allgather_partitions": "megapar all-gathers updated parameters at --zero-stage 1-2",
    "zero_optimization.allgather_bucket_size": _OWN_COMMS,
    "zero_optimization.round_robin_gradients": _OWN_COMMS,
    "zero_optimization.sub_group_size": "megapar steps each rank's whole optimizer shard at once",
    "zero_optimization.stage3_prefetch_bucket_size": "stage 3 prefetches exactly the next layer",
    "zero_optimization.stage3_max_live_parameters": "stage 3 holds at most two gathered layers",
    "zero_optimization.stage3_max_reuse_distance": "stage 3 gathers each layer again for its backward",
    "zero_optimization.stage3_param_persistence_threshold": "stage 3 shards every transformer layer's "
                                                           "parameters and keeps the others whole",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "checkpoints are megapar's own layout; "
                                                                   "tools/convert_to_hf.py writes full weights",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": "checkpoints are megapar's own layout; "
                                                                  "tools/convert_to_hf.py writes full weights",
    "zero_optimization.ignore_unused_parameters": "every GPT-2 parameter gets a gradient",
}
_OFFLOAD_NOT_ACTED_ON = {
    "pin_memory": "offloaded masters and gradients are always in pinned CPU memory (the Adam moments, never "
                  "copied, are not pinned)",
    "buffer_count": "an NVMe setting; megapar offloads to CPU memory only",
    "buffer_size": "an NVMe setting; megapar offloads to CPU memory only",
    "max_in_cpu": "an NVMe setting; megapar offloads to CPU memory only",
    "nvme_path": "megapar offloads to CPU memory only",
    "fast_init": "an NVMe setting; megapar offloads to CPU memory only",
}
NOT_ACTED_ON.update({f"zero_optimization.{offload}.{k}": why for offload in ("offload_optimizer", "offload_param")
                     for k, why in _OFFLOAD_NOT_ACTED_ON.items()})

# What each section may hold (anything else is an unknown key).
TOP_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
            "gradient_clipping", "steps_per_print", "wall_clock_breakdown", "fp16", "bf16", "bfloat16",
            "optimizer", "scheduler", "zero_optimization", "zero_allow_untested_optimizer", "memory_breakdown"}
FP16_KEYS = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale",
             "consecutive_hysteresis", "auto_cast"}
OPTIMIZER_PARAMS = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction"}
ZERO_KEYS = {"stage", "offload_optimizer", "offload_param"} | {
    k.split(".", 1)[1] for k in NOT_ACTED_ON if k.startswith("zero_optimization.") and k.count(".") == 1}
OFFLOAD_KEYS = {"device", "ratio"} | set(_OFFLOAD_NOT_ACTED_ON)
SCHEDULERS = {  # type -> its params (DeepSpeed's defaults; None: required)
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000, "warmup_type": "log",
                 "last_batch_iteration": -1},
    "WarmupDecayLR": {"total_num_steps": None, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": "log", "last_batch_iteration": -1},
    "WarmupCosineLR": {"total_num_steps": None, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log", "last_batch_iteration": -1},
}
DECAY_STYLE = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}
# Where an unknown key has a megapar flag, the error names it.
HINTS = {"activation_checkpointing": "use --recompute-granularity full (or selective)",
         "tensorboard": "use --tensorboard-dir", "flops_profiler": "use --profile",
         "checkpoint": "use --save / --load", "amp": "use --bf16 or --fp16"}


@dataclass
class DeepSpeedSettings:
    """What a DeepSpeed config set: flag values (dest -> value, with the key each came from), the
    gradient accumulation steps (resolved at world size by `resolve_batch`) and the keys accepted
    but not acted on."""
    path: str
    flags: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)       # dest -> key path
    gradient_accumulation_steps: Optional[int] = None
    not_acted_on: list[str] = field(default_factory=list)      # key paths

    def set(self, key: str, dest: str, value: Any) -> None:
        """Set flag `dest` from `key`; two keys that set one flag must agree."""
        if dest in self.flags and not _same(self.flags[dest], value):
            _fail(f"{self.path}: {self.origin[dest]} (= {_as_flag(dest, self.flags[dest])}) and {key} "
                  f"(= {_as_flag(dest, value)}) differ; make them equal or drop one")
        self.flags[dest] = value
        self.origin.setdefault(dest, key)

    def summary(self) -> list[str]:
        """The lines rank 0 prints at start: the flags set, and what was accepted but not acted on."""
        shown = [_as_flag(d, v) for d, v in self.flags.items()]
        line = f"> --deepspeed-config {self.path} set: {', '.join(shown) or 'nothing'}"
        if self.gradient_accumulation_steps is not None:
            line += f" (gradient_accumulation_steps {self.gradient_accumulation_steps})"
        lines = [line]
        if self.not_acted_on:
            by_reason: dict[str, list[str]] = {}
            for k in self.not_acted_on:
                by_reason.setdefault(NOT_ACTED_ON[k], []).append(k)
            why = "; ".join(f"{', '.join(keys)} ({reason})" for reason, keys in by_reason.items())
            lines.append(f"> --deepspeed-config {self.path}: accepted, not acted on: {why}")
        return lines

    def explain(self, message: str) -> str:
        """A validation error about flags this config set, with the keys they came from."""
        keys = [key for dest, key in self.origin.items()
                if re.search(re.escape(f"--{dest.replace('_', '-')}") + r"(?![\w-])", message)]
        return f"{message} (set by {', '.join(keys)} in {self.path})" if keys else message


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-12)
    return a == b


def _as_flag(dest: str, v: Any) -> str:
    """A flag and its value as a user would type it: `--zero-stage 3`, `--bf16`, `no --fp16`."""
    flag = f"--{dest.replace('_', '-')}"
    if v is True:
        return flag
    return f"no {flag}" if v is False or v is None else f"{flag} {v if isinstance(v, str) else _show(v)}"


def _show(v: Any) -> str:
    return json.dumps(v) if isinstance(v, (str, bool)) else f"{v:g}" if isinstance(v, float) else str(v)


# ---- reading the file -----------------------------------------------------------------------------
def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    dup = next((k for k in keys if keys.count(k) > 1), None)
    if dup is not None:
        raise ValueError(f"key {dup!r} appears twice in one object")
    return dict(pairs)


def load_json(path: str) -> dict[str, Any]:
    """The config's top-level object; one ConfigError for a missing, unreadable or malformed file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        _fail(f"--deepspeed-config {path}: no such file; give the path of a DeepSpeed JSON config")
    except IsADirectoryError:
        _fail(f"--deepspeed-config {path} is a directory; give the path of a DeepSpeed JSON config file")
    except (OSError, UnicodeDecodeError) as e:
        _fail(f"--deepspeed-config {path} cannot be read ({e.__class__.__name__}: {e}); check the file")
    try:
        raw = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        _fail(f"--deepspeed-config {path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}; "
              f"fix the file")
    except ValueError as e:
        _fail(f"--deepspeed-config {path} is not valid: {e}; keep one")
    if not isinstance(raw, dict):
        _fail(f"--deepspeed-config {path}: the top level is a JSON {type(raw).__name__}, not an object "
              f"({{\"train_batch_size\": ..., ...}}); fix the file")
    return raw


# ---- typed access with key paths ------------------------------------------------------------------
def _section(path: str, parent: dict, name: str, prefix: str, allowed: set[str]) -> dict[str, Any]:
    """The object under `name` ({} when absent or null), after refusing keys not in `allowed`."""
    key = f"{prefix}{name}"
    sec = parent.get(name)
    if sec is None:
        return {}
    if not isinstance(sec, dict):
        _fail(f"{path}: {key} must be a JSON object, not {json.dumps(sec)}; see docs/guide.md (Coming from DeepSpeed)")
    _check_keys(path, sec, key + ".", allowed)
    return sec


def _check_keys(path: str, obj: dict, prefix: str, allowed: set[str]) -> None:
    for k in obj:
        if k not in allowed:
            hint = HINTS.get(f"{prefix}{k}", "remove it; docs/guide.md (Coming from DeepSpeed) lists the keys "
                                             "megapar reads")
            _fail(f"{path}: unknown key {prefix}{k}: megapar does not read it; {hint}")


def _value(path: str, obj: dict, name: str, prefix: str, kind: type) -> Any:
    """obj[name] checked to be of `kind`; None when absent or "auto"."""
    v = obj.get(name)
    if v is None or v == AUTO:
        return None
    ok = (isinstance(v, bool) if kind is bool else
          isinstance(v, (int, float)) and not isinstance(v, bool) if kind is float else
          isinstance(v, int) and not isinstance(v, bool) if kind is int else isinstance(v, kind))
    if kind is int and isinstance(v, float) and v.is_integer():
        v, ok = int(v), True
    if not ok:
        want = {bool: "true or false", float: "a number", int: "an integer", str: "a string"}.get(kind, str(kind))
        _fail(f"{path}: {prefix}{name} {json.dumps(v)} must be {want} (or \"auto\")")
    return float(v) if kind is float else v


def _refuse(path: str, key: str, value: Any, why: str, fix: str) -> None:
    _fail(f"{path}: {key}: {json.dumps(value)} {why}; {fix}")


# ---- the sections ---------------------------------------------------------------------------------
def _simple(s: DeepSpeedSettings, raw: dict) -> None:
    """The KEY_TO_FLAG keys: one flag each."""
    for key, (dest, kind) in KEY_TO_FLAG.items():
        *parents, name = key.split(".")
        obj = raw
        for p in parents:
            obj = obj.get(p) if isinstance(obj.get(p), dict) else {}
        if key.startswith("fp16.") and obj.get("enabled") is False:
            continue  # DeepSpeed ignores the loss-scaler settings when fp16 is off
        v = _value(s.path, obj, name, key[: -len(name)], kind)
        if v is not None:
            s.set(key, dest, v)


def _top(s: DeepSpeedSettings, raw: dict) -> None:
    _check_keys(s.path, raw, "", TOP_KEYS)
    gas = _value(s.path, raw, "gradient_accumulation_steps", "", int)
    if gas is not None and gas < 1:
        _fail(f"{s.path}: gradient_accumulation_steps {gas} must be >= 1")
    s.gradient_accumulation_steps = gas
    if _value(s.path, raw, "wall_clock_breakdown", "", bool):
        s.set("wall_clock_breakdown", "timing_log_level", 1)
    s.not_acted_on += [k for k in ("zero_allow_untested_optimizer", "memory_breakdown") if k in raw]


def _precision(s: DeepSpeedSettings, raw: dict) -> None:
    """fp16 {enabled, loss_scale, initial_scale_power, ...}, bf16 / bfloat16 {enabled}."""
    fp16 = _section(s.path, raw, "fp16", "", FP16_KEYS)
    enabled = _value(s.path, fp16, "enabled", "fp16.", bool)
    if enabled is not None:
        s.set("fp16.enabled", "fp16", enabled)
    if enabled is not False:
        scale = _value(s.path, fp16, "loss_scale", "fp16.", float)
        if scale is not None and scale < 0:
            _refuse(s.path, "fp16.loss_scale", scale, "is negative", "use 0 (dynamic) or a positive static scale")
        if scale is not None:  # 0: dynamic loss scaling (no --loss-scale)
            s.set("fp16.loss_scale", "loss_scale", scale or None)
        power = _value(s.path, fp16, "initial_scale_power", "fp16.", int)
        if power is not None:
            if not 0 <= power <= 64:
                _refuse(s.path, "fp16.initial_scale_power", power, "is out of range", "use 0 to 64 (scale 2^p)")
            s.set("fp16.initial_scale_power", "initial_loss_scale", float(2 ** power))
        for name, why in (("consecutive_hysteresis", "megapar refills --hysteresis only when the scale grows"),
                          ("auto_cast", "megapar keeps the whole model in fp16 with fp32 masters")):
            if _value(s.path, fp16, name, "fp16.", bool):
                _refuse(s.path, f"fp16.{name}", True, f"is not supported ({why})", "set it to false")
    if "bf16" in raw and "bfloat16" in raw:
        _fail(f"{s.path}: bf16 and bfloat16 are the same section, given twice; keep one")
    name = "bfloat16" if "bfloat16" in raw else "bf16"
    bf16 = _value(s.path, _section(s.path, raw, name, "", {"enabled"}), "enabled", f"{name}.", bool)
    if bf16 is not None:
        s.set(f"{name}.enabled", "bf16", bf16)


def _optimizer(s: DeepSpeedSettings, raw: dict) -> None:
    """optimizer {type Adam | AdamW, params {lr, betas, eps, weight_decay, adam_w_mode, ...}}.
    DeepSpeed's Adam decouples weight decay by default (adam_w_mode true): that is megapar's AdamW."""
    opt = _section(s.path, raw, "optimizer", "", {"type", "params"})
    kind = _value(s.path, opt, "type", "optimizer.", str)
    if kind is not None and kind.lower() not in ("adam", "adamw"):
        _refuse(s.path, "optimizer.type", kind, "is not supported (megapar trains with AdamW)",
                'use "AdamW" (or "Adam")')
    params = _section(s.path, opt, "params", "optimizer.", OPTIMIZER_PARAMS)
    betas = params.get("betas")
    if betas is not None and betas != AUTO:
        if not (isinstance(betas, list) and len(betas) == 2 and all(
                isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas)):
            _refuse(s.path, "optimizer.params.betas", betas, "is not a pair of numbers", "use e.g. [0.9, 0.999]")
        s.set("optimizer.params.betas", "adam_beta1", float(betas[0]))
        s.set("optimizer.params.betas", "adam_beta2", float(betas[1]))
    decoupled = _value(s.path, params, "adam_w_mode", "optimizer.params.", bool)
    decay = _value(s.path, params, "weight_decay", "optimizer.params.", float)
    if decoupled is False and (kind or "").lower() == "adam" and decay:
        _refuse(s.path, "optimizer.params.adam_w_mode", False, "asks for L2 weight decay added to the gradient, "
                "which megapar's AdamW does not do", "set it to true (decoupled decay) or weight_decay to 0")
    if _value(s.path, params, "bias_correction", "optimizer.params.", bool) is False:
        _refuse(s.path, "optimizer.params.bias_correction", False, "is not supported (megapar's AdamW always "
                "corrects the moments' bias)", "set it to true or drop it")
    s.not_acted_on += ["optimizer.params.torch_adam"] if "torch_adam" in params else []


def _scheduler(s: DeepSpeedSettings, raw: dict, cli: dict[str, Any]) -> None:
    """scheduler {type WarmupLR | WarmupDecayLR | WarmupCosineLR, params}: megapar's schedule is a
    linear warmup from 0, then constant / linear / cosine decay to --min-lr at --lr-decay-iters."""
    sched = _section(s.path, raw, "scheduler", "", {"type", "params"})
    if not sched:
        return
    kind = _value(s.path, sched, "type", "scheduler.", str)
    if kind not in SCHEDULERS:
        _refuse(s.path, "scheduler.type", sched.get("type"), "is not a schedule megapar can run",
                f"use one of {', '.join(SCHEDULERS)}")
    defaults = SCHEDULERS[kind]
    given = _section(s.path, sched, "params", "scheduler.", set(defaults))
    params = {k: given.get(k, d) for k, d in defaults.items()}
    key = "scheduler.params."
    source = {k: key + k + ("" if k in given else " (absent: DeepSpeed's default)") for k in defaults}
    if params["warmup_type"] not in ("linear", AUTO):
        absent = "(DeepSpeed's default when absent) " if "warmup_type" not in given else ""
        _refuse(s.path, key + "warmup_type", params["warmup_type"],
                f"{absent}is not supported: megapar warms up linearly", 'set "warmup_type": "linear"')
    if params["last_batch_iteration"] not in (-1, AUTO):
        _refuse(s.path, key + "last_batch_iteration", params["last_batch_iteration"], "is not supported "
                "(megapar resumes the schedule from its checkpoint)", "use -1 or drop it")
    s.set("scheduler.type", "lr_decay_style", DECAY_STYLE[kind])
    steps = _value(s.path, params, "warmup_num_steps", key, int)
    if steps is not None:
        s.set(source["warmup_num_steps"], "lr_warmup_iters", steps)
    if "total_num_steps" in params:
        if params["total_num_steps"] is None:
            _fail(f"{s.path}: {kind} needs {key}total_num_steps; set it, or \"auto\" for --lr-decay-iters "
                  f"(default --train-iters)")
        total = _value(s.path, params, "total_num_steps", key, int)
        if total is not None:
            s.set(key + "total_num_steps", "lr_decay_iters", total)
    if kind == "WarmupCosineLR":
        _cosine(s, params, source, cli)
    else:
        _warmup_lr_range(s, params, source, decays=kind == "WarmupDecayLR")


def _warmup_starts_at_zero(s: DeepSpeedSettings, params: dict, name: str) -> None:
    """warmup_min_lr / warmup_min_ratio other than 0 cannot be honoured: megapar warms up from LR 0."""
    key = "scheduler.params."
    low = _value(s.path, params, name, key, float)
    if low:
        _refuse(s.path, key + name, low, "is not supported: megapar's warmup starts at LR 0",
                "use 0 (the nearest supported value)")


def _warmup_lr_range(s: DeepSpeedSettings, params: dict, source: dict[str, str], decays: bool) -> None:
    """WarmupLR / WarmupDecayLR: from warmup_min_lr (must be 0) up to warmup_max_lr (= --lr); the
    decay goes back to warmup_min_lr, i.e. --min-lr 0."""
    key = "scheduler.params."
    _warmup_starts_at_zero(s, params, "warmup_min_lr")
    high = _value(s.path, params, "warmup_max_lr", key, float)
    if high is not None:
        s.set(source["warmup_max_lr"], "lr", high)
    if decays:
        s.set(key + "warmup_min_lr", "min_lr", 0.0)


def _cosine(s: DeepSpeedSettings, params: dict, source: dict[str, str], cli: dict[str, Any]) -> None:
    """WarmupCosineLR: ratios of the optimizer's lr; --min-lr = cos_min_ratio x --lr."""
    from .arguments import default_of

    key = "scheduler.params."
    _warmup_starts_at_zero(s, params, "warmup_min_ratio")
    ratio = _value(s.path, params, "cos_min_ratio", key, float)
    if ratio is not None:
        if not 0 <= ratio <= 1:
            _refuse(s.path, key + "cos_min_ratio", ratio, "is out of range", "use a ratio in [0, 1]")
        lr = s.flags.get("lr", cli.get("lr", default_of("lr")))
        s.set(source["cos_min_ratio"], "min_lr", ratio * lr)


def _offload(s: DeepSpeedSettings, zero: dict, name: str, dest: str) -> None:
    """zero_optimization.offload_optimizer / offload_param {device cpu | none, ...}."""
    key = f"zero_optimization.{name}"
    sec = _section(s.path, zero, name, "zero_optimization.", OFFLOAD_KEYS)
    device = _value(s.path, sec, "device", key + ".", str)
    if device == "nvme":
        _refuse(s.path, key + ".device", device, "is not supported (megapar offloads to CPU memory only)",
                'use "cpu" (or "none")')
    if device not in (None, "cpu", "none"):
        _refuse(s.path, key + ".device", device, "is not a device", 'use "cpu" or "none"')
    if device is not None:
        s.set(key + ".device", dest, device == "cpu")
    ratio = _value(s.path, sec, "ratio", key + ".", float)
    if ratio is not None and ratio != 1.0:
        _refuse(s.path, key + ".ratio", ratio, "is not supported (megapar offloads all of the optimizer state)",
                "use 1.0 or drop it")
    s.not_acted_on += [f"{key}.{k}" for k in sec if f"{key}.{k}" in NOT_ACTED_ON]


def _zero(s: DeepSpeedSettings, raw: dict) -> None:
    zero = _section(s.path, raw, "zero_optimization", "", ZERO_KEYS)
    stage = _value(s.path, zero, "stage", "zero_optimization.", int)
    if stage is not None and stage not in (0, 1, 2, 3):
        _refuse(s.path, "zero_optimization.stage", stage, "is not a ZeRO stage", "use 0, 1, 2 or 3")
    _offload(s, zero, "offload_optimizer", "optimizer_cpu_offload")
    _offload(s, zero, "offload_param", "param_cpu_offload")
    s.not_acted_on += [f"zero_optimization.{k}" for k in zero if f"zero_optimization.{k}" in NOT_ACTED_ON]


def read(path: str, cli: dict[str, Any]) -> DeepSpeedSettings:
    """The settings of the config at `path` (`cli`: the command line's flags, for ratios of --lr)."""
    raw = load_json(path)
    s = DeepSpeedSettings(path)
    _top(s, raw)
    _precision(s, raw)
    _optimizer(s, raw)
    _zero(s, raw)
    _simple(s, raw)
    _scheduler(s, raw, cli)
    return s


def apply(path: str, given: dict[str, Any]) -> DeepSpeedSettings:
    """Merge the config at `path` into the command line's flags `given` (in place): a flag set on
    both sides must agree. Returns the settings (kept for `resolve_batch` and the start-up lines)."""
    s = read(path, given)
    for dest, value in s.flags.items():
        if dest in given and not _same(given[dest], value):
            _fail(f"{_as_flag(dest, given[dest])} on the command line and {s.origin[dest]} in {path} "
                  f"(= {_as_flag(dest, value)}) differ; drop one or make them equal")
        given[dest] = value
    return s


def resolve_batch(s: DeepSpeedSettings, micro: Optional[int], global_batch: Optional[int], default_micro: int,
                  dp: int) -> tuple[int, Optional[int]]:
    """(micro batch, global batch) with train_batch_size = micro x gradient_accumulation_steps x dp:
    any two of the three give the third; all three must agree. `micro` / `global_batch` are None
    where neither the command line nor the config gave them."""
    gas = s.gradient_accumulation_steps
    if gas is None:
        return (micro or default_micro), global_batch
    if micro is None and global_batch is not None:
        if global_batch % (gas * dp):
            _fail(f"{s.path}: the global batch (train_batch_size / --global-batch-size) {global_batch} is not "
                  f"divisible by gradient_accumulation_steps {gas} x data-parallel size {dp}; give "
                  f"train_micro_batch_size_per_gpu or change the batch")
        return global_batch // (gas * dp), global_batch
    micro = micro or default_micro
    if global_batch is not None and global_batch != micro * gas * dp:
        _fail(f"{s.path}: the global batch (train_batch_size / --global-batch-size) {global_batch} != micro batch "
              f"{micro} x gradient_accumulation_steps {gas} x data-parallel size {dp} (= {micro * gas * dp}); "
              f"give two of the three (\"auto\" for the third)")
    return micro, micro * gas * dp
