"""`--deepspeed-config ds_config.json`: a DeepSpeed JSON config read as DeepSpeed reads it, onto megapar's flags.

    bash scripts/pretrain_gpt2.sh --deepspeed --deepspeed_config ds_config.json [megapar flags]
    megapar-ds-config ds_config.json [--world-size N] [megapar flags]     # what it becomes, without a run

The config is read once, before validation, where `overlays.parse_flags` expands recipes, so
training, the launcher (which validates at the world size it will start), tools/estimate_memory.py
and `megapar-ds-config` all take it. Every key DeepSpeed reads falls in one class (its `Key` row in keys.py,
and the table in docs/guide.md, which `key_table()` writes):
  * honoured: it sets megapar flags;
  * noted (and the keys of a switched section while switched off): accepted and listed on one
    start-up line with why -- it only shapes how DeepSpeed schedules memory or communication, it
    is at DeepSpeed's default, it is switched off, or DeepSpeed itself ignores it;
  * refused: megapar cannot honour it (another optimizer, a switched-on section, ...).
Keys neither DeepSpeed nor megapar know are refused inside sections (DeepSpeed does too), with
"did you mean" for a near miss; at the top level DeepSpeed ignores them, and so does megapar
(noted) unless they are a near miss of a known key.

Rules:
  * `"auto"` means "not set here": the command line's flag, or megapar's default, applies; the
    start-up lines say what each one became;
  * a key absent from the config takes DeepSpeed's default where DeepSpeed's differs from
    megapar's or defines the feature (`Key.default`, and the scheduler's params): a flag given on the
    command line wins over such a default;
  * a flag set on the command line and by a key of the config must have the same value;
  * the batch triple train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps
    x data-parallel size needs the world size: `resolve_batch` completes it in
    `build.build_config`;
  * every problem of a config is reported at once, in one ConfigError.
"""
from __future__ import annotations

import difflib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from ..settings import default_of, fail, flag, flag_words
from .keys import BY_PATH, KEYS, NOTED

AUTO = "auto"
GUIDE = "docs/guide.md (Coming from DeepSpeed)"
# Values at which a "false only" key asks for nothing.
NOTED_ONLY_AT = {k: False for k, why in NOTED.items() if why.startswith("false only")}

OPTIMIZER_TYPES = {"adam", "adamw"}
REFUSED_OPTIMIZERS = {  # lower-cased type -> why
    "onebitadam": "1-bit Adam compresses its communication, which changes the update",
    "zerooneadam": "0/1 Adam compresses its communication, which changes the update",
    "onebitlamb": "1-bit LAMB is another optimizer",
    "lamb": "LAMB is another optimizer",
}
SCHEDULERS = {  # type -> its params (DeepSpeed's defaults; None: required)
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000, "warmup_type": "log",
                 "last_batch_iteration": -1},
    "WarmupDecayLR": {"total_num_steps": None, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": "log", "last_batch_iteration": -1},
    "WarmupCosineLR": {"total_num_steps": None, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log", "last_batch_iteration": -1},
}
DECAY_STYLE = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}
MONITOR_DEFAULTS = {"output_path": "", "job_name": "DeepSpeedJobName", "project": "deepspeed"}
REDUCE_DTYPES = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16", "half": "fp16",
                 "bf16": "bf16", "bfloat16": "bf16"}

def _section_keys(section: str) -> set[str]:
    """The keys of `section` the table names (one level down)."""
    prefix = section + "."
    return {k[len(prefix):].split(".")[0] for k in BY_PATH if k.startswith(prefix)} - {"*"}


# What each section may hold (anything else is an unknown key): the table's keys, and those of a noted `section.*`.
FP16_KEYS, OPTIMIZER_PARAMS = _section_keys("fp16"), _section_keys("optimizer.params")
OFFLOAD_KEYS = _section_keys("zero_optimization.offload_optimizer")
MONITOR_KEYS = {name: _section_keys(name) for name in ("tensorboard", "wandb", "csv_monitor")}
ACTIVATION_KEYS = {"partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
                   "number_checkpoints", "synchronize_checkpoint_boundary", "profile"}
FLOPS_KEYS = {"enabled", "profile_step", "module_depth", "top_modules", "detailed", "output_file",
              "recompute_fwd_factor"}
ZERO_KEYS = _section_keys("zero_optimization")
TOP_KEYS = {k.split(".")[0] for k in BY_PATH} | {"bfloat16"}


@dataclass
class DeepSpeedSettings:
    """What a DeepSpeed config set: flag values (dest -> value, with the key each came from), the
    gradient accumulation steps (resolved at world size by `resolve_batch`), the keys accepted but
    not acted on, the keys left "auto" (with the flags they would set) and the problems found."""
    path: str
    flags: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)       # dest -> key path
    defaulted: set[str] = field(default_factory=set)           # dests set by DeepSpeed's default for an absent key
    gradient_accumulation_steps: Optional[int] = None
    noted: dict[str, str] = field(default_factory=dict)        # key path -> why
    autos: dict[str, tuple[str, ...]] = field(default_factory=dict)   # key path -> the flags it leaves open
    problems: list[str] = field(default_factory=list)

    def set(self, key: str, dest: str, value: Any, default: bool = False) -> None:
        """Set flag `dest` from `key` (`default`: DeepSpeed's default for an absent key); two keys
        that set one flag must agree."""
        if dest in self.flags and not _same(self.flags[dest], value):
            self.problem(f"{self.origin[dest]} (= {_as_flag(dest, self.flags[dest])}) and {key} "
                         f"(= {_as_flag(dest, value)}) differ; make them equal or drop one")
            return
        if dest not in self.flags:
            self.flags[dest], self.origin[dest] = value, key
            if default:
                self.defaulted.add(dest)

    def note(self, key: str, why: str) -> None:
        self.noted.setdefault(key, why)

    def problem(self, message: str) -> None:
        if message not in self.problems:  # a key read by two sections is reported once
            self.problems.append(message)

    def check(self) -> None:
        """One ConfigError naming every problem found, if any."""
        if self.problems:
            fail(f"{self.path}: " + "; ".join(self.problems))

    def summary(self, cfg=None) -> list[str]:
        """The lines rank 0 prints at start: the flags set, what each "auto" became (from `cfg`,
        the resolved Config) and, on one line, the keys accepted but not acted on."""
        shown = [_as_flag(d, v) + (" (DeepSpeed's default)" if d in self.defaulted else "")
                 for d, v in self.flags.items()]
        line = f"> --deepspeed-config {self.path} set: {', '.join(shown) or 'nothing'}"
        if self.gradient_accumulation_steps is not None:
            line += f" (gradient_accumulation_steps {self.gradient_accumulation_steps})"
        lines = [line]
        if self.autos and cfg is not None:
            lines.append(f"> --deepspeed-config {self.path} \"auto\": " + ", ".join(
                f"{key} -> {_resolved(key, dests, cfg)}" for key, dests in self.autos.items()))
        if self.noted:
            by_reason: dict[str, list[str]] = {}
            for k, why in self.noted.items():
                by_reason.setdefault(why, []).append(k)
            why = "; ".join(f"{', '.join(keys)} ({reason})" for reason, keys in by_reason.items())
            lines.append(f"> --deepspeed-config {self.path}: accepted, not acted on: {why}")
        return lines


def _resolved(key: str, dests: tuple[str, ...], cfg) -> str:
    """What an "auto" key became in the resolved Config `cfg`."""
    if key == "gradient_accumulation_steps":
        return str(cfg.num_microbatches)
    if not dests:
        return "not acted on"
    if dests == ("lr_decay_iters",) and cfg.train.lr_decay_iters is None:
        return "no --lr-decay-iters (the decay ends with the run)"
    return ", ".join(_as_flag(d, cfg.get(d)) for d in dests)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-12)
    return a == b


def _as_flag(dest: str, v: Any) -> str:
    """A flag and its value as a user would type it: `--zero-stage 3`, `--bf16`, `no --fp16`, and a
    default-on switch turned off as its negative flag, `--no-overlap-grad-reduce`."""
    if v is True:
        return flag(dest)
    if v is False and flag_words(dest, False):
        return flag_words(dest, False)[0]
    return f"no {flag(dest)}" if v is False or v is None else f"{flag(dest)} {v if isinstance(v, str) else _show(v)}"


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
        fail(f"--deepspeed-config {path}: no such file; give the path of a DeepSpeed JSON config")
    except IsADirectoryError:
        fail(f"--deepspeed-config {path} is a directory; give the path of a DeepSpeed JSON config file")
    except (OSError, UnicodeDecodeError) as e:
        fail(f"--deepspeed-config {path} cannot be read ({e.__class__.__name__}: {e}); check the file")
    try:
        raw = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        fail(f"--deepspeed-config {path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}; "
             f"fix the file")
    except ValueError as e:
        fail(f"--deepspeed-config {path} is not valid: {e}; keep one")
    except RecursionError:   # the parser recurses once per level
        fail(f"--deepspeed-config {path} nests objects or arrays too deeply to read; a DeepSpeed config is a few "
             f"levels deep: fix the file")
    if not isinstance(raw, dict):
        fail(f"--deepspeed-config {path}: the top level is a JSON {type(raw).__name__}, not an object "
             f"({{\"train_batch_size\": ..., ...}}); fix the file")
    return raw


# ---- typed access with key paths ------------------------------------------------------------------
def _unknown(s: DeepSpeedSettings, key: str, name: str, allowed: set[str]) -> None:
    """Refuse the unknown key `key` (its last part `name`), naming a near miss among `allowed`."""
    near = difflib.get_close_matches(name, sorted(allowed), n=1, cutoff=0.75)
    hint = (f"did you mean {key[: -len(name)]}{near[0]}?" if near else
            f"remove it ({GUIDE} lists the keys megapar reads)")
    s.problem(f"unknown key {key}: {hint}")


def _section(s: DeepSpeedSettings, parent: dict, name: str, prefix: str, allowed: set[str],
             note: bool = True) -> dict[str, Any]:
    """The object under `name` ({} when absent, null or not an object), after refusing keys not in
    `allowed` and (`note`) noting those the table notes."""
    key = f"{prefix}{name}"
    sec = parent.get(name)
    if sec is None:
        return {}
    if not isinstance(sec, dict):
        s.problem(f"{key} must be a JSON object, not {json.dumps(sec)}")
        return {}
    for k, v in sec.items():
        if k not in allowed:
            _unknown(s, f"{key}.{k}", k, allowed)
        elif note and not isinstance(v, dict):
            _note_if_listed(s, f"{key}.{k}", v)
    return sec


def _note_if_listed(s: DeepSpeedSettings, key: str, value: Any) -> None:
    """Note `key` if the table notes it (or its section with `.*`); a "false only" key set to another
    value is refused."""
    why = NOTED.get(key) or NOTED.get(key.rsplit(".", 1)[0] + ".*")
    if why is None:
        return
    if key in NOTED_ONLY_AT and value not in (NOTED_ONLY_AT[key], None, AUTO):
        s.problem(f"{key}: {json.dumps(value)} is not supported ({why.split(': ', 1)[1]}); set it to "
                  f"{json.dumps(NOTED_ONLY_AT[key])} or drop it")
        return
    s.note(key, why)


def _value(s: DeepSpeedSettings, obj: dict, name: str, prefix: str, kind: type, dests: tuple[str, ...] = ()) -> Any:
    """obj[name] checked to be of `kind`; None when absent, "auto" (recorded with the flags `dests`
    it leaves open) or of the wrong type (a problem)."""
    v = obj.get(name)
    if v == AUTO:
        s.autos[prefix + name] = dests
    if v is None or v == AUTO:
        return None
    ok = (isinstance(v, bool) if kind is bool else
          isinstance(v, (int, float)) and not isinstance(v, bool) if kind is float else
          isinstance(v, int) and not isinstance(v, bool) if kind is int else isinstance(v, kind))
    if kind is int and isinstance(v, float) and v.is_integer():
        v, ok = int(v), True
    if not ok:
        want = {bool: "true or false", float: "a number", int: "an integer", str: "a string"}.get(kind, str(kind))
        s.problem(f"{prefix}{name} {json.dumps(v)} must be {want} (or \"auto\")")
        return None
    return float(v) if kind is float else v


def _refuse(s: DeepSpeedSettings, key: str, value: Any, why: str, fix: str) -> None:
    s.problem(f"{key}: {json.dumps(value)} {why}; {fix}")


# ---- the sections ---------------------------------------------------------------------------------
def _simple(s: DeepSpeedSettings, raw: dict) -> None:
    """The one-to-one keys: one flag each; absent ones with DeepSpeed's default (`Key.default`)."""
    fp16_on = _fp16_on(raw)
    for key, dest, kind, default in ((k.path, k.dest, k.type, k.default) for k in KEYS if k.dest):
        *parents, name = key.split(".")
        obj = raw
        for p in parents:
            obj = obj.get(p) if isinstance(obj.get(p), dict) else {}
        if key.startswith("fp16.") and not fp16_on:
            continue  # DeepSpeed ignores the loss-scaler settings when fp16 is off
        v = _value(s, obj, name, key[: -len(name)], kind, (dest,))
        if v is not None:
            s.set(key, dest, v)
        elif name not in obj and default is not None:
            s.set(f"{key} (absent: DeepSpeed's default)", dest, kind(default), default=True)


def _fp16_on(raw: dict) -> bool:
    """Whether DeepSpeed's fp16 may be on: `fp16.enabled` true or "auto" (absent: off)."""
    return isinstance(raw.get("fp16"), dict) and raw["fp16"].get("enabled") in (True, AUTO)


def _top(s: DeepSpeedSettings, raw: dict) -> None:
    """Unknown top-level keys (noted, as DeepSpeed ignores them, unless a near miss), the batch
    triple's third key, wall_clock_breakdown, communication_data_type and the noted top-level keys."""
    for k, v in raw.items():
        if k in BY_PATH and BY_PATH[k].disposition == "ignored":
            s.note(k, BY_PATH[k].why)
        elif k not in TOP_KEYS:
            if difflib.get_close_matches(k, sorted(TOP_KEYS), n=1, cutoff=0.75):
                _unknown(s, k, k, TOP_KEYS)
            else:
                s.note(k, "DeepSpeed ignores top-level keys it does not know")
        elif not isinstance(v, dict):
            _note_if_listed(s, k, v)
    gas = _value(s, raw, "gradient_accumulation_steps", "", int)
    if gas is not None and gas < 1:
        s.problem(f"gradient_accumulation_steps {gas} must be >= 1")
        gas = None
    s.gradient_accumulation_steps = gas
    if _value(s, raw, "wall_clock_breakdown", "", bool):
        s.set("wall_clock_breakdown", "timing_log_level", 1)
    dtype = _value(s, raw, "communication_data_type", "", str, ("grad_reduce_dtype",))
    if dtype is not None:
        if dtype.lower() not in REDUCE_DTYPES:
            _refuse(s, "communication_data_type", dtype, "is not a dtype megapar reduces gradients in",
                    'use "fp32", "bf16" or "fp16"')
        else:
            s.set("communication_data_type", "grad_reduce_dtype", REDUCE_DTYPES[dtype.lower()])


def _precision(s: DeepSpeedSettings, raw: dict) -> None:
    """fp16 {enabled, loss_scale, initial_scale_power, ...}, bf16 / bfloat16 {enabled}."""
    on = _fp16_on(raw)
    fp16 = _section(s, raw, "fp16", "", FP16_KEYS, note=on)
    enabled = _value(s, fp16, "enabled", "fp16.", bool, ("fp16",))
    if enabled is not None:
        s.set("fp16.enabled", "fp16", enabled)
    if on:  # DeepSpeed's fp16 is off unless enabled
        scale = _value(s, fp16, "loss_scale", "fp16.", float, ("loss_scale",))
        if scale is not None and scale < 0:
            _refuse(s, "fp16.loss_scale", scale, "is negative", "use 0 (dynamic) or a positive static scale")
        elif scale is not None:  # 0: dynamic loss scaling (no --loss-scale)
            s.set("fp16.loss_scale", "loss_scale", scale or None)
        power = _value(s, fp16, "initial_scale_power", "fp16.", int, ("initial_loss_scale",))
        if "initial_scale_power" not in fp16:
            power, key, default = BY_PATH["fp16.initial_scale_power"].default, "fp16.initial_scale_power (absent: " \
                                                                                "DeepSpeed's default)", True
        else:
            key, default = "fp16.initial_scale_power", False
        if power is not None and not 0 <= power <= 64:
            _refuse(s, "fp16.initial_scale_power", power, "is out of range", "use 0 to 64 (scale 2^p)")
        elif power is not None:
            s.set(key, "initial_loss_scale", float(2 ** power), default=default)
    elif fp16:
        s.note("fp16.*", "not used while fp16.enabled is false (DeepSpeed's default)")
    if "bf16" in raw and "bfloat16" in raw:
        s.problem("bf16 and bfloat16 are the same section, given twice; keep one")
    name = "bfloat16" if "bfloat16" in raw else "bf16"
    bf16 = _value(s, _section(s, raw, name, "", {"enabled", "immediate_grad_update"}), "enabled", f"{name}.", bool,
                  ("bf16",))
    if bf16 is not None:
        s.set(f"{name}.enabled", "bf16", bf16)


def _optimizer(s: DeepSpeedSettings, raw: dict) -> None:
    """optimizer {type Adam | AdamW, params {lr, betas, eps, weight_decay, adam_w_mode, ...}}.
    DeepSpeed's Adam decouples weight decay by default (adam_w_mode true): that is megapar's AdamW."""
    opt = _section(s, raw, "optimizer", "", {"type", "params"})
    kind = _value(s, opt, "type", "optimizer.", str)
    if kind is not None and kind.lower() not in OPTIMIZER_TYPES:
        why = REFUSED_OPTIMIZERS.get(kind.lower(), "is another optimizer")
        _refuse(s, "optimizer.type", kind, f"is not supported ({why}; megapar trains with AdamW)",
                'use "AdamW" (or "Adam")')
    params = _section(s, opt, "params", "optimizer.", OPTIMIZER_PARAMS)
    betas = params.get("betas")
    if betas == AUTO:
        s.autos["optimizer.params.betas"] = ("adam_beta1", "adam_beta2")
    elif betas is not None:
        if not (isinstance(betas, list) and len(betas) == 2 and all(
                isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas)):
            _refuse(s, "optimizer.params.betas", betas, "is not a pair of numbers", "use e.g. [0.9, 0.999]")
        else:
            s.set("optimizer.params.betas", "adam_beta1", float(betas[0]))
            s.set("optimizer.params.betas", "adam_beta2", float(betas[1]))
    decoupled = _value(s, params, "adam_w_mode", "optimizer.params.", bool)
    decay = _value(s, params, "weight_decay", "optimizer.params.", float)
    if decoupled is False and (kind or "").lower() == "adam" and decay:
        _refuse(s, "optimizer.params.adam_w_mode", False, "asks for L2 weight decay added to the gradient, "
                "which megapar's AdamW does not do", "set it to true (decoupled decay) or weight_decay to 0")
    if _value(s, params, "bias_correction", "optimizer.params.", bool) is False:
        _refuse(s, "optimizer.params.bias_correction", False, "is not supported (megapar's AdamW always "
                "corrects the moments' bias)", "set it to true or drop it")


def _scheduler(s: DeepSpeedSettings, raw: dict, cli: dict[str, Any]) -> None:
    """scheduler {type WarmupLR | WarmupDecayLR | WarmupCosineLR, params}: a log or linear warmup
    from 0 to --lr, then constant / linear / cosine decay to --min-lr at --lr-decay-iters."""
    sched = _section(s, raw, "scheduler", "", {"type", "params"})
    if not sched:
        return
    kind = _value(s, sched, "type", "scheduler.", str)
    if kind not in SCHEDULERS:
        _refuse(s, "scheduler.type", sched.get("type"), "is not a schedule megapar can run",
                f"use one of {', '.join(SCHEDULERS)}")
        return
    defaults = SCHEDULERS[kind]
    given = _section(s, sched, "params", "scheduler.", set(defaults))
    params = {k: given.get(k, d) for k, d in defaults.items()}
    key = "scheduler.params."
    source = {k: key + k + ("" if k in given else " (absent: DeepSpeed's default)") for k in defaults}
    absent = {k for k in defaults if k not in given}
    s.set("scheduler.type", "lr_decay_style", DECAY_STYLE[kind])
    style = _value(s, params, "warmup_type", key, str, ("lr_warmup_style",))
    if style is not None and style not in ("log", "linear"):
        _refuse(s, key + "warmup_type", style, "is not a warmup DeepSpeed knows", 'use "log" or "linear"')
    elif style is not None:
        s.set(source["warmup_type"], "lr_warmup_style", style, default="warmup_type" in absent)
    if params["last_batch_iteration"] not in (-1, AUTO):
        _refuse(s, key + "last_batch_iteration", params["last_batch_iteration"], "is not supported "
                "(megapar resumes the schedule from its checkpoint)", "use -1 or drop it")
    steps = _value(s, params, "warmup_num_steps", key, int, ("lr_warmup_iters",))
    if steps is not None:
        if style == "log" and steps < 2:  # DeepSpeed warms up over at least 2 steps
            steps = 2
        s.set(source["warmup_num_steps"], "lr_warmup_iters", steps, default="warmup_num_steps" in absent)
    if "total_num_steps" in params:
        if params["total_num_steps"] is None:
            s.problem(f"{kind} needs {key}total_num_steps; set it, or \"auto\" for --lr-decay-iters "
                      f"(default --train-iters)")
        total = _value(s, params, "total_num_steps", key, int, ("lr_decay_iters",))
        if total is not None:
            s.set(key + "total_num_steps", "lr_decay_iters", total)
    if kind == "WarmupCosineLR":
        _cosine(s, params, source, absent, cli)
    else:
        _warmup_lr_range(s, params, source, absent, decays=kind == "WarmupDecayLR")


def _warmup_lr_range(s: DeepSpeedSettings, params: dict, source: dict[str, str], absent: set[str],
                     decays: bool) -> None:
    """WarmupLR / WarmupDecayLR: from warmup_min_lr (--lr-warmup-init) up to warmup_max_lr (--lr);
    the decay goes back to warmup_min_lr (--min-lr)."""
    key = "scheduler.params."
    low = _value(s, params, "warmup_min_lr", key, float, ("lr_warmup_init", "min_lr") if decays else
                 ("lr_warmup_init",))
    if low is not None:
        s.set(source["warmup_min_lr"], "lr_warmup_init", low, default="warmup_min_lr" in absent)
        if decays:
            s.set(source["warmup_min_lr"], "min_lr", low, default="warmup_min_lr" in absent)
    high = _value(s, params, "warmup_max_lr", key, float, ("lr",))
    if high is not None:
        s.set(source["warmup_max_lr"], "lr", high, default="warmup_max_lr" in absent)


def _cosine(s: DeepSpeedSettings, params: dict, source: dict[str, str], absent: set[str],
            cli: dict[str, Any]) -> None:
    """WarmupCosineLR: ratios of the optimizer's lr: --lr-warmup-init = warmup_min_ratio x --lr,
    --min-lr = cos_min_ratio x --lr."""
    key = "scheduler.params."
    lr = s.flags.get("lr", cli.get("lr", default_of("lr")))
    for name, dest in (("warmup_min_ratio", "lr_warmup_init"), ("cos_min_ratio", "min_lr")):
        ratio = _value(s, params, name, key, float, (dest,))
        if ratio is not None and not 0 <= ratio <= 1:
            _refuse(s, key + name, ratio, "is out of range", "use a ratio in [0, 1]")
        elif ratio is not None:
            s.set(source[name], dest, ratio * lr, default=name in absent)


def _offload(s: DeepSpeedSettings, zero: dict, name: str, dest: str) -> None:
    """zero_optimization.offload_optimizer / offload_param {device cpu | nvme (optimizer only) | none, ...}."""
    key = f"zero_optimization.{name}"
    sec = _section(s, zero, name, "zero_optimization.", OFFLOAD_KEYS)
    device = _value(s, sec, "device", key + ".", str)
    nvme_ok = name == "offload_optimizer"
    if device == "nvme" and nvme_ok:
        _nvme_offload(s, sec, key)
    elif device == "nvme":
        _refuse(s, key + ".device", device, "is not supported (megapar offloads parameters to CPU memory only)",
                'use "cpu" (or "none")')
    elif device not in (None, "cpu", "none"):
        _refuse(s, key + ".device", device, "is not a device", 'use "cpu", "nvme" or "none"' if nvme_ok else
                'use "cpu" or "none"')
    elif device is not None:
        s.set(key + ".device", dest, device == "cpu")
    if nvme_ok and device != "nvme" and "nvme_path" in sec:
        s.note(key + ".nvme_path", "used with device nvme only")
    ratio = _value(s, sec, "ratio", key + ".", float)
    if ratio is not None and ratio != 1.0:
        _refuse(s, key + ".ratio", ratio, "is not supported (megapar offloads all of the optimizer state)",
                "use 1.0 or drop it")


def _nvme_offload(s: DeepSpeedSettings, sec: dict, key: str) -> None:
    """offload_optimizer {device: nvme, nvme_path: PATH} -> --optimizer-nvme-offload PATH."""
    path = _value(s, sec, "nvme_path", key + ".", str, ("optimizer_nvme_offload",))
    if path is None and sec.get("nvme_path") != AUTO:
        s.problem(f'{key}.device: "nvme" needs {key}.nvme_path, the folder on the NVMe disk for the state files; '
                  f"add it")
    elif path is not None:
        s.set(key + ".nvme_path", "optimizer_nvme_offload", path)


def _zero(s: DeepSpeedSettings, raw: dict) -> None:
    """zero_optimization {stage, offload_*, ...}, or DeepSpeed's legacy boolean (true: stage 1)."""
    if isinstance(raw.get("zero_optimization"), bool):
        s.set("zero_optimization", "zero_stage", int(raw["zero_optimization"]))
        return
    zero = _section(s, raw, "zero_optimization", "", ZERO_KEYS)
    stage = _value(s, zero, "stage", "zero_optimization.", int, ("zero_stage",))
    if stage is not None and stage not in (0, 1, 2, 3):
        _refuse(s, "zero_optimization.stage", stage, "is not a ZeRO stage", "use 0, 1, 2 or 3")
    elif stage is not None:
        s.set("zero_optimization.stage", "zero_stage", stage)
    _offload(s, zero, "offload_optimizer", "optimizer_cpu_offload")
    _offload(s, zero, "offload_param", "param_cpu_offload")
    for old, dest in (("cpu_offload", "optimizer_cpu_offload"), ("cpu_offload_param", "param_cpu_offload")):
        on = _value(s, zero, old, "zero_optimization.", bool)
        if on is not None:
            s.set(f"zero_optimization.{old}", dest, on)


def _monitors(s: DeepSpeedSettings, raw: dict) -> None:
    """tensorboard / csv_monitor {enabled, output_path, job_name}: output_path/job_name, as DeepSpeed
    writes there; wandb {enabled, project, group, team}."""
    for name, dest in (("tensorboard", "tensorboard_dir"), ("csv_monitor", "csv_log_dir"), ("wandb", "wandb_project")):
        sec = _section(s, raw, name, "", MONITOR_KEYS[name])
        if not _value(s, sec, "enabled", f"{name}.", bool):
            continue
        used = ("project",) if name == "wandb" else ("output_path", "job_name")
        values = [_value(s, sec, k, f"{name}.", str) or MONITOR_DEFAULTS[k] for k in used]
        s.set(f"{name}.enabled", dest, values[0] if name == "wandb" else os.path.join(*values))
        for k in ("enabled", *used):
            s.noted.pop(f"{name}.{k}", None)


def _flops_profiler(s: DeepSpeedSettings, raw: dict) -> None:
    """flops_profiler {enabled, profile_step, ...}: --profile of that one step."""
    sec = _section(s, raw, "flops_profiler", "", FLOPS_KEYS)
    if _value(s, sec, "enabled", "flops_profiler.", bool):
        step = _value(s, sec, "profile_step", "flops_profiler.", int)
        step = 1 if step is None else step
        s.set("flops_profiler.enabled", "profile", True)
        s.set("flops_profiler.profile_step", "profile_step_start", step)
        s.set("flops_profiler.profile_step", "profile_step_end", step + 1)
        for k in ("enabled", "profile_step"):
            s.noted.pop(f"flops_profiler.{k}", None)


def _layout(s: DeepSpeedSettings, raw: dict) -> None:
    """tensor_parallel {autotp_size}: --tensor-model-parallel-size; sequence_parallel_size (Ulysses):
    1 only; pipeline {stages, ...}: stages is --pipeline-model-parallel-size; the rest noted."""
    tp = _section(s, raw, "tensor_parallel", "", {"autotp_size", "tp_overlap_comm", "partition_config"})
    size = _value(s, tp, "autotp_size", "tensor_parallel.", int, ("tensor_model_parallel_size",))
    if size is not None:
        s.noted.pop("tensor_parallel.autotp_size", None)
        s.set("tensor_parallel.autotp_size", "tensor_model_parallel_size", size)
    ulysses = _value(s, raw, "sequence_parallel_size", "", int)
    if ulysses is not None and ulysses != 1:
        _refuse(s, "sequence_parallel_size", ulysses, "is not supported (megapar has no DeepSpeed-Ulysses sequence "
                "parallelism)", "use 1; --tensor-model-parallel-size with --sequence-parallel splits long sequences' "
                "activations instead")
    elif ulysses == 1:
        s.note("sequence_parallel_size", "1: no sequence parallelism asked for")
    sec = _section(s, raw, "pipeline", "", {"stages", "partition", "seed_layers", "activation_checkpoint_interval",
                                            "pipe_partitioned", "grad_partitioned", "use_reentrant"})
    stages = _value(s, sec, "stages", "pipeline.", int, ("pipeline_model_parallel_size",))
    if stages is not None:
        s.noted.pop("pipeline.stages", None)
        s.set("pipeline.stages", "pipeline_model_parallel_size", stages)


def _noted_sections(s: DeepSpeedSettings, raw: dict) -> None:
    """Sections whose every key is noted (activation_checkpointing, ...), data_types, and the
    switched sections: noted while off, refused when on; aio (tunes NVMe I/O)."""
    _section(s, raw, "activation_checkpointing", "", ACTIVATION_KEYS)
    for name in ("comms_logger", "timers", "checkpoint", "compile"):
        sec = raw.get(name)
        if isinstance(sec, dict):
            for k in sec:
                s.note(f"{name}.{k}", NOTED[f"{name}.*"])
        elif sec is not None:
            s.problem(f"{name} must be a JSON object, not {json.dumps(sec)}")
    _section(s, raw, "data_types", "", {"grad_accum_dtype"})
    for name, fix, given in ((k.path, k.why, k.disposition == "given") for k in KEYS
                             if k.disposition in ("switched", "given")):
        sec = raw.get(name)
        if sec is None:
            continue
        if not isinstance(sec, dict):
            s.problem(f"{name} must be a JSON object, not {json.dumps(sec)}")
        elif given and sec:
            s.problem(f"{name} is not supported; {fix}")
        elif sec.get("enabled") in (True, AUTO):
            s.problem(f"{name}.enabled: true is not supported; {fix}")
        else:
            for k in sec:
                s.note(f"{name}.{k}", f"{name} is switched off")
    _section(s, raw, "aio", "", _section_keys("aio"))


def read(path: str, cli: dict[str, Any], strict: bool = True) -> DeepSpeedSettings:
    """The settings of the config at `path` (`cli`: the command line's flags, for ratios of --lr).
    `strict`: raise one ConfigError naming every problem; else leave them in `problems`."""
    raw = load_json(path)
    s = DeepSpeedSettings(path)
    _top(s, raw)
    _precision(s, raw)
    _optimizer(s, raw)
    _zero(s, raw)
    _simple(s, raw)
    _scheduler(s, raw, cli)
    _monitors(s, raw)
    _flops_profiler(s, raw)
    _layout(s, raw)
    _noted_sections(s, raw)
    if strict:
        s.check()
    return s


def apply(path: str, given: dict[str, Any], strict: bool = True, below: frozenset[str] = frozenset()
          ) -> DeepSpeedSettings:
    """Read the config at `path` against the flags `given` (the recipes' and the command line's
    values): a flag set on the command line and by a key must agree, and a given flag wins over
    DeepSpeed's default for an absent key (that key's value is dropped from `flags`). `below`: the
    flags of `given` that a key overrides (a recipe's: recipes < config < command line). Returns the
    settings: `flags` is what the config's overlay sets (overlays.add_deepspeed); the rest is kept
    for `resolve_batch` and the start-up lines."""
    s = read(path, given, strict=False)
    for dest in list(s.flags):
        value = s.flags[dest]
        if dest in given and dest in s.defaulted:
            del s.flags[dest], s.origin[dest]
        elif dest in given and dest not in below and not _same(given[dest], value):
            s.problem(f"{_as_flag(dest, given[dest])} on the command line and {s.origin[dest]} "
                      f"(= {_as_flag(dest, value)}) differ; drop one or make them equal")
    if strict:
        s.check()
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
            fail(f"{s.path}: the global batch (train_batch_size / --global-batch-size) {global_batch} is not "
                 f"divisible by gradient_accumulation_steps {gas} x data-parallel size {dp}; give "
                 f"train_micro_batch_size_per_gpu or change the batch", "global_batch_size")
        return global_batch // (gas * dp), global_batch
    micro = micro or default_micro
    if global_batch is not None and global_batch != micro * gas * dp:
        fail(f"{s.path}: the global batch (train_batch_size / --global-batch-size) {global_batch} != micro batch "
             f"{micro} x gradient_accumulation_steps {gas} x data-parallel size {dp} (= {micro * gas * dp}); "
             f"give two of the three (\"auto\" for the third)", "global_batch_size", "micro_batch_size")
    return micro, micro * gas * dp


# ---- the key table (docs/guide.md) -----------------------------------------------------------------
def key_table() -> str:
    """docs/guide.md's table of every key: honoured (what it becomes), noted (why), refused."""
    kinds = {"honoured": "honoured", "noted": "noted", "ignored": "noted", "given": "refused when given",
             "switched": "noted while `enabled` is false; refused when true"}
    rows = [f"| `{k.path}{'.*' if k.disposition in ('switched', 'given') else ''}` | {kinds[k.disposition]} | {k.why} |"
            for k in KEYS]
    rows += [f"| `optimizer.type` {t} | refused | {why} |" for t, why in REFUSED_OPTIMIZERS.items()]
    rows += ["| any other key in a section | refused | with \"did you mean\" for a near miss |",
             "| any other top-level key | noted | DeepSpeed ignores it (a near miss of a known key is refused) |"]
    return "\n".join(["| key | class | megapar |", "|---|---|---|", *rows])
