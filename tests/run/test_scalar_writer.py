"""Training scalars to TensorBoard, W&B and CSV through one writer (megapar/run/scalar_writer.py).

The W&B test trains a tiny model with WANDB_MODE=offline (no network) and reads the run's
.wandb file back: its history holds the logged `lm loss` and `learning rate` of every step. It
skips where the optional wandb package is not installed (`pip install -e .[wandb]`). The refusal
when the package is missing is a fault case (tests/faults/test_faults_launch.py).
"""
from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from megapar.run.scalar_writer import ScalarWriter

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--log-interval", "1",
        "--eval-iters", "0", "--eval-interval", "0"]


class Recorder:
    def __init__(self):
        self.calls, self.closed = [], False

    def add_scalar(self, name, value, step):
        self.calls.append((name, value, step))

    def close(self):
        self.closed = True


def test_writer_fans_every_scalar_out_to_every_backend():
    a, b = Recorder(), Recorder()
    writer = ScalarWriter([a, b])
    writer.add_scalar("lm loss", 9.5, 1)
    writer.add_scalar("learning rate", 1e-4, 1)
    writer.close()
    assert a.calls == b.calls == [("lm loss", 9.5, 1), ("learning rate", 1e-4, 1)]
    assert a.closed and b.closed


def wandb_records(path: Path):
    """The protobuf records of a .wandb file: a 7-byte header (':W&B', magic, version), then
    LevelDB log blocks of 32 KiB holding records split in chunks (7-byte header: crc, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw, block, pos, data = path.read_bytes(), 32768, 7, b""
    assert raw[:4] == b":W&B", raw[:7]
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:  # block trailer
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if length == 0 and kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        data += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(data)
            yield record
            data = b""


def test_wandb_offline_run_holds_the_logged_scalars(embedded_data, tmp_path):
    pytest.importorskip("wandb")
    save_dir = tmp_path / "wandb_files"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "megapar.pretrain_gpt2", *embedded_data, *TINY,
                          "--data-cache-path", str(tmp_path / "cache"), "--wandb-project", "megapar-test",
                          "--wandb-exp-name", "tiny", "--wandb-save-dir", str(save_dir)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    logged = {int(i): (float(lr), float(loss)) for i, lr, loss in
              re.findall(r" iteration +(\d+)/.*?learning rate: (\S+) \|.*?lm loss: (\S+)", out.stdout)}
    runs = list(save_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list(save_dir.rglob("*"))
    history, names = {}, []
    for record in wandb_records(runs[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            names.append((record.run.project, record.run.display_name))
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[items["_step"]] = items
    assert names == [("megapar-test", "tiny")]
    assert sorted(history) == sorted(logged) == [1, 2, 3]
    for step, (lr, loss) in logged.items():  # the log prints 7 significant digits
        assert history[step]["lm loss"] == pytest.approx(loss, rel=1e-6)
        assert history[step]["learning rate"] == pytest.approx(lr, rel=1e-3)


def test_csv_writes_a_file_per_scalar_and_a_resumed_run_continues_it(tmp_path):
    from megapar.run.scalar_writer import CSV
    first = CSV(str(tmp_path / "csv"))
    first.add_scalar("lm loss", 9.5, 1)
    first.add_scalar("learning rate", 1e-4, 1)
    first.add_scalar("lm loss", 9.25, 2)
    first.close()
    again = CSV(str(tmp_path / "csv"))  # a resumed run appends, without a second header
    again.add_scalar("lm loss", 9.0, 3)
    again.close()
    assert (tmp_path / "csv" / "lm_loss.csv").read_text().splitlines() == ["step,lm loss", "1,9.5", "2,9.25", "3,9.0"]
    assert (tmp_path / "csv" / "learning_rate.csv").read_text().splitlines() == ["step,learning rate", "1,0.0001"]


@pytest.mark.slow
def test_a_deepspeed_config_run_logs_deepspeeds_log_warmup_to_csv(embedded_data, tmp_path):
    """A run from a DeepSpeed config with csv_monitor and a WarmupLR without warmup_type (DeepSpeed's
    log warm-up over 4 steps, peak 1e-3): learning_rate.csv holds, per iteration i (the LR its
    update used, after i - 1 steps), 1e-3 x ln(i - 1) / ln 4, by hand 0, 0, 0.5e-3 (ln 2 / ln 4),
    0.79248e-3 (ln 3 / ln 4), then 1e-3."""
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "train_batch_size": 4, "steps_per_print": 1,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 4}},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "tiny"}}))
    model = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
             "--eval-iters", "0", "--eval-interval", "0"]  # the batch and the log interval: from the config
    out = subprocess.run([sys.executable, "-m", "megapar.pretrain_gpt2", *embedded_data, *model, "--train-iters", "6",
                          "--data-cache-path", str(tmp_path / "cache"), "--deepspeed", "--deepspeed_config",
                          str(config)], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = (tmp_path / "csv" / "tiny" / "learning_rate.csv").read_text().splitlines()
    assert rows[0] == "step,learning rate"
    lrs = {int(step): float(lr) for step, lr in (r.split(",") for r in rows[1:])}
    assert sorted(lrs) == [1, 2, 3, 4, 5, 6]
    by_hand = {1: 0.0, 2: 0.0, 3: 0.5e-3, 4: 0.79248e-3, 5: 1e-3, 6: 1e-3}
    for i, lr in by_hand.items():
        assert lrs[i] == pytest.approx(lr, abs=1e-8), (i, lrs)
