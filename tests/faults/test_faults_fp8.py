"""--fp8-format, faulted the way users meet it: every setting that cannot run fp8 GEMMs is refused by
`bash scripts/pretrain_gpt2.sh` before torchrun starts a process (one `error:` line naming the flags
and a fix, exit 2, no traceback, nothing written). A GPU without FP8 and a missing torchao are
checked in-process (tests/model/test_fp8.py), as this machine has neither kind of GPU."""
from __future__ import annotations

import pytest

from harness import ROOT, refused

LAUNCHER = ["bash", "scripts/pretrain_gpt2.sh", "--nproc-per-node", "1"]
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--train-iters", "2"]
ENV = {"PYTHONPATH": str(ROOT)}

CASES = [  # (id, flags, expected fragments)
    ("on a CPU-only run", ["--fp8-format", "hybrid", "--bf16"],
     ["--fp8-format hybrid", "no CUDA GPU", "drop --fp8-format"]),
    ("without --bf16", ["--fp8-format", "e4m3"], ["--fp8-format e4m3 needs --bf16", "add --bf16"]),
    ("with --fp16", ["--fp8-format", "hybrid", "--fp16"], ["not --fp16", "use --bf16 instead of --fp16"]),
    ("hidden size not a multiple of 16", ["--fp8-format", "hybrid", "--bf16", "--hidden-size", "72"],
     ["multiples of 16", "--hidden-size 72"]),
    ("ffn size not a multiple of 16", ["--fp8-format", "hybrid", "--bf16", "--ffn-hidden-size", "100"],
     ["multiples of 16", "--ffn-hidden-size 100"]),
    ("rowwise with hybrid", ["--fp8-format", "hybrid", "--bf16", "--fp8-recipe", "rowwise"],
     ["--fp8-recipe rowwise", "use --fp8-format e4m3"]),
    ("recipe without a format", ["--fp8-recipe", "rowwise"], ["add --fp8-format e4m3 or drop it"]),
    ("unknown format", ["--fp8-format", "e5m2", "--bf16"], ["--fp8-format", "invalid choice"]),
]


@pytest.mark.parametrize("flags,expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_fp8_flags_through_the_launcher(tmp_path, flags, expect):
    out = refused([*LAUNCHER, *TINY, *flags, "--save", tmp_path / "ck"], fault_class="fp8 flags",
                  case=f"{' '.join(flags)} (scripts/pretrain_gpt2.sh, 1 CPU process)", expect=expect,
                  watch=[tmp_path], env=ENV)
    assert out.rc == 2 and "torch.distributed" not in out.output
