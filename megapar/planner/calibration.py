"""The machine constants of the layout planner's cost model, and their defaults for H100 and H200.

The defaults are PLACEHOLDERS until `python tools/plan_layout.py --calibrate --out calib.json` has been
run on the machine that will train (then pass `--calibration calib.json`). Each number was taken from a
measurement in docs/performance.md where one exists, otherwise from a datasheet:

    peak_tflops           dense bf16 tensor-core peak (datasheet; megapar/run/throughput.py)
    gemm_tflops           GEMM throughput by GEMM size (GFLOP of one GEMM -> TFLOP/s): H100 measured by
                          --calibrate (configs/calibration_h100.json); H200 still the earlier estimate from
                          profiles of the 345M step, extrapolated to smaller and larger GEMMs
    attn_*_tflops         cuDNN SDPA forward / backward, head dim 64, causal FLOPs counted (345M profile)
    hbm_gbps              copy bandwidth (read + write): H100 measured by --calibrate; H200 scaled by the
                          datasheet bandwidth ratio
    intra_node            NVLink: a measured NCCL all-reduce at tp 2 (bandwidth), latency fitted as the rest
    inter_node            not measured (only single-node machines were lent): InfiniBand NDR per GPU, datasheet
    pcie_*_gbps           pinned H2D / D2H copies measured by --calibrate
    cpu_adam_gparams_s    torch's fused CPU AdamW measured by --calibrate; shared by the GPUs of a node
    disk_gbps             --optimizer-nvme-offload's disk, mean of O_DIRECT read and write, shared by the GPUs of
                          a node: the virtio disk of a lent 2×H100 host, not a local NVMe array (set it for yours)
    elementwise bytes     LayerNorm/residual/dropout (replicated over TP unless sequence parallel) + GELU and the
                          rest (split over TP) per s·b·h element, forward; backward 2x; chosen so that the 345M
                          step's compiled elementwise kernels come out at their profiled time (the loss: per logit)
    optimizer bytes       per owned parameter (the fused AdamW: masters, moments, bf16 params) + per local
                          parameter (grad zeroing, norm), as profiled
    tp_bwd_overlap        the share of the backward all-reduces hidden behind the weight-gradient GEMMs (profiled)
    dp_overlap            the share of the gradient reduce-scatter hidden, from 345M dp 4 ZeRO-1 against one GPU
    layer_overhead_ms     launch gaps per layer and microbatch: 345M compiled without a CUDA graph against graphed
    zero2/3 overheads     per layer and microbatch: GPU busy time of ZeRO-2 / ZeRO-3 against ZeRO-1 (profiled: the
                          wall times of those runs were host-bound)

The measurement behind each value, with device and date: docs/performance.md#where-the-cost-models-defaults-come-from.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Optional

from ..run.throughput import PEAK_BF16_TFLOPS
from ..topology import ConfigError


@dataclass
class Link:
    """One kind of interconnect: NCCL bus bandwidth (GB/s, as nccl-tests define it: an all-reduce of S
    bytes over g ranks takes latency + 2 (g - 1) / g · S / bus, an all-gather or reduce-scatter
    latency + (g - 1) / g · S / bus) and point-to-point bandwidth (GB/s, S / p2p)."""
    bus_gbps: float
    latency_us: float
    p2p_gbps: float


@dataclass
class Calibration:
    """Every constant the cost model uses (see the module docstring for where the defaults come from)."""
    name: str
    peak_tflops: float
    gemm_tflops: list[list[float]]           # [[GFLOP of one GEMM, TFLOP/s], ...], ascending
    attn_fwd_tflops: float                    # causal flash attention, causal FLOPs counted
    attn_bwd_tflops: float
    hbm_gbps: float                           # bytes moved (read + write) per second, GB/s
    intra_node: Link
    inter_node: Link
    pcie_h2d_gbps: float
    pcie_d2h_gbps: float
    cpu_adam_gparams_s: float                 # one node's CPU, all cores
    disk_gbps: float = 1.6                    # one node's disk for NVMe offload, GB/s
    elementwise_replicated_bytes: float = 14.0   # per s·b·h element and layer, forward
    elementwise_split_bytes: float = 16.0        # per s·b·h element and layer, forward (÷ tp)
    loss_bytes_per_logit: float = 8.0            # forward + backward of the fused cross entropy
    optimizer_bytes_owned: float = 30.0
    optimizer_bytes_local: float = 8.0
    tp_bwd_overlap: float = 0.4
    dp_overlap: float = 0.5
    offload_overlap: float = 0.5                 # stage-3 parameter fetches from the host behind compute
    layer_overhead_ms: float = 0.2
    microbatch_overhead_ms: float = 0.5
    step_overhead_ms: float = 1.0
    zero2_layer_overhead_ms: float = 0.08
    zero3_layer_overhead_ms: float = 0.13
    notes: list[str] = field(default_factory=list)

    def gemm_efficiency(self, gflop: float) -> float:
        """TFLOP/s of a GEMM of `gflop` GFLOP: log-linear interpolation in the table, clamped at its ends."""
        table = self.gemm_tflops
        if gflop <= table[0][0]:
            return table[0][1] * max(gflop / table[0][0], 0.05)   # very small GEMMs: latency-bound
        for (x0, y0), (x1, y1) in zip(table, table[1:]):
            if gflop <= x1:
                w = (math.log(gflop) - math.log(x0)) / (math.log(x1) - math.log(x0))
                return y0 + w * (y1 - y0)
        return table[-1][1]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


H100 = Calibration(
    name="H100 SXM 80GB (one H100 calibrated 2026-11-24; NCCL and inter-node rates are placeholders)",
    peak_tflops=PEAK_BF16_TFLOPS["H100"],
    gemm_tflops=[[2.147, 117.9], [8.59, 453.6], [17.18, 613.4], [51.54, 625.5], [137.4, 670.7], [206.2, 667.7],
                 [1099.5, 691.8]],
    attn_fwd_tflops=270.0, attn_bwd_tflops=210.0,
    hbm_gbps=3009.0,
    intra_node=Link(bus_gbps=260.0, latency_us=15.0, p2p_gbps=200.0),
    inter_node=Link(bus_gbps=45.0, latency_us=30.0, p2p_gbps=45.0),
    pcie_h2d_gbps=53.8, pcie_d2h_gbps=55.0,
    cpu_adam_gparams_s=4.83,
)

H200 = Calibration(**{**asdict(H100), "name": "H200 SXM 141GB (placeholder defaults: run --calibrate)",
                      "gemm_tflops": [[1.0, 300.0], [4.0, 500.0], [16.0, 640.0], [64.0, 690.0], [256.0, 730.0],
                                      [1024.0, 750.0]],
                      "hbm_gbps": 2970.0 * 4.8 / 3.35,
                      "intra_node": H100.intra_node, "inter_node": H100.inter_node})

DEFAULTS = {"h100": H100, "h200": H200}


def gpu_kind(device_name: str, fallback: str) -> str:
    """The DEFAULTS key of a CUDA device name ("NVIDIA H200" -> h200), `fallback` for other GPUs."""
    return "h200" if "H200" in device_name else "h100" if "H100" in device_name else fallback


def _build(data: dict, base: Calibration, source: str) -> Calibration:
    """`base` with the keys of `data` replaced (links merged key by key); ConfigError on unknown keys or
    values that are not positive numbers."""
    known = {f.name for f in fields(Calibration)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{source}: unknown calibration key(s) {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(known))}")
    merged = asdict(base)
    for key, value in data.items():
        if key in ("intra_node", "inter_node"):
            if not isinstance(value, dict) or set(value) - {"bus_gbps", "latency_us", "p2p_gbps"}:
                raise ConfigError(f"{source}: {key} must be an object with bus_gbps, latency_us, p2p_gbps")
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    try:
        cal = Calibration(**{**merged, "intra_node": Link(**merged["intra_node"]),
                             "inter_node": Link(**merged["inter_node"])})
        _check(cal)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: {e}") from None
    return cal


def _check(cal: Calibration) -> None:
    """Every number positive and finite, the GEMM table ascending pairs."""
    numbers = {f.name: getattr(cal, f.name) for f in fields(cal) if f.name not in ("name", "notes", "gemm_tflops",
                                                                                   "intra_node", "inter_node")}
    for link in ("intra_node", "inter_node"):
        numbers.update({f"{link}.{k}": v for k, v in asdict(getattr(cal, link)).items()})
    for key, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{key} must be a non-negative number, got {value!r}")
    table = cal.gemm_tflops
    if (not isinstance(table, list) or not table or any(not isinstance(r, list) or len(r) != 2 for r in table)
            or any(not all(isinstance(x, (int, float)) and x > 0 for x in r) for r in table)
            or any(a[0] >= b[0] for a, b in zip(table, table[1:]))):
        raise ValueError("gemm_tflops must be a list of [GFLOP, TFLOP/s] pairs of positive numbers, GFLOP ascending")


def load_calibration(gpu: str, path: Optional[str]) -> Calibration:
    """The defaults of `gpu` (h100, h200), overridden by the JSON file at `path` when given (a file written
    by --calibrate, or a hand-written subset of keys). ConfigError (one line) for a file that cannot be
    read or is not a calibration."""
    base = DEFAULTS[gpu]
    if path is None:
        return base
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ConfigError(f"--calibration {path}: cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--calibration {path}: not JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--calibration {path}: not a text file; give the JSON that --calibrate wrote") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--calibration {path}: expected a JSON object of calibration keys, "
                          f"got {type(data).__name__}")
    return _build(data, base, f"--calibration {path}")
