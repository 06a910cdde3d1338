"""How much host memory a checkpoint save takes beyond what the rank already holds.

    growth, result = peak_rss_growth(lambda: save_checkpoint(...))

`peak_rss_growth` runs the save in this process and returns the peak of its resident set size
during the call minus the resident size just before it (bytes). The kernel's own high-water mark
is used: it is reset (/proc/self/clear_refs, "5") before the call and read (VmHWM in
/proc/self/status) after, so a short spike is never missed. Where the kernel refuses the reset,
a thread samples VmRSS every millisecond instead (it can miss a spike shorter than that).

`save_memory_per_rank(save_body, world_size, args)` runs `save_body(rank, world_size, *args) ->
(save callable, parameter count of the rank's shard)` on `world_size` gloo processes and returns,
per rank, {"growth": bytes, "numel": parameters, "per_param": growth / numel}. Any format's save
fits: the callable is what is measured, everything built before it (model, optimizer) is not.
"""
from __future__ import annotations

import gc
import threading
from typing import Any, Callable, Sequence

from distributed import run_distributed


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_high_water() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _Sampler(threading.Thread):
    """Fallback: the largest VmRSS seen every `interval` seconds until stopped."""

    def __init__(self, interval: float = 0.001):
        super().__init__(daemon=True)
        self.interval, self.peak, self.done = interval, _status_kib("VmRSS"), threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval):
            self.peak = max(self.peak, _status_kib("VmRSS"))

    def stop(self) -> int:
        self.done.set()
        self.join()
        return max(self.peak, _status_kib("VmRSS"))


def peak_rss_growth(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(peak resident bytes during fn() minus resident bytes before it, fn's result)."""
    gc.collect()
    before = _status_kib("VmRSS")
    if _reset_high_water():
        result = fn()
        peak = _status_kib("VmHWM")
    else:
        sampler = _Sampler()
        sampler.start()
        try:
            result = fn()
        finally:
            peak = sampler.stop()
    return (peak - before) * 1024, result


def _measure(rank: int, world_size: int, save_body: Callable, args: Sequence[Any]) -> dict:
    save, numel = save_body(rank, world_size, *args)
    growth, _ = peak_rss_growth(save)
    return {"growth": growth, "numel": numel, "per_param": growth / numel}


def save_memory_per_rank(save_body: Callable, world_size: int, args: Sequence[Any] = ()) -> list[dict]:
    """Per rank: the peak host-memory growth of the save callable `save_body` builds (module level)."""
    return run_distributed(_measure, world_size=world_size, args=(save_body, tuple(args)))
