#!/usr/bin/env python3
"""Load test of the generation server (PUT /api): N concurrent clients, each sending a few requests.

  python benchmarks/bench_server.py [--clients 16 64] [--requests 4] [--tokens 8] [--tp 2]
        [--url http://127.0.0.1:5000/api] [--server-repo DIR] [--workdir /tmp/bench_server]

Without --url it builds a tiny GPT-2 checkpoint (random weights, GPT-2 BPE vocabulary from
tests/data/gpt2 or --vocab-file/--merge-file), starts `tools/generate_text.py --server --port 0
--device cpu` on it (from --server-repo, default this checkout, so that two code states can be
compared), and stops it at the end. For each client count all clients start together (a barrier),
each sends --requests requests one after another on fresh connections, and the table reports:
clients, requests sent, answered (HTTP 200 with text), failed (any other status, a reset, a refused
connection or a timeout), p50/p90/p99 latency of the answered requests, and answered requests per
second of wall time.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import urlsplit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT2_DIR = os.path.join(ROOT, "tests", "data", "gpt2")


@dataclass
class Result:
    clients: int
    sent: int = 0
    latencies: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def failed(self) -> int:
        return sum(self.failures.values())


def build_checkpoint(root: str, vocab_file: str, merge_file: str, layers: int, hidden: int, heads: int) -> None:
    """A tiny GPT-2 checkpoint with random weights whose args name the GPT-2 BPE tokenizer."""
    from megapar.config.build import parse_config
    from megapar.checkpoint import save_checkpoint
    from megapar.model import GPT2Model, Stage, set_vocab
    from megapar.topology import Topology
    cfg = parse_config(["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads",
                        str(heads), "--seq-length", "128", "--attention-backend", "torch"], world_size=1)
    set_vocab(cfg.model, 50257, 1, log=lambda *_: None)
    ns = cfg.megatron_args()
    ns.consumed_train_samples = 0
    ns.tokenizer_type, ns.vocab_file, ns.merge_file = "GPT2BPETokenizer", vocab_file, merge_file
    model = GPT2Model(cfg.model, Stage.of(layers, 1, 0), 1234).eval()
    save_checkpoint(root, 1, model, None, None, ns, model.cfg, Topology(1, 1, 1), 0, save_optim=False,
                    save_rng=False)


def start_server(ckpt: str, repo: str, log_path: str, tokens: int, tp: int = 1, timeout: float = 120.0
                 ) -> tuple[subprocess.Popen, str]:
    """tools/generate_text.py --server on a free port (from `repo`; under torchrun with tp ranks
    when tp > 1); (process, URL) once it listens."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": repo}
    launch = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp)]
                                 if tp > 1 else [])
    cmd = launch + [os.path.join(repo, "tools", "generate_text.py"), "--load", ckpt, "--server", "--port", "0",
                    "--device", "cpu", "--out-seq-length", str(tokens), "--tensor-model-parallel-size", str(tp)]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=repo)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(r"serving PUT (http://\S+/api)", open(log_path).read())
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server did not start; its log ({log_path}):\n{open(log_path).read()[-3000:]}")


def one_request(url: str, body: bytes, timeout: float) -> tuple[bool, str]:
    """(answered, failure kind) of one PUT on a fresh connection."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("PUT", u.path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        if r.status == 200 and json.loads(data).get("text"):
            return True, ""
        return False, f"HTTP {r.status}"
    except Exception as e:  # reset, refused, timeout, bad response: all count as failed
        return False, type(e).__name__
    finally:
        conn.close()


def run_load(url: str, clients: int, requests: int, tokens: int, timeout: float) -> Result:
    """`clients` threads released together, each sending `requests` requests in turn."""
    res, lock = Result(clients), threading.Lock()
    barrier = threading.Barrier(clients + 1)

    def client(i: int) -> None:
        barrier.wait()
        for j in range(requests):
            body = json.dumps({"prompts": [f"Client {i} request {j}: once upon a time"], "tokens_to_generate": tokens,
                               "temperature": 0.9, "top_k": 40, "random_seed": i * 1000 + j}).encode()
            t0 = time.perf_counter()
            ok, why = one_request(url, body, timeout)
            dt = time.perf_counter() - t0
            with lock:
                res.sent += 1
                if ok:
                    res.latencies.append(dt)
                else:
                    res.failures[why] = res.failures.get(why, 0) + 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    res.wall_s = time.perf_counter() - t0
    return res


def percentile(xs: list[float], q: float) -> Optional[float]:
    """The q-th percentile (nearest rank) of xs, None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def table(results: list[Result]) -> str:
    """A markdown table of the runs."""
    ms = lambda v: "-" if v is None else f"{v * 1000:.0f}"  # noqa: E731
    rows = ["| clients | requests | answered | failed | p50 ms | p90 ms | p99 ms | requests/s |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        why = ", ".join(f"{k} {v}" for k, v in sorted(r.failures.items()))
        rows.append(f"| {r.clients} | {r.sent} | {len(r.latencies)} | {r.failed}{f' ({why})' if why else ''} | "
                    f"{ms(percentile(r.latencies, 50))} | {ms(percentile(r.latencies, 90))} | "
                    f"{ms(percentile(r.latencies, 99))} | {len(r.latencies) / r.wall_s:.1f} |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, nargs="+", default=[16, 64])
    p.add_argument("--requests", type=int, default=4, help="requests per client, sent one after another")
    p.add_argument("--tokens", type=int, default=8, help="tokens_to_generate per request")
    p.add_argument("--timeout", type=float, default=120.0, help="client socket timeout (s)")
    p.add_argument("--url", default=None, help="an already running server's http://HOST:PORT/api")
    p.add_argument("--server-repo", default=ROOT, help="checkout whose tools/generate_text.py serves")
    p.add_argument("--vocab-file", default=os.path.join(GPT2_DIR, "encoder.json"))
    p.add_argument("--merge-file", default=os.path.join(GPT2_DIR, "vocab.bpe"))
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the server (torchrun, gloo)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--workdir", default=None, help="checkpoint and server log (default: a temp dir, removed)")
    a = p.parse_args()
    work = a.workdir or tempfile.mkdtemp(prefix="bench_server_")
    os.makedirs(work, exist_ok=True)
    proc = None
    try:
        url = a.url
        if url is None:
            ckpt = os.path.join(work, "ckpt")
            build_checkpoint(ckpt, a.vocab_file, a.merge_file, a.layers, a.hidden, a.heads)
            proc, url = start_server(ckpt, os.path.abspath(a.server_repo), os.path.join(work, "server.log"),
                                     a.tokens, a.tp)
            print(f"> server {url} (log {work}/server.log); tiny model: {a.layers} layers, hidden {a.hidden}, "
                  f"tp {a.tp}",
                  file=sys.stderr)
        one_request(url, json.dumps({"prompts": ["warm up"], "tokens_to_generate": a.tokens}).encode(), a.timeout)
        results = []
        for n in a.clients:
            results.append(run_load(url, n, a.requests, a.tokens, a.timeout))
            if proc is not None and proc.poll() is not None:
                print(f"> the server exited (rc {proc.returncode}) during the {n}-client run", file=sys.stderr)
                break
        print(table(results))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
