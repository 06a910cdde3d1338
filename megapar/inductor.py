"""Options for every torch.compile in megapar (the transformer layers, the fused cross entropy).

Inductor tunes each generated kernel's launch parameters by coordinate descent: on an H200 the
CUDA-graphed step got 1-1.5% faster (GPT-2 345M 45.3 -> 44.9 ms, 124M 32.5 -> 32.0 ms; two
alternating pairs each, docs/performance.md). The first compile on a machine takes ~80 s longer;
the tuned configurations are cached with Inductor's other artefacts.
"""
COMPILE_OPTIONS = {"coordinate_descent_tuning": True}
