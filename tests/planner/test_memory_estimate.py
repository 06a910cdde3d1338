"""The memory estimator: parameter counts equal the real model's; the model of the bytes
reproduces the peak memory measured on GPUs (docs/benchmarks/) within 10%."""
import pytest

from gpt_helpers import tiny_model_config
from megapar.config.build import parse_config
from megapar.model.sizes import stage_params
from megapar.planner.memory_estimate import GiB, estimate, held_weight_gradient_bytes, layer_counts
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


# max allocated GiB measured by benchmarks/bench_train.py on an H100 / 4x H200
# (2026-11-21, docs/benchmarks/*_20261121.md)
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


def test_zero_bubble_holds_the_deferred_weight_gradients():
    """ZB-H1: stage k also keeps min(k, m) microbatches' GEMM inputs and output gradients."""
    flags = ["--pipeline-model-parallel-size", "4", "--micro-batch-size", "2", "--global-batch-size", "16"]
    plain, cfg = parse_config(GPT2_345M + flags, 4), parse_config(GPT2_345M + flags + ["--enable-zero-bubble"], 4)
    for c in (plain, cfg):
        set_vocab(c.model, 50257, 1, log=lambda *_: None)
    for k, (a, b) in enumerate(zip(estimate(plain), estimate(cfg))):
        held = held_weight_gradient_bytes(cfg, layer_counts(cfg.model, 4)[k]) * min(k, cfg.num_microbatches)
        assert b.activation_bytes - a.activation_bytes == pytest.approx(held) and (held > 0) == (k > 0)


# ---- ZeRO stages 0-3 and CPU offload, derived by hand -------------------------------------------------
# 2 layers, hidden 64 (ffn 256), seq 32, vocab 1000 -> padded 1024, bf16, 4 GPUs (dp 4):
#   one layer  = 12 h^2 + 13 h                  = 49,984 parameters
#   L (layers) = 2 x 49,984                     = 99,968
#   E (others) = 1024 h + 32 h + 2 h            = 67,712 (word + position embeddings, final LayerNorm)
#   n          = L + E                          = 167,680
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "32", "--bf16"]
ONE, L, E = 49_984, 99_968, 67_712
N = L + E
# (flags, GPU static, GPU transient, host) in bytes of the one stage
ZERO = [
    (["--zero-stage", "0"], 2 * N + 4 * N + 12 * N, 0, 0),
    (["--zero-stage", "1"], 2 * N + 4 * N + 12 * N / 4, 0, 0),
    (["--zero-stage", "2"], 2 * N + (4 * L / 4 + 4 * E) + 12 * N / 4, 8 * ONE, 0),
    (["--zero-stage", "3"], (2 * L / 4 + 2 * E) + (4 * L / 4 + 4 * E) + 12 * N / 4, 4 * ONE + 8 * ONE, 0),
    (["--zero-stage", "1", "--optimizer-cpu-offload"], 2 * N + 4 * N, 0, 16 * N / 4),
    # the delayed update's CPU-cast copy of the new bf16 weights
    (["--zero-stage", "3", "--optimizer-cpu-offload", "--delayed-param-update"],
     (2 * L / 4 + 2 * E) + (4 * L / 4 + 4 * E), 12 * ONE, 16 * N / 4 + 2 * N / 4),
    (["--zero-stage", "3", "--param-cpu-offload"], 2 * E + (4 * L / 4 + 4 * E) + 12 * N / 4, 12 * ONE, 2 * L / 4),
    (["--zero-stage", "3", "--optimizer-cpu-offload", "--param-cpu-offload"], 2 * E + (4 * L / 4 + 4 * E), 12 * ONE,
     16 * N / 4 + 2 * L / 4),
]


def _tiny(flags, world=4):
    from megapar.config.build import build_config
    from megapar.config.overlays import parse_flags
    cfg = build_config(parse_flags(TINY + flags), world, assume_gpus=True)
    set_vocab(cfg.model, 1000, cfg.parallel.tensor_model_parallel_size, log=lambda *_: None)
    return cfg


def test_hand_counts_match_the_model():
    from megapar.model.sizes import layer_params
    cfg = _tiny([])
    assert (layer_params(cfg), stage_params(cfg, 0)) == (ONE, N)


@pytest.mark.parametrize("flags,static,transient,host", ZERO, ids=[" ".join(f) for f, *_ in ZERO])
def test_zero_stage_and_offload_columns(flags, static, transient, host):
    (row,) = estimate(_tiny(flags))
    assert (row.static_bytes, row.transient_bytes, row.cpu_bytes) == (static, transient, host)


def test_nvme_offload_moves_the_state_from_host_memory_to_disk(tmp_path, capsys):
    """--optimizer-nvme-offload: 12 n / dp of disk per rank, summed over a node; host memory keeps
    the gradient copy and two chunks of state (here the whole small shard); the tool prints both."""
    from megapar.cli.estimate_memory import main
    from megapar.planner.memory_estimate import host_bytes_per_node
    flags = ["--zero-stage", "1", "--optimizer-nvme-offload", str(tmp_path)]
    cfg = _tiny(flags)
    (row,) = estimate(cfg)
    assert (row.static_bytes, row.disk_bytes, row.cpu_bytes) == (2 * N + 4 * N, 12 * N / 4, 4 * N / 4 + 24 * N / 4)
    assert host_bytes_per_node(cfg, [row], 2, "disk_bytes") == 2 * 12 * N / 4
    assert main(["--world-size", "4", "--vocab-size", "1000", *TINY, *flags, "--gpus-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "disk GiB/rank" in out and "CPU offload optimizer (NVMe)" in out
    assert f"NVMe offload: {2 * 12 * N / 4 / GiB:.1f} GiB of optimizer state files per node (2 GPUs per node)" in out


def test_host_memory_is_summed_over_a_node():
    from megapar.planner.memory_estimate import host_bytes_per_node
    cfg = _tiny(["--zero-stage", "3", "--optimizer-cpu-offload", "--param-cpu-offload"])
    rows = estimate(cfg)
    per_rank = 16 * N / 4 + 2 * L / 4
    assert host_bytes_per_node(cfg, rows, 2) == 2 * per_rank
    assert host_bytes_per_node(cfg, rows, 8) == 4 * per_rank    # one node holds the whole (4-GPU) job


def test_sizes_and_verdicts():
    from megapar.planner.memory_estimate import parse_size, verdict
    from megapar.topology import ConfigError
    assert parse_size("80GB", "--gpu-memory") == parse_size("80 GiB", "--gpu-memory") == 80 * GiB
    assert parse_size("1tb", "--host-memory") == 1024 * GiB and parse_size("512MiB", "--x") == GiB / 2
    for bad in ("80XB", "80", "GB", "-1GB", "0GB", "1e3GB"):
        with pytest.raises(ConfigError, match="is not a memory size"):
            parse_size(bad, "--gpu-memory")
    assert verdict(70 * GiB, 80 * GiB, "GPU") == "fits (70.0 of 80.0 GiB, 88%)"
    assert verdict(75 * GiB, 80 * GiB, "GPU") == "fits (75.0 of 80.0 GiB, 94%, tight)"
    assert verdict(90 * GiB, 80 * GiB, "GPU") == "does not fit: needs 90.0 GiB, GPU has 80.0"
    assert verdict(1.0, None, "GPU") == ""


def test_compare_stages_table_and_the_tool(capsys):
    from megapar.cli.estimate_memory import main
    from megapar.planner.memory_estimate import COMBINATIONS
    assert main(["--world-size", "4", "--vocab-size", "1000", *TINY, "--zero-stage", "3", "--param-cpu-offload",
                 "--gpu-memory", "80GB", "--host-memory", "1TB", "--gpus-per-node", "2", "--compare-stages"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO stage 3, CPU offload params" in out
    assert "GPU: fits (" in out and "host (2 GPUs per node): fits (" in out
    table = [line for line in out.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()
             and "ZeRO" not in line and len(line.split("|")) == 8]
    assert len(table) == len(COMBINATIONS) == 9
    assert all("fits (" in line for line in table)


def test_gpt3_sizes_give_sensible_verdicts(capsys):
    """The docs/guide.md examples: GPT-3 6.7B fits one 80 GB GPU only with the optimizer state on the CPU;
    GPT-3 13B on two 141 GB GPUs does not fit at stage 1 and fits at stage 3."""
    from megapar.cli.estimate_memory import main
    shape = ["--seq-length", "2048", "--max-position-embeddings", "2048", "--bf16", "--recompute-granularity", "full",
             "--micro-batch-size", "1"]
    gpt3_6_7b = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", *shape]
    gpt3_13b = ["--num-layers", "40", "--hidden-size", "5120", "--num-attention-heads", "40", *shape]
    runs = [(gpt3_6_7b, 1, ["--zero-stage", "1", "--optimizer-cpu-offload"], "80GB", "GPU: fits"),
            (gpt3_6_7b, 1, ["--zero-stage", "1"], "80GB", "GPU: does not fit"),
            (gpt3_13b, 2, ["--zero-stage", "1"], "141GB", "GPU: does not fit"),
            (gpt3_13b, 2, ["--zero-stage", "3"], "141GB", "GPU: fits")]
    for model, world, zero, gpu, expected in runs:
        assert main(["--world-size", str(world), *model, *zero, "--gpu-memory", gpu]) == 0
        assert expected in capsys.readouterr().out, (zero, world)
