"""Where the training scalars go: TensorBoard (--tensorboard-dir), Weights & Biases
(--wandb-project, Megatron's flags), CSV files (--csv-log-dir, DeepSpeed's csv_monitor), any of
them together, or nowhere.

The training loop calls `writer.add_scalar(name, value, step)` once per scalar (training.py,
StepLog.record); `ScalarWriter` passes each call on to every backend the flags asked for, so
both receive exactly the same scalars. Only rank 0 writes. The packages are optional
(`pip install tensorboard`, `pip install wandb` or `pip install -e .[wandb]`); a run that asks for
a backend whose package is missing is refused before any work (config/checks.py, `_check_loggers`).
W&B runs offline with WANDB_MODE=offline (no network; `wandb sync DIR` uploads later).
"""
from __future__ import annotations

import csv
import os
from typing import Any, Optional, Protocol

from ..config.settings import Config


class Backend(Protocol):
    def add_scalar(self, name: str, value: float, step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoard:
    """torch.utils.tensorboard's SummaryWriter into --tensorboard-dir."""

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=log_dir)

    def add_scalar(self, name: str, value: float, step: int) -> None:
        self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class CSV:
    """One CSV file per scalar, `log_dir/<name>.csv` ('/' and ' ' in the name become '_'), with a
    `step,<name>` header and a `step,value` row per call: DeepSpeed's csv_monitor layout. Files are
    appended to, so a resumed run continues them (the header is written only into a new file)."""

    def __init__(self, log_dir: str):
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self.files: dict[str, Any] = {}

    def add_scalar(self, name: str, value: float, step: int) -> None:
        f = self.files.get(name)
        if f is None:
            path = os.path.join(self.log_dir, name.replace("/", "_").replace(" ", "_") + ".csv")
            f = self.files[name] = open(path, "a", newline="", encoding="utf-8")
            if f.tell() == 0:
                csv.writer(f).writerow(["step", name])
        csv.writer(f).writerow([step, value])
        f.flush()

    def close(self) -> None:
        for f in self.files.values():
            f.close()


class WandB:
    """One W&B run (project, name, files under `save_dir/wandb`), with the run's settings as its config."""

    def __init__(self, project: str, name: Optional[str], save_dir: str, config: dict[str, Any]):
        import wandb
        os.makedirs(save_dir, exist_ok=True)
        self.run = wandb.init(project=project, name=name, dir=save_dir, config=config)

    def add_scalar(self, name: str, value: float, step: int) -> None:
        self.run.log({name: value}, step=step)  # scalars of one step are committed together

    def close(self) -> None:
        self.run.finish()


class ScalarWriter:
    """Fans each scalar out to every backend."""

    def __init__(self, backends: list[Backend]):
        self.backends = backends

    def add_scalar(self, name: str, value: float, step: int) -> None:
        for backend in self.backends:
            backend.add_scalar(name, value, step)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()


def wandb_save_dir(cfg: Config) -> str:
    """--wandb-save-dir, else Megatron's default: <--save>/wandb, else ./wandb."""
    log = cfg.log
    return log.wandb_save_dir or os.path.join(cfg.ckpt.save or ".", "wandb")


def build_writer(cfg: Config, rank: int) -> Optional[ScalarWriter]:
    """The writer for rank 0 of a run that logs scalars; None on other ranks or when none was asked for."""
    if rank != 0:
        return None
    log, backends = cfg.log, []
    if log.tensorboard_dir:
        backends.append(TensorBoard(log.tensorboard_dir))
    if log.csv_log_dir:
        backends.append(CSV(log.csv_log_dir))
    if log.wandb_project:
        settings = {k: v for k, v in vars(cfg.megatron_args()).items() if isinstance(v, (int, float, str, bool, list))}
        backends.append(WandB(log.wandb_project, log.wandb_exp_name, wandb_save_dir(cfg), settings))
    return ScalarWriter(backends) if backends else None
