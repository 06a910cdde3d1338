"""Interleaved 1F1B flags started the way users start training -- `bash scripts/pretrain_gpt2.sh`
at --pipeline-parallel 2 (torchrun, 2 CPU processes) -- each refused before any process starts
or any file is written: one `error:` line naming the flags and a fix, exit 2, no traceback. A
checkpoint saved with model chunks, resumed without them, is refused naming the converter."""
from __future__ import annotations

import sys

import pytest

from harness import ROOT, refused

sys.path.insert(0, str(ROOT / "tests"))
from synthetic_data import byte_gpt2_files, random_corpus  # noqa: E402

TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--make-vocab-size-divisible-by", "32",
        "--eval-iters", "0", "--eval-interval", "0", "--log-interval", "1", "--attention-backend", "torch",
        "--split", "90,10,0", "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "2"]
LAUNCHER = ["bash", "scripts/pretrain_gpt2.sh", "--pipeline-parallel", "2"]
V2 = ["--virtual-pipeline-model-parallel-size", "2"]

CASES = [
    (V2 + ["--global-batch-size", "6"],
     ["number of microbatches (3", "must be a multiple of --pipeline-model-parallel-size 2", "--global-batch-size 8"]),
    (["--virtual-pipeline-model-parallel-size", "3"],
     ["--num-layers 4 is not divisible by --pipeline-model-parallel-size 2 x "
      "--virtual-pipeline-model-parallel-size 3"]),
    (V2 + ["--num-layers-per-virtual-pipeline-stage", "2"],
     ["--virtual-pipeline-model-parallel-size 2 disagrees with --num-layers-per-virtual-pipeline-stage 2"]),
    (V2 + ["--pipeline-schedule", "afab"], ["--pipeline-schedule afab has no interleaved form"]),
    (V2 + ["--decoder-last-pipeline-num-layers", "1"],
     ["cannot be combined with --decoder-first/last-pipeline-num-layers"]),
]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    d = tmp_path_factory.mktemp("data")
    vocab, merge = byte_gpt2_files(str(d))
    random_corpus(str(d / "corpus"), docs=200)
    return [*TINY, "--data-path", str(d / "corpus"), "--vocab-file", vocab, "--merge-file", merge,
            "--data-cache-path", str(d / "cache")]


@pytest.mark.parametrize("flags,expect", CASES, ids=[" ".join(f) for f, _ in CASES])
def test_bad_virtual_pipeline_flags_through_the_launcher(data, tmp_path, flags, expect):
    (tmp_path / "keep.txt").write_text("user data")
    out = refused([*LAUNCHER, *data, *flags, "--save", tmp_path / "ck"], fault_class="flags",
                  case=f"{' '.join(flags)} (scripts/pretrain_gpt2.sh, pp 2)", expect=expect, watch=[tmp_path])
    assert out.rc == 2 and "torch.distributed" not in out.output


def test_virtual_stages_need_a_pipeline():
    """pp 1 with v 2 (in process: the launcher would start one process for it)."""
    from megapar.config.build import parse_config
    from megapar.config.settings import ConfigError
    with pytest.raises(ConfigError, match=r"needs --pipeline-model-parallel-size > 1"):
        parse_config(V2, 1)


def test_resuming_a_chunked_checkpoint_without_chunks(data, tmp_path):
    ck = tmp_path / "ck"
    from harness import run
    saved = run([*LAUNCHER, *data, *V2, "--save", ck], timeout=300)
    assert saved.rc == 0, saved.output
    refused([*LAUNCHER, *data, "--train-iters", "3", "--load", ck, "--save", ck], fault_class="checkpoint file",
            case="v 2 checkpoint resumed at v 1 (scripts/pretrain_gpt2.sh, pp 2)",
            expect=["holds 2 model chunk(s) per pipeline rank", "--target-virtual-pipeline-parallel-size 1"],
            watch=[ck])
