"""Heartbeats of a job's ranks, and the one line a rank prints when a collective timed out.

Every rank of a multi-process run bumps a counter of its own in the job's rendezvous key-value
store (the TCPStore that torchrun serves at MASTER_ADDR:MASTER_PORT: a connection apart from the
gloo/NCCL ones that a stopped peer blocks) from a daemon thread, every `interval` seconds.

When a collective times out (--distributed-timeout-minutes), the rank that waited reads every
counter twice, a few intervals apart. A rank whose counter stood still is not running at all:
stopped (SIGSTOP, a debugger), frozen, or its host is gone. When every counter moves, every rank
is alive and one is stuck (a deadlock, or a collective the others never call). Counters rather
than timestamps, so the nodes' clocks need not agree. Per rank the cost is one small store write
per interval (at most every `MAX_INTERVAL_S` seconds).
"""
from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ..errors import MegaparError
from ..topology import Topology

MIN_INTERVAL_S, MAX_INTERVAL_S = 0.2, 10.0
KEY = "megapar/heartbeat/{}"
GROUP_NAMES = {"tp": "tensor-parallel", "dp": "data-parallel", "pp": "pipeline"}


class PeerTimeoutError(MegaparError, RuntimeError):
    """A collective waited longer than --distributed-timeout-minutes for a peer; the message names
    the rank(s) that stopped answering, or says every rank is alive but one is stuck."""


def is_timeout(e: BaseException) -> bool:
    """Is `e` a collective or point-to-point timeout (gloo: "Timed out waiting ...", or the
    "Application timeout caused pair closure" of a pair a timeout closed; NCCL: "timeout")?"""
    return isinstance(e, RuntimeError) and any(s in str(e).lower() for s in ("timed out", "timeout"))


class Heartbeat:
    """A daemon thread that bumps this rank's counter in the job's store every `interval` seconds
    (nothing for a one-process run, or where no store can be reached: `silent_ranks` then says
    None). Use as a context manager, or call `close()`."""

    def __init__(self, rank: int, world: int, timeout_minutes: float):
        self.rank, self.world = rank, world
        self.interval = min(max(timeout_minutes * 60.0 / 10, MIN_INTERVAL_S), MAX_INTERVAL_S)
        self.store = _connect(timeout_minutes) if world > 1 else None
        self._stop = threading.Event()
        self._thread = None
        if self.store is not None:
            self._beat()
            self._thread = threading.Thread(target=self._run, name="megapar-heartbeat", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        self.store.add(KEY.format(self.rank), 1)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 (the store went away: the job is ending)
                return

    def silent_ranks(self) -> Optional[list[int]]:
        """The other ranks whose counter did not move over 3 intervals (read twice); None when
        there is no store to ask."""
        if self.store is None:
            return None
        try:
            keys = [KEY.format(r) for r in range(self.world)]
            before = [self.store.add(k, 0) for k in keys]
            time.sleep(3 * self.interval)
            after = [self.store.add(k, 0) for k in keys]
        except Exception:  # noqa: BLE001 (diagnostics must never mask the real error)
            return None
        return [r for r in range(self.world) if r != self.rank and after[r] == before[r]]

    def close(self) -> None:
        self._stop.set()

    def __enter__(self) -> "Heartbeat":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _connect(timeout_minutes: float) -> Optional[dist.Store]:
    """A client of the job's rendezvous store of its own (the default group's store is shared
    with torch's own blocking waits); None where there is none to reach."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not (port or "").isdigit():
        return None
    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(minutes=timeout_minutes),
                             wait_for_workers=False)
    except Exception:  # noqa: BLE001 (no heartbeat is a worse diagnosis, not a failure)
        return None


def timeout_error(e: BaseException, heartbeat: Heartbeat, topo: Topology, timeout_minutes: float,
                  where: str = "") -> PeerTimeoutError:
    """The one-line error for the collective timeout `e` on this rank: which rank(s) it waited for
    (by their heartbeats) and in which of this rank's groups, or that every rank is alive."""
    rank, waited = heartbeat.rank, f"--distributed-timeout-minutes {timeout_minutes:g}"
    at = f" ({where})" if where else ""
    silent = heartbeat.silent_ranks()
    if silent:
        peers = ", ".join(f"{r}{_shared(topo, rank, r)}" for r in silent)
        return PeerTimeoutError(
            f"rank {rank} waited {waited} in a collective{at} for rank {peers}, which stopped answering (its "
            f"heartbeat stopped: a stopped (SIGSTOP) or frozen process, or its host is gone); end that process "
            f"and resume from the last checkpoint (--load)")
    if silent is None:
        return PeerTimeoutError(f"rank {rank} waited {waited} in a collective{at} for a peer that did not answer "
                                f"({e}); resume from the last checkpoint (--load), or raise {waited.split()[0]} if "
                                f"a step or a checkpoint save legitimately takes longer")
    return PeerTimeoutError(
        f"rank {rank} waited {waited} in a collective{at}, but every rank is alive: one is stuck (a deadlock, or a "
        f"collective the others never call; py-spy dump --pid shows where each rank is); raise "
        f"{waited.split()[0]} if a step or a checkpoint save legitimately takes longer")


def _shared(topo: Topology, rank: int, other: int) -> str:
    """' (this rank's tensor-parallel group [0, 1])': the groups of `rank` that hold `other`."""
    kinds = [k for k in GROUP_NAMES if other in topo.group_of(k, rank)]
    if not kinds:
        return ""
    return " (" + ", ".join(f"this rank's {GROUP_NAMES[k]} group {topo.group_of(k, rank)}" for k in kinds) + ")"
