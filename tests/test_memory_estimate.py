"""The memory estimator: parameter counts equal the real model's; the model of the bytes
reproduces the peak memory measured on GPUs (docs/performance.md) within 10%."""
import pytest

from gpt_helpers import tiny_model_config
from megapar.arguments import parse_config
from megapar.memory_estimate import GiB, estimate, stage_params
from megapar.model import GPT2Model, Stage, set_vocab

GPT2_345M = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
             "--bf16", "--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_stage_params_equal_the_built_model(pp):
    cfg = tiny_model_config(["--pipeline-parallel", str(pp)], world_size=pp)
    for stage in range(pp):
        model = GPT2Model(cfg.model, Stage.of(4, pp, stage), seed=1)
        assert stage_params(cfg, stage) == sum(p.numel() for p in model.parameters())


def _peak(flags, world):
    cfg = parse_config(GPT2_345M + flags, world_size=world)
    set_vocab(cfg.model, 50257, cfg.parallel.tensor_model_parallel_size, log=lambda *_: None)
    return max(s.total for s in estimate(cfg)) / GiB, cfg


# max allocated GiB measured by benchmarks/bench_train.py on an H100 / 4x H200 (2026-11-21, docs/performance.md)
MEASURED = [
    (["--micro-batch-size", "8"], 1, 13.6),
    (["--micro-batch-size", "8", "--global-batch-size", "32", "--use-distributed-optimizer"], 4, 10.6),
    (["--micro-batch-size", "8", "--tensor-parallel", "2"], 2, 7.6),
    (["--micro-batch-size", "8", "--global-batch-size", "64", "--pipeline-parallel", "2"], 2, 9.6),
    (["--micro-batch-size", "8", "--global-batch-size", "64", "--pipeline-parallel", "4"], 4, 8.3),
    (["--micro-batch-size", "8", "--global-batch-size", "64", "--tensor-parallel", "2", "--pipeline-parallel", "2",
      "--use-distributed-optimizer"], 4, 5.7),
]


@pytest.mark.parametrize("flags,world,measured", MEASURED)
def test_prediction_within_10_percent_of_measured_peak(flags, world, measured):
    predicted, _ = _peak(flags, world)
    assert abs(predicted - measured) / measured < 0.10, (predicted, measured)


def test_zero1_and_recompute_shrink_what_they_should():
    base, cfg = _peak(["--micro-batch-size", "8", "--global-batch-size", "32"], 4)
    zero, zcfg = _peak(["--micro-batch-size", "8", "--global-batch-size", "32", "--use-distributed-optimizer"], 4)
    n = stage_params(cfg, 0)
    assert base - zero == pytest.approx(12 * n * (1 - 1 / 4) / GiB)
    rec, _ = _peak(["--micro-batch-size", "8", "--checkpoint-activations"], 1)
    assert rec < base - 4.0                                   # 24 layers of activations -> inputs + one layer
