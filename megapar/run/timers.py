"""Named wall-clock timers (device-synchronised on GPU when timing is switched on)."""
from __future__ import annotations

import time
from collections import defaultdict

import torch


class Timers:
    def __init__(self, level: int, device: torch.device):
        self.level, self.device = level, device
        self.elapsed: dict[str, float] = defaultdict(float)
        self._start: dict[str, float] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self, name: str, level: int = 1) -> None:
        if level <= self.level:
            self._sync()
            self._start[name] = time.perf_counter()

    def stop(self, name: str, level: int = 1) -> None:
        if level <= self.level and name in self._start:
            self._sync()
            self.elapsed[name] += time.perf_counter() - self._start.pop(name)

    def report(self, iterations: int) -> str:
        """'name: ms per iteration' for every timer since the last report; then reset."""
        parts = [f"{k}: {1000 * v / max(1, iterations):.2f}" for k, v in sorted(self.elapsed.items())]
        self.elapsed.clear()
        return "(ms per iteration) " + " | ".join(parts) if parts else ""
