"""Grouped-query attention, per-row RoPE positions and token-id checks (twell_jax.model)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.twell_jax.test_model import forward_fn, init_params, small_model, tokens
from twell_jax import config as C
from twell_jax import config_io
from twell_jax import model as M


@pytest.mark.parametrize("bad", [0, -2, 3])
def test_n_kv_heads_must_divide_n_heads(bad):
    with pytest.raises(ValueError, match=rf"n_kv_heads={bad}: must be None or a positive divisor"):
        small_model(n_kv_heads=bad)


def test_default_kv_heads_keep_the_parameter_tree_and_outputs():
    mha = small_model()
    explicit = small_model(n_kv_heads=mha.n_heads)
    assert mha.kv_heads == explicit.kv_heads == mha.n_heads
    a, b = init_params(mha), init_params(explicit)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    t = tokens(mha)
    np.testing.assert_array_equal(forward_fn(mha)(a, t)[0], forward_fn(explicit)(b, t)[0])


def test_gqa_equals_mha_with_repeated_key_value_heads():
    gqa = small_model(n_heads=4, n_kv_heads=2, dtype="float32")
    params = init_params(gqa)
    attn = params["blocks"]["attn"]
    assert attn["wk"].shape == attn["wv"].shape == (gqa.n_layers, gqa.d_model, 2, gqa.head_dim)
    assert attn["wq"].shape == (gqa.n_layers, gqa.d_model, 4, gqa.head_dim)
    # Query head h reads key / value head h // 2 (HF repeat_kv order).
    mha = dataclasses.replace(gqa, n_kv_heads=None)
    repeated = jax.tree.map(lambda x: x, params)
    for name in ("wk", "wv"):
        repeated["blocks"]["attn"][name] = jnp.repeat(attn[name], 2, axis=2)
    t = tokens(gqa)
    want = forward_fn(mha)(repeated, t)[0]
    got = forward_fn(gqa)(params, t)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_saved_configs_without_n_kv_heads_still_match():
    cfg = C.train_preset("tiny")
    saved = config_io.config_to_dict(cfg)
    del saved["model"]["n_kv_heads"]
    assert config_io.config_diff(saved, cfg) == {}
    assert config_io.train_config_from_dict(saved) == cfg
    gqa = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_kv_heads=2))
    assert config_io.config_diff(saved, gqa) == {"model.n_kv_heads": (None, 2)}


def test_per_row_rope_positions_match_shared_tables():
    cos, sin = M.rope_tables(8, 16, 1e4)
    pos = jnp.stack([jnp.arange(8), jnp.arange(8) + 3])
    rcos, rsin = M.rope_angles(pos, 16, 1e4)
    assert rcos.shape == (2, 8, 8)
    x = jax.random.normal(jax.random.key(0), (2, 8, 2, 16))
    shared = M.apply_rope(x, cos, sin)
    np.testing.assert_array_equal(M.apply_rope(x, rcos, rsin)[0], shared[0])
    shifted = M.apply_rope(x[1:, :5], cos[3:], sin[3:])
    np.testing.assert_array_equal(M.apply_rope(x, rcos, rsin)[1:, :5], shifted)


@pytest.mark.parametrize("bad_id", [-1, 256, 1000])
def test_out_of_range_token_ids_are_named(bad_id):
    cfg = small_model()
    model = M.Transformer(cfg, rngs=nnx.Rngs(0))
    t = np.zeros((2, 4), np.int32)
    t[1, 2] = bad_id
    with pytest.raises(ValueError, match=rf"tokens\[1, 2\] = {bad_id} is not a token id"):
        model(t)
    with pytest.raises(ValueError, match=r"tokens\[1, 2\]"):
        model.ffn_inputs(t)


@pytest.mark.gpu
def test_gqa_with_cudnn_attention_on_gpu():
    """cuDNN flash attention groups the key / value heads like XLA (run with -m gpu)."""
    gqa = small_model(d_model=256, d_ff=1024, n_heads=4, n_kv_heads=2, seq_len=256)
    assert M.attention_implementation(gqa.compute_dtype, gqa.head_dim) == "cudnn"
    params = init_params(gqa)
    repeated = jax.tree.map(lambda x: x, params)
    for name in ("wk", "wv"):
        repeated["blocks"]["attn"][name] = jnp.repeat(params["blocks"]["attn"][name], 2, axis=2)
    t = tokens(gqa, batch=4)
    want = forward_fn(dataclasses.replace(gqa, n_kv_heads=None))(repeated, t)[0]
    got = forward_fn(gqa)(params, t)[0]
    assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) < 1e-2
