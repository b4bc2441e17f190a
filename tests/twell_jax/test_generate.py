"""KV-cache generation: the full forward, batching, stopping, sampling (twell_jax.generate)."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_kernels
from tests.twell_jax.test_model import forward_fn, init_params, small_model
from twell_jax import config, ffn, serving, synthetic, train
from twell_jax import generate as G

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_tiny"
PROMPTS = [[3, 14, 15, 92, 65], [35, 89], [7, 9, 3, 2, 38, 46, 26]]
NEW = 6


@pytest.fixture(scope="module")
def model():
    cfg = small_model(n_kv_heads=2, dtype="float32", seq_len=32, init_std=0.2)
    return cfg, init_params(cfg, seed=1)


@pytest.fixture(scope="module")
def greedy(model):
    """Greedy continuations of PROMPTS, generated as one batch."""
    cfg, params = model
    return G.generate(cfg, params, PROMPTS, max_new_tokens=NEW).new_token_ids


def test_greedy_decode_equals_argmax_of_the_full_forward(model, greedy):
    cfg, params = model
    # The forward is causal (test_model), so one pass over prompt + generated tokens,
    # right-padded to a common length, gives the logits of every decode step at once.
    rows = [p + new for p, new in zip(PROMPTS, greedy, strict=True)]
    padded = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for b, row in enumerate(rows):
        padded[b, : len(row)] = row
    logits, _ = forward_fn(cfg)(params, jnp.asarray(padded))
    for b, (prompt, new) in enumerate(zip(PROMPTS, greedy, strict=True)):
        assert len(new) == NEW
        steps = logits[b, len(prompt) - 1 : len(prompt) - 1 + NEW]
        assert np.asarray(jnp.argmax(steps, axis=-1)).tolist() == new


def test_a_batch_generates_what_each_prompt_generates_alone(model, greedy):
    cfg, params = model
    alone = [G.generate(cfg, params, [p], max_new_tokens=NEW).new_token_ids[0] for p in PROMPTS]
    assert greedy == alone


def test_greedy_generation_matches_transformers():
    hf = pytest.importorskip("twell_jax.hf")
    cfg, params = hf.load_checkpoint(FIXTURES / "relu_gqa")
    golden = json.loads((FIXTURES / "relu_gqa" / "greedy.json").read_text())
    out = G.generate(cfg, params, golden["prompts"], max_new_tokens=len(golden["new_tokens"][0]))
    assert out.new_token_ids == golden["new_tokens"]


def test_stop_tokens_and_streaming(model, greedy):
    cfg, params = model
    stop = greedy[0][2]
    cut = [row[: row.index(stop) + 1] if stop in row else row for row in greedy]
    stopped = G.generate(cfg, params, PROMPTS, max_new_tokens=NEW, stop_tokens=[stop])
    assert stopped.new_token_ids == cut and stopped.prompt_ids == PROMPTS
    columns = []
    streamed = G.generate(
        cfg, params, PROMPTS, max_new_tokens=NEW, stop_tokens=[stop], on_tokens=columns.append
    )
    assert streamed.new_token_ids == cut
    # Streaming ends once every row has stopped; stopped rows stream NO_TOKEN.
    assert len(columns) == max(len(r) for r in cut)
    for b, row in enumerate(cut):
        assert [int(c[b]) for c in columns[: len(row)]] == row
        assert all(int(c[b]) == G.NO_TOKEN for c in columns[len(row) :])


def test_sampling_options(model, greedy):
    cfg, params = model
    narrow = G.SamplingConfig(temperature=1.0, top_k=1)
    assert G.generate(cfg, params, PROMPTS, NEW, sampling=narrow).new_token_ids == greedy
    hot = G.SamplingConfig(temperature=2.0, vocab_limit=10)
    a = G.generate(cfg, params, PROMPTS, NEW, sampling=hot, seed=3).new_token_ids
    assert a == G.generate(cfg, params, PROMPTS, NEW, sampling=hot, seed=3).new_token_ids
    assert a != G.generate(cfg, params, PROMPTS, NEW, sampling=hot, seed=4).new_token_ids
    assert all(0 <= t < 10 for row in a for t in row)


def test_sample_restricts_to_top_k_and_top_p():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 4000))
    draw = lambda **kw: np.asarray(
        G.sample(logits, jax.random.key(0), G.SamplingConfig(temperature=1.0, **kw))
    )
    assert set(draw(top_k=2)) == {0, 1}
    assert set(draw(top_p=0.7)) == {0, 1}  # 0.5 < 0.7, then 0.5 + 0.3 covers it
    assert set(draw(top_p=0.5)) == {0}
    counts = np.bincount(draw(), minlength=4) / 4000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.03)


def test_refusals(model):
    cfg, params = model
    with pytest.raises(ValueError, match=r"prompts\[1\]\[1\] = 256 is not a token id"):
        G.generate(cfg, params, [[1, 2], [3, 256]], 4)
    with pytest.raises(ValueError, match=r"prompts\[0\]\[0\] = -3 is not a token id"):
        G.generate(cfg, params, [[-3]], 4)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        G.generate(cfg, params, [[1], []], 4)
    with pytest.raises(ValueError, match="exceeds the model's context seq_len=32"):
        G.generate(cfg, params, [[1] * 30], 3)
    with pytest.raises(ValueError, match="top_p=0"):
        G.SamplingConfig(top_p=0)
    with pytest.raises(ValueError, match="temperature=nan: must be finite"):
        G.SamplingConfig(temperature=float("nan"))
    with pytest.raises(ValueError, match=r"top_k=2\.5: must be an int"):
        G.SamplingConfig(top_k=2.5)
    with pytest.raises(ValueError, match=r"stop_tokens\[1\] = 256 is not a token id"):
        G.generate(cfg, params, [[1]], 2, stop_tokens=[3, 256])
    with pytest.raises(ValueError, match="dtype='float16': generation computes in one of"):
        G.generate(dataclasses.replace(cfg, dtype="float16"), params, [[1]], 2)
    with pytest.raises(ValueError, match="ffn='fast'"):
        G.inference_configs(cfg, "fast")
    with pytest.raises(ValueError, match="needs a ReLU FFN"):
        G.inference_configs(small_model(ffn_variant="gated_silu"), "sparse")


def test_ffn_modes_pick_the_prefill_and_decode_paths():
    cfg = small_model()
    twell = small_model(ffn_impl="twell")
    impls = lambda c, f: tuple(x.ffn_impl for x in G.inference_configs(c, f))
    assert impls(cfg, "auto") == impls(cfg, "dense") == ("dense", "dense")
    assert impls(cfg, "sparse") == impls(twell, "sparse") == ("twell", "decode")
    # auto: the measured faster paths, TwELL prefill (from enough tokens), the decode op
    # (in small batches)
    assert impls(twell, "auto") == impls(small_model(ffn_impl="decode"), "auto")
    assert impls(twell, "auto") == ("twell", "decode")
    assert G.twell_prefill_min_tokens("auto") == G.AUTO_TWELL_PREFILL_TOKENS > 0
    assert G.twell_prefill_min_tokens("sparse") == 0
    assert G.decode_op_max_batch("auto") == G.AUTO_DECODE_OP_MAX_BATCH == 8
    assert G.decode_op_max_batch("sparse") is None
    assert impls(small_model(ffn_impl="sparse"), "auto") == ("dense", "dense")
    # fp32 compute: no TwELL prefill; a non-gated model: no decode path
    assert impls(small_model(dtype="float32"), "sparse") == ("dense", "decode")
    assert impls(small_model(ffn_variant="relu"), "sparse") == ("twell", "dense")


def test_sparse_decode_gives_the_dense_tokens_on_a_sparse_model():
    """fp32, a tiny model whose gates are calibrated to ~24 of 512 positive per token
    (as trained with L1): 64 greedy tokens per prompt through the decode op equal the
    dense FFN's, and the op (not its dense formula) ran on a sparse input."""
    params, l0 = synthetic.synthetic_sparse_params("tiny", 24.0, calib_tokens=(4, 128))
    assert 10 < float(np.mean(l0)) < 40
    params = jax.tree.map(lambda a: a.astype(jnp.float32), params)
    cfg = config.model_preset("tiny", dtype="float32", remat=False)
    prompts = [[5, 17, 3, 9, 60, 2, 44, 8], [7, 7, 100]]
    dense = G.generate(cfg, params, prompts, 64, ffn="dense").new_token_ids
    sparse = G.generate(cfg, params, prompts, 64, ffn="sparse").new_token_ids
    assert sparse == dense and all(len(row) == 64 for row in dense)
    # A decode step's FFN (B = 2 tokens: the prompts' last positions) runs the op, not
    # its dense formula, in every layer, on the layer's real (sparse) input.
    model = nnx.merge(train.model_graphdef(cfg), params)
    ffn_in = model.ffn_inputs(jnp.asarray([prompts[0][-3:], prompts[1]]))  # [L, 2 * 3, H]
    weights = params["blocks"]["ffn"]
    for layer in range(cfg.n_layers):
        w = {k: weights[k][layer] for k in ("w_gate", "w_up", "w_down")}
        _, stats = ffn.decode(ffn_in[layer, 2::3], w)
        assert int(stats["dense_fallback"]) == 0 and float(stats["l0"]) < 64, layer


def _record_twell_calls(monkeypatch) -> list:
    calls = []

    def stand_in(x, w_gate, w_up, w_down, **kw):
        calls.append(x.shape)
        out, _ = ffn.dense(x, {"w_gate": w_gate, "w_up": w_up, "w_down": w_down}, "gated_relu")
        zero = jnp.zeros((), jnp.int32)
        return out, pallas_kernels.TwellStats(jnp.zeros((), jnp.float32), zero, zero, zero, zero)

    monkeypatch.setattr(pallas_kernels, "twell_gated_mlp", stand_in)
    return calls


def test_sparse_prefill_runs_the_twell_kernels(monkeypatch):
    calls = _record_twell_calls(monkeypatch)
    cfg = small_model(seq_len=24)  # a config no other test compiles
    params = init_params(cfg)
    sparse = G.generate(cfg, params, PROMPTS[:2], 3, ffn="sparse").new_token_ids
    # Traced once per (unrolled) layer with the prefill's B * P tokens, never in a decode step.
    assert calls == [(2 * G.PROMPT_BUCKET, cfg.d_model)] * cfg.n_layers
    assert [len(row) for row in sparse] == [3, 3]


def test_auto_decodes_through_the_op_only_in_small_batches(monkeypatch):
    calls = []
    op = serving.sparse_decode_ffn_block

    def stand_in(x, *weights, eps):
        calls.append(x.reshape(-1, x.shape[-1]).shape)
        return op(x, *weights, eps=eps, impl="xla")

    monkeypatch.setattr(serving, "sparse_decode_ffn_block", stand_in)
    cfg = small_model(seq_len=28, ffn_impl="decode")  # a config no other test compiles
    params = init_params(cfg)
    G.generate(cfg, params, PROMPTS, 3, ffn="auto")
    assert calls == [(3, cfg.d_model)] * cfg.n_layers  # batch 3 <= 8: traced once per layer
    calls.clear()
    monkeypatch.setattr(G, "AUTO_DECODE_OP_MAX_BATCH", 1)  # so that batch 2 is above it
    G.generate(cfg, params, PROMPTS[:1], 3, ffn="auto")
    assert calls == [(1, cfg.d_model)] * cfg.n_layers
    calls.clear()
    G.generate(cfg, params, PROMPTS[:2], 3, ffn="auto")  # above the limit: dense
    assert calls == []
    G.generate(cfg, params, PROMPTS[:2], 3, ffn="sparse")
    assert calls == [(2, cfg.d_model)] * cfg.n_layers


def test_auto_prefill_runs_twell_only_from_enough_tokens(monkeypatch):
    calls = _record_twell_calls(monkeypatch)
    cfg = small_model(seq_len=26, ffn_impl="twell")  # a config no other test compiles
    params = init_params(cfg)
    G.generate(cfg, params, PROMPTS[:2], 3, ffn="auto")  # 16 prompt tokens
    assert calls == []
    monkeypatch.setattr(G, "AUTO_TWELL_PREFILL_TOKENS", 16)
    G.generate(cfg, params, PROMPTS[:2], 3, ffn="auto")
    assert calls == [(2 * G.PROMPT_BUCKET, cfg.d_model)] * cfg.n_layers


@pytest.mark.gpu
def test_twell_prefill_on_gpu_agrees_with_dense():
    """The compiled TwELL kernels in the prefill (run with -m gpu): the first token of
    each row depends on the prefill alone, and bf16 rounding rarely flips an argmax
    of this sharply peaked model."""
    cfg = small_model(d_model=256, d_ff=1024, n_kv_heads=2, seq_len=128, init_std=0.2)
    params = init_params(cfg, seed=2)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 17, 40, 64) * 4]
    sparse = G.generate(cfg, params, prompts, 8, ffn="sparse").new_token_ids
    dense = G.generate(cfg, params, prompts, 8, ffn="dense").new_token_ids
    first = np.mean([s[0] == d[0] for s, d in zip(sparse, dense, strict=True)])
    assert first >= 0.9, (first, sparse, dense)
