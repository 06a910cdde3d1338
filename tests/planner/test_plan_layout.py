"""The layout planner (megapar/planner, tools/plan_layout.py): every layout it accepts is one training accepts,
its memory column is the estimator's, its cost model moves the right way, and its command line parses."""
from __future__ import annotations

import contextlib
import io
import json
import random
import re
import shlex
from dataclasses import replace

import pytest

from megapar.config.build import build_config
from megapar.config.overlays import parse_flags
from megapar.config.settings import ConfigError
from megapar.planner.memory_estimate import GiB, estimate, host_bytes_per_node
from megapar.model import set_vocab
from megapar.planner import calibration, cost, search
from megapar.launch import LAUNCHER_FLAGS

H100 = calibration.H100
SMALL = dict(num_layers=8, hidden_size=512, num_attention_heads=8, seq_length=512, global_batch_size=64)


def request(gpus=8, gpus_per_node=4, gpu_memory=1 * GiB, host_memory=64 * GiB, **shape) -> search.Request:
    return search.Request(**{**SMALL, **shape}, gpus=gpus, gpus_per_node=gpus_per_node, gpu_memory=gpu_memory,
                          host_memory=host_memory)


@pytest.fixture(scope="module")
def small_plan() -> search.Plan:
    return search.plan(request(), H100)


def sample(plan: search.Plan, k: int = 60) -> list[search.Candidate]:
    rest = plan.accepted[10:]
    return plan.accepted[:10] + random.Random(0).sample(rest, min(k, len(rest)))


def test_the_plan_has_accepted_and_rejected_layouts(small_plan):
    assert len(small_plan.accepted) > 50 and small_plan.rejected
    times = [c.seconds for c in small_plan.accepted]
    assert times == sorted(times)
    kinds = " ".join(r for r, _ in small_plan.reasons())
    for reason in ("refused by validation", "does not fit", "selective recompute"):
        assert reason in kinds


def test_accepted_layouts_pass_validation(small_plan):
    """The top picks and a sample of the others, through build_config as training runs it."""
    for c in sample(small_plan):
        cfg = build_config(search.flags(small_plan.request, c.layout), 8, assume_gpus=True)
        lay = c.layout
        assert (cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size,
                cfg.parallel.data_parallel_size, cfg.parallel.zero_stage) == (lay.tp, lay.pp, lay.dp, lay.zero)
        assert (cfg.model.virtual_pipeline_model_parallel_size or 1) == lay.v
        assert cfg.model.sequence_parallel == lay.sp and cfg.train.micro_batch_size == lay.micro


def test_the_command_line_of_accepted_layouts_parses(small_plan):
    for c in sample(small_plan, 20):
        line = search.command(small_plan.request, c.layout)
        build_config(parse_flags(training_flags(line)), 8, assume_gpus=True)


def test_rejected_for_validation_really_are_refused(small_plan):
    refused = [c for c in small_plan.rejected if c.reason.startswith("refused by validation")]
    assert refused
    for c in refused[:20]:
        with pytest.raises(ConfigError):
            build_config(search.flags(small_plan.request, c.layout), 8, assume_gpus=True)


def test_memory_column_equals_the_estimator(small_plan):
    req = small_plan.request
    for c in sample(small_plan, 30) + [c for c in small_plan.rejected if c.reason.startswith("does not fit")][:10]:
        cfg = build_config(search.flags(req, c.layout), req.gpus, assume_gpus=True)
        set_vocab(cfg.model, 50257, c.layout.tp, log=lambda _: None)
        rows = estimate(cfg)
        assert c.gpu_bytes == max(r.total for r in rows)
        assert c.host_bytes == host_bytes_per_node(cfg, rows, req.gpus_per_node)


def test_memory_column_equals_the_estimator_tool(small_plan):
    """End to end: tools/estimate_memory.py on the best layout's command prints the same peak."""
    from megapar.cli.estimate_memory import main
    best = small_plan.best
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--world-size", "8", "--gpus-per-node", "4",
                     *training_flags(search.command(small_plan.request, best.layout))]) == 0
    peaks = [float(line.split("|")[7]) for line in out.getvalue().splitlines() if re.match(r"\| \d+ \|", line)]
    assert max(peaks) == pytest.approx(round(best.gpu_bytes / GiB, 2))


# ---- the cost model moves the right way ---------------------------------------------------------
def layout(**kw) -> cost.Layout:
    base = dict(tp=1, pp=1, v=1, dp=1, zero=1, optimizer_offload=False, param_offload=False, micro=4,
                recompute="none", sp=False)
    return cost.Layout(**{**base, **kw})


MODEL = cost.Model(num_layers=24, hidden=2048, heads=16, ffn=8192, seq=2048, vocab=50304, global_batch=256)
CLUSTER = cost.Cluster(gpus=64, gpus_per_node=8)


def test_more_data_parallel_fewer_microbatches_per_rank():
    m = [cost.microbatches(MODEL, layout(dp=dp)) for dp in (1, 2, 4, 8)]
    assert m == [64, 32, 16, 8]
    pipeline = [cost.step_time(H100, MODEL, layout(dp=dp), CLUSTER).pipeline for dp in (1, 2, 4, 8)]
    assert pipeline == sorted(pipeline, reverse=True)


def test_larger_pipeline_larger_bubble_at_fixed_microbatches():
    def bubble_share(pp):
        s = cost.step_time(H100, MODEL, layout(pp=pp, dp=4), CLUSTER)   # m = 16 whatever pp
        return s.bubble / (s.pipeline - s.bubble)
    shares = [bubble_share(pp) for pp in (1, 2, 4, 8)]
    assert shares[0] == 0 and shares == sorted(shares)
    assert shares[2] == pytest.approx(3 / 16)                            # (p - 1) / m


def test_interleaving_shrinks_the_bubble():
    one, two = (cost.step_time(H100, MODEL, layout(pp=4, v=v, dp=4), CLUSTER) for v in (1, 2))
    assert two.bubble / two.microbatch == pytest.approx(one.bubble / one.microbatch / 2)   # (p - 1) / v
    assert two.bubble < one.bubble and two.microbatch > one.microbatch                     # v x the p2p


def test_zero_bubble_shrinks_the_bubble_and_loses_the_reduction_overlap():
    one, zb = (cost.step_time(H100, MODEL, layout(pp=4, dp=4, zb=z), CLUSTER) for z in (False, True))
    w = MODEL.num_layers // 4 * cost.layer_gemms_forward(H100, MODEL, layout(pp=4, dp=4))
    assert zb.microbatch == one.microbatch and one.bubble == pytest.approx(3 * one.microbatch)
    assert zb.bubble == pytest.approx(3 * (one.microbatch - 2 * w)) and 0 < zb.bubble < one.bubble
    assert zb.dp_exposed >= one.dp_exposed                  # the reduction waits for the last W


def test_zero_bubble_is_planned_where_it_runs(small_plan):
    """ZB-H1 layouts are enumerated for pp > 1, v = 1, ZeRO 0-1 only, and training accepts them."""
    zb = [c for c in small_plan.accepted + small_plan.rejected if c.layout.zb]
    assert zb and all(c.layout.pp > 1 and c.layout.v == 1 and c.layout.zero <= 1 for c in zb)
    assert not [c for c in zb if c.reason and "refused by validation" in c.reason]
    best = next(c for c in small_plan.accepted if c.layout.zb)
    cfg = build_config(search.flags(small_plan.request, best.layout), 8, assume_gpus=True)
    assert cfg.parallel.enable_zero_bubble and "--enable-zero-bubble" in search.command(small_plan.request, best.layout)
    assert search.row(small_plan, best).split("|")[3].strip() == "zb"


def test_recompute_is_slower_and_smaller():
    req = request(gpus=2, gpu_memory=80 * GiB)
    none, full = (search.evaluate(req, H100, layout(dp=2, recompute=r)) for r in ("none", "full"))
    assert none.reason is None and full.reason is None
    assert full.seconds > none.seconds and full.gpu_bytes < none.gpu_bytes


def test_tensor_parallel_across_nodes_costs_more():
    inside, across = (cost.step_time(H100, MODEL, layout(tp=8, dp=1), cost.Cluster(8, n)).total for n in (8, 4))
    assert across > inside


def test_zero3_smaller_than_zero1_at_dp_greater_than_1():
    req = request(gpus=4, gpu_memory=80 * GiB)
    one, three = (search.evaluate(req, H100, layout(dp=4, zero=z)) for z in (1, 3))
    assert three.gpu_bytes < one.gpu_bytes


GPT3_6_7B = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=2048, global_batch_size=128)


def test_6_7b_on_one_80gb_gpu_picks_offload():
    plan = search.plan(request(gpus=1, gpus_per_node=1, gpu_memory=80 * GiB, host_memory=1024 * GiB, **GPT3_6_7B),
                       H100)
    assert plan.best.layout.optimizer_offload
    assert all(c.layout.optimizer_offload for c in plan.accepted)      # nothing else fits
    assert plan.best.gpu_bytes <= 0.9 * 80 * GiB


def test_a_model_too_big_for_one_gpu_without_offload_uses_more_gpus():
    plan = search.plan(request(gpus=8, gpus_per_node=8, gpu_memory=80 * GiB, host_memory=0.0, **GPT3_6_7B), H100)
    best = plan.best.layout
    assert not best.optimizer_offload and not best.param_offload
    assert best.tp * best.pp > 1 or best.zero >= 1                     # the state is split over GPUs
    assert not search.plan(request(gpus=1, gpus_per_node=1, gpu_memory=80 * GiB, host_memory=0.0, **GPT3_6_7B),
                           H100).accepted


def test_gemm_efficiency_interpolates_and_clamps():
    table = H100.gemm_tflops
    assert H100.gemm_efficiency(table[-1][0] * 10) == table[-1][1]
    assert H100.gemm_efficiency(table[0][0] / 2) < table[0][1]
    mid = H100.gemm_efficiency((table[1][0] * table[2][0]) ** 0.5)
    assert mid == pytest.approx((table[1][1] + table[2][1]) / 2)


# ---- calibration files --------------------------------------------------------------------------
def test_a_calibration_file_overrides_the_defaults(tmp_path):
    path = tmp_path / "calib.json"
    path.write_text(json.dumps({"hbm_gbps": 1000.0, "intra_node": {"bus_gbps": 100.0}}))
    cal = calibration.load_calibration("h200", str(path))
    assert cal.hbm_gbps == 1000.0 and cal.intra_node.bus_gbps == 100.0
    assert cal.intra_node.latency_us == calibration.H200.intra_node.latency_us and cal.peak_tflops == 989.0


def test_what_calibrate_writes_loads_back(tmp_path):
    path = tmp_path / "calib.json"
    path.write_text(calibration.H200.to_json())
    assert calibration.load_calibration("h100", str(path)) == calibration.H200


@pytest.mark.parametrize("content,match", [
    ("{not json", "not JSON"), ("[1, 2]", "expected a JSON object"), ('{"hbm": 3}', "unknown calibration key"),
    ('{"hbm_gbps": "fast"}', "hbm_gbps must be a non-negative number"),
    ('{"gemm_tflops": [[10, 500], [1, 300]]}', "GFLOP ascending")])
def test_bad_calibration_files_are_refused(tmp_path, content, match):
    path = tmp_path / "calib.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        calibration.load_calibration("h100", str(path))


# ---- the command ---------------------------------------------------------------------------------
LAUNCHER = {flag for flag, _, _ in LAUNCHER_FLAGS}   # scripts/pretrain_gpt2.sh's own flags


def training_flags(line: str) -> list[str]:
    """The training flags of a `bash scripts/pretrain_gpt2.sh ...` line (the launcher's own dropped)."""
    words = shlex.split(line, comments=True)
    assert words[:2] == ["bash", "scripts/pretrain_gpt2.sh"]
    out, i = [], 2
    while i < len(words):
        if words[i] in LAUNCHER:
            i += 2
        else:
            out.append(words[i])
            i += 1
    return out


def run_tool(argv: list[str]) -> tuple[int, str, str]:
    from megapar.cli.plan_layout import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_the_tool_prints_the_table_and_a_command_training_accepts():
    rc, out, _ = run_tool(["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length",
                           "512", "--global-batch-size", "64", "--gpus", "16", "--gpus-per-node", "8", "--gpu-memory",
                           "4GB", "--host-memory", "64GB", "--hidden-dropout", "0", "--show-rejected", "3"])
    assert rc == 0
    assert "| tp | pp | v | dp | ZeRO | offload | micro | recompute | SP | ms/step | tokens/s | MFU | GPU GiB" in out
    assert len([line for line in out.splitlines() if re.match(r"\| \d+ \| \d+ \| \d+ \| \d+ \|", line)]) >= 10
    assert "| rejected layouts | reason" in out
    line = next(line for line in out.splitlines() if line.startswith("bash scripts/pretrain_gpt2.sh"))
    assert "--nnodes 2" in line and "--hidden-dropout 0" in line
    cfg = build_config(parse_flags(training_flags(line)), 16, assume_gpus=True)
    assert cfg.model.hidden_dropout == 0.0


@pytest.mark.parametrize("argv,match", [
    (["--gpus", "0"], "--gpus 0 must be >= 1"),
    (["--gpus", "2", "--gpu-memory", "80XB"], "--gpu-memory '80XB' is not a memory size"),
    (["--gpus", "2", "--tensor-model-parallel-size", "2"], "the planner chooses these itself"),
    (["--gpus", "4", "--num-attention-heads", "3", "--num-layers", "3", "--global-batch-size", "2"],
     "no valid layout: "),
    (["--gpus", "2", "--calibration", "/nonexistent/calib.json"], "cannot read it"),
    (["--gpus", "12", "--gpus-per-node", "8"], "--gpus 12 is not a multiple of --gpus-per-node 8"),
])
def test_bad_input_is_one_error_line(argv, match):
    base = dict(zip(["--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--global-batch-size"],
                    ["4", "96", "4", "64", "8"]))
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    rc, out, err = run_tool([w for kv in base.items() for w in kv])
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ") and match in err, err


def test_cpu_adam_rate_is_measured_on_the_cpu():
    from megapar.planner.measure import cpu_adam
    assert cpu_adam(numel=100_000) > 0


def test_calibrate_refuses_without_a_gpu():
    import torch
    from megapar.planner.measure import calibrate
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="--calibrate needs a CUDA GPU; planning works without one"):
        calibrate("h100")


def test_the_collective_measurement_runs_on_gloo():
    """--calibrate's spawned collective workers, on 2 CPU processes with gloo and small sizes: the same
    calls on every rank (no hang), results for every op and size, a positive Link."""
    from megapar.planner.measure import nccl
    link, notes = nccl(2, backend="gloo", sizes=[4096, 65536], reps={4096: 2, 65536: 2}, p2p_bytes=65536)
    assert link.bus_gbps > 0 and link.latency_us > 0 and link.p2p_gbps > 0
    assert len(notes) == 2 * 3 + 1 and all(n.startswith("GLOO ") for n in notes)


def test_calibrate_writes_a_calibration_that_plans(tmp_path, monkeypatch):
    """--calibrate's assembly and file, with the GPU measurements stubbed (this machine may have no GPU)."""
    import torch
    from megapar.planner import measure
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(measure, "gemm_table", lambda: ([[2.0, 400.0], [200.0, 700.0]], ["GEMM ..."]))
    monkeypatch.setattr(measure, "attention", lambda: (300.0, 250.0, ["attention ..."]))
    monkeypatch.setattr(measure, "hbm_gbps", lambda: 4000.0)
    monkeypatch.setattr(measure, "pcie", lambda: (50.0, 48.0))
    monkeypatch.setattr(measure, "nccl", lambda gpus: (calibration.Link(350.0, 12.0, 300.0), [f"NCCL over {gpus}"]))
    monkeypatch.setattr(measure, "cpu_adam", lambda: 5.0)
    out = tmp_path / "calib.json"
    rc, stdout, _ = run_tool(["--calibrate", "--out", str(out)])
    assert rc == 0 and f"wrote {out}" in stdout and "NCCL over 8" in stdout
    cal = calibration.load_calibration("h100", str(out))
    assert (cal.name, cal.hbm_gbps, cal.intra_node.bus_gbps, cal.cpu_adam_gparams_s) == ("NVIDIA H200", 4000.0, 350.0,
                                                                                         5.0)
    assert cal.inter_node == calibration.H200.inter_node and cal.dp_overlap == calibration.H200.dp_overlap
    rc, stdout, _ = run_tool(["--num-layers", "4", "--hidden-size", "96", "--num-attention-heads", "4", "--seq-length",
                              "64", "--global-batch-size", "8", "--gpus", "2", "--calibration", str(out)])
    assert rc == 0 and "cost model: NVIDIA H200" in stdout and "uncalibrated" not in stdout


def test_nvme_offload_plans_optimizer_offload_through_the_disk(tmp_path):
    """--optimizer-nvme-offload among the kept flags: every layout offloads the optimizer to it, its step
    pays the 24 B per owned parameter over the node's disk, and the command names NVMe, not CPU, offload."""
    req = request(gpus=2, gpus_per_node=2, gpu_memory=80 * GiB, **GPT3_6_7B)
    req.extra = {"optimizer_nvme_offload": str(tmp_path)}
    plan = search.plan(req, H100)
    assert plan.accepted and all(c.layout.nvme and c.layout.optimizer_offload for c in plan.accepted)
    best = plan.best
    owned = 6.6e9 / best.layout.dp if best.layout.zero else 6.6e9
    assert best.step.optimizer > 24 * owned * 2 / (H100.disk_gbps * 1e9)
    cpu = cost.step_time(H100, search.model_of(req, best.layout.tp), replace(best.layout, nvme=False), req.cluster)
    assert best.step.optimizer > cpu.optimizer
    flags = search.flags(req, best.layout)
    assert flags["optimizer_nvme_offload"] == str(tmp_path) and "optimizer_cpu_offload" not in flags
