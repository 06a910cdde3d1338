"""Pipeline parallelism: point-to-point transfers between stages and the microbatch schedules."""
from .p2p import PipelineP2PError, PipelineTimeoutError, current_step, set_step
from .schedules import (ScheduleConfig, average_logs, backward_step, forward_backward_no_pipelining,
                        forward_backward_pipelining_1f1b, forward_backward_pipelining_afab,
                        forward_only_pipelining, forward_step_and_loss, get_forward_backward_func)
from .interleaved import forward_backward_pipelining_interleaved
from .zero_bubble import forward_backward_pipelining_zb_h1

__all__ = ["PipelineP2PError", "PipelineTimeoutError", "ScheduleConfig", "average_logs", "backward_step",
           "current_step",
           "forward_backward_no_pipelining", "forward_backward_pipelining_1f1b",
           "forward_backward_pipelining_afab", "forward_backward_pipelining_interleaved",
           "forward_backward_pipelining_zb_h1", "forward_only_pipelining",
           "forward_step_and_loss",
           "get_forward_backward_func", "set_step"]
