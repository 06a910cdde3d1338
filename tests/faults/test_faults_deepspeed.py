"""--deepspeed-config and the memory estimator's own options, faulted the way users meet them.

deepspeed config: a key megapar cannot honour (NVMe parameter offload, NVMe optimizer offload without
its nvme_path, a 1-bit optimizer, curriculum learning, a misspelt key, a config with several such
problems), a file that is missing, is not JSON or nests too deeply for the parser, a flag given on
the command line and in the config with different values, and a batch triple that does not hold at
the world size the launcher starts -- each is refused by `bash scripts/pretrain_gpt2.sh` before
torchrun starts a process: one `error:` line naming the key (or file, line and column) and a fix
(every problem of the file, joined by "; "), exit 2, no traceback, nothing written.
`megapar-ds-config` ends a refused config the same way.
estimator: tools/estimate_memory.py refuses a size it cannot read (`--gpu-memory 80XB`), a count
below 1 and a bad DeepSpeed config the same way.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import ROOT, refused

LAUNCHER = ["bash", "scripts/pretrain_gpt2.sh", "--tensor-parallel", "2"]   # 2 CPU processes: world 2, dp 1
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--train-iters", "2"]
ESTIMATE = ["python", "tools/estimate_memory.py", "--num-layers", "4", "--hidden-size", "64",
            "--num-attention-heads", "8", "--seq-length", "32"]
ENV = {"PYTHONPATH": str(ROOT)}


def _config(folder: Path, content) -> Path:
    path = folder / "ds_config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content, indent=2))
    return path


LAUNCHER_CASES = [  # (id, config or text, extra flags, expected fragments)
    ("nvme offload", {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}},
     [], ['zero_optimization.offload_param.device: "nvme" is not supported', 'use "cpu"']),
    ("nvme optimizer offload without nvme_path",
     {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}, [],
     ['zero_optimization.offload_optimizer.device: "nvme" needs zero_optimization.offload_optimizer.nvme_path']),
    ("malformed JSON", '{\n  "train_batch_size": 8,\n  "bf16": {"enabled": true,}\n}', [],
     ["is not valid JSON", "line 3 column"]),
    ("missing file", None, [], ["no such file"]),
    ("flag and key differ", {"train_micro_batch_size_per_gpu": 2}, ["--micro-batch-size", "4"],
     ["--micro-batch-size 4 on the command line", "train_micro_batch_size_per_gpu"]),
    ("batch triple at world size", {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                                    "gradient_accumulation_steps": 4}, [],
     ["(train_batch_size / --global-batch-size) 16 != micro batch 2 x gradient_accumulation_steps 4 x "
      "data-parallel size 1"]),
    ("unknown key", {"zero_optimization": {"stage": 2, "overlap_com": True}}, [],
     ["unknown key zero_optimization.overlap_com: did you mean zero_optimization.overlap_comm?"]),
    ("every problem at once (1-bit optimizer, curriculum learning, aio, misspelt key, warmup type)",
     {"train_batch_sise": 8, "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}},
      "curriculum_learning": {"enabled": True, "curriculum_type": "seqlen"}, "aio": {"block_sise": 1048576},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "exp"}},
      "zero_optimization": {"overlap_comm": "yes"}}, [],
     ["unknown key train_batch_sise: did you mean train_batch_size?; ",
      'optimizer.type: "OneBitAdam" is not supported (1-bit Adam', 'use "AdamW"',
      'scheduler.params.warmup_type: "exp" is not a warmup DeepSpeed knows',
      "curriculum_learning.enabled: true is not supported", "did you mean aio.block_size?",
      'zero_optimization.overlap_comm "yes" must be true or false']),
    ("reduce bucket size 0", {"zero_optimization": {"stage": 1, "reduce_bucket_size": 0}}, [],
     ["--ddp-bucket-size 0 must be >= 1", "set by zero_optimization.reduce_bucket_size"]),
    ("nested too deeply", '{"train_batch_size": ' + "[" * 100_000 + "]" * 100_000 + "}", [],
     ["nests objects or arrays too deeply to read", "fix the file"]),
]


@pytest.mark.parametrize("content,extra,expect", [c[1:] for c in LAUNCHER_CASES], ids=[c[0] for c in LAUNCHER_CASES])
def test_bad_deepspeed_config_through_the_launcher(tmp_path, content, extra, expect):
    path = _config(tmp_path, content) if content is not None else tmp_path / "absent.json"
    out = refused([*LAUNCHER, *TINY, "--deepspeed", "--deepspeed_config", path, *extra,
                   "--data-path", tmp_path / "corpus", "--save", tmp_path / "ck"],
                  fault_class="deepspeed config", case=f"{' '.join(expect[:1])} (scripts/pretrain_gpt2.sh, tp 2)",
                  expect=expect, watch=[tmp_path], env=ENV)
    assert out.rc == 2 and "torch.distributed" not in out.output


ESTIMATOR_CASES = [
    (["--gpu-memory", "80XB"], ["--gpu-memory '80XB' is not a memory size", "80GB"]),
    (["--host-memory", "0TB"], ["--host-memory '0TB' is not a memory size"]),
    (["--host-memory=-1TB"], ["--host-memory '-1TB' is not a memory size"]),
    (["--gpu-memory", "80"], ["--gpu-memory '80' is not a memory size"]),
    (["--gpus-per-node", "0"], ["--gpus-per-node 0 must be >= 1"]),
    (["--gpus-per-node", "eight"], ["invalid int value: 'eight'"]),
    (["--world-size", "0"], ["--world-size 0 must be >= 1"]),
]


@pytest.mark.parametrize("flags,expect", ESTIMATOR_CASES, ids=[" ".join(f) for f, _ in ESTIMATOR_CASES])
def test_bad_estimator_option(tmp_path, flags, expect):
    refused([*ESTIMATE, *flags], fault_class="flags", case=f"{' '.join(flags)} (tools/estimate_memory.py)",
            expect=expect, watch=[tmp_path], env=ENV)


def test_refused_config_in_the_ds_config_tool(tmp_path):
    path = _config(tmp_path, {"optimizer": {"type": "OneBitLamb"}, "zero_optimisation": {"stage": 2}})
    refused(["python", "tools/ds_config.py", path, "--world-size", "2"], fault_class="deepspeed config",
            case="1-bit LAMB and a misspelt section (tools/ds_config.py)",
            expect=['optimizer.type: "OneBitLamb" is not supported', "did you mean zero_optimization?"],
            watch=[tmp_path], env=ENV)


def test_bad_deepspeed_config_in_the_estimator(tmp_path):
    path = _config(tmp_path, {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    refused([*ESTIMATE, "--deepspeed-config", path, "--gpu-memory", "80GB"], fault_class="deepspeed config",
            case="NVMe parameter offload (tools/estimate_memory.py)",
            expect='zero_optimization.offload_param.device: "nvme"', watch=[tmp_path], env=ENV)
