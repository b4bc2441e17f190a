"""sparse_decode_ffn_block (x + MLP(RMSNorm(x)), the norm's scale folded into the
weights) against an fp32 truth and the unfused path: both firing phases, rows,
fallback, errors, lowering.

Tolerance, the bf16 rule of the op's tests: the error against the fp32 truth (the
norm, the MLP and the residual add in fp32 from the same bf16 inputs) at most 1.5x
that of the model's bf16 path (normed x rounded, the dense bf16 MLP, the add) plus
1e-3 of the largest output. The down weights are scaled so that the MLP's output is
as large as x, so that the residual does not hide the MLP's errors.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import reference
from pallas_kernels.decode import DecodeConfig
from pallas_kernels.decode import reference as decode_reference
from tests.lowering import count_triton_calls
from tests.pallas_kernels.decode.test_op import SMALL, SMALL_GROUPS, TILES, H, N, normal_mlp

EPS = 1e-5
IMPLS = [
    pytest.param(("interpret", SMALL), id="interpret_row_products"),
    pytest.param(("interpret", SMALL_GROUPS), id="interpret_groups"),
    pytest.param(("interpret", TILES), id="interpret_tiles"),
    pytest.param(("xla", SMALL), id="xla"),
    pytest.param(("pallas", SMALL), id="gpu_row_products", marks=pytest.mark.gpu),
    pytest.param(("pallas", TILES), id="gpu_tiles", marks=pytest.mark.gpu),
]


def block_case(seed: int, m: int, nnz: float, x_scale: float = 3.0):
    """bf16 (x, w_gate, w_up, w_down, scale): x far from unit RMS (so the norm matters),
    a random norm scale, ~nnz firing neurons per row, MLP outputs about as large as x."""
    x, wg, wu, wd = normal_mlp(seed, m, nnz)
    rng = np.random.default_rng(seed + 1)
    scale = rng.uniform(0.5, 1.5, H)
    scale[0] = 1.0  # x's bias-like column (`normal_mlp`) normed to ~1 keeps ~nnz firing
    scale = jnp.asarray(scale, jnp.float32)
    x = (x.astype(jnp.float32) * x_scale).astype(jnp.bfloat16)
    out = model_block(x, wg, wu, wd, scale, jnp.float32) - x.astype(jnp.float32)
    gain = float(jnp.max(jnp.abs(x.astype(jnp.float32)))) / max(float(jnp.max(jnp.abs(out))), 1e-6)
    wd = (wd.astype(jnp.float32) * gain).astype(jnp.bfloat16)
    return x, wg, wu, wd, scale


def fold(w, scale):
    """w [N, H] with the norm's scale folded into its columns, rounded once."""
    return (w.astype(jnp.float32) * scale[None, :]).astype(jnp.bfloat16)


def run(impl, x, wg, wu, wd, scale, **kw):
    backend, cfg = impl
    kw = {"max_tokens": 64, **kw}
    return pk.sparse_decode_ffn_block(
        x, fold(wg, scale), fold(wu, scale), wd, eps=EPS, impl=backend, config=cfg, **kw
    )


def model_block(x, wg, wu, wd, scale, dtype):
    """x + gated_mlp(RMSNorm(x) with scale) in `dtype`, as the model computes it."""
    x32 = x.astype(jnp.float32)
    normed = x32 * (1 / jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + EPS)) * scale
    ws = [w.astype(dtype) for w in (wg, wu, wd)]
    out = reference.gated_mlp(normed.astype(dtype), *ws)
    return (x.astype(dtype) + out).astype(dtype)


def assert_block_close(y, x, wg, wu, wd, scale):
    truth = model_block(x, wg, wu, wd, scale, jnp.float32)
    model = model_block(x, wg, wu, wd, scale, jnp.bfloat16).astype(jnp.float32)
    assert y.shape == x.shape and y.dtype == x.dtype
    err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - truth)))
    model_err = float(jnp.max(jnp.abs(model - truth)))
    out_scale = float(jnp.max(jnp.abs(truth - x.astype(jnp.float32))))
    assert out_scale > float(jnp.max(jnp.abs(x.astype(jnp.float32)))) / 4  # the MLP matters
    assert err <= 1.5 * model_err + 1e-3 * float(jnp.max(jnp.abs(truth))), (err, model_err)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("m", [1, 3, 4, 8])
def test_matches_the_model_block(impl, m):
    case = block_case(m, m, 6.0)
    assert_block_close(run(impl, *case), *case[:4], case[4])


@pytest.mark.parametrize("impl", IMPLS)
def test_every_neuron_firing_and_none(impl):
    """A row where every neuron fires, beside rows where none does: those rows come
    back as x exactly (the MLP adds zeros)."""
    x, wg, wu, wd, scale = block_case(11, 3, 0.5)
    wg = wg.at[:, 1].set(jnp.bfloat16(8.0))  # x[0, 1] large: row 0 fires everywhere
    x = x.at[0, 1].set(jnp.bfloat16(60.0)).at[1:, 1].set(jnp.bfloat16(-60.0))
    g = np.asarray(reference.hidden(decode_reference.rms_normed(x, EPS), fold(wg, scale)))
    assert (g[0] > 0).all() and not (g[1:] > 0).any()
    y = run(impl, x, wg, wu, wd, scale)
    np.testing.assert_array_equal(np.asarray(y[1:], np.float32), np.asarray(x[1:], np.float32))
    truth = model_block(x, wg, wu, wd, scale, jnp.float32)
    model = model_block(x, wg, wu, wd, scale, jnp.bfloat16).astype(jnp.float32)
    err = float(jnp.max(jnp.abs(y[0].astype(jnp.float32) - truth[0])))
    assert err <= 1.5 * float(jnp.max(jnp.abs(model[0] - truth[0]))) + 1e-3 * float(
        jnp.max(jnp.abs(truth[0]))
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_and_non_finite_rows(impl):
    """A zero row stays zero (its factor is rsqrt(eps), its products 0); a row with an
    inf or a NaN gives a NaN row; the other rows are untouched by them."""
    x, wg, wu, wd, scale = block_case(12, 4, 6.0)
    x = x.at[1].set(0).at[2, 5].set(jnp.inf).at[3, 0].set(jnp.nan)
    y = np.asarray(run(impl, x, wg, wu, wd, scale), np.float32)
    assert not y[1].any()
    assert np.isnan(y[2]).all() and np.isnan(y[3]).all()
    alone = np.asarray(run(impl, x[:1], wg, wu, wd, scale), np.float32)
    np.testing.assert_array_equal(y[0], alone[0])


@pytest.mark.parametrize("backend", ["interpret", "xla"])
def test_above_max_tokens_runs_the_dense_formula(backend):
    case = block_case(13, 12, 6.0)
    y = run((backend, SMALL), *case, max_tokens=8)
    assert_block_close(y, *case[:4], case[4])


def test_fp32_is_the_model_block():
    """fp32 (xla only): the unfused model block to fp32 rounding."""
    x, wg, wu, wd, scale = (a.astype(jnp.float32) for a in block_case(14, 3, 6.0))
    y = pk.sparse_decode_ffn_block(
        x, wg * scale[None, :], wu * scale[None, :], wd, eps=EPS, impl="auto"
    )
    want = model_block(x, wg, wu, wd, scale, jnp.float32)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_leading_axes_and_empty_batch():
    x, wg, wu, wd, scale = block_case(15, 2, 6.0)
    y = run(("interpret", SMALL), x[:, None], wg, wu, wd, scale)
    assert y.shape == (2, 1, H)
    empty = jnp.zeros((0, H), jnp.bfloat16)
    assert run(("interpret", SMALL), empty, wg, wu, wd, scale).shape == (0, H)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"impl": "cuda"}, "impl='cuda'"),
        ({"max_tokens": 65}, "max_tokens=65"),
        ({"w_shape": (N, H // 2)}, "w_up must be"),
    ],
)
def test_bad_inputs_raise(kwargs, message):
    x = jnp.ones((2, H), jnp.bfloat16)
    w = jnp.ones((N, H), jnp.bfloat16)
    w_up = jnp.ones(kwargs.pop("w_shape", (N, H)), jnp.bfloat16)
    with pytest.raises(ValueError, match=message):
        pk.sparse_decode_ffn_block(x, w, w_up, w, eps=EPS, **kwargs)


@pytest.mark.parametrize("m", [1, 4, 8])
def test_cross_lowers_for_cuda_at_production_shape(m):
    """H = 2048, N = 5632, default launches: the op's two kernels, nothing else Triton."""
    x = jnp.zeros((m, 2048), jnp.bfloat16)
    w = jnp.zeros((5632, 2048), jnp.bfloat16)
    fn = lambda *a: pk.sparse_decode_ffn_block(*a, eps=EPS, impl="pallas", config=DecodeConfig())
    assert count_triton_calls(fn, x, w, w, w) == 2


@pytest.mark.parametrize("impl", IMPLS)
def test_stats_count_the_gate_that_ran(impl):
    """Active neurons and l0 of the gate each backend computes: the kernels scale the
    fp32 product of the raw x by the row's factor, the XLA path rounds the normed x
    first (a neuron at the edge may fire in one and not the other)."""
    x, wg, wu, wd, scale = block_case(16, 3, 6.0)
    _, stats = run(impl, x, wg, wu, wd, scale, return_stats=True)
    x32, wg32 = x.astype(jnp.float32), fold(wg, scale).astype(jnp.float32)
    factor = 1 / jnp.sqrt(jnp.mean(x32 * x32, axis=1, keepdims=True) + EPS)
    if impl[0] == "xla":
        pre = decode_reference.rms_normed(x, EPS).astype(jnp.float32) @ wg32.T
    else:
        pre = (x32 @ wg32.T) * factor
    fires = np.asarray(pre.astype(jnp.bfloat16).astype(jnp.float32)) > 0
    assert int(stats.active_neurons) == int(fires.any(axis=0).sum()) > 0
    assert int(stats.dense_fallback) == 0
    assert float(stats.l0) == pytest.approx(fires.sum() / x.shape[0])
