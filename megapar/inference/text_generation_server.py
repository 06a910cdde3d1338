"""A small HTTP server with Megatron's text-generation REST interface (stdlib http.server).

    PUT /api   {"prompts": ["Hello"], "tokens_to_generate": 32, "temperature": 0.9, "top_k": 0,
                "top_p": 0.9, "logprobs": true, "random_seed": 1234}
    200        {"text": ["Hello world..."], "segments": [["Hello", " world", ...]], "logprobs": [[...]] | null}
    4xx / 5xx  {"message": "..."} naming the bad field or the problem

`text` is each prompt followed by its continuation; `segments` the same split into tokens;
`logprobs` the log-probability of every segment after the first (when asked for). An empty prompt
starts from the end-of-document token (unconditional sample).

Concurrency: every connection gets a daemon thread, so a slow, idle or half-sent client never
holds up the others. A connection must send each request -- request line, headers and body -- within
`Limits.timeout` in all (not per read: a client that drips a byte at a time is cut off too), and may
sit idle on a write that long. When every connection slot is taken, a new connection takes the slot
of the one that has been sending its request longest (for over `EVICT_AFTER_S`), so slow clients
cannot lock the others out; only when no such connection is left does it get 503. Generation itself
is collective over the model's ranks (rank 0 ships each request to the others), so requests pass
through the engine one at a time under one lock; everything else
(reading, parsing, validating, replying) runs outside it. Every field is type- and range-checked
before a request reaches the lock, so a bad request is answered with a 4xx and never reaches a rank.
Bound to 127.0.0.1 by default; pass host="0.0.0.0" to expose it.
"""
from __future__ import annotations

import io
import json
import math
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

from .generation import MAX_SEED, MAX_TEMPERATURE, MIN_TEMPERATURE, GenerationError, SamplingParams

MAX_PROMPTS = 128
MAX_PROMPT_CHARS = 100_000
MAX_TOKENS_TO_GENERATE = 1 << 16        # beyond any context; the engine cuts generation to the context
MAX_TOP_K = 1000
EVICT_AFTER_S = 1.0                      # a connection still sending its request after this may lose its slot

GenerateFn = Callable[[list[str], SamplingParams], dict]


class RequestError(Exception):
    """A request the server refuses: an HTTP status and a message for the client."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class Limits:
    """Per-connection and per-request bounds (what one client may cost the server)."""
    timeout: float = 30.0                 # seconds to send one whole request; or to sit idle on a write
    max_body_bytes: int = 1 << 20         # larger bodies get 413
    max_connections: int = 256            # open connections beyond this get 503 at once
    backlog: int = 128                    # the listen queue (connections not yet accepted)

    def validate(self) -> None:
        """Refuse limits that would make the server unusable."""
        if not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise GenerationError(f"the request timeout must be a positive number of seconds, got {self.timeout}")
        for name in ("max_body_bytes", "max_connections", "backlog"):
            if getattr(self, name) < 1:
                raise GenerationError(f"{name} must be >= 1, got {getattr(self, name)}")


# ---- request validation ------------------------------------------------------------------------
def _field(req: dict, name: str, kind: type, default: Any, ok: Callable[[Any], bool], msg: str) -> Any:
    """req[name] (or default) if it has type `kind` (an int passes as a float; a bool is never a
    number) and passes `ok`; else GenerationError "name msg"."""
    value = req.get(name, default)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool) or not ok(value):
        raise GenerationError(f"{name} {msg}, got {json.dumps(value)[:80]}")
    return value


def _check_prompts(req: dict) -> list[str]:
    """The prompts: a non-empty list of at most MAX_PROMPTS strings, each valid Unicode (no lone
    surrogates, which JSON's \\ud800 escapes can smuggle in and tokenizers choke on) and at most
    MAX_PROMPT_CHARS long."""
    if "prompts" not in req:
        raise GenerationError("prompts argument required")
    prompts = req["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise GenerationError("prompts is not a list of strings")
    if not prompts:
        raise GenerationError("prompts is empty")
    if len(prompts) > MAX_PROMPTS:
        raise GenerationError(f"Maximum number of prompts is {MAX_PROMPTS}, got {len(prompts)}")
    for i, p in enumerate(prompts):
        if len(p) > MAX_PROMPT_CHARS:
            raise GenerationError(f"prompt {i} has {len(p)} characters; at most {MAX_PROMPT_CHARS} are accepted")
        try:
            p.encode("utf-8")
        except UnicodeEncodeError:
            raise GenerationError(f"prompt {i} is not valid Unicode (a lone surrogate escape)") from None
    return prompts


def parse_request(req: Any, defaults: SamplingParams) -> tuple[list[str], SamplingParams]:
    """Validate a Megatron /api request body; raise GenerationError with Megatron-style messages.
    Every numeric field is range-checked here so that nothing out of range reaches a rank."""
    if not isinstance(req, dict):
        raise GenerationError("the request body must be a JSON object with a prompts field")
    prompts = _check_prompts(req)
    p = SamplingParams(**{**defaults.__dict__, "logprobs": False, "return_logits": False})
    p.tokens_to_generate = _field(req, "tokens_to_generate", int, defaults.tokens_to_generate,
                                  lambda v: 0 <= v <= MAX_TOKENS_TO_GENERATE,
                                  f"must be an integer between 0 and {MAX_TOKENS_TO_GENERATE}")
    p.logprobs = _field(req, "logprobs", bool, False, lambda v: True, "must be a boolean value")
    if p.tokens_to_generate == 0 and not p.logprobs:
        raise GenerationError("tokens_to_generate=0 implies logprobs should be True")
    p.temperature = _field(req, "temperature", float, defaults.temperature,
                           lambda v: v == 0.0 or MIN_TEMPERATURE <= v <= MAX_TEMPERATURE,
                           f"must be 0 (greedy) or a number between {MIN_TEMPERATURE} and {MAX_TEMPERATURE}")
    p.top_k = _field(req, "top_k", int, defaults.top_k, lambda v: 0 <= v <= MAX_TOP_K,
                     f"must be an integer between 0 and {MAX_TOP_K}")
    p.top_p = _field(req, "top_p", float, defaults.top_p, lambda v: 0.0 <= v <= 1.0,
                     "must be a number between 0 and 1")
    # Without random_seed every request draws fresh randomness (like Megatron's server).
    p.seed = _field(req, "random_seed", int, None, lambda v: 0 <= v < MAX_SEED,
                    "must be an integer in [0, 2^63)") if "random_seed" in req else None
    p.greedy = defaults.greedy and not any(k in req for k in ("temperature", "top_k", "top_p"))
    return prompts, p


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def decode_body(body: bytes) -> Any:
    """The JSON value of a request body; RequestError 400 for bad UTF-8, bad JSON (NaN and Infinity
    included), integers too long to convert or nesting too deep to parse."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(400, f"request body is not UTF-8: {e}") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise RequestError(400, "request body is not JSON: nested too deeply") from None
    except ValueError as e:   # JSONDecodeError, NaN/Infinity, an integer of thousands of digits
        raise RequestError(400, f"request body is not JSON: {e}") from None


# ---- the server --------------------------------------------------------------------------------
class GenerationServer(ThreadingHTTPServer):
    """A thread per connection in front of one generation lock (see the module docstring)."""
    daemon_threads = True

    def __init__(self, address: tuple[str, int], generate: GenerateFn, defaults: SamplingParams,
                 limits: Optional[Limits] = None):
        self.limits = limits or Limits()
        self.limits.validate()
        self.request_queue_size = self.limits.backlog          # read by server_activate's listen()
        self.generate_fn, self.defaults = generate, defaults
        self.generation_lock = threading.Lock()
        self.closed = False
        self.connection_slots = threading.BoundedSemaphore(self.limits.max_connections)
        self.open_connections = 0                                # connections with a thread now
        self._count_lock = threading.Lock()
        self.sending: dict["Handler", float] = {}                 # connections sending a request: since when
        super().__init__(address, Handler)

    def run_generation(self, prompts: list[str], params: SamplingParams) -> dict:
        """generate(prompts, params) with no other generation in flight; RequestError 503 once
        close_generation() has run (the other ranks have been or are being told to stop)."""
        with self.generation_lock:
            if self.closed:
                raise RequestError(503, "the server is shutting down")
            return self.generate_fn(prompts, params)

    def close_generation(self) -> None:
        """Wait for the generation in flight (if any) and refuse any later one: call this before
        telling the other ranks to stop, so that no request thread starts a collective after."""
        with self.generation_lock:
            self.closed = True

    def process_request(self, request: socket.socket, client_address) -> None:
        """Start the connection's thread; when max_connections are open, first free the slot of the
        connection that has been sending its request longest, or answer 503 at once."""
        if not self.connection_slots.acquire(blocking=False):
            if not (self._evict_slowest() and self.connection_slots.acquire(timeout=EVICT_AFTER_S)):
                self._refuse_busy(request)
                return
        self._count(+1)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._count(-1)
            raise

    def process_request_thread(self, request: socket.socket, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._count(-1)

    def sending_request(self, handler: "Handler", started: bool) -> None:
        """Note that `handler` started (or finished) sending a request."""
        with self._count_lock:
            if started:
                self.sending[handler] = time.monotonic()
            else:
                self.sending.pop(handler, None)

    def _evict_slowest(self) -> bool:
        """Close the connection that has been sending its request longest, if for over EVICT_AFTER_S;
        its thread then ends and gives back its slot. False when there is none."""
        with self._count_lock:
            if not self.sending:
                return False
            handler, since = min(self.sending.items(), key=lambda kv: kv[1])
            if time.monotonic() - since < EVICT_AFTER_S:
                return False
            del self.sending[handler]
        handler.log_error("closed: still sending its request after %.1f s while every slot was taken",
                          time.monotonic() - since)
        try:
            handler.connection.shutdown(socket.SHUT_RDWR)  # its blocked read returns at once
        except OSError:
            pass
        return True

    def _count(self, delta: int) -> None:
        """Take (+1) or give back (-1) a connection slot."""
        with self._count_lock:
            self.open_connections += delta
        if delta < 0:
            self.connection_slots.release()

    def _refuse_busy(self, request: socket.socket) -> None:
        """Answer 503 on a short-lived thread of its own (the accept loop must not wait on it)."""
        threading.Thread(target=self._send_busy, args=(request,), daemon=True).start()

    def _send_busy(self, request: socket.socket) -> None:
        """503, then read and drop what the client sends for up to a second before closing: closing
        with its request unread would reset the connection before the client reads the answer."""
        body = json.dumps({"message": f"too many open connections (at most {self.limits.max_connections}); "
                                      "retry later"}).encode()
        try:
            request.settimeout(1.0)
            request.sendall(b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
            request.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline and request.recv(65536):
                pass
        except OSError:
            pass
        finally:
            request.close()


class Handler(BaseHTTPRequestHandler):
    """PUT /api; every other method or path, and every error, is answered with a JSON message."""
    server: GenerationServer
    error_content_type = "application/json"

    def setup(self) -> None:
        self.timeout = self.server.limits.timeout     # StreamRequestHandler.setup: socket.settimeout
        super().setup()
        self.deadline: Optional[float] = None
        self.rfile = io.BufferedReader(_DeadlineReader(self), 1 << 16)

    def handle_one_request(self) -> None:
        """One request, which must arrive whole within the timeout (see the module docstring)."""
        self.deadline = time.monotonic() + self.server.limits.timeout
        self.server.sending_request(self, True)
        try:
            super().handle_one_request()
        except OSError:                               # the client went away, or its slot was taken
            self.close_connection = True
        finally:
            self._request_received()

    def _request_received(self) -> None:
        """The request is in: reads and writes get the plain idle timeout again."""
        self.deadline = None
        self.server.sending_request(self, False)
        try:
            self.connection.settimeout(self.server.limits.timeout)
        except OSError:  # already closed
            pass

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode("utf-8")
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if code == 405:
            self.send_header("Allow", "PUT")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def send_error(self, code: int, message: Optional[str] = None, explain: Optional[str] = None) -> None:
        """The stdlib's own errors (bad request line, headers too long, unknown method, timeout) as
        JSON messages too."""
        short, long = self.responses.get(code, ("error", ""))
        self.log_error("code %d, message %s", code, message or short)
        self.close_connection = True
        try:
            self._reply(code, {"message": message or explain or long or short})
        except OSError:
            pass

    def _read_body(self) -> bytes:
        """The request body, of exactly Content-Length bytes (RequestError 411/400/413/408)."""
        if self.headers.get("Transfer-Encoding"):
            raise RequestError(411, "chunked or other Transfer-Encoding is not supported; send Content-Length")
        raw = self.headers.get_all("Content-Length") or []
        if not raw:
            raise RequestError(411, "Content-Length header required")
        if len(set(raw)) != 1 or not raw[0].strip().isdigit():
            raise RequestError(400, f"bad Content-Length {', '.join(raw)[:40]!r}; it must be one non-negative integer")
        n = int(raw[0])
        if n > self.server.limits.max_body_bytes:
            raise RequestError(413, f"request body of {n} bytes is larger than the limit of "
                                    f"{self.server.limits.max_body_bytes}")
        return self._read_exactly(n)

    def _read_exactly(self, n: int) -> bytes:
        """n bytes before the request's deadline; RequestError 408 when they do not come in time,
        400 when the client closes first."""
        parts, got = [], 0
        try:
            while got < n:
                chunk = self.rfile.read1(min(n - got, 1 << 16))
                if not chunk:
                    raise RequestError(400, f"request body ended after {got} of {n} bytes (Content-Length)")
                parts.append(chunk)
                got += len(chunk)
        except TimeoutError:
            raise RequestError(408, f"request not received within {self.server.limits.timeout} s") from None
        return b"".join(parts)

    def do_PUT(self) -> None:
        try:
            if self.path.split("?")[0].rstrip("/") != "/api":
                raise RequestError(404, f"unknown path {self.path[:200]}; use PUT /api")
            body = self._read_body()
            self._request_received()
            prompts, params = parse_request(decode_body(body), self.server.defaults)
            resp = self.server.run_generation(prompts, params)
        except RequestError as e:
            self.close_connection = True
            return self._reply(e.status, {"message": e.message})
        except GenerationError as e:  # a bad field, or e.g. a prompt longer than the context: before any rank
            self.close_connection = True
            return self._reply(400, {"message": str(e)})
        except Exception as e:  # a bug or a failed generation: tell the client, keep serving
            self.log_error("generation failed: %s: %s", type(e).__name__, e)
            self.close_connection = True
            return self._reply(500, {"message": f"generation failed: {type(e).__name__}: {e}"})
        self._reply(200, resp)

    def _wrong_method(self) -> None:
        self.close_connection = True
        self._reply(405, {"message": f"{self.command} is not supported; use PUT /api with a JSON body"})

    do_GET = do_POST = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _wrong_method

    def log_message(self, fmt: str, *args) -> None:
        """One short line per request, on stderr (stdout is for generated text)."""
        print(f"> {self.address_string()} {fmt % args}", file=sys.stderr, flush=True)


class _DeadlineReader(io.RawIOBase):
    """The handler's socket as a raw stream whose reads end at the handler's `deadline` (TimeoutError),
    however slowly the bytes come; with no deadline, the plain per-read timeout applies."""

    def __init__(self, handler: Handler):
        self.handler = handler

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        sock, deadline = self.handler.connection, self.handler.deadline
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("request not received in time")
            sock.settimeout(left)
        return sock.recv_into(buffer)


def make_server(generate: GenerateFn, defaults: SamplingParams, host: str = "127.0.0.1", port: int = 5000,
                limits: Optional[Limits] = None) -> GenerationServer:
    """A GenerationServer (listening, not yet serving); port 0 picks a free port (see server.server_address)."""
    return GenerationServer((host, port), generate, defaults, limits)


def response_for(tokenizer, prompts: list[str], out, want_logprobs: bool) -> dict:
    """Megatron's response JSON from a GenerationOutput."""
    skip = [1 if p == "" else 0 for p in prompts]   # an empty prompt was started from end-of-document
    return {"text": [tokenizer.detokenize(t[k:]) for t, k in zip(out.tokens, skip)],
            "segments": [[tokenizer.detokenize([i]) for i in t[k:]] for t, k in zip(out.tokens, skip)],
            "logprobs": [lp[k:] for lp, k in zip(out.logprobs, skip)] if want_logprobs else None}
