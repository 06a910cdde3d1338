"""--enable-zero-bubble (ZB-H1) where it cannot run, started the way users start training --
`bash scripts/pretrain_gpt2.sh` with 2 CPU processes: refused before torchrun starts a process (one
`error:` line naming the flags and the fix, exit 2, no traceback, nothing written)."""
from __future__ import annotations

import pytest

from harness import ROOT, refused

LAUNCHER = ["bash", "scripts/pretrain_gpt2.sh", "--nproc-per-node", "2"]
TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--enable-zero-bubble"]
PP2 = ["--pipeline-parallel", "2"]
ENV = {"PYTHONPATH": str(ROOT)}

CASES = [  # (id, flags, expected fragments)
    ("no pipeline", [], ["--enable-zero-bubble", "needs --pipeline-model-parallel-size > 1",
                         "drop --enable-zero-bubble"]),
    ("the afab schedule", PP2 + ["--pipeline-schedule", "afab"],
     ["--enable-zero-bubble", "not of --pipeline-schedule afab", "drop --pipeline-schedule afab"]),
    ("the interleaved schedule", PP2 + ["--virtual-pipeline-model-parallel-size", "2"],
     ["--enable-zero-bubble", "--virtual-pipeline-model-parallel-size 2", "drop the virtual-pipeline flags"]),
    ("ZeRO-2", PP2 + ["--zero-stage", "2"], ["--enable-zero-bubble", "--zero-stage 2", "use --zero-stage 0 or 1"]),
    ("ZeRO-3", PP2 + ["--zero-stage", "3"], ["--enable-zero-bubble", "--zero-stage 3", "use --zero-stage 0 or 1"]),
    ("unfused weight gradients", PP2 + ["--no-gradient-accumulation-fusion"],
     ["--enable-zero-bubble", "drop --no-gradient-accumulation-fusion"]),
]


@pytest.mark.parametrize("flags,expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_zero_bubble_flags_through_the_launcher(tmp_path, flags, expect):
    (tmp_path / "keep.txt").write_text("user data")
    out = refused([*LAUNCHER, *TINY, *flags, "--save", tmp_path / "ck"], fault_class="zero-bubble flags",
                  case=f"--enable-zero-bubble {' '.join(flags)} (scripts/pretrain_gpt2.sh, 2 CPU processes)",
                  expect=expect, watch=[tmp_path], env=ENV)
    assert out.rc == 2 and "torch.distributed" not in out.output


def test_fp8_is_refused():
    """fp8 needs a GPU, which the checks before this one require: the zero-bubble check alone, in process."""
    from megapar.config.build import ConfigError, _check_zero_bubble, parse_config
    cfg = parse_config(PP2 + ["--enable-zero-bubble"], 2)
    cfg.model.fp8_format = "e4m3"
    with pytest.raises(ConfigError, match=r"--enable-zero-bubble: --fp8-format e4m3.*drop --fp8-format"):
        _check_zero_bubble(cfg)
