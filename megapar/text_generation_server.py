"""A small HTTP server with Megatron's text-generation REST interface (stdlib http.server).

    PUT /api   {"prompts": ["Hello"], "tokens_to_generate": 32, "temperature": 0.9, "top_k": 0,
                "top_p": 0.9, "logprobs": true, "random_seed": 1234}
    200        {"text": ["Hello world..."], "segments": [["Hello", " world", ...]], "logprobs": [[...]] | null}
    400        a plain-text message naming the bad field

`text` is each prompt followed by its continuation; `segments` the same split into tokens;
`logprobs` the log-probability of every segment after the first (when asked for). An empty prompt
starts from the end-of-document token (unconditional sample). Requests are served one at a time.
Bound to 127.0.0.1 by default; pass host="0.0.0.0" to expose it.
"""
from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Callable

from .generation import GenerationError, SamplingParams

MAX_PROMPTS = 128


def parse_request(req: dict, defaults: SamplingParams) -> tuple[list[str], SamplingParams]:
    """Validate a Megatron /api request; raise GenerationError with Megatron-style messages."""
    if not isinstance(req, dict) or "prompts" not in req:
        raise GenerationError("prompts argument required")
    prompts = req["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise GenerationError("prompts is not a list of strings")
    if not prompts:
        raise GenerationError("prompts is empty")
    if len(prompts) > MAX_PROMPTS:
        raise GenerationError(f"Maximum number of prompts is {MAX_PROMPTS}")

    def get(name, kind, ok, msg, default):
        value = req.get(name, default)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool or not ok(value):
            raise GenerationError(f"{name} {msg}")
        return value

    p = SamplingParams(**{**defaults.__dict__, "logprobs": False, "return_logits": False})
    p.tokens_to_generate = get("tokens_to_generate", int, lambda v: v >= 0,
                               "must be an integer greater than or equal to 0", defaults.tokens_to_generate)
    p.logprobs = get("logprobs", bool, lambda v: True, "must be a boolean value", False)
    if p.tokens_to_generate == 0 and not p.logprobs:
        raise GenerationError("tokens_to_generate=0 implies logprobs should be True")
    p.temperature = get("temperature", float, lambda v: 0.0 <= v <= 100.0,
                        "must be a positive number less than or equal to 100.0", defaults.temperature)
    p.top_k = get("top_k", int, lambda v: 0 <= v <= 1000, "must be an integer between 0 and 1000", defaults.top_k)
    p.top_p = get("top_p", float, lambda v: 0.0 <= v <= 1.0, "must be a number between 0 and 1", defaults.top_p)
    # Without random_seed every request draws fresh randomness (like Megatron's server).
    p.seed = get("random_seed", int, lambda v: v >= 0, "must be a non-negative integer", 0) \
        if "random_seed" in req else None
    p.greedy = defaults.greedy and not any(k in req for k in ("temperature", "top_k", "top_p"))
    return prompts, p


def make_handler(generate: Callable[[list[str], SamplingParams], dict], defaults: SamplingParams):
    """A request handler class calling generate(prompts, params) -> response dict (HTTPServer
    serves one request at a time, so generations never overlap)."""

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code: int, body, content_type: str) -> None:
            data = body.encode("utf-8") if isinstance(body, str) else body
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self) -> None:
            if self.path.rstrip("/") != "/api":
                return self._reply(404, f"unknown path {self.path}; use PUT /api\n", "text/plain")
            try:
                n = int(self.headers.get("Content-Length") or 0)
                req = json.loads(self.rfile.read(n) or b"null")
                prompts, params = parse_request(req, defaults)
                resp = generate(prompts, params)
            except json.JSONDecodeError as e:
                return self._reply(400, f"request body is not JSON: {e}\n", "text/plain")
            except GenerationError as e:
                return self._reply(400, f"{e}\n", "text/plain")
            self._reply(200, json.dumps(resp), "application/json")

        def do_GET(self) -> None:
            self._reply(405, "use PUT /api with a JSON body (see megapar/text_generation_server.py)\n", "text/plain")

        do_POST = do_GET

        def log_message(self, fmt, *args) -> None:  # one short line per request
            print(f"> {self.address_string()} {fmt % args}", flush=True)

    return Handler


def make_server(generate: Callable[[list[str], SamplingParams], dict], defaults: SamplingParams,
                host: str = "127.0.0.1", port: int = 5000) -> HTTPServer:
    """An HTTPServer (not yet serving); port 0 picks a free port (see server.server_address)."""
    return HTTPServer((host, port), make_handler(generate, defaults))


def response_for(tokenizer, prompts: list[str], out, want_logprobs: bool) -> dict:
    """Megatron's response JSON from a GenerationOutput."""
    skip = [1 if p == "" else 0 for p in prompts]   # an empty prompt was started from end-of-document
    return {"text": [tokenizer.detokenize(t[k:]) for t, k in zip(out.tokens, skip)],
            "segments": [[tokenizer.detokenize([i]) for i in t[k:]] for t, k in zip(out.tokens, skip)],
            "logprobs": [lp[k:] for lp, k in zip(out.logprobs, skip)] if want_logprobs else None}
