"""L1 term, l0 / alive statistics and dead-neuron handling against hand computations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax import sparsity as S
from twell_jax.config import ModelConfig, SparsityConfig

# 2 tokens x 4 neurons. Row sums of |h|: 3 and 3.5; non-zeros: 2 and 2.
H = jnp.array([[1.0, -2.0, 0.0, 0.0], [0.0, 3.0, 0.0, 0.5]], jnp.bfloat16)


def test_hidden_stats_by_hand():
    stats = S.hidden_stats(H)
    assert float(stats["l1"]) == pytest.approx((3.0 + 3.5) / 2)
    assert float(stats["l0"]) == pytest.approx(2.0)
    np.testing.assert_array_equal(stats["fired"], [True, True, False, True])
    assert stats["l1"].dtype == stats["l0"].dtype == jnp.float32
    assert float(S.sparsity_fraction(stats["l0"], 4)) == pytest.approx(0.5)


def test_l1_gradient_is_sign_over_tokens():
    """d l1 / d h = sign(h) / M on the non-zeros, the sparse backward's term (docs/design.md §6.2).

    (At h == 0 the subgradient does not matter: h = relu(.) * (.) passes nothing back
    through a zero ReLU.)
    """
    h = np.asarray(H, np.float32)
    grad = jax.grad(lambda h: S.hidden_stats(h)["l1"])(jnp.asarray(h))
    np.testing.assert_allclose(np.asarray(grad)[h != 0], np.sign(h[h != 0]) / 2)


def test_l1_penalty_and_warmup():
    layer_l1 = jnp.array([1.0, 3.0])  # mean over layers = 2
    cfg = SparsityConfig(l1_coef=1e-2)
    assert float(S.l1_penalty(layer_l1, {}, 0, cfg)) == pytest.approx(2e-2)
    warm = SparsityConfig(l1_coef=1e-2, l1_warmup_steps=10)
    assert float(S.l1_coef_at(0, warm)) == 0.0
    assert float(S.l1_coef_at(5, warm)) == pytest.approx(5e-3)
    assert float(S.l1_coef_at(50, warm)) == pytest.approx(1e-2)
    assert float(S.l1_penalty(layer_l1, {}, 5, warm)) == pytest.approx(1e-2)


def test_weight_l1_penalty():
    # 2 layers, N=2, H=1: per-layer sums of |W| over three matrices: 6 and 12.
    ones = jnp.ones((2, 2, 1))
    ffn = {"w_gate": ones * jnp.array([1.0, 2.0])[:, None, None], "w_up": -ones, "w_down": ones}
    params = {"blocks": {"ffn": ffn}}
    cfg = SparsityConfig(l1_coef=0.5, l1_target="weights")
    # Layer 0: 2*1 + 2 + 2 = 6; layer 1: 2*2 + 2 + 2 = 8; mean 7; times 0.5.
    assert float(S.l1_penalty(jnp.zeros(2), params, 0, cfg)) == pytest.approx(3.5)


def test_dead_neuron_tracking_sequence():
    fired_seq = [
        [[True, False, False]],
        [[False, False, False]],
        [[False, True, False]],
    ]
    tsf = S.init_tokens_since_fired(1, 3)
    history = []
    for fired in fired_seq:
        tsf = S.update_tokens_since_fired(tsf, jnp.array(fired), n_tokens=10)
        history.append(np.asarray(tsf).tolist())
    assert history == [[[0, 10, 10]], [[10, 20, 20]], [[20, 0, 30]]]
    # Alive = fired within the last 20 tokens (strictly fewer than 20 since).
    np.testing.assert_allclose(S.alive_fraction(tsf, 20), [1 / 3])
    np.testing.assert_allclose(S.alive_fraction(tsf, 21), [2 / 3])
    assert tsf.dtype == jnp.int32


def test_tokens_since_fired_saturates():
    near_max = jnp.full((1, 2), jnp.iinfo(jnp.int32).max - 5, jnp.int32)
    tsf = S.update_tokens_since_fired(near_max, jnp.array([[False, True]]), n_tokens=1000)
    assert np.asarray(tsf).tolist() == [[jnp.iinfo(jnp.int32).max, 0]]


@pytest.mark.parametrize("variant", ["gated_relu", "relu"])
def test_reinit_changes_only_dead_gating_rows(variant):
    cfg = ModelConfig(ffn_variant=variant, n_layers=2, d_ff=4, d_model=8, n_heads=2)
    names = ("w_gate", "w_up", "w_down") if cfg.gated else ("w_up", "w_down")
    keys = jax.random.split(jax.random.key(0), len(names))
    ffn = {n: jax.random.normal(k, (2, 4, 8)) for n, k in zip(names, keys, strict=True)}
    params = {"blocks": {"ffn": ffn, "attn_norm": {"scale": jnp.ones((2, 8))}}, "embed": 1.0}
    tsf = jnp.array([[0, 50, 100, 99], [100, 0, 0, 7]], jnp.int32)
    dead = np.asarray(tsf) >= 100

    new, new_tsf = S.reinit_dead_rows(params, tsf, jax.random.key(1), cfg, 100)

    target = "w_gate" if cfg.gated else "w_up"
    for name in names:
        changed = np.any(np.asarray(new["blocks"]["ffn"][name] != ffn[name]), axis=-1)
        np.testing.assert_array_equal(changed, dead if name == target else np.zeros_like(dead))
    fresh = np.asarray(new["blocks"]["ffn"][target])[dead]
    assert 0.0 < fresh.std() < 5 * cfg.init_std
    np.testing.assert_array_equal(new_tsf, np.where(dead, 0, tsf))
    assert new["embed"] == 1.0 and new["blocks"]["attn_norm"] is params["blocks"]["attn_norm"]


def test_sparse_switch_rechecks_every_k_steps():
    cfg = SparsityConfig(sparse_l0_cutoff=50.0, sparse_recheck_every=20)
    l0 = jnp.array([10.0, 50.0, 80.0])
    zero = jnp.zeros(3)
    use = jnp.array([False, True, True])
    switch = lambda step: S.next_use_sparse(step, l0, zero, zero, use, cfg)
    np.testing.assert_array_equal(switch(0), [True, False, False])
    np.testing.assert_array_equal(switch(40), [True, False, False])
    np.testing.assert_array_equal(switch(7), use)


def test_cutoff_moves_with_the_hot_share_between_its_calibrated_shares():
    cfg = SparsityConfig(sparse_l0_cutoff=57.0, sparse_hot_shift=(0.2, 0.0, 0.6, 2.0, 0.8, 10.0))
    hot = jnp.array([0.0, 0.2, 0.4, 0.6, 0.7, 0.8, 1.0])
    want = [57.0, 57.0, 58.0, 59.0, 63.0, 67.0, 67.0]  # linear between knots, held at the ends
    np.testing.assert_allclose(S.l0_cutoff(hot, cfg), want, rtol=1e-6)


def test_a_saved_three_value_hot_shift_reads_as_two_knots():
    old = SparsityConfig(sparse_l0_cutoff=57.0, sparse_hot_shift=(0.2, 0.8, 8.0))
    assert old.sparse_hot_shift == (0.2, 0.0, 0.8, 8.0)
    np.testing.assert_allclose(S.l0_cutoff(jnp.array([0.5]), old), [61.0], rtol=1e-6)


def test_switch_reads_the_hot_share_and_guards_the_tail():
    cfg = SparsityConfig(sparse_l0_cutoff=57.0, sparse_hot_shift=(0.0, 0.0, 0.8, 8.0))
    # l0 60 runs sparse only when skewed; l0 30 runs dense once its heavy rows
    # overflow the sparse op's dense tail (load above 1: the op would fall back).
    l0 = jnp.array([60.0, 60.0, 30.0, 30.0, 30.0])
    hot = jnp.array([0.0, 0.8, 0.0, 0.0, 0.0])
    tail = jnp.array([0.0, 0.0, 0.5, 1.0, 1.01])
    got = S.next_use_sparse(0, l0, hot, tail, jnp.zeros(5, bool), cfg)
    np.testing.assert_array_equal(got, [False, True, True, True, False])


@pytest.mark.parametrize(
    "knots",
    [
        (0.5, 0.0, 0.5, 3.0),  # shares not ascending
        (0.5, 0.0, 0.2, 3.0),
        (-0.1, 0.0, 0.2, 3.0),  # outside [0, 1]
        (0.0, 0.0, 1.5, 3.0),
        (0.5, 0.5, 3.0),  # the earlier (low, high, shift) with low = high
        (0.0, 0.0, 0.5, 3.0, 0.9),  # not pairs
        (0.0, 0.0, 0.5, float("nan")),
        (),
    ],
)
def test_hot_shift_knots_must_be_ordered_pairs(knots):
    with pytest.raises(ValueError, match="sparse_hot_shift"):
        SparsityConfig(sparse_hot_shift=knots)
