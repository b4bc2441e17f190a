"""Model shapes, FFN implementations, the sparse switch and remat (twell_jax.model)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_kernels
from twell_jax import config as C
from twell_jax import ffn, train
from twell_jax import model as M

# bf16 compute: twell vs dense logits may differ by a few bf16 ulps of the hidden
# activations; relative to the logit scale that stays well under this.
TWELL_LOGITS_RTOL = 3e-2
# Sparse-kernel vs dense model gradients, both bf16: ||g_sparse - g_dense|| / ||g_dense||
# per parameter (reduction orders differ; measured ~5e-3 on CPU interpret mode).
SPARSE_GRAD_RTOL = 2e-2


def small_model(**overrides) -> C.ModelConfig:
    """A model that compiles in about a second on CPU."""
    base = dict(vocab_size=256, d_model=64, d_ff=256, n_layers=2, n_heads=4, seq_len=16)
    return C.model_preset("tiny", **{**base, **overrides})


def init_params(cfg: C.ModelConfig, seed: int = 0):
    """Pure-dict params of a fresh model (eager; the rbg PRNG compiles faster on CPU)."""
    rngs = nnx.Rngs(params=jax.random.key(seed, impl="rbg"))
    return nnx.to_pure_dict(nnx.state(M.Transformer(cfg, rngs=rngs)))


@functools.cache
def forward_fn(cfg: C.ModelConfig, body: bool = False):
    """Jitted `model(tokens)` (or `model.body(tokens)`) of (params, tokens), one compile
    per config for the whole module."""
    graphdef = train.model_graphdef(cfg)
    if body:
        return jax.jit(lambda p, t: nnx.merge(graphdef, p).body(t))
    return jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))


def tokens(cfg: C.ModelConfig, batch: int = 2, seed: int = 0) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (batch, cfg.seq_len), 0, cfg.vocab_size)


@pytest.mark.parametrize("variant", C.FFN_VARIANTS)
def test_forward_shapes_and_stats(variant):
    cfg = small_model(ffn_variant=variant)
    params = init_params(cfg)
    assert ("w_gate" in params["blocks"]["ffn"]) == (variant != "relu")
    for w in params["blocks"]["ffn"].values():
        assert w.shape == (cfg.n_layers, cfg.d_ff, cfg.d_model) and w.dtype == jnp.float32
    logits, stats = forward_fn(cfg)(params, tokens(cfg))
    assert logits.shape == (2, cfg.seq_len, cfg.vocab_size) and logits.dtype == jnp.float32
    assert stats["l1"].shape == (cfg.n_layers,) and stats["l1"].dtype == jnp.float32
    assert stats["l0"].shape == (cfg.n_layers,) and stats["l0"].dtype == jnp.float32
    assert stats["fired"].shape == (cfg.n_layers, cfg.d_ff) and stats["fired"].dtype == bool
    l0 = np.asarray(stats["l0"])
    if variant == "gated_silu":
        # silu is almost never exactly 0: a dense hidden layer.
        assert np.all(l0 > 0.99 * cfg.d_ff)
    else:
        # A ReLU at random init fires for about half of the neurons.
        assert np.all((l0 > 0.3 * cfg.d_ff) & (l0 < 0.7 * cfg.d_ff))


def test_body_and_causality():
    cfg = small_model()
    params = init_params(cfg)
    t = tokens(cfg)
    body = forward_fn(cfg, body=True)(params, t)
    assert body.shape == (2, cfg.seq_len, cfg.d_model) and body.dtype == jnp.bfloat16
    changed = t.at[:, -1].set((t[:, -1] + 1) % cfg.vocab_size)
    a, b = forward_fn(cfg)(params, t)[0], forward_fn(cfg)(params, changed)[0]
    np.testing.assert_array_equal(a[:, :-1], b[:, :-1])
    assert not np.allclose(a[:, -1], b[:, -1])


def test_untied_head_has_its_own_matrix():
    cfg = small_model(tie_embeddings=False)
    params = init_params(cfg)
    assert params["lm_head"].shape == (cfg.vocab_size, cfg.d_model)


def test_attention_uses_xla_on_cpu():
    assert M.attention_implementation(jnp.bfloat16, 64) == "xla"


@pytest.mark.parametrize(
    "batch, shards, chunk_seqs, sizes",
    [(6, 1, 2, [2, 2, 2]), (5, 1, 2, [1, 2, 2]), (4, 1, 32, [4]), (6, 2, 2, [2, 4])],
)
def test_attention_runs_in_sequence_chunks(monkeypatch, batch, shards, chunk_seqs, sizes):
    """Past ATTENTION_CHUNK_SEQS sequences per batch shard the attention block runs on
    chunks of the batch as even as their count allows (cuDNN's backward keeps an fp32
    dQ accumulator over its whole batch): the same logits and gradients, fp32. With 2
    shards a chunk takes the same rows of each (sizes are per call: both shards')."""
    cfg = small_model(dtype="float32")
    params, t = init_params(cfg), tokens(cfg, batch=batch)
    graphdef = train.model_graphdef(cfg)

    def loss(p):
        logits, _ = nnx.merge(graphdef, p)(t)
        return jnp.mean(logits**2), logits

    (_, want_logits), want_grads = jax.value_and_grad(loss, has_aux=True)(params)
    seen, attend = [], jax.nn.dot_product_attention
    monkeypatch.setattr(
        jax.nn,
        "dot_product_attention",
        lambda q, *a, **k: (seen.append(q.shape[0]), attend(q, *a, **k))[1],
    )
    monkeypatch.setattr(M, "ATTENTION_CHUNK_SEQS", chunk_seqs)
    monkeypatch.setattr(M.sharding, "batch_shards", lambda: shards)
    (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
    assert seen == sizes  # one trace of the scanned layer
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-6)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("variant", ["gated_relu", "relu"])
def test_twell_matches_dense(variant):
    dense = small_model(ffn_variant=variant)
    params = init_params(dense)
    t = tokens(dense)
    want, _ = forward_fn(dense)(params, t)
    got, stats = forward_fn(dataclasses.replace(dense, ffn_impl="twell"))(params, t)
    rel = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    assert rel < TWELL_LOGITS_RTOL
    assert stats["l0"].shape == stats["overflow_tiles"].shape == (dense.n_layers,)


def _dense_stand_in(x, w_gate, w_up, w_down, *, config):
    """A differentiable stand-in for the sparse training op, scaled to be recognisable."""
    _STAND_IN_CONFIGS.append(config)
    out, stats = ffn.dense_counted(
        x, dict(w_gate=w_gate, w_up=w_up, w_down=w_down), config.ell_width
    )
    return 2 * out, stats


_STAND_IN_CONFIGS = []


def test_sparse_switch_selects_layers(monkeypatch):
    monkeypatch.setattr(pallas_kernels, "sparse_gated_mlp_train", _dense_stand_in, raising=False)
    cfg = small_model(ffn_impl="sparse")
    params = init_params(cfg)
    graphdef = train.model_graphdef(cfg)
    t = tokens(cfg)
    run = jax.jit(lambda p, s: nnx.merge(graphdef, p).body(t, s))
    dense = run(params, jnp.array([False, False]))
    want = forward_fn(small_model(), body=True)(params, t)
    np.testing.assert_array_equal(dense, want)
    # The stand-in doubles the FFN output, so any sparse layer changes the result.
    assert not np.allclose(run(params, jnp.array([False, True])), want)


def test_sparse_ell_width_reaches_the_op(monkeypatch):
    monkeypatch.setattr(pallas_kernels, "sparse_gated_mlp_train", _dense_stand_in, raising=False)
    _STAND_IN_CONFIGS.clear()
    for width in (128, 16):
        cfg = small_model(ffn_impl="sparse", sparse_ell_width=width)
        body = lambda p, t, g=train.model_graphdef(cfg): nnx.merge(g, p).body(t)
        jax.eval_shape(body, init_params(cfg), tokens(cfg))
    assert [c.ell_width for c in _STAND_IN_CONFIGS] == [128, 16]
    with pytest.raises(ValueError, match="sparse_ell_width=48: ell_width must be a power of two"):
        small_model(sparse_ell_width=48)


@pytest.mark.gpu
def test_kernel_paths_match_dense_on_gpu():
    """Compiled Pallas kernels and cuDNN attention inside the model (run with -m gpu)."""
    cfg = small_model(d_model=256, d_ff=1024, n_heads=4, seq_len=256, remat=True)
    assert M.attention_implementation(cfg.compute_dtype, cfg.head_dim) == "cudnn"
    params = init_params(cfg)
    t = tokens(cfg, batch=8)
    want, _ = forward_fn(cfg)(params, t)
    got, _ = forward_fn(dataclasses.replace(cfg, ffn_impl="twell"))(params, t)
    assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) < TWELL_LOGITS_RTOL

    def grads(model_cfg):
        graphdef = train.model_graphdef(model_cfg)
        use_sparse = jnp.ones(cfg.n_layers, bool)

        def loss(p):
            logits, stats = nnx.merge(graphdef, p)(t, use_sparse)
            return logits.std() + 1e-2 * stats["l1"].mean()

        return jax.jit(jax.grad(loss))(params)

    dense, sparse = grads(cfg), grads(dataclasses.replace(cfg, ffn_impl="sparse"))
    for a, b in zip(jax.tree.leaves(sparse), jax.tree.leaves(dense), strict=True):
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < SPARSE_GRAD_RTOL


def test_remat_wraps_each_layer():
    """Remat is JAX's job to get right; check that it is applied to the scanned layer."""
    cfg = small_model()
    params = init_params(cfg)
    t = tokens(cfg)

    def jaxpr(remat):
        graphdef = train.model_graphdef(dataclasses.replace(cfg, remat=remat))
        return str(jax.make_jaxpr(lambda p: nnx.merge(graphdef, p)(t)[0])(params))

    # "remat2" is jax.checkpoint's primitive.
    assert "remat2" in jaxpr(True)
    assert "remat2" not in jaxpr(False)


def test_sparse_residuals_recomputed_give_the_same_gradients_in_less_memory():
    """With remat and the sparse FFN, not saving the ELL residuals re-runs the layer's
    sparse forward in the backward: bitwise the same gradients, and XLA plans less
    temporary memory (the residuals of every layer no longer live at once)."""
    cfg = small_model(ffn_impl="sparse", remat=True, n_layers=6, d_ff=1024, seq_len=256)
    params = init_params(cfg)
    t = tokens(cfg, batch=4)
    use_sparse = jnp.ones(cfg.n_layers, bool)

    def grad_fn(save):
        graphdef = train.model_graphdef(dataclasses.replace(cfg, sparse_save_residuals=save))

        def loss(p):
            logits, stats = nnx.merge(graphdef, p)(t, use_sparse)
            return logits.astype(jnp.float32).std() + 1e-2 * stats["l1"].mean()

        return jax.jit(jax.grad(loss))

    saved, recomputed = grad_fn(True), grad_fn(False)
    leaves = lambda f: jax.tree.leaves(f(params))
    for a, b in zip(leaves(saved), leaves(recomputed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    temp = lambda f: f.lower(params).compile().memory_analysis().temp_size_in_bytes
    assert temp(recomputed) < temp(saved)
