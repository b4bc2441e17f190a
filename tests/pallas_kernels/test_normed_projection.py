"""normed_projection against an fp64 numpy reference: kernel, rows, errors, lowering.

Numeric tests run the kernel in the Pallas interpreter and, marked gpu, compiled on
the GPU, with the XLA backend beside them. Tolerance: the product sums bf16 inputs in
fp32 and is rounded once to bf16, so |y - truth| <= 2^-8 |truth| (half a bf16 ulp, with
room for the fp32 sums) plus 1e-3 of the largest |truth| for cancellation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.normed_projection import (
    MAX_ROWS,
    ProjectionConfig,
    fitted_config,
    normed_projection,
    reference,
)
from tests.lowering import count_triton_calls

EPS = 1e-5
IMPLS = [
    pytest.param("interpret", id="interpret"),
    pytest.param("xla", id="xla"),
    pytest.param("pallas", id="gpu", marks=pytest.mark.gpu),
]


def make_case(seed: int, m: int, h: int, f: int, row_scales=None):
    """bf16 x [M, H] (row r times row_scales[r]) and w_scaled [F, H]."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, h))
    if row_scales is not None:
        x *= np.asarray(row_scales, np.float64)[:, None]
    w = 0.05 * rng.standard_normal((f, h))
    return jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)


def truth(x, w, eps=EPS):
    """rsqrt(mean(x^2) + eps) * x w^T in fp64, from the bf16 operands."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    factor = 1 / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + eps)
    return factor * (x @ w.T)


def assert_close(got, want):
    got = np.asarray(got, np.float64)
    bound = 2**-8 * np.abs(want) + 1e-3 * np.abs(want).max()
    assert got.shape == want.shape
    assert np.all(np.abs(got - want) <= bound), np.abs(got - want).max()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_matches_reference(impl, m):
    x, w = make_case(m, m, 256, 192)
    got = normed_projection(x, w, eps=EPS, impl=impl, config=ProjectionConfig(block_k=64))
    assert got.dtype == jnp.bfloat16
    assert_close(got, truth(x, w))


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_get_their_own_factor(impl):
    """Rows of very different sizes, a zero row (factor rsqrt(eps), output 0) and a
    row of one repeated value: each row is normed by its own mean square."""
    scales = [1e-3, 1.0, 0.0, 300.0, 7.0]
    x, w = make_case(5, len(scales), 128, 64, scales)
    x = x.at[4].set(jnp.bfloat16(2.5))
    got = normed_projection(x, w, eps=EPS, impl=impl)
    assert_close(got, truth(x, w))
    assert not np.any(np.asarray(got[2], np.float32))


@pytest.mark.parametrize("impl", IMPLS)
def test_a_non_finite_row_gives_a_nan_row_only(impl):
    x, w = make_case(6, 4, 128, 64)
    x = x.at[1, 7].set(jnp.inf).at[3, 0].set(jnp.nan)
    got = np.asarray(normed_projection(x, w, eps=EPS, impl=impl), np.float32)
    assert np.all(np.isnan(got[[1, 3]]))
    keep = np.array([0, 2])
    assert_close(got[keep], truth(x[keep], w))


def test_fp32_is_the_model_norm_then_product():
    """In fp32 the op is RMSNorm (scale folded into w) then the product, to fp32
    rounding."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    scale = jnp.asarray(rng.uniform(0.5, 1.5, 64), jnp.float32)
    normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + EPS) * scale
    got = normed_projection(x, w * scale[None, :], eps=EPS)
    np.testing.assert_allclose(np.asarray(got), np.asarray(normed @ w.T), rtol=2e-5, atol=2e-5)


def test_auto_runs_xla_on_cpu_and_for_fp32_or_many_rows():
    x, w = make_case(8, MAX_ROWS + 1, 256, 128)
    want = reference(x, w, EPS)
    np.testing.assert_array_equal(np.asarray(normed_projection(x, w, eps=EPS)), np.asarray(want))


@pytest.mark.parametrize(
    "xs, ws, kwargs, message",
    [
        ((4, 64), (32, 64), {"impl": "cuda"}, "impl='cuda'"),
        ((4, 1, 64), (32, 64), {}, "must be 2-D"),
        ((4, 64), (32, 48), {}, "H=64"),
        ((0, 64), (32, 64), {}, "M=0"),
        ((4, 64), (32, 64), {"w_dtype": jnp.float32}, "must share"),
        ((4, 64), (32, 64), {"dtype": jnp.float16, "w_dtype": jnp.float16}, "must share"),
        ((MAX_ROWS + 1, 64), (32, 64), {"impl": "interpret"}, "MAX_ROWS=8"),
        ((4, 64), (32, 64), {"impl": "interpret", "dtype": jnp.float32}, "bf16 only"),
        ((4, 40), (32, 40), {"impl": "interpret"}, "H=40 is not a multiple"),
        ((4, 64), (24, 64), {"impl": "interpret"}, "F=24 is not a multiple"),
    ],
)
def test_bad_inputs_raise(xs, ws, kwargs, message):
    dtype = kwargs.pop("dtype", jnp.bfloat16)
    w_dtype = kwargs.pop("w_dtype", dtype)
    with pytest.raises(ValueError, match=message):
        normed_projection(jnp.ones(xs, dtype), jnp.ones(ws, w_dtype), eps=EPS, **kwargs)


def test_bad_launch_raises():
    x, w = make_case(9, 2, 64, 64)
    with pytest.raises(ValueError, match="block_n=48 must be a power of two"):
        normed_projection(x, w, eps=EPS, impl="interpret", config=ProjectionConfig(block_n=48))


def test_fitted_config_divides_small_shapes():
    assert fitted_config(2048, 6144) == ProjectionConfig()
    small = fitted_config(64, 96)
    assert (small.block_k, small.block_n) == (64, 32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("m", [1, 4, 6, 8])
def test_a_d_model_that_is_not_a_power_of_two(impl, m):
    """H = 768 (the 125M preset): the norm's loads come in pieces that divide H."""
    x, w = make_case(m, m, 768, 128)
    assert_close(normed_projection(x, w, eps=EPS, impl=impl), truth(x, w))


@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("h", [2048, 768])
def test_cross_lowers_for_cuda(m, h):
    """The 1.5B preset's stacked q / k / v (H 2048, 32 heads of 64), and the 125M
    preset's H 768: one kernel."""
    x = jnp.zeros((m, h), jnp.bfloat16)
    w = jnp.zeros((3 * h, h), jnp.bfloat16)
    fn = lambda x, w: normed_projection(x, w, eps=EPS, impl="pallas")
    assert count_triton_calls(fn, x, w) == 1
