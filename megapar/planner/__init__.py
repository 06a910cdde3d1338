"""The layout planner: which (tp, pp, v, dp, ZeRO, offload, micro-batch, recompute, sequence parallel) to
train a model with on N GPUs. calibration.py: the machine constants; cost.py: the predicted step time;
search.py: enumeration, validation, memory (megapar/planner/memory_estimate.py) and ranking; measure.py: --calibrate.
The command is tools/plan_layout.py (megapar/cli/plan_layout.py)."""
