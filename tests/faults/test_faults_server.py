"""The generation server under faults: idle and half-sent connections, many concurrent clients,
every class of bad request, out-of-range seeds, too many connections, shutdown; plus the CLI's
refusal of a bad --port (through the fault harness) and of a port already in use.

The server runs in-process on a tiny random model with a character tokenizer (no files), with a
2 s connection timeout so the timeout cases stay fast."""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

import pytest
import torch

from gpt_helpers import tiny_model_config
from harness import ROOT, ROWS, Row, refused
from megapar.cli import generate_text
from megapar.inference.generation import GenerationError, InferenceEngine, SamplingParams
from megapar.checkpoint import save_checkpoint
from megapar.model import GPT2Model, Stage
from megapar.topology import Topology
from megapar.inference.text_generation_server import Limits, make_server, response_for

VOCAB, EOD = 100, 99
TIMEOUT = 2.0
GOOD = {"prompts": ["Hello"], "tokens_to_generate": 3, "temperature": 0.9, "random_seed": 7}


class CharTokenizer:
    """ids 1..98 <-> characters; 99 is end-of-document."""
    vocab_size, eod = VOCAB, EOD

    def tokenize(self, text: str) -> list[int]:
        return [1 + (ord(ch) - 32) % 98 for ch in text]

    def detokenize(self, ids) -> str:
        return "".join(chr(31 + i) for i in ids if i != EOD)


class Generator:
    """generate(prompts, params) on a tiny model, recording the most generations ever in flight."""

    def __init__(self):
        cfg = tiny_model_config(["--seq-length", "48"], vocab=VOCAB)
        model = GPT2Model(cfg.model, Stage.of(cfg.model.num_layers, 1, 0), 1234).eval()
        self.engine = InferenceEngine(model, Topology(1, 1, 1), 0, VOCAB, EOD)
        self.tok, self.in_flight, self.max_in_flight, self.calls = CharTokenizer(), 0, 0, 0
        self.lock = threading.Lock()

    def __call__(self, prompts: list[str], params: SamplingParams) -> dict:
        with self.lock:
            self.in_flight += 1
            self.calls += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            out = self.engine.generate([self.tok.tokenize(p) if p else [EOD] for p in prompts], params)
            time.sleep(0.002)   # widen the window in which an overlap would show
            return response_for(self.tok, prompts, out, params.logprobs)
        finally:
            with self.lock:
                self.in_flight -= 1


@pytest.fixture(scope="module")
def one_thread():
    """2 shared cores: OpenMP spinning with 2 threads makes tiny ops 100x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def start(gen: Generator, **limits) -> tuple:
    """A served GenerationServer on a free port; (server, port)."""
    server = make_server(gen, SamplingParams(tokens_to_generate=4), port=0,
                         limits=Limits(timeout=TIMEOUT, max_body_bytes=1 << 16, **limits))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


@pytest.fixture(scope="module")
def served(one_thread):
    """(port, generator) of a server shared by the tests of this module."""
    gen = Generator()
    server, port = start(gen)
    yield port, gen
    server.shutdown()
    server.server_close()


def put(port: int, body, method: str = "PUT", path: str = "/api") -> tuple[int, dict]:
    """(status, JSON body) of one request; body is a dict (sent as JSON) or bytes."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def raw(port: int, data: bytes) -> tuple[int, dict]:
    """(status, JSON body) of a hand-written request (for broken headers http.client would fix)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def answers_good(port: int) -> None:
    status, body = put(port, GOOD)
    assert status == 200 and body["text"][0].startswith("Hello"), body


# ---- (a) idle and half-sent connections ----------------------------------------------------------
def test_idle_and_half_sent_connections_block_no_one_and_are_closed(served):
    port, _ = served
    idle = socket.create_connection(("127.0.0.1", port))                       # sends nothing
    half = socket.create_connection(("127.0.0.1", port))
    half.sendall(b"PUT /api HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompts\"")   # 10 of 100
    try:
        t0 = time.monotonic()
        for _ in range(3):
            answers_good(port)
        assert time.monotonic() - t0 < TIMEOUT      # answered while both connections are still open
        half.settimeout(5)
        reply = b""
        while chunk := half.recv(4096):
            reply += chunk
        assert reply.startswith(b"HTTP/1.0 408") and b'"message"' in reply
        idle.settimeout(5)
        assert idle.recv(4096) == b""                # closed by the server after its timeout
    finally:
        idle.close()
        half.close()
    answers_good(port)


# ---- (b) many concurrent clients -----------------------------------------------------------------
def test_32_concurrent_clients_all_answered_one_generation_at_a_time(served):
    port, gen = served
    n, statuses = 32, []
    barrier = threading.Barrier(n)

    def client(i: int) -> None:
        barrier.wait()
        statuses.append(put(port, {**GOOD, "prompts": [f"client {i}"]})[0])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert statuses == [200] * n
    assert gen.max_in_flight == 1


# ---- (c) every class of bad request --------------------------------------------------------------
def request(method: str, path: str, body: bytes, headers: Optional[dict] = None) -> bytes:
    head = [f"{method} {path} HTTP/1.1", "Host: x", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def framed(body: bytes) -> bytes:
    return request("PUT", "/api", body, {"Content-Length": len(body)})


BAD_RAW = [  # (case, raw request, status, fragment of the message)
    ("bad JSON", framed(b'{"prompts": ['), 400, "not JSON"),
    ("bad UTF-8", framed(b'{"prompts": ["\xff\xfe"]}'), 400, "not UTF-8"),
    ("NaN", framed(b'{"prompts": ["a"], "temperature": NaN}'), 400, "not JSON"),
    ("nesting too deep", framed(b"[" * 30000), 400, "nested too deeply"),
    ("integer of 5000 digits", framed(b'{"prompts": ["a"], "random_seed": 1' + b"0" * 5000 + b"}"), 400, "not JSON"),
    ("missing Content-Length", request("PUT", "/api", b""), 411, "Content-Length"),
    ("Content-Length not a number", request("PUT", "/api", b"{}", {"Content-Length": "abc"}), 400, "Content-Length"),
    ("negative Content-Length", request("PUT", "/api", b"{}", {"Content-Length": "-1"}), 400, "Content-Length"),
    ("two Content-Lengths", request("PUT", "/api", b"{}", {"Content-Length": "2\r\nContent-Length: 3"}), 400,
     "Content-Length"),
    ("chunked body", request("PUT", "/api", b"2\r\n{}\r\n0\r\n\r\n", {"Transfer-Encoding": "chunked"}), 411,
     "Transfer-Encoding"),
    ("body over the cap", request("PUT", "/api", b"", {"Content-Length": 10**9}), 413, "larger than the limit"),
    ("body shorter than Content-Length", request("PUT", "/api", b"{}", {"Content-Length": 50}), 400, "ended after"),
    ("GET", request("GET", "/api", b""), 405, "use PUT /api"),
    ("POST", framed(b"{}").replace(b"PUT", b"POST", 1), 405, "use PUT /api"),
    ("unknown method", request("BREW", "/api", b""), 501, "Unsupported method"),
    ("wrong path", framed(json.dumps(GOOD).encode()).replace(b"/api", b"/generate", 1), 404, "unknown path"),
]

BAD_FIELDS = [  # (request body, fragment of the message); all 400
    ([GOOD], "JSON object"),
    ({"tokens_to_generate": 3}, "prompts argument required"),
    ({"prompts": "x"}, "not a list of strings"),
    ({"prompts": ["x", 3]}, "not a list of strings"),
    ({"prompts": []}, "prompts is empty"),
    ({"prompts": ["x"] * 129}, "Maximum number of prompts"),
    ({"prompts": ["\ud800"]}, "not valid Unicode"),
    ({"prompts": ["x" * 60]}, "longer than"),                  # 60 tokens, context 48
    ({**GOOD, "tokens_to_generate": "3"}, "tokens_to_generate"),
    ({**GOOD, "tokens_to_generate": 3.0}, "tokens_to_generate"),
    ({**GOOD, "tokens_to_generate": True}, "tokens_to_generate"),
    ({**GOOD, "tokens_to_generate": -1}, "tokens_to_generate"),
    ({**GOOD, "tokens_to_generate": 2**16 + 1}, "tokens_to_generate"),
    ({**GOOD, "tokens_to_generate": 0}, "implies logprobs"),
    ({**GOOD, "temperature": "hot"}, "temperature"),
    ({**GOOD, "temperature": -0.1}, "temperature"),
    ({**GOOD, "temperature": 101}, "temperature"),
    ({**GOOD, "temperature": 1e-40}, "temperature"),          # logits / t overflow: sampling would fail
    ({**GOOD, "temperature": 1e999}, "temperature"),           # json.dumps writes Infinity: refused as JSON
    ({**GOOD, "top_k": 1.5}, "top_k"),
    ({**GOOD, "top_k": -1}, "top_k"),
    ({**GOOD, "top_k": 1001}, "top_k"),
    ({**GOOD, "top_p": 1.5}, "top_p"),
    ({**GOOD, "top_p": -0.1}, "top_p"),
    ({**GOOD, "top_p": None}, "top_p"),
    ({**GOOD, "logprobs": "yes"}, "logprobs"),
    ({**GOOD, "logprobs": 1}, "logprobs"),
    ({**GOOD, "random_seed": -1}, "random_seed"),
    ({**GOOD, "random_seed": 1.0}, "random_seed"),
    ({**GOOD, "random_seed": "7"}, "random_seed"),
]


def test_every_bad_request_gets_a_4xx_json_message_and_the_server_goes_on(served):
    port, gen = served
    calls = gen.calls
    for case, data, status, fragment in BAD_RAW:
        got, body = raw(port, data)
        assert (got, fragment in body.get("message", "")) == (status, True), (case, got, body)
    for req, fragment in BAD_FIELDS:
        got, body = put(port, req)
        msg = body.get("message", "")
        assert got == 400 and (fragment in msg or fragment == "temperature" and "not JSON" in msg), (req, got, body)
    assert gen.calls == calls + 1      # only the over-long prompt, refused by check_prompts before any rank
    answers_good(port)


# ---- (d) seeds beyond int64 ----------------------------------------------------------------------
def test_random_seed_of_2_63_or_more_is_refused_before_any_rank(served):
    port, _ = served
    for seed in (2**63, 2**64):
        status, body = put(port, {**GOOD, "random_seed": seed})
        assert status == 400 and "random_seed" in body["message"] and "2^63" in body["message"]
    a, b = (put(port, {**GOOD, "random_seed": 2**63 - 1}) for _ in range(2))
    assert a[0] == 200 and a == b
    with pytest.raises(GenerationError, match="2\\^63"):           # the engine refuses it too
        SamplingParams(seed=2**63).validate()


# ---- connection cap and shutdown -----------------------------------------------------------------
def test_connections_beyond_the_cap_get_503_and_shutdown_refuses_new_generations(one_thread):
    gen = Generator()
    server, port = start(gen, max_connections=2)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    try:
        deadline = time.monotonic() + 5
        while server.open_connections < 2:               # both accepted and holding their slots
            assert time.monotonic() < deadline
            time.sleep(0.02)
        status, body = put(port, GOOD)
        assert status == 503 and "too many open connections" in body["message"]
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 5
    while put(port, GOOD)[0] != 200:                     # slots come back as the threads end
        assert time.monotonic() < deadline
        time.sleep(0.05)
    server.close_generation()
    status, body = put(port, GOOD)
    assert status == 503 and "shutting down" in body["message"]
    server.shutdown()
    server.server_close()


# ---- the CLI -------------------------------------------------------------------------------------
def test_cli_refuses_a_port_out_of_range(tmp_path):
    refused(["python", "tools/generate_text.py", "--load", tmp_path / "ckpt", "--server", "--port", "70000"],
            fault_class="generation server", case="--port 70000", expect="--port 70000", watch=[tmp_path])


def test_cli_refuses_a_port_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        a = argparse.Namespace(host="127.0.0.1", port=port, request_timeout=1.0, max_request_bytes=1024)
        session = argparse.Namespace(api=lambda prompts, params: {}, params=SamplingParams())
        with pytest.raises(GenerationError, match=f"cannot listen on 127.0.0.1:{port}"):
            generate_text.serve(session, a, generate_text.server_limits(a))


def _tiny_checkpoint(path, gpt2_files) -> None:
    """A tp 1 checkpoint of a tiny GPT-2 with the real GPT-2 tokenizer files."""
    vocab_file, merge_file = gpt2_files
    cfg = tiny_model_config(["--seq-length", "48"], vocab=50257)
    ns = cfg.megatron_args()
    ns.consumed_train_samples = 0
    ns.tokenizer_type, ns.vocab_file, ns.merge_file = "GPT2BPETokenizer", vocab_file, merge_file
    model = GPT2Model(cfg.model, Stage.of(cfg.model.num_layers, 1, 0), 1234).eval()
    save_checkpoint(str(path), 1, model, None, None, ns, model.cfg, Topology(1, 1, 1), 0,
                    save_optim=False, save_rng=False)


def _serving_port(proc: subprocess.Popen, log) -> int:
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        m = re.search(r"serving PUT http://127.0.0.1:(\d+)/api", log.read_text())
        if m:
            return int(m.group(1))
        time.sleep(0.1)


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C"])
def test_tp2_server_stops_cleanly_on_sigterm_or_ctrl_c(tmp_path, gpt2_files, how):
    """scripts/generate_text.sh --tensor-model-parallel-size 2 --server (torchrun behind megapar.launch):
    SIGTERM to the script, or Ctrl-C to its process group, stops rank 0, which tells rank 1 to stop:
    exit 0 like the one-process server, no traceback, no torchrun report. Before: exit 1 with both."""
    pytest.importorskip("megapar.reshard", reason="in-memory resharding (megapar.reshard) not available")
    _tiny_checkpoint(tmp_path / "ck", gpt2_files)
    log = tmp_path / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    env.pop("TORCHRUN", None)
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", "scripts/generate_text.sh", "--load", str(tmp_path / "ck"), "--server",
                                 "--port", "0", "--device", "cpu", "--tensor-model-parallel-size", "2"],
                                cwd=str(ROOT), stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        port = _serving_port(proc, log)
        status, body = put(port, GOOD)
        assert status == 200 and body["text"][0].startswith("Hello"), body
        os.killpg(proc.pid, signal.SIGINT) if how == "Ctrl-C" else proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = log.read_text()
    ok = rc == 0 and "Traceback" not in out and "ChildFailedError" not in out and "server stopped" in out
    ROWS.append(Row("generation server", f"{how} to a tp 2 server (scripts/generate_text.sh): exit 0, no traceback",
                    ok, True))
    assert ok, (rc, out[-3000:])


def test_real_server_process_refuses_bad_requests_answers_good_ones_and_stops_on_ctrl_c(tmp_path, gpt2_files):
    """tools/generate_text.py --server end to end: the request threads drive the engine through
    Session.api; Ctrl-C (SIGINT) stops it with exit status 0."""
    _tiny_checkpoint(tmp_path / "ck", gpt2_files)
    log = tmp_path / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "tools/generate_text.py", "--load", str(tmp_path / "ck"), "--server",
                                 "--port", "0", "--device", "cpu", "--request-timeout", "2"], cwd=str(ROOT),
                                stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline, port = time.monotonic() + 60, None
        while port is None:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            m = re.search(r"serving PUT http://127.0.0.1:(\d+)/api", log.read_text())
            port = int(m.group(1)) if m else time.sleep(0.1)
        for seed in (2**63, 2**64):
            assert put(port, {**GOOD, "random_seed": seed})[0] == 400
        status, body = put(port, GOOD)
        assert status == 200 and body["text"][0].startswith("Hello"), body
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- slow clients that drip bytes ----------------------------------------------------------------
def _drip(port: int, stop: threading.Event, every: float = 0.3) -> bool:
    """A slowloris client: a request line, then one header byte every `every` s (each read well
    within the timeout) until the server closes the connection (True) or `stop` is set (False)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"PUT /api HTTP/1.1\r\nX-Slow: ")
            while not stop.wait(every):
                s.sendall(b"a")
                s.settimeout(0.001)
                try:
                    if s.recv(4096) == b"":
                        return True
                except socket.timeout:
                    pass
                except OSError:
                    return True
                s.settimeout(10)
    except OSError:
        return True
    return False


def test_a_client_that_drips_its_request_is_cut_off_at_the_timeout(one_thread):
    """Each byte comes well within the timeout, but the whole request must come within it."""
    server, port = start(Generator())
    stop, result = threading.Event(), []
    t = threading.Thread(target=lambda: result.append(_drip(port, stop)))
    t0 = time.monotonic()
    t.start()
    t.join(TIMEOUT * 4)
    stop.set()
    t.join(5)
    server.shutdown()
    server.server_close()
    assert result == [True] and time.monotonic() - t0 < TIMEOUT * 3


def test_drip_clients_holding_every_slot_do_not_lock_out_others(one_thread):
    """20 drip clients against 16 slots (the 300 against 256 of an attack, scaled down): a normal
    client is still answered, by taking the slot of the slowest drip client."""
    server, port = start(Generator(), max_connections=16)
    stop = threading.Event()
    drippers = [threading.Thread(target=_drip, args=(port, stop), daemon=True) for _ in range(20)]
    try:
        for t in drippers:
            t.start()
        deadline = time.monotonic() + 5
        while server.open_connections < 16:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(1.2)                                  # past EVICT_AFTER_S: the drip clients may lose slots
        t0 = time.monotonic()
        for _ in range(3):
            answers_good(port)
        assert time.monotonic() - t0 < TIMEOUT           # answered before any drip client timed out
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
