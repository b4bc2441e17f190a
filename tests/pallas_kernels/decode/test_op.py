"""sparse_decode_mlp against the dense reference: capacities, fallback, dedup, stats, errors.

Tolerances: integer-valued inputs make every fp32 sum exact, so there the op must equal
`pallas_kernels.reference.gated_mlp` bit for bit (same gate GEMM, same rounding points,
the up and down GEMMs only summing fewer exact terms). Normal-valued bf16 inputs use the
project's bf16 rule (`assert_bf16_close`: the error against the fp32 truth at most 1.5x
the dense bf16 MLP's plus 1e-3 of the output's largest magnitude); fp32 inputs allow
1e-5 of the largest magnitude. Inference only: gradients are not tested.
"""

import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import reference
from pallas_kernels.decode import DEFAULT_CAPACITIES
from pallas_kernels.decode.op import resolve_capacities
from tests.pallas_kernels.twell.kernel_cases import assert_bf16_close, integer_mlp

H, N = 128, 512
SMALL_CAPS = (4, 8, 16)


def normal_mlp(seed: int, m: int, nnz: float, h: int = H, n: int = N):
    """Normal-valued bf16 (x, w_gate, w_up, w_down) with ~nnz positive gate entries per row.

    The density comes from a bias-like column: x[:, 0] = 1 and w_gate[:, 0] = -q, the
    other columns giving unit-variance pre-activations (q = Phi^-1(1 - nnz / N)).
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, h))
    x[:, 0] = 1.0
    wg = rng.standard_normal((n, h)) / np.sqrt(h - 1)
    wg[:, 0] = -statistics.NormalDist().inv_cdf(1.0 - nnz / n)
    wu, wd = (0.05 * rng.standard_normal((n, h)) for _ in range(2))
    return [jnp.asarray(a, jnp.bfloat16) for a in (x, wg, wu, wd)]


def controlled_mlp(seed: int, active: np.ndarray, h: int = 64):
    """Integer bf16 (x, w_gate, w_up, w_down) whose gate is positive exactly at `active`.

    active: bool [M, N], M < h. x[i, :M] is one-hot at i and w_gate[j, i] is 1-3 where
    neuron j fires for row i, -1 elsewhere; w_gate[:, M:] = 0, so the gate is exactly
    that column. The other columns of x and the up / down weights are small integers.
    """
    m, n = active.shape
    rng = np.random.default_rng(seed)
    x = rng.integers(-2, 3, (m, h)).astype(np.float32)
    x[:, :m] = np.eye(m)
    wg = np.zeros((n, h), np.float32)
    wg[:, :m] = np.where(active.T, rng.integers(1, 4, (n, m)), -1)
    wu = rng.integers(-2, 3, (n, h)).astype(np.float32)
    wd = rng.integers(-1, 2, (n, h)).astype(np.float32)
    return [jnp.asarray(a, jnp.bfloat16) for a in (x, wg, wu, wd)]


def first_k_active(m: int, n: int, k: int) -> np.ndarray:
    """Neurons 0..k-1 fire, each for one row (round robin): K = k, no row sharing."""
    active = np.zeros((m, n), bool)
    for j in range(k):
        active[j % m, j] = True
    return active


def run(x, wg, wu, wd, **kw):
    return pk.sparse_decode_mlp(x, wg, wu, wd, return_stats=True, **kw)


def assert_exact(out, x, wg, wu, wd):
    want = reference.gated_mlp(x, wg, wu, wd)
    assert out.dtype == want.dtype and out.shape == want.shape
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


def expected_stats(x, wg, caps):
    """(K, capacity) the op should report, from the dense reference's gate."""
    gate = np.asarray(reference.hidden(x, wg), np.float32) > 0
    k = int(gate.any(axis=0).sum())
    cap = next((c for c in caps if c >= k), -1)
    return k, cap, float(gate.sum()) / x.shape[0]


@pytest.mark.parametrize("m", [1, 3, 8, 64])
def test_random_sparse_inputs_match_dense(m):
    """Normal-valued bf16 inputs, ~4 positives per row; K grows with M (64 -> 256 bucket)."""
    x, wg, wu, wd = normal_mlp(m, m, 4.0)
    out, stats = run(x, wg, wu, wd)
    assert out.shape == (m, H) and out.dtype == jnp.bfloat16
    assert_bf16_close(out, x, (wg, wu, wd), gated=True)
    k, cap, l0 = expected_stats(x, wg, resolve_capacities(DEFAULT_CAPACITIES, N))
    assert int(stats.active_neurons) == k and int(stats.capacity) == cap
    assert int(stats.dense_fallback) == 0 and float(stats.l0) == pytest.approx(l0)


def test_integer_inputs_are_bitwise_dense():
    x, wg, wu, wd = integer_mlp(0, 8, H, N, 40.0)
    out, stats = run(x, wg, wu, wd)
    assert 0 < int(stats.active_neurons) <= 256 and int(stats.dense_fallback) == 0
    assert_exact(out, x, wg, wu, wd)


def test_fp32_inputs():
    x, wg, wu, wd = (a.astype(jnp.float32) for a in normal_mlp(9, 3, 4.0))
    out, stats = run(x, wg, wu, wd)
    want = np.asarray(reference.gated_mlp(x, wg, wu, wd))
    assert out.dtype == jnp.float32 and int(stats.dense_fallback) == 0
    np.testing.assert_allclose(np.asarray(out), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_all_neurons_dead_gives_exact_zeros():
    x, wg, wu, wd = controlled_mlp(1, np.zeros((4, N), bool))
    out, stats = run(x, wg, wu, wd)
    np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)
    assert int(stats.active_neurons) == 0 and int(stats.capacity) == 64
    assert float(stats.l0) == 0.0


def test_one_neuron_always_on():
    """Every row fires neuron 17 only: 8 row entries, K = 1 (dedup)."""
    active = np.zeros((8, N), bool)
    active[:, 17] = True
    x, wg, wu, wd = controlled_mlp(2, active)
    out, stats = run(x, wg, wu, wd)
    assert int(stats.active_neurons) == 1 and float(stats.l0) == 1.0
    assert np.all(np.asarray(out, np.float32).any(axis=1))  # every row gets neuron 17
    assert_exact(out, x, wg, wu, wd)


@pytest.mark.parametrize(
    ("k", "capacity"),
    [(8, 8), (9, 16), (16, 16), (17, -1), (60, -1)],
    ids=["at_8", "past_8", "at_largest", "past_largest", "far_past"],
)
def test_capacity_buckets_and_dense_fallback(k, capacity):
    x, wg, wu, wd = controlled_mlp(3, first_k_active(4, 64, k))
    out, stats = run(x, wg, wu, wd, capacities=SMALL_CAPS)
    assert int(stats.active_neurons) == k and int(stats.capacity) == capacity
    assert int(stats.dense_fallback) == int(capacity == -1)
    assert_exact(out, x, wg, wu, wd)


def test_rows_sharing_neurons_are_gathered_once():
    """4 rows each fire 6 of the same 8 neurons: 24 row entries, K = 8, capacity 8."""
    rng = np.random.default_rng(4)
    active = np.zeros((4, 64), bool)
    pool = np.arange(20, 28)
    for row in active:
        row[rng.choice(pool, 6, replace=False)] = True
    x, wg, wu, wd = controlled_mlp(4, active)
    out, stats = run(x, wg, wu, wd, capacities=SMALL_CAPS)
    assert float(stats.l0) == 6.0
    assert int(stats.active_neurons) == 8 and int(stats.capacity) == 8
    assert_exact(out, x, wg, wu, wd)


def test_nonfinite_x_runs_dense_and_propagates():
    x, wg, wu, wd = controlled_mlp(5, first_k_active(3, 64, 5))
    x = x.at[1, 40].set(jnp.nan)
    out, stats = run(x, wg, wu, wd, capacities=SMALL_CAPS)
    assert int(stats.dense_fallback) == 1 and int(stats.capacity) == -1
    assert np.isnan(np.asarray(out[1], np.float32)).all()
    assert_exact(out, x, wg, wu, wd)  # NaNs in the same places, the other rows exact


def test_leading_axes_jit_and_empty_batch():
    x, wg, wu, wd = normal_mlp(6, 6, 4.0)
    op = jax.jit(pk.sparse_decode_mlp, static_argnames=("capacities", "return_stats"))
    out3, stats = op(x.reshape(2, 3, H), wg, wu, wd, capacities=(32, 64), return_stats=True)
    assert out3.shape == (2, 3, H)
    eager = pk.sparse_decode_mlp(x, wg, wu, wd, capacities=(32, 64))
    np.testing.assert_array_equal(
        np.asarray(out3.reshape(6, H), np.float32), np.asarray(eager, np.float32)
    )
    assert int(stats.capacity) in (32, 64)
    out0, stats0 = run(jnp.zeros((0, H), jnp.bfloat16), wg, wu, wd)
    assert out0.shape == (0, H) and int(stats0.active_neurons) == 0


def test_resolve_capacities_sorts_dedups_and_drops_those_past_n():
    assert resolve_capacities((128, 4, 64, 4, 16), 64) == (4, 16)
    assert resolve_capacities((64,), 64) == ()


def test_no_capacity_below_n_always_runs_dense():
    x, wg, wu, wd = controlled_mlp(7, first_k_active(2, 64, 3))
    out, stats = run(x, wg, wu, wd, capacities=(64, 128))
    assert int(stats.dense_fallback) == 1 and int(stats.active_neurons) == 3
    assert_exact(out, x, wg, wu, wd)


X = jnp.zeros((4, 64), jnp.bfloat16)
W = jnp.zeros((256, 64), jnp.bfloat16)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((X.astype(jnp.float16), W, W, W), {}, "x must be bfloat16 or float32, got float16"),
        ((X[0, 0], W, W, W), {}, r"x must be \[\.\.\., H\]"),
        ((X, W.astype(jnp.float32), W, W), {}, "w_gate must have x's dtype bfloat16"),
        ((X, W, W, W.astype(jnp.float32)), {}, "w_down must have x's dtype"),
        ((X, W, W[:, :32], W), {}, r"w_up must be \[N, H\] = \[256, 64\]"),
        ((X, W, W, W[:128]), {}, r"w_down must be \[N, H\]"),
        ((X[:, :32], W, W, W), {}, r"w_gate must be \[N, H\] = \[256, 32\]"),
        ((X, W[0], W, W), {}, r"w_gate must be an \[N, H\] matrix, got shape \(64,\)"),
        ((X, W, W[None], W), {}, r"w_up must be an \[N, H\] matrix"),
        ((X, W, W, W), {"capacities": ()}, "capacities must be a non-empty"),
        ((X, W, W, W), {"capacities": (8, 0)}, "positive ints"),
        ((X, W, W, W), {"capacities": (8.0,)}, "positive ints"),
    ],
)
def test_bad_inputs_raise(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        pk.sparse_decode_mlp(*args, **kwargs)


def test_exported_with_the_other_ops():
    assert pk.sparse_decode_mlp is pk.decode.sparse_decode_mlp
    assert {"sparse_decode_mlp", "DecodeStats", "twell_gated_mlp"} <= set(pk.__all__)
