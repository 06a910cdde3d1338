"""benchmarks/bench_layouts_4gpu.py's plan (--dry-run): each layout's run is that layout at the planner's
fastest fitting choice, graphed where validation allows, and the planner's overall pick is marked."""
import importlib
import re

import pytest


@pytest.fixture(scope="module")
def bench(monkeypatch_module):
    return importlib.import_module("bench_layouts_4gpu")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        from data_dirs import ROOT
        mp.syspath_prepend(str(ROOT / "benchmarks"))
        yield mp


def sizes(command: str) -> tuple[int, int, int]:
    get = lambda flag, default: int(m.group(1)) if (m := re.search(flag + r" (\d+)", command)) else default  # noqa
    return (get("--tensor-model-parallel-size", 1), get("--pipeline-model-parallel-size", 1),
            get("--virtual-pipeline-model-parallel-size", 1))


def test_dry_run_plans_every_layout_of_a_shape(bench, capsys, tmp_path):
    assert bench.main(["--dry-run", "--shapes", "1.3b", "--log-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split("|")[2].strip(): i for i, line in enumerate(out) if line.startswith("| 1.3b |")}
    assert set(rows) == set(bench.LAYOUTS)
    for name, i in rows.items():
        tp, pp, v, dp, zero, zb = bench.LAYOUTS[name]
        command = out[i + 1]
        assert command.strip().startswith("pretrain_gpt2.sh --nproc-per-node 4 ")
        assert sizes(command) == (tp, pp, v) and f"--zero-stage {zero}" in command
        assert ("--enable-zero-bubble" in command) == zb
        assert "--torch-compile" in command and command.count("--torch-compile") == 1
        assert ("--enable-cuda-graph" in command) == ("graph" in out[i].split("|")[3])
    assert sum("*micro" in out[i] for i in rows.values()) <= 1
