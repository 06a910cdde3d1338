"""Text generation from checkpoints.

    generation.py               the KV-cache inference engine over the (tp, pp) layout, sampling, and the
                                leader/follower loop that keeps every rank in step
    text_generation_server.py   the HTTP server in front of it (Megatron's REST API)
"""
