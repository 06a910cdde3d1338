"""Sample text from a megapar/Megatron checkpoint saved at any (tp, pp) layout.

    python tools/generate_text.py --load {embedded}   # interactive (after `bash scripts/pretrain_gpt2.sh`)
    python tools/generate_text.py --load CKPT --sample-input-file prompts.txt --sample-output-file out.jsonl
    python tools/generate_text.py --load CKPT --num-samples 8 --top-p 0.9          # unconditional
    python tools/generate_text.py --load CKPT --server --port 5000                  # PUT /api
    bash scripts/generate_text.sh --load CKPT --tensor-model-parallel-size 2       # 2 processes (torchrun)

Interactive mode reads one prompt per line from stdin (a terminal or a pipe) and prints the
continuation; an empty line, `stop` or end of input ends it. Generated text goes to stdout,
everything else (load summary, timing, errors) to stderr. The tokenizer defaults to the one
named in the checkpoint's args. Each generation is followed by a timing line (prefill ms,
decode tokens/s). Under torchrun only rank 0 reads and writes; the world must be tp x pp.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megapar.errors import USER_ERROR_EXIT, MegaparError, OneLineErrorParser
from megapar.inference.generation import (GenerationError, InferenceEngine, Leader, SamplingParams, follow,
                                          load_inference_model, tokenizer_for_checkpoint)
from megapar.run.initialize import init_distributed
from megapar.topology import Topology

GROUP_TIMEOUT_MINUTES = 30  # how long a collective of any group may wait (torch's default)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written (its example commands); every flag that has a default value shows it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        shown = action.default not in (None, argparse.SUPPRESS) and not isinstance(action.default, bool) and action.help
        return f"{action.help} (default: %(default)s)" if shown else action.help


def build_parser() -> argparse.ArgumentParser:
    from megapar.config.overlays import embedded_save_dir
    p = OneLineErrorParser(prog="python tools/generate_text.py", usage="%(prog)s --load CKPT [FLAGS]",
                                description=__doc__.format(embedded=embedded_save_dir()),
                                formatter_class=_HelpFormatter, allow_abbrev=False)
    g = p.add_argument_group("checkpoint and layout")
    g.add_argument("--load", required=True, help="checkpoint directory (a training run's --save)")
    g.add_argument("--tensor-model-parallel-size", "--tensor-parallel", type=int, default=1, metavar="N",
                   help="tensor-parallel size to run at (any; the checkpoint is resharded on load)")
    g.add_argument("--pipeline-model-parallel-size", "--pipeline-parallel", type=int, default=1, metavar="N",
                   help="pipeline-parallel size to run at")
    g.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    g.add_argument("--bf16", action="store_true", help="run the model in bfloat16")
    g.add_argument("--fp16", action="store_true", help="run the model in float16 (GPU)")
    g = p.add_argument_group("tokenizer (default: what the checkpoint's args name)")
    g.add_argument("--tokenizer-type", default=None, help="GPT2BPETokenizer, SentencePieceTokenizer or TikTokenizer")
    g.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocabulary")
    g.add_argument("--merge-file", default=None, help="GPT-2 BPE merges")
    g.add_argument("--tokenizer-model", default=None, help="SentencePiece / tiktoken model file")
    g = p.add_argument_group("sampling")
    sampling = SamplingParams()  # the defaults the server's requests get too
    g.add_argument("--greedy", action="store_true", help="argmax decoding (ignores the sampling settings)")
    g.add_argument("--temperature", type=float, default=sampling.temperature,
                   help="divides the logits before sampling")
    g.add_argument("--top-k", type=int, default=sampling.top_k, help="sample among the k likeliest tokens (0 = all)")
    g.add_argument("--top-p", type=float, default=sampling.top_p,
                   help="sample among the likeliest tokens whose probabilities add up to p (0 = off)")
    g.add_argument("--seed", type=int, default=None, help="makes sampling repeatable")
    g.add_argument("--out-seq-length", type=int, default=128, help="tokens to generate per prompt")
    g.add_argument("--no-stop-on-eod", action="store_true", help="keep going past end-of-document")
    g.add_argument("--no-kv-cache", action="store_true", help="recompute the whole sequence each step")
    g.add_argument("--batch-size", type=int, default=8, help="prompts per batch (file / unconditional modes)")
    g = p.add_argument_group("modes (default: interactive)")
    g.add_argument("--sample-input-file", default=None, help="one prompt per line")
    g.add_argument("--sample-output-file", default=None, help=".jsonl: JSON lines; else text (default stdout)")
    g.add_argument("--num-samples", type=int, default=0, help="unconditional samples to generate")
    g.add_argument("--server", action="store_true", help="serve Megatron's PUT /api")
    g.add_argument("--host", default="127.0.0.1", help="server: the address to listen on")
    g.add_argument("--port", type=int, default=5000, help="server: the port (0 picks a free one, printed at start)")
    g.add_argument("--request-timeout", type=float, default=30.0,
                   help="server: seconds a client may take to send one request (or sit idle on a "
                        "write) before its connection is closed")
    g.add_argument("--max-request-bytes", type=int, default=1 << 20, help="server: larger request bodies get 413")
    return p


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def setup(a: argparse.Namespace) -> tuple[int, Topology, torch.device]:
    """Process group (under torchrun), topology and device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    if world != tp * pp:
        raise GenerationError(f"{world} process(es) for --tensor-model-parallel-size {tp} x "
                              f"--pipeline-model-parallel-size {pp}; launch exactly {tp * pp} "
                              f"(scripts/generate_text.sh starts torchrun for you)")
    cuda = torch.cuda.is_available() if a.device == "auto" else a.device.startswith("cuda")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    topo = Topology(tp, pp, 1)
    rank = 0
    if world > 1:
        rank, _, _ = init_distributed("nccl" if cuda else "gloo", timeout_minutes=GROUP_TIMEOUT_MINUTES)
        topo.create_groups(rank, timedelta(minutes=GROUP_TIMEOUT_MINUTES))
    return rank, topo, device


def sampling_params(a: argparse.Namespace) -> SamplingParams:
    p = SamplingParams(tokens_to_generate=a.out_seq_length, temperature=a.temperature, top_k=a.top_k,
                       top_p=a.top_p, greedy=a.greedy, seed=a.seed, stop_on_eod=not a.no_stop_on_eod,
                       use_cache=not a.no_kv_cache)
    p.validate()
    return p


class Session:
    """Rank 0's view: tokenize, generate across all ranks, detokenize, report timing."""

    def __init__(self, leader: Leader, tokenizer, params: SamplingParams, log=print):
        self.leader, self.engine, self.tok, self.params, self.log = leader, leader.engine, tokenizer, params, log

    def encode(self, text: str) -> list[int]:
        return self.tok.tokenize(text) if text else [self.tok.eod]   # empty = unconditional

    def complete(self, texts: list[str], params: Optional[SamplingParams] = None):
        out = self.leader.generate([self.encode(t) for t in texts], params or self.params)
        for note in out.notes:
            self.log(f"> note: {note}")
        self.log(out.timing_line())
        return out, [self.continuation(t[:n], t[n:]) for t, n in zip(out.tokens, out.prompt_lengths)]

    def continuation(self, prompt: list[int], generated: list[int]) -> str:
        """The text the generated tokens add (decoded in context: SentencePiece drops a leading
        space when a piece is decoded on its own)."""
        head, full = self.tok.detokenize(prompt), self.tok.detokenize(prompt + generated)
        return full[len(head):] if full.startswith(head) else self.tok.detokenize(generated)

    def api(self, prompts: list[str], params: SamplingParams) -> dict:
        """A server request (run in the server's request thread, one at a time)."""
        from megapar.inference.text_generation_server import response_for
        if self.engine.device.type == "cuda":      # the current device is per thread
            torch.cuda.set_device(self.engine.device)
        out, _ = self.complete(prompts, params)
        return response_for(self.tok, prompts, out, params.logprobs)


def interactive(s: Session, stdin=None, stdout=None) -> None:
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    tty = stdin.isatty()
    while True:
        if tty:
            stdout.write("\nPrompt (empty line or 'stop' to quit): ")
            stdout.flush()
        line = stdin.readline()
        if not line or line.strip() in ("", "stop"):
            return
        try:
            _, texts = s.complete([line.rstrip("\n")])
        except GenerationError as e:
            s.log(f"error: {e}")
            continue
        stdout.write(texts[0] + "\n")
        stdout.flush()


def batches(items: list, n: int):
    for i in range(0, len(items), n):
        yield items[i:i + n]


def write_samples(path: Optional[str], pairs: list[tuple[str, str]]) -> None:
    """JSON lines {"prompt", "text"} for .jsonl/.json; otherwise Megatron-style text blocks."""
    as_json = bool(path) and path.endswith((".jsonl", ".json"))
    lines = [json.dumps({"prompt": p, "text": t}) + "\n" if as_json else f"Context: {p}\n\nmegapar: {t}\n\n"
             for p, t in pairs]
    if not path:
        sys.stdout.write("".join(lines))
        return
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(lines)
    os.replace(tmp, path)
    print(f"> wrote {len(pairs)} samples to {path}", file=sys.stderr, flush=True)


def from_file(s: Session, a: argparse.Namespace) -> None:
    try:
        with open(a.sample_input_file, encoding="utf-8") as f:
            prompts = [ln.rstrip("\n") for ln in f]
    except OSError as e:
        raise GenerationError(f"cannot read --sample-input-file {a.sample_input_file}: {e.strerror}") from None
    pairs = []
    for chunk in batches(prompts, a.batch_size):
        pairs += list(zip(chunk, s.complete(chunk)[1]))
    write_samples(a.sample_output_file, pairs)


def unconditional(s: Session, a: argparse.Namespace) -> None:
    pairs = []
    for chunk in batches([""] * a.num_samples, a.batch_size):
        pairs += list(zip(chunk, s.complete(chunk)[1]))
    write_samples(a.sample_output_file, pairs)


def server_limits(a: argparse.Namespace):
    """The server's Limits from the flags; GenerationError (before the model loads) when they or
    --port are out of range."""
    from megapar.inference.text_generation_server import Limits
    if not 0 <= a.port <= 65535:
        raise GenerationError(f"--port {a.port} is not a TCP port; pass 1-65535 (0 picks a free one)")
    limits = Limits(timeout=a.request_timeout, max_body_bytes=a.max_request_bytes)
    try:
        limits.validate()
    except GenerationError as e:
        raise GenerationError(f"--request-timeout / --max-request-bytes: {e}") from None
    return limits


def serve(s: Session, a: argparse.Namespace, limits) -> None:
    """Serve PUT /api until Ctrl-C; the generation in flight finishes, later ones are refused,
    before the caller tells the other ranks to stop."""
    from megapar.inference.text_generation_server import make_server
    try:
        server = make_server(s.api, s.params, a.host, a.port, limits)
    except OSError as e:
        raise GenerationError(f"cannot listen on {a.host}:{a.port}: {e.strerror or e}") from None
    print(f"> serving PUT http://{a.host}:{server.server_address[1]}/api (Ctrl-C or SIGTERM to stop)",
          file=sys.stderr, flush=True)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops it as Ctrl-C does
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.close_generation()
        server.server_close()
    print("> server stopped", file=sys.stderr, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the tool; a process group it started (under torchrun) is destroyed before it returns."""
    started_group = not dist.is_initialized()
    try:
        return generate(argv)
    finally:
        if started_group and dist.is_initialized():
            dist.destroy_process_group()


def generate(argv: Optional[Sequence[str]] = None) -> int:
    a = get_args(argv)
    try:
        if a.num_samples < 0 or a.batch_size < 1:
            raise GenerationError("--num-samples must be >= 0 and --batch-size >= 1")
        params = sampling_params(a)
        limits = server_limits(a) if a.server else None  # bad --port etc.: refuse before loading the model
        rank, topo, device = setup(a)
        dtype = torch.bfloat16 if a.bf16 else torch.float16 if a.fp16 else torch.float32
        model, saved = load_inference_model(a.load, topo, rank, device, dtype)
        tok = tokenizer_for_checkpoint(saved, a.tokenizer_type, a.vocab_file, a.merge_file, a.tokenizer_model)
    except MegaparError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT
    engine = InferenceEngine(model, topo, rank, model.cfg.vocab_size, tok.eod)
    if rank != 0:
        follow(engine)
        return 0
    n = sum(p.numel() for p in model.parameters())
    print(f"> loaded {a.load} ({model.cfg.num_layers} layers, hidden {model.cfg.hidden_size}, vocab "
          f"{model.cfg.vocab_size} padded to {model.cfg.padded_vocab_size}) on {device} as tp={topo.tp} pp={topo.pp}, "
          f"{n / 1e6:.1f}M parameters on rank 0", file=sys.stderr, flush=True)
    if params.seed is None and not params.is_greedy and not a.server:   # server: per-request random_seed
        params.seed = int(torch.randint(0, 2**31 - 1, ()).item())
        print(f"> sampling seed {params.seed} (pass --seed to repeat)", file=sys.stderr, flush=True)
    leader = Leader(engine)
    s = Session(leader, tok, params, log=lambda m: print(m, file=sys.stderr, flush=True))
    try:
        if a.server:
            serve(s, a, limits)
        elif a.sample_input_file:
            from_file(s, a)
        elif a.num_samples:
            unconditional(s, a)
        else:
            interactive(s)
    except GenerationError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT
    finally:
        leader.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
