"""A training run: what is built before the first step, the step and its loop, and what watches them.

    initialize.py     process groups, device, model, ZeRO stage (optimizer/zero.py), LR schedule -> `Run`
    training.py       the step (schedule, reduction, optimizer), the loop, evaluation, saves and loads
    cuda_graph.py     the whole step captured in one CUDA graph (--enable-cuda-graph)
    heartbeat.py      a rank that stops answering: named within --distributed-timeout-minutes
    timers.py, throughput.py, scalar_writer.py   timing, tokens/s and MFU, TensorBoard / W&B / CSV logs
"""
