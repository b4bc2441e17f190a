"""normed_projection and residual_projection against fp64 numpy references: kernel,
rows, partial sums of squares, errors, lowering.

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
    RESIDUAL_BLOCK_N,
    ProjectionConfig,
    fitted_config,
    normed_projection,
    reference,
    residual_projection,
    residual_reference,
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


@pytest.mark.parametrize("m", [1, 8])
def test_cross_lowers_for_cuda(m):
    """The 1.5B preset's stacked q / k / v (H 2048, 32 heads of 64): one kernel."""
    x = jnp.zeros((m, 2048), jnp.bfloat16)
    w = jnp.zeros((3 * 2048, 2048), jnp.bfloat16)
    fn = lambda x, w: normed_projection(x, w, eps=EPS, impl="pallas")
    assert count_triton_calls(fn, x, w) == 1


def residual_case(seed: int, m: int, k: int, f: int):
    """bf16 o [M, K], w [F, K] and a residual [M, F] about as large as o w^T."""
    o, w = make_case(seed, m, k, f)
    rng = np.random.default_rng(seed + 100)
    residual = jnp.asarray(rng.standard_normal((m, f)), jnp.bfloat16)
    return o, w, residual


def assert_residual_close(got, o, w, residual):
    """Within the bf16 rule: the product rounded (half an ulp), then the sum rounded."""
    prod = np.asarray(o, np.float64) @ np.asarray(w, np.float64).T
    want = np.asarray(residual, np.float64) + prod
    got = np.asarray(got, np.float64)
    bound = 2**-8 * (np.abs(want) + np.abs(prod)) + 1e-3 * np.abs(want).max()
    assert got.shape == want.shape
    assert np.all(np.abs(got - want) <= bound), np.abs(got - want).max()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_residual_projection_and_its_sums_of_squares(impl, m):
    """y = residual + o w^T, and partial sums of squares of y's rows whose sum is the
    row's sum of squares of y as returned (in fp32)."""
    o, w, residual = residual_case(20 + m, m, 256, 128)
    y, sumsq = residual_projection(o, w, residual, impl=impl, return_sumsq=True)
    assert y.dtype == jnp.bfloat16 and sumsq.dtype == jnp.float32
    assert_residual_close(y, o, w, residual)
    if impl != "xla":
        assert sumsq.shape == (128 // RESIDUAL_BLOCK_N, m)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(residual_reference(o, w, residual)))
    y32 = np.asarray(y, np.float64)
    np.testing.assert_allclose(np.asarray(sumsq).sum(axis=0), (y32 * y32).sum(axis=1), rtol=1e-5)
    alone = residual_projection(o, w, residual, impl=impl)
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(y))


@pytest.mark.parametrize("impl", IMPLS)
def test_residual_projection_non_finite_rows_stay_in_their_row(impl):
    o, w, residual = residual_case(30, 4, 128, 64)
    o = o.at[1, 3].set(jnp.nan)
    residual = residual.at[2, 0].set(jnp.inf)
    y, sumsq = residual_projection(o, w, residual, impl=impl, return_sumsq=True)
    y, total = np.asarray(y, np.float32), np.asarray(sumsq).sum(axis=0)
    assert np.isnan(y[1]).all() and np.isinf(y[2, 0]) and np.isinf(total[2])
    keep = np.array([0, 3])
    assert np.isfinite(y[keep]).all() and np.isfinite(total[keep]).all()
    assert_residual_close(y[keep], o[keep], w, residual[keep])


def test_residual_projection_fp32_is_the_model_add():
    rng = np.random.default_rng(8)
    o, w, r = (
        jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((3, 64), (32, 64), (3, 32))
    )
    got = residual_projection(o, w, r)
    np.testing.assert_allclose(np.asarray(got), np.asarray(r + o @ w.T), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    "rs, kwargs, message",
    [
        ((4, 48), {}, "residual \\(4, 48\\)"),
        ((4, 32), {"r_dtype": jnp.float32}, "in x's dtype"),
        ((4, 32), {"impl": "pallas_triton"}, "impl="),
        ((MAX_ROWS + 1, 32), {"impl": "interpret", "m": MAX_ROWS + 1}, "MAX_ROWS=8"),
    ],
)
def test_residual_projection_bad_inputs_raise(rs, kwargs, message):
    r_dtype = kwargs.pop("r_dtype", jnp.bfloat16)
    m = kwargs.pop("m", 4)
    o, w = jnp.ones((m, 64), jnp.bfloat16), jnp.ones((32, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=message):
        residual_projection(o, w, jnp.ones(rs, r_dtype), **kwargs)


@pytest.mark.parametrize("m", [1, 8])
def test_residual_projection_cross_lowers_for_cuda(m):
    """The 1.5B preset's W_o ([H, nH D] = [2048, 2048]): one kernel."""
    o = jnp.zeros((m, 2048), jnp.bfloat16)
    w = jnp.zeros((2048, 2048), jnp.bfloat16)
    fn = lambda o, w, r: residual_projection(o, w, r, impl="pallas", return_sumsq=True)
    assert count_triton_calls(fn, o, w, o) == 1


def partial_sumsq(x, parts: int = 4):
    """fp32 [parts, M]: the sums of squares of x's rows over `parts` column blocks."""
    x32 = np.asarray(x, np.float32)
    return jnp.asarray(np.stack([np.sum(c * c, axis=1) for c in np.split(x32, parts, axis=1)]))


@pytest.mark.parametrize("impl", IMPLS)
def test_factors_from_partial_sums_of_squares(impl):
    """Given x's rows' sums of squares in partials, the kernel reads those instead of
    x: the same result within rounding; sums four times too large halve the rows
    (the xla backend recomputes them from x and does not change)."""
    x, w = make_case(40, 5, 256, 128, [1.0, 0.0, 30.0, 1e-2, 3.0])
    y = normed_projection(x, w, eps=EPS, impl=impl, sumsq=partial_sumsq(x))
    assert_close(y, truth(x, w))
    wrong = normed_projection(x, w, eps=EPS, impl=impl, sumsq=4 * partial_sumsq(x))
    if impl == "xla":
        np.testing.assert_array_equal(np.asarray(wrong), np.asarray(y))
    else:  # eps is negligible beside the mean square of rows 0, 2 and 4
        rows = np.array([0, 2, 4])
        assert_close(2 * np.asarray(wrong, np.float64)[rows], truth(x, w)[rows])


@pytest.mark.parametrize(
    "sumsq, message",
    [(jnp.ones((4, 3), jnp.float32), "M=2"), (jnp.ones((4, 2), jnp.bfloat16), "float32")],
)
def test_bad_sumsq_raises(sumsq, message):
    x, w = jnp.ones((2, 64), jnp.bfloat16), jnp.ones((32, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=message):
        normed_projection(x, w, eps=EPS, sumsq=sumsq)


def test_normed_projection_with_sums_cross_lowers_for_cuda():
    x = jnp.zeros((1, 2048), jnp.bfloat16)
    w = jnp.zeros((3 * 2048, 2048), jnp.bfloat16)
    ss = jnp.ones((32, 1), jnp.float32)
    fn = lambda x, w, ss: normed_projection(x, w, eps=EPS, impl="pallas", sumsq=ss)
    assert count_triton_calls(fn, x, w, ss) == 1
