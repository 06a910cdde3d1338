"""How megapar prints a command for the user to paste: the one renderer of whole command lines (next
steps, the layout planner, the HF importer), beside `flag`/`flag_words` (settings.py) for single flags."""
from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Processes:
    """The processes scripts/pretrain_gpt2.sh starts: `per_node` on each of `nodes` nodes (node rank
    0 hosting the rendezvous at `master_addr`:`master_port`)."""
    per_node: int
    nodes: int = 1
    master_addr: str = "NODE0"
    master_port: int = 29500

    @classmethod
    def of_this_run(cls) -> "Processes":
        """What torchrun started this process with (its environment); one process without torchrun."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        return cls(per_node, max(1, world // per_node), os.environ.get("MASTER_ADDR", "NODE0"),
                   int(os.environ.get("MASTER_PORT", "29500")))

    def launcher_flags(self) -> list[str]:
        """scripts/pretrain_gpt2.sh's own flags that start these processes (those of node rank 0
        when they span nodes): always --nproc-per-node, since the script's default (every visible
        GPU, else tp x pp) may differ from this run's count."""
        words = []
        if self.nodes > 1:
            words += ["--nnodes", str(self.nodes), "--node-rank", "0", "--master-addr", self.master_addr,
                      "--master-port", str(self.master_port)]
        return words + ["--nproc-per-node", str(self.per_node)]


TRAINING_SCRIPT = "bash scripts/pretrain_gpt2.sh"


def command_line(program: str, words: Sequence[object], why: str = "") -> str:
    """A command for the user to paste: `program` (as written, e.g. `python tools/x.py`), then
    `words` shell-quoted, then `why` as a trailing comment."""
    line = " ".join([program, shlex.join(map(str, words))]) if words else program
    return line + (f"   # {why}" if why else "")


def training_command(flags: Sequence[object], procs: Processes, why: str = "") -> str:
    """The one way megapar prints a training command (next steps, the layout planner, the HF
    importer): the launcher with the flags that start `procs`, then the training `flags`. Several
    nodes: node 0's command, and the comment says what the other nodes change."""
    notes = [why] if why else []
    if procs.nodes > 1:
        notes.append("on node 0; the same with " + ("--node-rank 1 on the other node" if procs.nodes == 2 else
                                                    f"--node-rank 1..{procs.nodes - 1} on the other nodes"))
    return command_line(TRAINING_SCRIPT, [*procs.launcher_flags(), *flags], "; ".join(notes))
