"""Several nodes on one machine (CPU, gloo): scripts/pretrain_gpt2.sh started once per node with
--nnodes 2 --node-rank R --master-addr 127.0.0.1 --master-port P (torchrun's static rendezvous),
and scripts/slurm_pretrain_gpt2.sbatch run with stubbed SLURM variables and fake `srun` and
`scontrol` commands on PATH. Both must train exactly as one node with two processes does (dp 2).
The bad rendezvous flags are fault cases in tests/faults/test_faults_launch.py.
"""
from __future__ import annotations

import os
import random
import re
import socket
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "scripts" / "slurm_pretrain_gpt2.sbatch"
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--log-interval", "1",
        "--eval-iters", "0", "--eval-interval", "0", "--hidden-dropout", "0", "--attention-dropout", "0"]
LOSS = re.compile(r" iteration +(\d+)/ *\d+ \|.*?lm loss: (\S+)")

# srun stand-in: runs the command once per node (SLURM_NODEID 0..N-1) at the same time, like
# `srun --ntasks-per-node 1 --nodes N`; FAKE_SRUN_PRINT=1 only writes each node's command (NUL-separated
# arguments) to $FAKE_SRUN_LOGS/nodeR.cmd instead.
FAKE_SRUN = r"""#!/usr/bin/env bash
nodes=1
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) nodes=$2; shift 2;; --ntasks-per-node) shift 2;; --*=*) shift;;
    *) break;;
  esac
done
pids=()
for ((r = 0; r < nodes; r++)); do
  if [ -n "${FAKE_SRUN_PRINT:-}" ]; then
    printf "%s\0" "$@" > "$FAKE_SRUN_LOGS/node$r.cmd"
  else
    SLURM_NODEID=$r "$@" > "$FAKE_SRUN_LOGS/node$r.log" 2>&1 &
    pids+=($!)
  fi
done
rc=0
for p in ${pids[@]+"${pids[@]}"}; do wait "$p" || rc=$?; done
exit $rc
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
[ "$1 $2" = "show hostnames" ] && printf '127.0.0.1\\nnode-b\\n'
"""


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: the launcher binds it seconds later, and
    meanwhile no socket the kernel numbers itself (a connection, a store on port 0, in another test
    running in parallel) can take it; only another explicit choice of the same port could."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    while True:
        port = random.randrange(max(1024, low - 8192), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def losses(log: str) -> dict[int, str]:
    """{iteration: logged lm loss, as printed} of a training log."""
    return {int(i): loss for i, loss in LOSS.findall(log)}


@pytest.fixture(scope="module")
def flags(embedded_data, tmp_path_factory) -> list[str]:
    return [*embedded_data, "--data-cache-path", str(tmp_path_factory.mktemp("cache")), *TINY]


@pytest.fixture(scope="module")
def one_node(flags) -> dict[int, str]:
    """The reference: one launcher, two processes (dp 2)."""
    out = subprocess.run(["bash", "scripts/pretrain_gpt2.sh", "--nproc-per-node", "2", *flags], cwd=ROOT,
                         env=env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "data 2" in out.stdout
    return losses(out.stdout)


@pytest.fixture
def fake_slurm(tmp_path) -> dict[str, str]:
    """PATH with fake srun/scontrol, and the variables SLURM sets in a 2-node job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "logs").mkdir()
    return {**env(), "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "127.0.0.1,node-b",
            "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(ROOT),
            "FAKE_SRUN_LOGS": str(tmp_path / "logs")}


def test_sbatch_script_builds_one_launcher_per_node(fake_slurm, tmp_path):
    """Quick: the script is valid bash and, in the fake srun's print mode, starts on each node the
    launcher with the job's rendezvous and that node's rank; its flags pass the launcher's checks."""
    from megapar.launch import _world_size, check_flags, check_rendezvous

    assert subprocess.run(["bash", "-n", str(SBATCH)]).returncode == 0
    run_env = {**fake_slurm, "FAKE_SRUN_PRINT": "1", "SLURM_GPUS_ON_NODE": "4"}
    out = subprocess.run(["bash", str(SBATCH), "--tensor-parallel", "2", "--train-iters", "5",
                          "--global-batch-size", "16"],
                         cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    commands = [p.read_text().split("\0")[:-1] for p in sorted((tmp_path / "logs").glob("*.cmd"))]
    assert len(commands) == 2
    for rank, cmd in enumerate(commands):
        assert cmd[:3] == ["bash", "-c", cmd[2]] and "scripts/pretrain_gpt2.sh" in cmd[2]
        argv = expand(cmd, rank)
        assert argv[:8] == ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
                            "--master-port", str(20000 + 4242)]
        assert argv[8:] == ["--nproc-per-node", "4", "--tensor-parallel", "2", "--train-iters", "5",
                            "--global-batch-size", "16"]
        launcher, training = argv[:10], argv[10:]
        check_rendezvous(launcher)
        check_flags(training, _world_size(launcher))  # 8 processes at tp 2: dp 4


def expand(cmd: list[str], node_id: int) -> list[str]:
    """The launcher arguments a `bash -c SCRIPT ARGS...` task runs with on node `node_id`."""
    probe = cmd[2].replace("exec bash scripts/pretrain_gpt2.sh", 'printf "%s\\0"')
    out = subprocess.run(["bash", "-c", probe, *cmd[3:]], env={**os.environ, "SLURM_NODEID": str(node_id)},
                         capture_output=True, text=True, check=True)
    return out.stdout.split("\0")[:-1]


@pytest.mark.slow
def test_two_launchers_match_one_node(flags, one_node):
    """Node ranks 0 and 1, one process each, as two nodes would run them: both exit 0 and log the
    losses of the one-node run with two processes."""
    port = str(free_port())
    nodes = [subprocess.Popen(["bash", "scripts/pretrain_gpt2.sh", "--nnodes", "2", "--node-rank", str(rank),
                               "--master-addr", "127.0.0.1", "--master-port", port, "--nproc-per-node", "1", *flags],
                              cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (1, 0)]  # node 1 first: it waits for the master
    outs = [p.communicate(timeout=300)[0] for p in nodes]
    for p, out in zip(nodes, outs):
        assert p.returncode == 0, out[-3000:]
    master = outs[1]
    assert "world size 2 = tensor 1 x pipeline 1 x data 2" in master
    assert losses(master) == one_node and len(one_node) == 3


@pytest.mark.slow
def test_sbatch_script_trains_like_one_node(flags, one_node, fake_slurm, tmp_path):
    """The sbatch script with a fake srun that really starts both node tasks on this machine."""
    run_env = {**fake_slurm, "MASTER_PORT": str(free_port())}
    out = subprocess.run(["bash", str(SBATCH), *flags], cwd=tmp_path, env=run_env, capture_output=True, text=True,
                         timeout=300)
    logs = [(tmp_path / "logs" / f"node{r}.log").read_text() for r in (0, 1)]
    assert out.returncode == 0, out.stderr + logs[0][-2000:] + logs[1][-2000:]
    assert losses(logs[0]) == one_node
