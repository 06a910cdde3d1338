"""Options for every torch.compile in megapar (the transformer layers, the fused cross entropy).

Inductor tunes each generated kernel's launch parameters by coordinate descent: the CUDA-graphed
step measured about 1% faster on an H200 in every alternating pair (GPT-2 345M and 124M, and tp 2),
at the edge of the run-to-run spread; see docs/benchmarks/log_h100_20261121.md#performance-log-predicted-vs-measured.
The first compile on a machine takes over a minute longer; the tuned configurations are cached with
Inductor's other artefacts.
"""
COMPILE_OPTIONS = {"coordinate_descent_tuning": True}
