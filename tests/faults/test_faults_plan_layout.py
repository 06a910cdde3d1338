"""tools/plan_layout.py, faulted the way users meet it: a GPU count below 1, a memory size it cannot read, a
calibration file that is missing or not JSON, a flag the planner chooses itself, a model no layout can run,
and --calibrate on a machine without a GPU -- each one `error:` line, exit 2, no traceback, nothing written."""
from __future__ import annotations

import pytest

from harness import ROOT, refused

PLAN = ["python", "tools/plan_layout.py", "--num-layers", "4", "--hidden-size", "96", "--num-attention-heads", "4",
        "--seq-length", "64", "--global-batch-size", "8"]
ENV = {"PYTHONPATH": str(ROOT)}

CASES = [  # (id, flags, expected fragments)
    ("--gpus 0", ["--gpus", "0"], "--gpus 0 must be >= 1"),
    ("--gpu-memory 80XB", ["--gpus", "2", "--gpu-memory", "80XB"], ["--gpu-memory '80XB'", "is not a memory size"]),
    ("--gpus-per-node 0", ["--gpus", "2", "--gpus-per-node", "0"], "--gpus-per-node 0 must be >= 1"),
    ("a flag the planner chooses", ["--gpus", "2", "--zero-stage", "3"], ["--zero-stage", "the planner chooses"]),
    ("a misspelled flag", ["--gpus", "2", "--gpu-memmory", "80GB"], "unrecognized arguments: --gpu-memmory"),
    ("heads and layers that no tp or pp divides", ["--gpus", "4", "--num-attention-heads", "3", "--num-layers", "3",
                                                   "--global-batch-size", "2"],
     ["no valid layout", "heads not divisible by tp", "global batch not divisible by dp"]),
    ("a model that fits nowhere", ["--gpus", "1", "--num-layers", "32", "--hidden-size", "4096",
                                   "--num-attention-heads", "32", "--seq-length", "2048", "--gpu-memory", "16GB",
                                   "--host-memory", "1GB"],
     ["no valid layout", "does not fit"]),
]


@pytest.mark.parametrize("flags,expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_plan_input(tmp_path, flags, expect):
    refused([*PLAN, *flags], fault_class="layout planner", case=f"{' '.join(flags)} (tools/plan_layout.py)",
            expect=expect, watch=[tmp_path], env=ENV)


def test_missing_calibration_file(tmp_path):
    refused([*PLAN, "--gpus", "2", "--calibration", tmp_path / "calib.json"], fault_class="layout planner",
            case="--calibration FILE that does not exist", expect=["--calibration", "cannot read it"],
            watch=[tmp_path], env=ENV)


@pytest.mark.parametrize("content,expect", [("{\"hbm_gbps\": 3000,\n", "not JSON (line 2"),
                                            ('{"hbm_gbps": -1}', "hbm_gbps must be a non-negative number"),
                                            ('{"gpu": "h100"}', "unknown calibration key(s) gpu")],
                         ids=["malformed JSON", "negative bandwidth", "unknown key"])
def test_bad_calibration_file(tmp_path, content, expect):
    path = tmp_path / "calib.json"
    path.write_text(content)
    refused([*PLAN, "--gpus", "2", "--calibration", path], fault_class="layout planner",
            case=f"--calibration with {content[:20]!r}", expect=expect, watch=[tmp_path], env=ENV)


def test_calibrate_without_a_gpu(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --calibrate would measure it")
    refused(["python", "tools/plan_layout.py", "--calibrate", "--out", tmp_path / "calib.json"],
            fault_class="layout planner", case="--calibrate on a CPU-only machine",
            expect="--calibrate needs a CUDA GPU; planning works without one", watch=[tmp_path], env=ENV)
