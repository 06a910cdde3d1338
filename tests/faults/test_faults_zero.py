"""ZeRO stages and CPU offload, faulted the way users meet them: every combination that cannot work
is refused by `bash scripts/pretrain_gpt2.sh` before torchrun starts a process (one `error:` line
naming the flags and a fix, exit 2, no traceback, nothing written)."""
from __future__ import annotations

import pytest

from harness import ROOT, refused

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
]


@pytest.mark.parametrize("flags,expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_zero_flags_through_the_launcher(tmp_path, flags, expect):
    out = refused([*LAUNCHER, *TINY, *flags, "--save", tmp_path / "ck"], fault_class="ZeRO and offload flags",
                  case=f"{' '.join(flags)} (scripts/pretrain_gpt2.sh, 2 CPU processes)", expect=expect,
                  watch=[tmp_path], env=ENV)
    assert out.rc == 2 and "torch.distributed" not in out.output


def test_stage3_with_cuda_graph_is_refused_before_any_process_group():
    """On a GPU machine the CUDA-graph check passes the device test; stage 3 is then refused by name
    (checked in-process with a GPU assumed, as the estimator plans for GPUs)."""
    from megapar.arguments import ConfigError, config_from_namespace, parse_flags
    with pytest.raises(ConfigError, match="--zero-stage 3 allocates and frees.*CUDA graph"):
        config_from_namespace(parse_flags(["--zero-stage", "3", "--enable-cuda-graph", "--bf16", "--hidden-dropout",
                                           "0", "--attention-dropout", "0"]), 1, assume_gpus=True)
