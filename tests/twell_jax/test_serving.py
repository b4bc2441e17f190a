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


@pytest.fixture(scope="module")
def gqa():
    """fp32 masters, bf16 compute, 4 query heads on 2 key / value heads."""
    cfg = small_model(n_kv_heads=2, dtype="bfloat16", init_std=0.2)
    return cfg, init_params(cfg, seed=3)


def test_layout_stacks_qkv_with_h_last_and_casts_matrices_only(gqa):
    cfg, params = gqa
    sp = serving.serving_params(params, cfg)
    h, n, kv, d = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    assert len(sp["blocks"]) == len(sp["attention"]) == cfg.n_layers
    for i, att in enumerate(sp["attention"]):
        assert att["wqkv"].shape == ((n + 2 * kv) * d, h) and att["wo"].shape == (h, n * d)
        assert att["wqkv"].dtype == att["wo"].dtype == jnp.bfloat16
        src = params["blocks"]["attn"]
        # rows: the q heads, then the k heads, then the v heads, each head's D columns
        want_k = src["wk"][i].astype(jnp.bfloat16).reshape(h, kv * d).T
        np.testing.assert_array_equal(att["wqkv"][n * d : (n + kv) * d], want_k)
        want_o = src["wo"][i].astype(jnp.bfloat16).reshape(n * d, h).T
        np.testing.assert_array_equal(att["wo"], want_o)
        block = sp["blocks"][i]
        assert block["ffn"]["w_up"].dtype == jnp.bfloat16
        assert block["attn_norm"]["scale"].dtype == jnp.float32  # vectors stay fp32
        assert all(w.size == 0 for w in block["attn"].values())  # placeholders
    assert sp["embed"].dtype == jnp.bfloat16
    assert sp["final_norm"]["scale"].dtype == jnp.float32
    assert serving.serving_params(sp, cfg) is sp  # already in the layout


def test_run_layers_is_the_model_forward_in_fp32():
    """With no cache history (slot 0, causal mask over the prompt), the layer stack is
    the model's body, to fp32 rounding."""
    cfg = small_model(n_kv_heads=2, dtype="float32", init_std=0.2)
    params = init_params(cfg, seed=4)
    tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, cfg.vocab_size)
    want = nnx.merge(model_graphdef(cfg), params).body(tokens)

    sp = serving.serving_params(params, cfg)
    model = serving.merge_model(model_graphdef(cfg), sp)
    b, s = tokens.shape
    cos, sin = M.rope_tables(s, cfg.head_dim, cfg.rope_theta)
    cache = jnp.zeros((cfg.n_layers, b, s, cfg.kv_heads, cfg.head_dim), jnp.float32)
    mask = jnp.tril(jnp.ones((s, s), bool))[None, None]
    x = jnp.take(sp["embed"], tokens, axis=0)
    got, cache_k, _ = serving.run_layers(model, sp, x, cos, sin, cache, cache, 0, mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(cache_k).sum()) > 0  # the keys were written
