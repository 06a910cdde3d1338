"""ZeRO stages and CPU offload, faulted the way users meet them: every combination that cannot work
is refused by `bash scripts/pretrain_gpt2.sh` before torchrun starts a process (one `error:` line
naming the flags and a fix, exit 2, no traceback, nothing written). NVMe offload's folder: a
missing, non-directory or read-only PATH is refused there too; a folder without room for the state,
or holding a rank folder already, once the model's size is known, before the model is built."""
from __future__ import annotations

import os
import shutil

import pytest

from harness import ROOT, refused
from test_faults_checkpoints import TINY as TINY_ONE, data  # noqa: F401

LAUNCHER = ["bash", "scripts/pretrain_gpt2.sh", "--nproc-per-node", "2"]   # 2 CPU processes: dp 2
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--train-iters", "2"]
ENV = {"PYTHONPATH": str(ROOT)}

CASES = [  # (id, flags, expected fragments)
    ("offload on a CPU-only run", ["--zero-stage", "2", "--optimizer-cpu-offload"],
     ["--optimizer-cpu-offload", "no CUDA GPU", "drop --optimizer-cpu-offload"]),
    ("param offload below stage 3", ["--zero-stage", "2", "--param-cpu-offload"],
     ["--param-cpu-offload", "needs --zero-stage 3", "--zero-stage 2"]),
    ("offload without ZeRO", ["--optimizer-cpu-offload"], ["needs --zero-stage 1, 2 or 3"]),
    ("stage 0 with the distributed optimizer", ["--zero-stage", "0", "--use-distributed-optimizer"],
     ["--use-distributed-optimizer (= --zero-stage 1) and --zero-stage 0"]),
    ("stage 4", ["--zero-stage", "4"], ["--zero-stage", "invalid choice"]),
    ("nvme offload without ZeRO", ["--optimizer-nvme-offload", "{tmp}"],
     ["--optimizer-nvme-offload", "needs --zero-stage 1, 2 or 3"]),
    ("nvme offload to a missing folder", ["--zero-stage", "1", "--optimizer-nvme-offload", "{tmp}/missing"],
     ["--optimizer-nvme-offload", "missing is not a directory", "create it"]),
    ("nvme offload to a file", ["--zero-stage", "1", "--optimizer-nvme-offload", "{tmp}/a_file"],
     ["a_file is not a directory"]),
    ("nvme offload with csrc's GPU AdamW", ["--zero-stage", "1", "--optimizer-nvme-offload", "{tmp}",
                                            "--adam-impl", "fused"], ["steps AdamW on the CPU"]),
    ("delayed update without offload", ["--zero-stage", "2", "--delayed-param-update"],
     ["--delayed-param-update", "is not offloaded", "add --optimizer-cpu-offload"]),
    ("half the optimizer offloaded", ["--zero-stage", "1", "--optimizer-offload-fraction", "0.5"],
     ["--optimizer-offload-fraction 0.5", "the whole optimizer state or none", "1.0"]),
    ("an offload fraction above 1", ["--zero-stage", "1", "--optimizer-offload-fraction", "2"],
     ["--optimizer-offload-fraction 2.0 is out of range"]),
    ("a negative bucket size", ["--zero-stage", "1", "--ddp-bucket-size", "-1"], ["--ddp-bucket-size -1 must be >= 1"]),
    ("a value for a switch", ["--zero-stage", "1", "--overlap-param-gather=yes"],
     ["--overlap-param-gather", "ignored explicit argument"]),
]


@pytest.mark.parametrize("flags,expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_zero_flags_through_the_launcher(tmp_path, flags, expect):
    (tmp_path / "a_file").write_text("the user's")
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    out = refused([*LAUNCHER, *TINY, *flags, "--save", tmp_path / "ck"], fault_class="ZeRO and offload flags",
                  case=f"{' '.join(flags)} (scripts/pretrain_gpt2.sh, 2 CPU processes)", expect=expect,
                  watch=[tmp_path], env=ENV)
    assert out.rc == 2 and "torch.distributed" not in out.output


def test_parameter_offload_with_cuda_graph_is_refused_before_any_process_group():
    """ZeRO-3 is captured, but not its host-side parameter shards: refused by name (checked in-process
    with a GPU assumed, as the estimator plans for GPUs); plain stage 3 passes."""
    from megapar.config.build import build_config
    from megapar.config.overlays import parse_flags
    from megapar.config.settings import ConfigError
    flags = ["--zero-stage", "3", "--enable-cuda-graph", "--bf16", "--hidden-dropout", "0", "--attention-dropout", "0"]
    with pytest.raises(ConfigError, match="--enable-cuda-graph: --param-cpu-offload fetches"):
        build_config(parse_flags([*flags, "--param-cpu-offload"]), 1, assume_gpus=True)
    build_config(parse_flags(flags), 1, assume_gpus=True)


def test_offload_with_cuda_graph_is_refused_before_any_process_group():
    """The offloaded step runs on the CPU, which no graph captures (checked in-process with a GPU assumed)."""
    from megapar.config.build import build_config
    from megapar.config.overlays import parse_flags
    from megapar.config.settings import ConfigError
    with pytest.raises(ConfigError, match="--enable-cuda-graph: the offloaded optimizer steps on the CPU"):
        build_config(parse_flags(["--zero-stage", "1", "--optimizer-cpu-offload", "--delayed-param-update",
                                           "--enable-cuda-graph", "--bf16", "--hidden-dropout", "0",
                                           "--attention-dropout", "0"]), 1, assume_gpus=True)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to a read-only folder")
def test_nvme_offload_to_a_read_only_folder(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o555)
    refused([*LAUNCHER, *TINY, "--zero-stage", "1", "--optimizer-nvme-offload", folder],
            fault_class="ZeRO and offload flags", case="--optimizer-nvme-offload to a read-only folder",
            expect=[f"--optimizer-nvme-offload {folder} is not writable"], watch=[tmp_path], env=ENV)


def _pretrain_nvme(data, tmp_path, *shape):
    return ["python", "-m", "megapar.pretrain_gpt2", *TINY_ONE, *data, *shape, "--zero-stage", "1",
            "--optimizer-nvme-offload", tmp_path]


def test_nvme_offload_without_room_is_refused_before_the_model_is_built(data, tmp_path):
    hidden = 8192                                 # 12 B/param of optimizer state, ~12 h^2 params per layer
    layers = shutil.disk_usage(tmp_path).free // (12 * 12 * hidden * hidden) + 2
    refused(_pretrain_nvme(data, tmp_path, "--num-layers", str(layers), "--hidden-size", str(hidden)),
            fault_class="ZeRO and offload flags",
            case=f"--optimizer-nvme-offload without room for the state ({layers} layers x hidden {hidden})",
            expect=[f"--optimizer-nvme-offload {tmp_path} has", "GiB free, but the optimizer state of the 1 rank",
                    "give a folder on a larger disk"], watch=[tmp_path], timeout=120)


def test_nvme_offload_never_reuses_a_rank_folder(data, tmp_path):
    """A rank folder already there (an earlier run's, or the user's) is refused, and kept as it is."""
    (tmp_path / "rank_00000").mkdir()
    (tmp_path / "rank_00000" / "exp_avg.bin").write_bytes(b"kept")
    refused(_pretrain_nvme(data, tmp_path), fault_class="ZeRO and offload flags",
            case="--optimizer-nvme-offload whose rank folder exists",
            expect=[f"{tmp_path / 'rank_00000'} already exists", "remove it or give another folder"],
            watch=[tmp_path], timeout=120)
