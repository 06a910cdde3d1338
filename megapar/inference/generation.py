"""Text generation with a key/value cache on any (tp, pp) layout.

    model, saved = load_inference_model("checkpoints/gpt2_embedded", Topology(1, 1, 1), rank=0, device=cpu)
    tok = tokenizer_for_checkpoint(saved)
    engine = InferenceEngine(model, topo, rank=0, vocab_size=model.cfg.vocab_size, eod=tok.eod)
    out = engine.generate([tok.tokenize("Hello")], SamplingParams(tokens_to_generate=20, greedy=True))
    tok.detokenize(out.generated(0))

Batches of prompts of different lengths are right-padded (Megatron's scheme): the prompt prefix
that all rows share in length is prefilled once, then the loop feeds one position per step to
every row -- the row's own prompt token while it still has one, else the token just sampled. All
rows stay aligned on the same positions, so no attention mask is needed and the KV cache is exact.

Collectives: `generate` is called by every rank of the (tp x pp) model with the same arguments.
Each step the first stage embeds, stages pass activations with torch.distributed send/recv, the
last stage gathers the vocab-parallel logits of the last position only, masks the padded vocab
rows (>= vocab_size) to -inf, samples, and broadcasts the new tokens to every rank.
The host reads a step's tokens back (to see which rows stopped) only after it has queued the next
step's forward (readback.py), so the GPU does not idle while the host decides; when the last row
stops, that one forward goes unused.
Only rank 0 does I/O: its `Leader` ships requests to the other ranks, which `follow` them.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..config.settings import ModelConfig
from ..checkpoint import SavedConfig
from ..model.gpt2 import GPT2Model, Stage
from ..model.kv_cache import KVCache
from ..kernels.readback import to_host, wait_host
from ..reshard import load_model_state_for
from ..tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from ..tensor_parallel.mappings import gather_from_tp
from ..topology import Topology
from ..errors import MegaparError


class GenerationError(MegaparError, ValueError):
    """Bad input to generation (prompt too long, wrong tokenizer, missing checkpoint...)."""


MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-6, 100.0
MAX_SEED = 2**63  # exclusive: a seed is a non-negative int64 (torch.Generator.manual_seed)


@dataclass
class SamplingParams:
    tokens_to_generate: int = 64
    temperature: float = 1.0
    top_k: int = 0                 # 0 = off
    top_p: float = 0.0             # 0 = off
    greedy: bool = False           # argmax (also when temperature == 0 or top_k == 1)
    seed: Optional[int] = None     # None = fresh randomness
    stop_on_eod: bool = True
    logprobs: bool = False         # log-probabilities of every token after the first
    use_cache: bool = True         # False recomputes the whole sequence every step (reference)
    return_logits: bool = False    # keep the masked last-position logits of every step (tests)

    def validate(self) -> None:
        if self.tokens_to_generate < 0:
            raise GenerationError(f"tokens_to_generate must be >= 0, got {self.tokens_to_generate}")
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            raise GenerationError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                                  f"got {self.temperature}")   # below: logits / t overflow, sampling fails
        if self.top_k < 0:
            raise GenerationError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise GenerationError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < MAX_SEED:   # checked before any rank sees it
            raise GenerationError(f"seed must be an integer in [0, 2^63), got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0 or self.top_k == 1


# ---- sampling ---------------------------------------------------------------------------------
def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Set logits of the padded vocab rows (ids >= vocab_size) to -inf (in place; returned)."""
    if logits.shape[-1] > vocab_size:
        logits[..., vocab_size:] = float("-inf")
    return logits


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 0.0) -> torch.Tensor:
    """Keep the top_k largest logits and/or the smallest set whose probability reaches top_p;
    the rest become -inf. logits: [b, V] float (modified copy returned)."""
    logits = logits.clone()
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits[logits < kth] = float("-inf")
    if 0.0 < top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum > top_p
        drop[:, 1:] = drop[:, :-1].clone()   # keep the token that crosses top_p
        drop[:, 0] = False
        logits.scatter_(-1, idx, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Next token per row from masked logits [b, V] -> [b] int64."""
    logits = logits.float()
    if params.is_greedy:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def vocab_parallel_logprobs(local: torch.Tensor, targets: torch.Tensor, vocab_size: int, tp_group) -> torch.Tensor:
    """log softmax(logits)[target] from vocab-parallel logits [b, s, V/tp] (padded rows masked);
    targets [b, s] -> [b, s] fp32: the negated vocab-parallel cross entropy."""
    return -vocab_parallel_cross_entropy(local, targets, vocab_size, tp_group)


# ---- the generation loop ------------------------------------------------------------------------
@dataclass
class GenerationOutput:
    tokens: list[list[int]]                 # prompt + generated, without the final end-of-document
    prompt_lengths: list[int]
    logprobs: Optional[list[list[float]]] = None   # one per token of `tokens` after the first
    logits: Optional[torch.Tensor] = None          # [b, steps, V] masked (return_logits, last stage)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    notes: list[str] = field(default_factory=list)

    def generated(self, i: int) -> list[int]:
        return self.tokens[i][self.prompt_lengths[i]:]

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens produced per second by the decode steps, over the whole batch."""
        return len(self.tokens) * self.decode_steps / self.decode_s if self.decode_s > 0 else float("nan")

    def timing_line(self) -> str:
        return (f"> prefill {self.prefill_s * 1e3:.1f} ms, decode {self.decode_tokens_per_s:.1f} tokens/s "
                f"({self.decode_steps} steps x batch {len(self.tokens)}, {self.decode_s:.2f} s)")


class InferenceEngine:
    """One rank's stage of a model in eval mode plus what generation needs to run it."""

    def __init__(self, model: GPT2Model, topo: Topology, rank: int, vocab_size: int, eod: int):
        self.model, self.topo, self.rank = model.eval(), topo, rank
        self.stage: Stage = model.stage
        self.vocab_size, self.eod = vocab_size, eod
        self.max_positions = model.cfg.max_position_embeddings
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.src = topo.rank(0, 0, topo.pp - 1)    # samples and broadcasts (last stage, tp rank 0)
        self.distributed = topo.tp * topo.pp > 1

    # ---- one forward through the pipeline ----
    def _forward(self, tokens: torch.Tensor, cache: Optional[KVCache]) -> Optional[torch.Tensor]:
        """tokens [b, s] -> vocab-parallel logits [b, s, V/tp] on the last stage, None elsewhere."""
        b, s = tokens.shape
        if self.stage.is_first:
            out = self.model(tokens, None, kv_cache=cache)
        else:
            x = torch.empty(s, b, self.model.cfg.hidden_size, device=self.device, dtype=self.dtype)
            dist.recv(x, src=self.topo.prev_rank(self.rank))
            self.model.set_input_tensor(x)
            out = self.model(None, None, kv_cache=cache)
        if not self.stage.is_last:
            dist.send(out.contiguous(), dst=self.topo.next_rank(self.rank))
            return None
        return out

    def _new_cache(self, batch: int, max_len: int) -> KVCache:
        attn = self.model.language_model.encoder.layers[0].self_attention
        return KVCache(len(self.model.language_model.encoder.layers), batch, attn.heads_local, max_len, attn.hn,
                       self.device, self.dtype)

    def check_prompts(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> None:
        """Raise GenerationError for empty prompts or prompts that do not fit the context."""
        params.validate()
        if not prompts:
            raise GenerationError("no prompts given")
        need = 1 if params.tokens_to_generate > 0 else 0
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise GenerationError(f"prompt {i} is empty; start it with the end-of-document token "
                                      f"({self.eod}) for unconditional generation")
            if len(p) + need > self.max_positions:
                raise GenerationError(
                    f"prompt {i} has {len(p)} tokens, longer than the model's context of {self.max_positions} "
                    f"positions (--max-position-embeddings) leaves room for; shorten it to at most "
                    f"{self.max_positions - need} tokens")
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise GenerationError(f"prompt {i} has token ids outside the vocabulary [0, {self.vocab_size}): "
                                      f"{bad[:5]}")

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> GenerationOutput:
        """Collective over the model's ranks (same arguments on each). See the module docstring."""
        self.check_prompts(prompts, params)
        b, lens = len(prompts), [len(p) for p in prompts]
        n_gen, notes = params.tokens_to_generate, []
        total = max(lens) + n_gen
        if total > self.max_positions:
            notes.append(f"generation cut to the model's context of {self.max_positions} positions")
            total = self.max_positions
        stop_at = [min(n + n_gen, total) for n in lens]           # exclusive end of each row
        tokens = torch.full((b, total), self.eod, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = torch.tensor(list(p), dtype=torch.long)
        lens_t = torch.tensor(lens, device=self.device)
        end = [n if n >= s else None for n, s in zip(lens, stop_at)]   # final length once known
        gen = self._generator(params)
        last = self.stage.is_last
        cache = self._new_cache(b, total) if params.use_cache else None
        lp_rows: list[torch.Tensor] = []
        step_logits: list[torch.Tensor] = []

        t = min(lens)
        sync(self.device)
        t0 = time.perf_counter()
        local = self._forward(tokens[:, :t], cache)                  # prefill
        if last and params.logprobs and t > 1:
            lp_rows.append(vocab_parallel_logprobs(local[:, :-1], tokens[:, 1:t], self.vocab_size,
                                                   self.model.tp_group))
        sync(self.device)
        prefill_s, t1, steps = time.perf_counter() - t0, time.perf_counter(), 0
        while t < total and any(e is None for e in end):
            new = torch.zeros(b, dtype=torch.long, device=self.device)
            if last:
                logits = gather_from_tp(local[:, -1].contiguous(), self.model.tp_group).float()
                logits = mask_padded_vocab(logits, self.vocab_size)
                new = sample(logits[:, :self.vocab_size], params, gen)   # padding never drawn, nor
                # does it change the draws: the same tokens for every padded size (any tp)
                if params.return_logits:
                    step_logits.append(logits.cpu())
            if self.distributed:
                dist.broadcast(new, src=self.src)
            tokens[:, t] = torch.where(t < lens_t, tokens[:, t], new)
            if last and params.logprobs:
                lp_rows.append(vocab_parallel_logprobs(local[:, -1:], tokens[:, t:t + 1], self.vocab_size,
                                                       self.model.tp_group))
            pending = to_host(tokens[:, t])
            t, steps = t + 1, steps + 1
            if t < total:  # queue the next forward before waiting for this token: the GPU keeps busy
                local = self._forward(tokens[:, t - 1:t] if cache is not None else tokens[:, :t], cache)
            col = wait_host(*pending).tolist()   # if every row ends here, that forward is unused
            for i in range(b):
                if end[i] is None and t - 1 >= lens[i] and params.stop_on_eod and col[i] == self.eod:
                    end[i] = t - 1
                elif end[i] is None and t >= stop_at[i]:
                    end[i] = t
        sync(self.device)
        out = GenerationOutput(tokens=[tokens[i, :e].tolist() for i, e in enumerate(end)], prompt_lengths=lens,
                               prefill_s=prefill_s, decode_s=time.perf_counter() - t1, decode_steps=steps,
                               notes=notes)
        if params.return_logits and last and step_logits:
            out.logits = torch.stack(step_logits, dim=1)
        if params.logprobs:
            out.logprobs = self._collect_logprobs(lp_rows, end)
        return out

    def _generator(self, params: SamplingParams) -> Optional[torch.Generator]:
        if params.is_greedy:
            return None
        g = torch.Generator(device=self.device)
        if params.seed is None:
            g.seed()
        else:
            g.manual_seed(params.seed)
        return g

    def _collect_logprobs(self, rows: list[torch.Tensor], end: list[int]) -> list[list[float]]:
        """Per-row log-probabilities of tokens[1:end], moved from the last stage to every rank."""
        lp = None
        if self.stage.is_last:
            full = torch.cat([r.float().cpu() for r in rows], dim=1) if rows else torch.zeros(len(end), 0)
            lp = [full[i, :max(e - 1, 0)].tolist() for i, e in enumerate(end)]
        if self.topo.pp > 1:
            box = [lp]
            dist.broadcast_object_list(box, src=self.src)
            lp = box[0]
        return lp


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- rank 0 leads, the other ranks follow ----------------------------------------------------
KEEPALIVE_S = 60.0   # an idle leader pings the followers this often: far below any process group's timeout


class Leader:
    """Rank 0's line to the ranks in `follow`: each command goes out under one lock, so that a
    generation, a ping and the stop never interleave their collectives. While rank 0 waits for a
    prompt or a request, the followers wait in a broadcast that would time out with the process
    group (30 minutes): a thread pings them every `keepalive_s` so that an idle server or prompt
    can wait for as long as its user does. `group`: the ranks of the model (None: the world)."""

    def __init__(self, engine: InferenceEngine, keepalive_s: float = KEEPALIVE_S, group=None):
        self.engine, self.group = engine, group
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._pinger: Optional[threading.Thread] = None
        if engine.distributed:
            self._pinger = threading.Thread(target=self._keepalive, args=(keepalive_s,), name="keepalive",
                                            daemon=True)
            self._pinger.start()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> GenerationOutput:
        """Check the request, send it to the other ranks, generate together."""
        self.engine.check_prompts(prompts, params)   # fail before any collective
        with self._lock:
            self._send("generate", [list(p) for p in prompts], params)
            return self.engine.generate(prompts, params)

    def stop(self) -> None:
        """Tell the followers to return (once); no command goes out after."""
        with self._lock:
            if not self._stopped.is_set():
                self._stopped.set()
                self._send("stop")
        if self._pinger is not None:
            self._pinger.join()

    def _send(self, cmd: str, prompts=None, params: Optional[SamplingParams] = None) -> None:
        if self.engine.distributed:
            dist.broadcast_object_list([(cmd, prompts, params)], src=_leader_rank(self.group), group=self.group)

    def _keepalive(self, every: float) -> None:
        if self.engine.device.type == "cuda":      # the current device is per thread
            torch.cuda.set_device(self.engine.device)
        while not self._stopped.wait(every):
            with self._lock:
                if not self._stopped.is_set():
                    self._send("ping")


def _leader_rank(group) -> int:
    """The global rank of the Leader: rank 0 of `group` (None: the world)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def follow(engine: InferenceEngine, group=None) -> None:
    """Ranks other than 0: generate whatever rank 0's Leader asks for, until it says stop."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=_leader_rank(group), group=group)
        cmd, prompts, params = box[0]
        if cmd == "stop":
            return
        if cmd == "generate":
            engine.generate(prompts, params)


# ---- loading a checkpoint for inference ------------------------------------------------------
def _saved_layout(step_dir: str) -> tuple[int, int]:
    """(tp, pp) a checkpoint was saved with, from its mp_rank_* directory names."""
    from .. import checkpoint as ck
    ranks = [ck.parse_shard_dir(n) for n in ck.shard_dirs(step_dir)]
    if not ranks:
        raise GenerationError(f"{step_dir} holds no mp_rank_* shard directories; the checkpoint is incomplete")
    return max(t for t, _ in ranks) + 1, max(p or 0 for _, p in ranks) + 1


def read_model_state(load_dir: str, tp: int, pp: int, tp_rank: int, pp_rank: int,
                     iteration=None) -> tuple[SavedConfig, dict[str, torch.Tensor]]:
    """(the checkpoint's SavedConfig, flat model state dict) of shard (tp_rank, pp_rank) for an inference layout
    tp x pp, from a checkpoint saved at any layout (via megapar.reshard when the layouts differ)."""
    from .. import checkpoint as ck
    if not os.path.isdir(load_dir):
        raise GenerationError(f"--load {load_dir}: no such directory; pass the --save directory of a training run")
    it = iteration if iteration is not None else ck.read_tracker(load_dir)
    if it is None:
        raise GenerationError(f"--load {load_dir} has no {ck.TRACKER}; it is not a (finished) checkpoint directory "
                              f"-- pass the --save directory of a training run")
    step_dir = ck.published_dir(load_dir, it)
    if not os.path.isdir(step_dir):
        raise GenerationError(f"checkpoint directory {step_dir} (named by {ck.TRACKER}) is missing")
    if ck.detect(step_dir) is not ck.legacy.FORMAT or _saved_layout(step_dir) != (tp, pp):  # canonical, resharded
        return load_model_state_for(load_dir, tp, pp, tp_rank, pp_rank, iteration=it)
    path = os.path.join(step_dir, ck.shard_dir_name(tp_rank, pp_rank, pp), ck.MODEL_FILE)
    state = ck.load_file(path)
    if "model" not in state:  # model chunks of interleaved 1F1B (model0, model1, ...): regroup into stages
        return load_model_state_for(load_dir, tp, pp, tp_rank, pp_rank, iteration=it)
    return ck.read_saved_config(state, path), ck.flatten_model_state(state["model"])


def inference_config(saved: ModelConfig, device: torch.device) -> ModelConfig:
    """The checkpoint's model config for inference: no dropout, no recompute, no sequence
    parallelism (a decoded token cannot be split), no fp8 GEMMs (a training setting; one decoded
    token is no multiple of 16 rows), reference kernels where the fused ones cannot run."""
    cfg = dataclasses.replace(saved, hidden_dropout=0.0, attention_dropout=0.0, recompute_granularity=None,
                              recompute_method=None, sequence_parallel=False, fp8_format=None)
    if cfg.attention_backend == "fused" and device.type != "cuda":
        cfg.attention_backend = "flash"
    if device.type != "cuda":
        cfg.layernorm_impl = "torch"
    cfg.vocab_size = saved.vocab_size or saved.padded_vocab_size
    return cfg


def load_inference_model(load_dir: str, topo: Topology, rank: int, device: torch.device,
                         dtype: torch.dtype = torch.float32, iteration=None) -> tuple[GPT2Model, SavedConfig]:
    """This rank's stage of the checkpoint's model, in eval mode on `device`. Returns (model, the
    checkpoint's SavedConfig for this layout)."""
    c = topo.coord(rank)
    if topo.dp != 1:
        raise GenerationError(f"inference runs one model replica: launch tp x pp = {topo.tp * topo.pp} "
                              f"processes (got {topo.world_size})")
    saved, state = read_model_state(load_dir, topo.tp, topo.pp, c.tp, c.pp, iteration)
    cfg = inference_config(saved.model, device)  # describes this (possibly resharded) layout
    model = GPT2Model(cfg, Stage.for_config(cfg, topo.pp, c.pp), seed=0, tp_group=topo.groups.tp,
                      device=device, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise GenerationError(f"checkpoint {load_dir} does not match the model its config describes: missing "
                              f"{missing[:4]}, unexpected {unexpected[:4]}")
    return model.eval(), saved


def tokenizer_for_checkpoint(saved: SavedConfig, tokenizer_type=None, vocab_file=None, merge_file=None,
                             tokenizer_model=None):
    """The checkpoint's tokenizer (flags override what it names); its vocabulary must match."""
    from ..data.tokenizer import TokenizerError, build_tokenizer
    d, m = saved.data, saved.model
    kind = tokenizer_type or d.tokenizer_type
    files = dict(vocab_file=vocab_file or d.vocab_file, merge_file=merge_file or d.merge_file,
                 tokenizer_model=tokenizer_model or d.tokenizer_model)
    try:
        tok = build_tokenizer(kind, **files)
    except TokenizerError as e:
        raise GenerationError(f"cannot build the checkpoint's tokenizer ({kind}): {e}. Pass the files used in "
                              f"training with --vocab-file/--merge-file or --tokenizer-model") from None
    if m.vocab_size is not None and tok.vocab_size != m.vocab_size:
        raise GenerationError(f"tokenizer {kind} has {tok.vocab_size} tokens but the checkpoint was trained with a "
                              f"vocabulary of {m.vocab_size} (padded {m.padded_vocab_size}); pass the tokenizer "
                              f"used in training (--tokenizer-type/--vocab-file/--merge-file/--tokenizer-model)")
    if m.vocab_size is None and tok.vocab_size > m.padded_vocab_size:
        raise GenerationError(f"tokenizer {kind} has {tok.vocab_size} tokens, more than the checkpoint's "
                              f"{m.padded_vocab_size} embedding rows; pass the tokenizer used in training")
    return tok
