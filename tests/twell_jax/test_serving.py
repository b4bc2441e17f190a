"""The serving layout (twell_jax.serving): shapes, dtypes, and the model's math."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.twell_jax.test_model import init_params, small_model
from twell_jax import model as M
from twell_jax import serving
from twell_jax.train import model_graphdef


def _with_random_norm_scales(params, seed: int):
    """params with every norm scale drawn from [0.5, 1.5) (they start at ones), so that
    the scale folded into the serving weights is tested."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    drawn = [
        jax.random.uniform(k, a.shape, a.dtype, 0.5, 1.5)
        if "scale" in [getattr(p, "key", None) for p in path]
        else a
        for k, (path, a) in zip(keys, leaves, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, drawn)


@pytest.fixture(scope="module")
def gqa():
    """fp32 masters, bf16 compute, 4 query heads on 2 key / value heads."""
    cfg = small_model(n_kv_heads=2, dtype="bfloat16", init_std=0.2)
    return cfg, _with_random_norm_scales(init_params(cfg, seed=3), 3)


def test_layout_stacks_qkv_with_h_last_and_casts_matrices_only(gqa):
    cfg, params = gqa
    sp = serving.serving_params(params, cfg)
    h, n, kv, d = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    assert len(sp["blocks"]) == len(sp["attention"]) == cfg.n_layers
    for i, att in enumerate(sp["attention"]):
        assert att["wqkv"].shape == ((n + 2 * kv) * d, h) and att["wo"].shape == (h, n * d)
        assert att["wqkv"].dtype == att["wo"].dtype == jnp.bfloat16
        src = params["blocks"]["attn"]
        scale = params["blocks"]["attn_norm"]["scale"][i]
        # rows: the q heads, then the k heads, then the v heads, each head's D columns,
        # column h times the attention norm's scale[h], rounded once
        want_k = (src["wk"][i].reshape(h, kv * d) * scale[:, None]).astype(jnp.bfloat16).T
        np.testing.assert_array_equal(att["wqkv"][n * d : (n + kv) * d], want_k)
        want_o = src["wo"][i].astype(jnp.bfloat16).reshape(n * d, h).T
        np.testing.assert_array_equal(att["wo"], want_o)
        block = sp["blocks"][i]
        ffn_scale = params["blocks"]["ffn_norm"]["scale"][i]
        for k in ("w_gate", "w_up"):  # the FFN norm's scale folded in, rounded once
            want = (params["blocks"]["ffn"][k][i] * ffn_scale[None, :]).astype(jnp.bfloat16)
            np.testing.assert_array_equal(block["ffn"][k], want)
        np.testing.assert_array_equal(block["ffn_norm"]["scale"], np.ones(h, np.float32))
        want_down = params["blocks"]["ffn"]["w_down"][i].astype(jnp.bfloat16)
        np.testing.assert_array_equal(block["ffn"]["w_down"], want_down)
        assert block["ffn"]["w_up"].dtype == jnp.bfloat16
        assert block["attn_norm"]["scale"].dtype == jnp.float32  # vectors stay fp32
        assert all(w.size == 0 for w in block["attn"].values())  # placeholders
    assert sp["embed"].dtype == jnp.bfloat16
    assert sp["final_norm"]["scale"].dtype == jnp.float32
    assert serving.serving_params(sp, cfg) is sp  # already in the layout


def test_run_layers_is_the_model_forward_in_fp32():
    """A prefill (slot None: no cache history, causal mask over the prompt) and a chunk
    written at a traced slot 0 (XLA's attention over the whole cache) are both the
    model's body, to fp32 rounding."""
    cfg = small_model(n_kv_heads=2, dtype="float32", init_std=0.2)
    params = _with_random_norm_scales(init_params(cfg, seed=4), 4)
    tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, cfg.vocab_size)
    want = nnx.merge(model_graphdef(cfg), params).body(tokens)

    sp = serving.serving_params(params, cfg)
    model = serving.merge_model(model_graphdef(cfg), sp)
    b, s = tokens.shape
    cos, sin = M.rope_tables(s, cfg.head_dim, cfg.rope_theta)
    cache = (jnp.zeros((b, s, cfg.kv_heads, cfg.head_dim), jnp.float32),) * cfg.n_layers
    x = jnp.take(sp["embed"], tokens, axis=0)
    pad = jnp.zeros((b,), jnp.int32)
    got, cache_k, _ = serving.run_layers(model, sp, x, cos, sin, cache, cache, None, pad)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    chunk, _, _ = serving.run_layers(model, sp, x, cos, sin, cache, cache, jnp.int32(0), pad)
    np.testing.assert_allclose(np.asarray(chunk), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert len(cache_k) == cfg.n_layers
    assert all(float(jnp.abs(c).sum()) > 0 for c in cache_k)  # every layer's keys written


def _left_padded_prompt(cfg, params, p: int, t: int, pads: tuple[int, ...]):
    """(serving params, merged model, random tokens [B, p], pad, cos, sin, bf16 caches of
    t slots) for rows left-padded by `pads`."""
    sp = serving.serving_params(params, cfg)
    model = serving.merge_model(model_graphdef(cfg), sp)
    b = len(pads)
    pad = jnp.asarray(pads, jnp.int32)
    tokens = jax.random.randint(jax.random.key(p), (b, p), 0, cfg.vocab_size)
    pos = jnp.maximum(jnp.arange(p)[None] - pad[:, None], 0)
    cos, sin = M.rope_angles(pos, cfg.head_dim, cfg.rope_theta)
    cache = (jnp.zeros((b, t, cfg.kv_heads, cfg.head_dim), jnp.bfloat16),) * cfg.n_layers
    return sp, model, tokens, pad, cos, sin, cache


def test_one_token_step_through_the_attention_kernel_matches_xla(gqa):
    """A decode step (prompt of left-padded rows in the cache, one new token each) with
    the attention kernel in the interpreter against XLA's attention: layer 0's caches
    equal (the same rounded RoPE), the rest within bf16 rounding over the 2 layers."""
    cfg, params = gqa
    sp, model, tokens, pad, cos, sin, cache = _left_padded_prompt(cfg, params, 8, 12, (0, 3, 7))
    p = tokens.shape[1]
    embed = lambda ids: jnp.take(sp["embed"], ids, axis=0)
    _, ck, cv = serving.run_layers(model, sp, embed(tokens), cos, sin, cache, cache, None, pad)
    slot = jnp.int32(p)
    cos1, sin1 = M.rope_angles((slot - pad)[:, None], cfg.head_dim, cfg.rope_theta)
    new = embed(tokens[:, -1:])
    outs = {
        impl: serving.run_layers(model, sp, new, cos1, sin1, ck, cv, slot, pad, attention=impl)
        for impl in ("xla", "interpret")
    }
    (want, want_k, want_v), (got, got_k, got_v) = outs["xla"], outs["interpret"]
    np.testing.assert_array_equal(np.asarray(got_k[0]), np.asarray(want_k[0]))
    np.testing.assert_array_equal(np.asarray(got_v[0]), np.asarray(want_v[0]))
    for a, c in zip((want, *want_k, *want_v), (got, *got_k, *got_v), strict=True):
        a, c = np.asarray(a, np.float32), np.asarray(c, np.float32)
        assert np.abs(c - a).max() <= 0.02 * np.abs(a).max()


def test_prefill_through_the_prompt_kernel_matches_xla(gqa):
    """A prefill of left-padded rows (slot 0) with the prompt's attention kernel in the
    interpreter against XLA's attention: layer 0's caches equal (the kernel leaves the
    RoPE and the cache update to the same XLA ops), the real rows' hidden states and
    the later caches within bf16 rounding over the 2 layers."""
    cfg, params = gqa
    sp, model, tokens, pad, cos, sin, cache = _left_padded_prompt(cfg, params, 24, 30, (0, 5, 23))
    p = tokens.shape[1]
    x = jnp.take(sp["embed"], tokens, axis=0)
    outs = {
        impl: serving.run_layers(model, sp, x, cos, sin, cache, cache, None, pad, attention=impl)
        for impl in ("xla", "interpret")
    }
    (want, want_k, want_v), (got, got_k, got_v) = outs["xla"], outs["interpret"]
    np.testing.assert_array_equal(np.asarray(got_k[0]), np.asarray(want_k[0]))
    np.testing.assert_array_equal(np.asarray(got_v[0]), np.asarray(want_v[0]))
    real = np.arange(p)[None, :] >= np.asarray(pad)[:, None]
    a, c = np.asarray(want, np.float32)[real], np.asarray(got, np.float32)[real]
    assert np.abs(c - a).max() <= 0.02 * np.abs(a).max()
    for i in range(1, cfg.n_layers):  # the real rows' slots
        for w, g in ((want_k[i], got_k[i]), (want_v[i], got_v[i])):
            w, g = np.asarray(w, np.float32)[:, :p][real], np.asarray(g, np.float32)[:, :p][real]
            assert np.abs(g - w).max() <= 0.02 * np.abs(w).max()
