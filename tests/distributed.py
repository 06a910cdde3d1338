"""Run a test body on N CPU processes under gloo.

    results = run_distributed(body, world_size=4, args=(x,))

`body(rank, world_size, *args)` runs in each spawned process after
`torch.distributed.init_process_group("gloo")`; its return value (anything torch.save can
pickle) comes back in `results[rank]`. An exception in any rank fails the test with that
rank's traceback. Bodies must be module-level functions (they are pickled by reference).

The rendezvous store is hosted by the calling process, as torchrun's agent hosts it: it listens on
a port the kernel picks (port 0) before any rank starts, and the ranks connect to it as clients
(TORCHELASTIC_USE_AGENT_STORE). No port is chosen, freed and bound again later, so test runs in
parallel (pytest-xdist workers, another job on the machine) cannot take each other's port.

The ranks are forked from a fork server that has imported torch and megapar once (the
multiprocessing "forkserver" start method, started by the first call), instead of each rank
starting a new interpreter and importing them again: most of a small test's time was those
imports. A rank still starts in the caller's current environment variables, working directory
and sys.path, as a spawned one would.
"""
from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    """A port free now (for the NCCL tests, which rendezvous on their own); it may be taken before use."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ["torch", "torch.distributed", "megapar.pretrain_gpt2"]


def _worker(rank: int, world_size: int, port: int, out_dir: str, caller: tuple[dict, str, list],
            payload: bytes) -> None:
    environ, cwd, path = caller
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = path
    body, args = pickle.loads(payload)  # after sys.path: the body's module may lie on a folder added since
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      TORCHELASTIC_USE_AGENT_STORE="True")  # the caller hosts the store (run_distributed)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = body(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(body: Callable, world_size: int, args: Sequence[Any] = ()) -> list[Any]:
    """Spawn `world_size` gloo processes running `body`; return each rank's result."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # read when the server starts, at the first call
    caller = (dict(os.environ), os.getcwd(), list(sys.path))
    with tempfile.TemporaryDirectory() as out_dir:
        payload = pickle.dumps((body, tuple(args)))
        mp.start_processes(_worker, args=(world_size, store.port, out_dir, caller, payload),
                           nprocs=world_size, join=True, start_method="forkserver")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                for r in range(world_size)]
