"""Run a test body on N CPU processes under gloo.

    results = run_distributed(body, world_size=4, args=(x,))

`body(rank, world_size, *args)` runs in each spawned process after
`torch.distributed.init_process_group("gloo")`; its return value (anything torch.save can
pickle) comes back in `results[rank]`. An exception in any rank fails the test with that
rank's traceback. Bodies must be module-level functions (they are pickled by reference).
"""
from __future__ import annotations

import os
import socket
import tempfile
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out_dir: str, body: Callable, args: Sequence[Any]) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = body(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(body: Callable, world_size: int, args: Sequence[Any] = ()) -> list[Any]:
    """Spawn `world_size` gloo processes running `body`; return each rank's result."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world_size, _free_port(), out_dir, body, tuple(args)),
                 nprocs=world_size, join=True)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                for r in range(world_size)]
