"""Neuron profile: counts against numpy, and the shares on constructed patterns."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from twell_jax import neuron_profile
from twell_jax.config import model_preset
from twell_jax.model import Transformer


def test_gate_positives_match_numpy():
    k = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(k[0], (2, 64, 32), jnp.float32)
    w = jax.random.normal(k[1], (2, 48, 32), jnp.float32)
    per_neuron, per_token = neuron_profile.gate_positives(x, w)
    pos = np.einsum("lmh,lnh->lmn", np.asarray(x), np.asarray(w)) > 0
    np.testing.assert_array_equal(per_neuron, pos.sum(1))
    np.testing.assert_array_equal(per_token, pos.sum(2))


def test_profile_shares():
    n, m = 200, 1000
    uniform = np.full((n,), 10)
    hot = np.zeros((n,), int)
    hot[:2], hot[2:20] = 400, 5  # 2 neurons of 200 (1%) hold 800 of 890 positives
    rows = np.full((m,), 2)
    rows[7] = 150
    rec_u, rec_h = neuron_profile.profile(np.stack([uniform, hot]), np.stack([rows, rows]))
    assert rec_u["top1_share"] == pytest.approx(0.01) and rec_u["dead_share"] == 0.0
    assert rec_u["top10_share"] == pytest.approx(0.10)
    assert rec_h["top1_share"] == pytest.approx(800 / 890)
    assert rec_h["dead_share"] == pytest.approx(0.9) and rec_h["hottest_rate"] == 0.4
    assert rec_h["l0_max"] == 150 and rec_h["l0"] == pytest.approx((2 * 999 + 150) / m)
    assert neuron_profile.table([rec_u, rec_h]).count("\n") == 3


def test_ffn_inputs_feed_the_model_ffn():
    """The captured inputs are what the FFN of each layer sees in the forward."""
    cfg = model_preset("tiny", ffn_impl="dense", remat=False)
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, cfg.vocab_size)
    ffn_in = model.ffn_inputs(tokens)
    assert ffn_in.shape == (cfg.n_layers, 32, cfg.d_model)
    params = nnx.to_pure_dict(nnx.state(model))
    w_gate = params["blocks"]["ffn"]["w_gate"]
    per_neuron, per_token = neuron_profile.gate_positives(ffn_in, w_gate)
    assert int(per_neuron.sum()) == int(per_token.sum())
    _, stats = model(tokens)
    # the model's own l0 per layer, from the same inputs
    np.testing.assert_allclose(np.asarray(per_token).mean(1), stats["l0"], rtol=1e-5)
