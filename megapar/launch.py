"""What scripts/pretrain_gpt2.sh runs: check the flags, then start torchrun and stand between it
and the user.

    python -m megapar.launch [torchrun flags] -- [megapar.pretrain_gpt2 flags]

1. The flags are parsed and validated here, once, at the world size torchrun will start
   (--nproc-per-node x --nnodes): a bad flag ends in one `error:` line and exit 2 before any
   process starts (no line per rank, no torchrun report). So are the rendezvous flags of a
   multi-node job (`check_rendezvous`): torchrun's static rendezvous, where node rank 0 hosts the
   store at --master-addr:--master-port and every node gives the same --nnodes and its own
   --node-rank.
2. torchrun runs in a session of its own, its output read line by line and passed on. Once a rank
   reports a user error (a line starting `error:`, printed by megapar.pretrain_gpt2's main, which
   then exits with status 2), what follows on stderr is its consequence -- the other ranks losing
   their peer, torchrun's ChildFailedError report -- and is dropped, as are repeats of the error
   line from other ranks; the launcher exits 2. A failure with no `error:` line (a bug, a crash)
   passes through untouched, torchrun's report included.
3. Signals. SIGTERM or SIGINT (Ctrl-C) -- and SIGHUP, SIGQUIT, as torchrun does -- sent to the
   launcher (or to its process group, as a terminal or a batch system does) is forwarded once to
   each training process directly, not to torchrun: torchrun would answer a signal by stopping
   the workers itself (SIGKILL after 30 s) and exit 1 with a SignalException traceback even when
   they saved and exited 0. With
   --exit-signal-handler the workers finish the iteration, save, name the signal and exit 0, so
   torchrun and the launcher exit 0. A second signal goes to the workers and to torchrun: a second
   Ctrl-C aborts without saving, and torchrun SIGKILLs a worker still running 30 s later. Without
   --exit-signal-handler the first signal stops the run unsaved. In those cases the launcher drops
   the resulting tracebacks and torchrun report, says whether a checkpoint was saved after the first
   signal, and exits 128 + the signal number. The launcher killed outright (SIGKILL, which it
   cannot see) takes torchrun with it (the kernel sends torchrun SIGTERM: `die_with_parent`), and
   torchrun stops its workers; a worker whose torchrun is killed outright dies too
   (megapar.pretrain_gpt2 asks the kernel for SIGKILL then).
4. `--generate` runs tools/generate_text.py the same way (scripts/generate_text.sh with several
   processes): the first SIGTERM or Ctrl-C goes to rank 0 alone, which stops serving (or sampling)
   and tells the other ranks to stop; all exit 0, as one process does.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from typing import Optional, Sequence

from .config.command import TRAINING_SCRIPT
from .errors import USER_ERROR_EXIT, die_with_parent

# What torchrun itself would forward; the first two make --exit-signal-handler save (training.py).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
SAVING_SIGNALS = (signal.SIGTERM, signal.SIGINT)
AUTO_NPROC = ("gpu", "cpu", "auto")  # --nproc-per-node values with which torchrun counts the processes itself
MAX = 2**31
SAVED_LINE = re.compile(rb"successfully saved checkpoint at iteration\s+(\d+)")


def _world_size(torchrun_args: Sequence[str]) -> Optional[int]:
    """--nproc-per-node x --nnodes, or None where torchrun decides ('gpu', 'auto', ...)."""
    nproc = _launcher_value(torchrun_args, "--nproc-per-node") or "1"
    nnodes = _launcher_value(torchrun_args, "--nnodes") or "1"
    return int(nproc) * int(nnodes) if nproc.isdigit() and nnodes.isdigit() else None


def _launcher_value(torchrun_args: Sequence[str], flag: str) -> Optional[str]:
    """The value of a torchrun flag (`--flag v`, `--flag=v`, or the underscore spelling), or None."""
    for i, a in enumerate(torchrun_args):
        if a in (flag, flag.replace("-", "_")) and i + 1 < len(torchrun_args):
            return torchrun_args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


# scripts/pretrain_gpt2.sh's own flags (it starts torchrun with them; the rest go to training).
LAUNCHER_FLAGS = (
    ("--nproc-per-node", "N", "processes on this node; default every visible GPU, else tensor x pipeline "
                              "parallel size on CPU"),
    ("--nnodes", "N", "nodes of the job, the same on every node; default 1"),
    ("--node-rank", "R", "this node's rank: 0 on the --master-addr node, 1 .. N-1 on the others"),
    ("--master-addr", "HOST", "address of the node with --node-rank 0, the same on every node (with --nnodes > 1)"),
    ("--master-port", "PORT", "a free TCP port of the --master-addr node, the same on every node"),
)


def print_help() -> None:
    """scripts/pretrain_gpt2.sh --help: its own flags, then the training flags."""
    from .config.settings import build_parser
    parser = build_parser(prog=TRAINING_SCRIPT)
    group = parser.add_argument_group("launcher (scripts/pretrain_gpt2.sh: how many processes, on which nodes)")
    for flag, metavar, help in LAUNCHER_FLAGS:
        group.add_argument(flag, metavar=metavar, help=help)
    parser._action_groups.insert(2, parser._action_groups.pop())   # after argparse's own two, before training's
    parser.print_help()


class LaunchError(ValueError):
    """A launcher flag the user can fix."""


def _whole(flag: str, value: Optional[str], low: int, high: int, why: str) -> Optional[int]:
    """`value` as an integer in [low, high], or None when the flag was not given."""
    if value is None:
        return None
    if not value.isdigit() or not low <= int(value) <= high:
        raise LaunchError(f"{flag} {value} must be a whole number " + (f">= {low}" if high == MAX else
                          f"in [{low}, {high}]") + f"; {why}")
    return int(value)


def check_rendezvous(torchrun_args: Sequence[str]) -> None:
    """The multi-node flags, checked before torchrun starts. torchrun's static rendezvous has node
    rank 0 host the store at --master-addr:--master-port, and each of the --nnodes launchers must
    give the same --nnodes and its own --node-rank. Mistakes there leave nodes waiting for each
    other until a timeout (two nodes of rank 0, a node 1 connecting to itself), so they end here."""
    def value(flag: str) -> Optional[str]:
        return _launcher_value(torchrun_args, flag)

    if value("--nproc-per-node") not in AUTO_NPROC:
        _whole("--nproc-per-node", value("--nproc-per-node"), 1, MAX, "the number of processes on this node")
    nnodes = _whole("--nnodes", value("--nnodes"), 1, MAX, "the number of nodes, the same on every node (a "
                    "range MIN:MAX needs an elastic rendezvous, which this launcher does not start)") or 1
    rank = _whole("--node-rank", value("--node-rank"), 0, MAX, "0 on the --master-addr node, 1, 2, ... on the others")
    _whole("--master-port", value("--master-port"), 1, 65535, "a free TCP port of the --master-addr node, the "
           "same on every node")
    if rank is not None and rank >= nnodes:
        raise LaunchError(f"--node-rank {rank} must be less than --nnodes {nnodes}; node ranks run from 0 to "
                          f"{nnodes - 1}, one per node")
    if nnodes > 1 and value("--master-addr") is None:
        raise LaunchError(f"--nnodes {nnodes} needs --master-addr: the address of the node with --node-rank 0, "
                          f"the same on every node")
    if nnodes > 1 and rank is None:
        raise LaunchError(f"--nnodes {nnodes} needs --node-rank on every node: 0 on the --master-addr node, "
                          + ("1 on the other" if nnodes == 2 else f"1 to {nnodes - 1} on the others"))


def check_flags(flags: Sequence[str], world: Optional[int]) -> None:
    """Parse and validate the training flags as every rank will (exit 2 with one line if bad)."""
    from .config.settings import ConfigError
    from .pretrain_gpt2 import parse

    if world is None:
        return
    try:
        parse(list(flags), world)  # argparse errors print one `error:` line and exit 2 themselves
    except ConfigError as e:
        print(f"error: {e}{_process_count_hint(flags, world)}", file=sys.stderr, flush=True)
        raise SystemExit(USER_ERROR_EXIT) from None


def _process_count_hint(flags: Sequence[str], world: int) -> str:
    """Where the launcher chose the process count itself (scripts/pretrain_gpt2.sh without --nproc-per-node:
    it sets MEGAPAR_NPROC_CHOSEN to what it counted), the count these flags work with (a recipe's or a DeepSpeed
    config's batch triple imply one the script cannot see), as the flag to add; nothing when no count fits."""
    import contextlib
    import io

    from .config.settings import ConfigError
    from .pretrain_gpt2 import parse

    chosen = os.environ.get("MEGAPAR_NPROC_CHOSEN")
    if not chosen:
        return ""
    for size in range(1, 65):
        if size == world:
            continue
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                parse(list(flags), size)
        except (ConfigError, SystemExit):
            continue
        return (f" (this launch counted {world} process(es): {chosen}; these flags work with {size}: add "
                f"--nproc-per-node {size})")
    return ""   # no process count fixes it: the error is not about the count


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc): torchrun's workers."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


def _rank_of(pid: int) -> Optional[int]:
    """The RANK torchrun gave worker `pid` (its environment, Linux /proc), or None."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    return next((int(e[5:]) for e in env if e.startswith(b"RANK=") and e[5:].isdigit()), None)


class Launch:
    """torchrun in front of `target` (the training entry point, or with `leader_stops` the text
    generation tool, whose rank 0 stops the others: the first signal goes to rank 0 alone)."""

    def __init__(self, torchrun_args: Sequence[str], flags: Sequence[str],
                 target: Sequence[str] = ("-m", "megapar.pretrain_gpt2"), leader_stops: bool = False):
        self.flags = list(flags)
        self.leader_stops = leader_stops
        self.handler_on = leader_stops or "--exit-signal-handler" in self.flags
        self.cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args, *target, *self.flags]
        self.lock = threading.Lock()
        self.error_seen = False
        self.signals: list[int] = []  # forwarded, in order
        self.saved_after_signal: Optional[str] = None  # the iteration of a save that finished after the first
        self.proc: Optional[subprocess.Popen] = None

    # -- output ----------------------------------------------------------------------------------
    def _quiet(self) -> bool:
        """Drop stderr from now on? After a user error, or after a signal that stops the run unsaved."""
        graceful = self.handler_on and len(self.signals) == 1 and self.signals[0] in SAVING_SIGNALS
        return self.error_seen or bool(self.signals and not graceful)

    def _relay(self, src, dst, is_stderr: bool) -> None:
        for line in iter(src.readline, b""):
            with self.lock:
                if line.startswith(b"error:"):
                    if self.error_seen:
                        continue  # the same failure seen by another rank
                    self.error_seen = True
                elif is_stderr and self._quiet():
                    continue
                elif self.signals and not is_stderr:
                    self._note_save(line)
                try:
                    dst.write(line)
                    dst.flush()
                except OSError:  # our reader went away (e.g. `| head`): keep draining, so no rank blocks
                    pass

    def _note_save(self, line: bytes) -> None:
        """Remember a checkpoint the workers finished saving after a signal (training.py's Megatron
        line `successfully saved checkpoint at iteration N to DIR`), for the closing line."""
        m = SAVED_LINE.search(line)
        if m:
            self.saved_after_signal = m.group(1).decode()

    # -- signals ---------------------------------------------------------------------------------
    def _forward(self, signum, frame) -> None:
        self.signals.append(signum)
        if self.proc is None or self.proc.poll() is not None:
            return
        workers = _children(self.proc.pid)
        if self.leader_stops and len(self.signals) == 1:
            workers = [w for w in workers if _rank_of(w) == 0] or workers
        # No worker yet: torchrun stops itself. A second signal also goes to torchrun, which then
        # stops the workers itself and SIGKILLs any still running 30 s later (a rank hung in a collective).
        targets = workers + [self.proc.pid] if len(self.signals) > 1 else workers or [self.proc.pid]
        for pid in targets:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def run(self) -> int:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for sig in FORWARDED:
            signal.signal(sig, self._forward)
        # A session of its own: a terminal's Ctrl-C reaches only this process, which forwards it once.
        # torchrun gets SIGTERM if the launcher is killed outright (SIGKILL): it stops its workers itself.
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                     start_new_session=True, preexec_fn=lambda: die_with_parent(signal.SIGTERM))
        relays = [threading.Thread(target=self._relay, args=(self.proc.stdout, sys.stdout.buffer, False), daemon=True),
                  threading.Thread(target=self._relay, args=(self.proc.stderr, sys.stderr.buffer, True), daemon=True)]
        for t in relays:
            t.start()
        while True:
            try:
                rc = self.proc.wait()
                break
            except InterruptedError:
                continue
        for t in relays:
            t.join(timeout=10)  # a worker left behind would hold the pipes open
        if self.error_seen:
            return USER_ERROR_EXIT  # the status the target itself exits with
        if rc != 0 and self._quiet():
            name = signal.Signals(self.signals[-1]).name
            if self.saved_after_signal is not None:
                print(f"> stopped by {name} after the checkpoint at iteration {self.saved_after_signal} was saved; "
                      f"nothing was lost", flush=True)
            else:
                print(f"> stopped by {name} without saving" + ("" if self.handler_on else
                      " (--exit-signal-handler makes SIGTERM or a first Ctrl-C finish the iteration and save)"),
                      flush=True)
            return 128 + self.signals[-1]
        return rc


GENERATE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "generate_text.py")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`[torchrun flags] -- [training flags]`, or `--generate [torchrun flags] -- [tools/generate_text.py
    flags]` (scripts/generate_text.sh with several processes)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    generate = bool(argv) and argv[0] == "--generate"
    argv = argv[1:] if generate else argv
    split = argv.index("--") if "--" in argv else len(argv)
    torchrun_args, flags = argv[:split], argv[split + 1:]
    if not generate and any(a in ("-h", "--help") for a in argv):
        print_help()
        return 0
    try:
        check_rendezvous(torchrun_args)
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT
    if generate:
        return Launch(torchrun_args, flags, target=[GENERATE], leader_stops=True).run()
    check_flags(flags, _world_size(torchrun_args))
    return Launch(torchrun_args, flags).run()


if __name__ == "__main__":
    sys.exit(main())
