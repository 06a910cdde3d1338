"""Text generation: sampling, KV cache vs recompute, batching of different-length prompts,
tp/pp layouts, checkpoints of another layout, the HTTP server and the CLI.

Tolerances: cached decoding and recomputation run the same fp32 ops in a different grouping
(one query row vs the full causal matrix), so logits agree to ~1e-6; tp=2 splits the matmul
reductions over two ranks, ~1e-5. We assert 1e-4 (logits are O(1))."""
import io
import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from gpt_helpers import tiny_model_config
from megapar.checkpoint import read_saved_config, save_checkpoint
from megapar.cli import generate_text
from megapar.inference.generation import (GenerationError, InferenceEngine, Leader, SamplingParams, filter_logits,
                                          follow, load_inference_model, mask_padded_vocab, sample,
                                          tokenizer_for_checkpoint)
from megapar.model import GPT2Model, Stage
from megapar.inference.text_generation_server import make_server, response_for
from megapar.topology import Topology

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VOCAB, EOD, SEED, ATOL = 100, 99, 1234, 1e-4
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """2 shared cores: OpenMP spinning with 2 threads makes tiny ops 100x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def config(tp=1, pp=1, vocab=VOCAB, tokenizer=None):
    extra = ["--seq-length", "48", "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    cfg = tiny_model_config(extra, world_size=tp * pp, vocab=vocab, tp=tp)
    ns = cfg.megatron_args()
    ns.consumed_train_samples = 0
    for k, v in (tokenizer or {}).items():
        setattr(ns, k, v)
    return cfg, ns


def build(tp=1, pp=1, pp_rank=0, tp_group=None, vocab=VOCAB):
    cfg, ns = config(tp, pp, vocab)
    return GPT2Model(cfg.model, Stage.of(cfg.model.num_layers, pp, pp_rank), SEED, tp_group).eval(), ns


def save(model, ns, root, topo=Topology(1, 1, 1), rank=0):
    save_checkpoint(root, 7, model, None, None, ns, model.cfg, topo, rank, save_optim=False, save_rng=False)


def greedy(n=12, **kw):
    return SamplingParams(tokens_to_generate=n, greedy=True, stop_on_eod=False, return_logits=True, **kw)


def engine(model, topo=Topology(1, 1, 1), rank=0, eod=EOD):
    return InferenceEngine(model, topo, rank, VOCAB, eod)


def close(a, b):  # masked logits: compare the real vocabulary only (-inf - -inf is nan)
    return torch.allclose(a[..., :VOCAB], b[..., :VOCAB], atol=ATOL, rtol=0)


# ---- sampling -------------------------------------------------------------------------------
def test_padded_vocab_never_sampled_and_filters():
    logits = torch.zeros(4, 128)
    logits[:, VOCAB:] = 50.0                                  # padded rows would win every draw
    masked = mask_padded_vocab(logits.clone(), VOCAB)
    g = torch.Generator().manual_seed(0)
    for p in (SamplingParams(temperature=5.0), SamplingParams(greedy=True), SamplingParams(top_p=0.99)):
        draws = torch.stack([sample(masked, p, g) for _ in range(50)])
        assert draws.max() < VOCAB
    x = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    assert torch.isinf(filter_logits(x, top_k=2)).tolist() == [[True, False, True, False, True]]
    # probabilities ~ [.03, .64, .09, .24, .01]: top_p .7 keeps 1 (0.64) and 3 (crosses .7)
    assert torch.isinf(filter_logits(x, top_p=0.7)).tolist() == [[True, False, True, False, True]]
    with pytest.raises(GenerationError, match="top_p"):
        SamplingParams(top_p=1.5).validate()


def test_seed_makes_sampling_repeatable():
    eng = engine(build()[0])
    p = SamplingParams(tokens_to_generate=16, temperature=1.5, top_k=50, seed=5, stop_on_eod=False)
    a, b = eng.generate(PROMPTS, p), eng.generate(PROMPTS, p)
    c = eng.generate(PROMPTS, SamplingParams(**{**p.__dict__, "seed": 6}))
    assert a.tokens == b.tokens and a.tokens != c.tokens


# ---- KV cache and batching ----------------------------------------------------------------------
def test_kv_cache_equals_recompute_and_batching_is_exact():
    eng = engine(build()[0])
    cached = eng.generate(PROMPTS, greedy(logprobs=True))
    full = eng.generate(PROMPTS, greedy(logprobs=True, use_cache=False))
    assert cached.tokens == full.tokens
    assert close(cached.logits, full.logits)
    assert all(len(t) == len(p) + 12 for t, p in zip(cached.tokens, PROMPTS))
    for lp_c, lp_f, t in zip(cached.logprobs, full.logprobs, cached.tokens):
        assert len(lp_c) == len(t) - 1 and max(abs(x - y) for x, y in zip(lp_c, lp_f)) < ATOL
    for i, p in enumerate(PROMPTS):          # each prompt alone = its row of the padded batch
        alone = eng.generate([p], greedy(logprobs=True))
        assert alone.tokens[0] == cached.tokens[i]
        assert max(abs(x - y) for x, y in zip(alone.logprobs[0], cached.logprobs[i])) < ATOL
    # logprobs of the prompt equal a plain full forward's log-softmax
    with torch.no_grad():
        ref = torch.log_softmax(eng.model(torch.tensor([PROMPTS[1]]), None)[0, :, :VOCAB], -1)
    want = ref[:-1].gather(-1, torch.tensor(PROMPTS[1][1:])[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(cached.logprobs[1][:6]), want, atol=ATOL)


def test_stops_at_end_of_document_and_checks_prompts():
    model = build()[0]
    first = engine(model).generate([PROMPTS[0]], greedy(n=1)).generated(0)[0]
    out = engine(model, eod=first).generate(PROMPTS, SamplingParams(tokens_to_generate=8, greedy=True))
    assert out.tokens[0] == PROMPTS[0]                         # stopped at once, eod not included
    assert len(out.tokens[1]) <= len(PROMPTS[1]) + 8
    eng = engine(model)
    with pytest.raises(GenerationError, match="longer than the model's context of 48"):
        eng.generate([list(range(48))], greedy(n=4))
    with pytest.raises(GenerationError, match="empty"):
        eng.generate([[]], greedy())
    cut = eng.generate([list(range(40))], greedy(n=20))
    assert len(cut.tokens[0]) == 48 and cut.notes


# ---- checkpoints and layouts ----------------------------------------------------------------------
def test_checkpoint_roundtrip_and_clear_errors(tmp_path):
    model, ns = build()
    save(model, ns, str(tmp_path / "ck"))
    loaded, saved = load_inference_model(str(tmp_path / "ck"), Topology(1, 1, 1), 0, torch.device("cpu"))
    assert saved.model.vocab_size == loaded.cfg.vocab_size == VOCAB and loaded.cfg.padded_vocab_size == 128
    assert engine(loaded).generate(PROMPTS, greedy()).tokens == engine(model).generate(PROMPTS, greedy()).tokens
    with pytest.raises(GenerationError, match="no such directory"):
        load_inference_model(str(tmp_path / "nope"), Topology(1, 1, 1), 0, torch.device("cpu"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(GenerationError, match="latest_checkpointed_iteration.txt"):
        load_inference_model(str(tmp_path / "empty"), Topology(1, 1, 1), 0, torch.device("cpu"))


def _layouts_body(rank, world, root):
    """tp=2 then pp=2 on 2 gloo processes: save a checkpoint of each layout, reload it, generate."""
    out = {}
    for name, (tp, pp) in {"tp2": (2, 1), "pp2": (1, 2)}.items():
        topo = Topology(tp, pp, 1)
        topo.create_groups(rank)
        c = topo.coord(rank)
        model, ns = build(tp, pp, c.pp, topo.groups.tp)
        save(model, ns, os.path.join(root, name), topo, rank)
        loaded, _ = load_inference_model(os.path.join(root, name), topo, rank, torch.device("cpu"))
        res = InferenceEngine(loaded, topo, rank, VOCAB, EOD).generate(PROMPTS, greedy(logprobs=True))
        sampled = InferenceEngine(loaded, topo, rank, VOCAB, EOD).generate(
            PROMPTS, SamplingParams(tokens_to_generate=10, top_p=0.9, seed=3, stop_on_eod=False))
        out[name] = (res.tokens, res.logits, res.logprobs, sampled.tokens)
    return out


def test_tp2_and_pp2_generation_equal_tp1_and_load_on_one_process(tmp_path):
    root = str(tmp_path)
    dist_out = run_distributed(_layouts_body, 2, args=(root,))
    eng = engine(build()[0])
    ref = eng.generate(PROMPTS, greedy(logprobs=True))
    ref_sampled = eng.generate(PROMPTS, SamplingParams(tokens_to_generate=10, top_p=0.9, seed=3, stop_on_eod=False))
    for name, last_rank in (("tp2", 0), ("pp2", 1)):
        tokens, logits, logprobs, sampled = dist_out[last_rank][name]
        assert tokens == ref.tokens and dist_out[0][name][0] == tokens, name
        assert close(logits, ref.logits), name
        assert all(max(abs(x - y) for x, y in zip(a, b)) < ATOL for a, b in zip(logprobs, ref.logprobs))
        assert sampled == ref_sampled.tokens == dist_out[0][name][3], name
    pytest.importorskip("megapar.reshard", reason="in-memory resharding (megapar.reshard) not available")
    for name in ("tp2", "pp2"):      # tp2 is padded to 256 rows, the one-process model to 128
        loaded, _ = load_inference_model(os.path.join(root, name), Topology(1, 1, 1), 0, torch.device("cpu"))
        assert loaded.cfg.padded_vocab_size == 128
        res = engine(loaded).generate(PROMPTS, greedy())
        assert res.tokens == ref.tokens and close(res.logits, ref.logits), name


def _idle_leader_body(rank, world, idle_s, timeout_s, keepalive_s):
    """tp 2 whose rank 0 sits idle for longer than the model group's timeout before each request."""
    import datetime
    import time
    topo = Topology(2, 1, 1)
    topo.create_groups(rank)
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=timeout_s))  # followers wait on it
    eng = InferenceEngine(build(2, 1, 0, topo.groups.tp)[0], topo, rank, VOCAB, EOD)
    if rank != 0:
        follow(eng, group)
        return None
    leader = Leader(eng, keepalive_s=keepalive_s, group=group)
    tokens = []
    for _ in range(2):
        time.sleep(idle_s)
        tokens.append(leader.generate(PROMPTS, greedy(4)).tokens)
    leader.stop()
    return tokens


def test_idle_leader_keeps_followers_past_the_group_timeout():
    """A tp 2 server or prompt left idle longer than the process group's timeout still answers:
    rank 0's Leader pings the waiting ranks (without the pings rank 1's broadcast times out)."""
    tokens = run_distributed(_idle_leader_body, 2, args=(3.0, 1.5, 0.3))[0]
    assert tokens[0] == tokens[1] == engine(build()[0]).generate(PROMPTS, greedy(4)).tokens


# ---- server --------------------------------------------------------------------------------------
class CharTokenizer:
    """ids 1..98 <-> characters; 99 is end-of-document."""
    vocab_size, eod = VOCAB, EOD

    def tokenize(self, text):
        return [1 + (ord(ch) - 32) % 98 for ch in text]

    def detokenize(self, ids):
        return "".join(chr(31 + i) for i in ids if i != EOD)


def test_server_answers_megatron_api_on_localhost():
    eng, tok = engine(build()[0]), CharTokenizer()

    def generate(prompts, params):
        out = eng.generate([tok.tokenize(p) if p else [tok.eod] for p in prompts], params)
        return response_for(tok, prompts, out, params.logprobs)

    server = make_server(generate, SamplingParams(tokens_to_generate=8), port=0)
    assert server.server_address[0] == "127.0.0.1"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/api"

    def put(body):
        req = urllib.request.Request(url, data=json.dumps(body).encode(), method="PUT",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())
    try:
        body = {"prompts": ["Hello", "a longer prompt", ""], "tokens_to_generate": 5, "temperature": 0.8,
                "top_k": 20, "logprobs": True, "random_seed": 42}
        a, b = put(body), put(body)
        assert a == b and set(a) == {"text", "segments", "logprobs"}
        assert a["text"][0].startswith("Hello") and len(a["segments"][1]) == len("a longer prompt") + 5
        assert all(len(lp) == len(seg) - 1 for lp, seg in zip(a["logprobs"], a["segments"]))
        assert len(a["segments"][2]) <= 5 and not a["text"][2].startswith(chr(31 + EOD))
        assert put({"prompts": ["x"], "tokens_to_generate": 3})["logprobs"] is None
        for bad, msg in (({"prompts": "x"}, "not a list"), ({"prompts": ["x"], "top_p": 2}, "top_p"),
                         ({"prompts": ["x" * 60]}, "longer than")):
            with pytest.raises(urllib.error.HTTPError) as e:
                put(bad)
            assert e.value.code == 400 and msg in e.value.read().decode()
    finally:
        server.shutdown()
        server.server_close()


# ---- the CLI with a real GPT-2 tokenizer ----------------------------------------------------------
def test_cli_modes_and_errors(tmp_path, gpt2_files, monkeypatch, capsys):
    vocab_file, merge_file = gpt2_files
    tok_args = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": vocab_file, "merge_file": merge_file}
    cfg, ns = config(vocab=50257, tokenizer=tok_args)
    ck = str(tmp_path / "ck")
    save(GPT2Model(cfg.model, Stage.of(4, 1, 0), SEED), ns, ck)
    base = ["--load", ck, "--out-seq-length", "6", "--seed", "1", "--device", "cpu"]

    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello world\n" + "word " * 60 + "\nThe end\nstop\nignored\n"))
    assert generate_text.main(base) == 0
    out, err = capsys.readouterr()
    assert len(out.strip().split("\n")) == 2                   # two continuations; too-long prompt skipped
    assert "longer than the model's context" in err and err.count("decode") == 2 and "tokens/s" in err

    (tmp_path / "in.txt").write_text("Once upon a time\nThe\n")
    outf = str(tmp_path / "out.jsonl")
    assert generate_text.main(base + ["--sample-input-file", str(tmp_path / "in.txt"),
                                      "--sample-output-file", outf]) == 0
    rows = [json.loads(line) for line in open(outf)]
    assert [r["prompt"] for r in rows] == ["Once upon a time", "The"] and all(r["text"] for r in rows)
    assert generate_text.main(base + ["--num-samples", "3", "--batch-size", "2", "--greedy"]) == 0
    assert capsys.readouterr().out.count("megapar: ") == 3

    assert generate_text.main(["--load", str(tmp_path / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err
    small_cfg, small_ns = config(vocab=VOCAB, tokenizer=tok_args)    # gpt2 tokenizer, 100-token checkpoint
    save(GPT2Model(small_cfg.model, Stage.of(4, 1, 0), SEED), small_ns, str(tmp_path / "small"))
    assert generate_text.main(["--load", str(tmp_path / "small")]) == 2
    assert "has 50257 tokens but the checkpoint was trained with a vocabulary of 100" in capsys.readouterr().err
    with pytest.raises(GenerationError, match="tokenizer-model"):
        tokenizer_for_checkpoint(read_saved_config({"args": ns}), tokenizer_type="SentencePieceTokenizer",
                                 tokenizer_model="/nope.model")


@pytest.mark.slow  # --quick skips it; tp 2 generation itself is checked in-process above
def test_generate_text_sh_tp2_under_torchrun(tmp_path, gpt2_files):
    """The wrapper starts torchrun for tp=2 and loads a tp=1 checkpoint by resharding in memory."""
    pytest.importorskip("megapar.reshard", reason="in-memory resharding (megapar.reshard) not available")
    vocab_file, merge_file = gpt2_files
    cfg, ns = config(vocab=50257, tokenizer={"tokenizer_type": "GPT2BPETokenizer", "vocab_file": vocab_file,
                                             "merge_file": merge_file})
    ck = str(tmp_path / "ck")
    save(GPT2Model(cfg.model, Stage.of(4, 1, 0), SEED), ns, ck)
    cmd = ["bash", os.path.join(ROOT, "scripts", "generate_text.sh"), "--load", ck, "--out-seq-length", "5",
           "--greedy", "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}  # tp 2: torchrun behind megapar.launch
    env.pop("TORCHRUN", None)
    outs = [subprocess.run(cmd + extra, input="Hello world\n", capture_output=True, text=True, env=env, timeout=120)
            for extra in ([], ["--tensor-model-parallel-size", "2"])]
    for r in outs:
        assert r.returncode == 0, r.stderr[-2000:]
    assert outs[0].stdout == outs[1].stdout and outs[0].stdout.strip()
