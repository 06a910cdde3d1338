"""benchmarks/profile_summary.py on a small hand-written chrome trace."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _trace() -> dict:
    def cpu(name, ts, dur, dims=()):
        return {"cat": "cpu_op", "name": name, "pid": 1, "tid": 7, "ts": ts, "dur": dur,
                "args": {"Input Dims": list(dims)}}

    def call(ts, corr):
        return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 7, "ts": ts,
                "dur": 1, "args": {"correlation": corr}}

    def kernel(name, ts, dur, corr):
        return {"cat": "kernel", "name": name, "pid": 0, "tid": 0, "ts": ts, "dur": dur,
                "args": {"correlation": corr}}

    return {"traceEvents": [
        cpu("aten::linear", 0, 50), cpu("aten::addmm", 5, 10), call(6, 1),       # addmm inside linear
        cpu("aten::sum", 20, 10, [[1024, 3072], []]), call(22, 2),                # a sibling after it
        call(40, 3),                                                               # linear itself
        kernel("sm90_xmma_gemm_bf16", 100, 400, 1),
        kernel("reduce_kernel<float>", 500, 100, 2),
        kernel("reduce_kernel<float>", 700, 100, 3),
    ]}


def test_categories_busy_time_and_launching_ops(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_trace()))
    script = str(ROOT / "benchmarks/profile_summary.py")
    out = subprocess.run([sys.executable, script, str(path), "--iters", "1", "--by-op"],
                         capture_output=True, text=True, check=True).stdout
    assert "GPU span 0.70 ms, GPU busy 0.60 ms" in out
    assert "| gemm | 0.40 |" in out and "| reduction | 0.20 |" in out
    assert "| sm90_xmma_gemm_bf16 | 1 | 0.40 | aten::linear > aten::addmm ×1 |" in out
    assert "| reduce_kernel<float> | 2 | 0.20 | aten::linear > aten::sum[[1024,3072]] ×1, aten::linear ×1 |" in out
