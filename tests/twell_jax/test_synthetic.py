"""Synthetic activation patterns: the mean l0 lands on its target for every pattern,
and each pattern has the shape it claims (hot and dead neurons, heavy rows)."""

import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax.synthetic import PATTERNS, gate_pattern, synthetic_mlp

M, H, N, NNZ = 4096, 256, 2048, 20


def _positives(pattern, sigma):
    x, wg, _, _ = synthetic_mlp(M, H, N, NNZ, pattern=pattern, sigma=sigma)
    u = jnp.einsum("mh,nh->mn", x, wg, preferred_element_type=jnp.float32)
    return np.asarray(u > 0)


@pytest.mark.parametrize("pattern, sigma", [("uniform", 1.0), ("skew", 1.0), ("heavy_rows", 0.35)])
def test_mean_l0_on_target(pattern, sigma):
    pos = _positives(pattern, sigma)
    assert pos.sum(1).mean() == pytest.approx(NNZ, rel=0.15)


def test_skew_has_hot_and_dead_neurons_and_uniform_does_not():
    for pattern, top_share, dead in (
        ("uniform", (0.09, 0.2), (0, 0.01)),
        ("skew", (0.6, 1), (0.1, 0.7)),
    ):
        col = np.sort(_positives(pattern, 1.0).sum(0))[::-1]
        share = col[: N // 10].sum() / col.sum()  # the top 10% of neurons' share
        assert top_share[0] < share < top_share[1], pattern
        assert dead[0] <= np.mean(col == 0) < dead[1], pattern


def test_heavy_rows_have_a_heavy_tail():
    rows = _positives("heavy_rows", 0.35).sum(1)
    uniform = _positives("uniform", 1.0).sum(1)
    assert np.percentile(rows, 99) > 5 * rows.mean()
    assert np.percentile(uniform, 99) < 2 * uniform.mean()


def test_bad_pattern_raises():
    with pytest.raises(ValueError, match="pattern must be one of"):
        gate_pattern("hot", 8, 256, 4)
    with pytest.raises(ValueError, match="sigma must be >= 0"):
        gate_pattern("skew", 8, 256, 4, sigma=-1.0)
    assert set(PATTERNS) == {"uniform", "skew", "heavy_rows"}
