"""Training scalars to TensorBoard and W&B through one writer (megapar/scalar_writer.py).

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

from megapar.scalar_writer import ScalarWriter

ROOT = Path(__file__).resolve().parent.parent
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
