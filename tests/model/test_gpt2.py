"""Tiny GPT-2: tp 2/4 equal tp 1; recompute equals no recompute; QKV layout; padding."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed import run_distributed
from gpt_helpers import batch, gather_grads, tiny_model_config
from megapar.model import GPT2Model, Stage
from megapar.model.sharding import is_vocab_parallel
from megapar.model.transformer import ParallelAttention
from megapar.tensor_parallel.mappings import gather_from_tp
from megapar.tensor_parallel.random import seed_everything


def _run(tp, group, extra=(), dropout=False, seed=5):
    flags = list(extra) + ([] if dropout else ["--hidden-dropout", "0", "--attention-dropout", "0"])
    cfg = tiny_model_config(flags, tp=tp)
    seed_everything(seed, tp_rank=dist.get_rank(group) if tp > 1 else 0, pp_rank=0)
    model = GPT2Model(cfg.model, Stage.of(4, 1, 0), seed=seed, tp_group=group if tp > 1 else None)
    ids, labels = batch()
    model.eval() if not dropout else model.train()
    logits = model(ids)
    loss = model(ids, labels=labels).mean()
    loss.backward()
    logits = gather_from_tp(logits, group) if tp > 1 else logits
    return {"logits": logits[..., :100].detach(), "loss": loss.item(), "grads": gather_grads(model, group, tp)}


def _tp_body(rank, world_size):
    return _run(world_size, dist.group.WORLD)


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tp_equals_serial(tp):
    ref = _run(1, None)
    for out in run_distributed(_tp_body, world_size=tp):
        assert abs(out["loss"] - ref["loss"]) < 1e-5
        assert torch.allclose(out["logits"], ref["logits"], atol=1e-5)
        for name, g in ref["grads"].items():
            got = out["grads"][name][:100] if is_vocab_parallel(name) else out["grads"][name]
            g = g[:100] if is_vocab_parallel(name) else g          # padding differs: 128*tp rows
            assert torch.allclose(got, g, atol=1e-6, rtol=1e-4), name


@pytest.mark.parametrize("recompute", [["--recompute-granularity", "full", "--recompute-method", "uniform",
                                        "--recompute-num-layers", "2"],
                                       ["--recompute-granularity", "full", "--recompute-method", "block",
                                        "--recompute-num-layers", "3"],
                                       ["--recompute-activations"]])
def test_activation_checkpointing_gives_identical_grads_with_dropout(recompute):
    plain = _run(1, None, dropout=True)
    again = _run(1, None, dropout=True)
    rec = _run(1, None, extra=recompute, dropout=True)
    assert plain["loss"] == again["loss"] == rec["loss"]
    for name, g in plain["grads"].items():
        assert torch.equal(rec["grads"][name], g), name


def _recompute_tp_body(rank, world_size):
    base = _run(2, dist.group.WORLD, dropout=True)
    rec = _run(2, dist.group.WORLD, extra=["--checkpoint-activations"], dropout=True)
    return all(torch.equal(base["grads"][k], rec["grads"][k]) for k in base["grads"]) and base["loss"] == rec["loss"]


def test_recompute_restores_tp_rng_streams():
    assert all(run_distributed(_recompute_tp_body, world_size=2))


def test_dropout_differs_without_rng_restore():
    """Guard: two different seeds give different dropout losses, so the equality above is meaningful."""
    assert _run(1, None, dropout=True, seed=1)["loss"] != _run(1, None, dropout=True, seed=2)["loss"]


def test_qkv_rows_are_per_head():
    """Rows of query_key_value form [np, 3, hn, h]: head i's q, k, v are consecutive blocks."""
    cfg = tiny_model_config(["--hidden-dropout", "0", "--attention-dropout", "0"])
    attn = ParallelAttention(cfg.model, "a", 0, None, None, torch.float32).eval()
    x = torch.randn(5, 2, 32)                                                     # [s, b, h]
    w = attn.query_key_value.weight.view(4, 3, 8, 32)                             # [np, 3, hn, h]
    b = attn.query_key_value.bias.view(4, 3, 8)
    heads = []
    for i in range(4):
        q, k, v = (x @ w[i, j].T + b[i, j] for j in range(3))                     # [s, b, hn]
        heads.append(F.scaled_dot_product_attention(*(t.permute(1, 0, 2) for t in (q, k, v)), is_causal=True))
    ctx = torch.cat(heads, dim=-1).permute(1, 0, 2)                               # [s, b, h]
    assert torch.allclose(attn(x), attn.dense(ctx), atol=1e-5)


def test_loss_ignores_padded_vocab_rows():
    cfg = tiny_model_config(["--hidden-dropout", "0", "--attention-dropout", "0"])
    assert cfg.model.padded_vocab_size == 128
    model = GPT2Model(cfg.model, Stage.of(4, 1, 0), seed=5).eval()
    ids, labels = batch()
    before = model(ids, labels=labels)
    with torch.no_grad():
        model.language_model.embedding.word_embeddings.weight[100:] = 5 * torch.randn(28, 32)  # garbage
    after = model(ids, labels=labels)
    logits = model(ids)[..., :100]
    ref = F.cross_entropy(logits.reshape(-1, 100), labels.reshape(-1), reduction="none").view_as(after)
    assert torch.allclose(after, ref, atol=1e-5)
    assert torch.allclose(before, after, atol=1e-6)
    assert model(ids)[..., 100:].abs().max() > 1.0                              # the padding logits are garbage


def test_state_dict_keys_are_megatron_names():
    cfg = tiny_model_config()
    keys = set(GPT2Model(cfg.model, Stage.of(4, 2, 1), seed=1).state_dict())
    assert "word_embeddings_for_head.weight" in keys
    assert "language_model.encoder.final_layernorm.weight" in keys
    assert "language_model.encoder.layers.1.mlp.dense_4h_to_h.weight" in keys   # local index
    assert "language_model.encoder.layers.2.input_layernorm.bias" not in keys
    assert not any(k.startswith("language_model.embedding") for k in keys)


def test_layers_built_in_parallel_threads_have_the_serial_weights_and_arrive_in_order(monkeypatch):
    """Encoder builds up to BUILD_THREADS layers at once (each weight drawn from its own generator):
    the weights equal a one-thread build's, and on_layer_built (ZeRO-3's sharding) sees the layers
    in order with at most BUILD_THREADS built ahead."""
    import megapar.model.gpt2 as gpt2
    cfg = tiny_model_config(["--num-layers", "6"])

    def build(threads: int) -> tuple[GPT2Model, list[int]]:
        monkeypatch.setattr(gpt2, "BUILD_THREADS", threads)
        seen, built = [], []
        real = gpt2.TransformerLayer

        def counted(*args):
            built.append(args[1])
            return real(*args)
        monkeypatch.setattr(gpt2, "TransformerLayer", counted)
        model = GPT2Model(cfg.model, Stage.of(6, 1, 0), seed=3,
                          on_layer_built=lambda layer: seen.append((len(built), len(seen))))
        monkeypatch.setattr(gpt2, "TransformerLayer", real)
        for started, index in seen:                            # started: layers begun when `index` was added
            assert started <= index + threads
        return model, [i for _, i in seen]

    serial, order = build(1)
    parallel, order3 = build(3)
    assert order == order3 == list(range(6))
    for (name, a), (_, b) in zip(serial.state_dict().items(), parallel.state_dict().items()):
        assert torch.equal(a, b), name
