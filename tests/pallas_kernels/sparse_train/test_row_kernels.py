"""Row kernels (SDDMMs, row SpMMs) against dense jnp, and their CUDA lowering at
production shapes with the default launches."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference as ref
from pallas_kernels.sparse_train import format as fmt
from pallas_kernels.sparse_train import row_kernels
from pallas_kernels.sparse_train.config import SparseTrainConfig
from tests.lowering import count_triton_calls
from tests.pallas_kernels.sparse_train.cases import (
    MODES,
    OUT_RTOL,
    PH,
    PM,
    PN,
    PW,
    ROW,
    H,
    M,
    N,
    ell_of,
    f32,
    make_inputs,
    rel_err,
    scatter,
    zeros,
)


@pytest.mark.parametrize("interpret", MODES)
def test_sddmm_up_matches_dense(interpret):
    x, wg, wu, *_ = make_inputs(1, M, H, N, 8, heavy=(5,), zero=(2,))
    _, ell, ell_count, _ = ell_of(x, wg, 16)
    r, t, l1_rows = row_kernels.sddmm_up(
        x, wu, ell_count, ell.cols, ell.vals, launch=ROW, interpret=interpret
    )
    mask = scatter(jnp.ones_like(ell.vals), ell.cols, ell_count, N)
    r_dense = jnp.einsum("mh,nh->mn", x, wu, preferred_element_type=jnp.float32)
    r_dense = r_dense.astype(x.dtype).astype(jnp.float32) * mask
    h_dense = ref.gated_hidden(x, wg, wu).astype(jnp.float32) * mask
    assert rel_err(scatter(r, ell.cols, ell_count, N), r_dense) < OUT_RTOL
    assert rel_err(scatter(t, ell.cols, ell_count, N), h_dense) < OUT_RTOL
    assert rel_err(l1_rows, jnp.sum(jnp.abs(h_dense), axis=1)) < OUT_RTOL
    valid = np.asarray(fmt.slot_mask(ell_count, 16))
    assert (f32(r)[~valid] == 0).all() and (f32(t)[~valid] == 0).all()
    assert float(l1_rows[5]) == 0.0  # tail row: not processed by the ELL kernels


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("n_terms", [1, 2])
def test_spmm_rows_matches_dense(interpret, n_terms):
    x, wg, wu, wd, _ = make_inputs(2, M, H, N, 8, zero=(7,))
    _, ell, ell_count, _ = ell_of(x, wg, 16)
    k = jax.random.split(jax.random.key(3), 2)
    vals = [jax.random.normal(ki, ell.vals.shape).astype(jnp.bfloat16) for ki in k]
    terms = tuple(zip(vals, (wd, wu), strict=True))[:n_terms]
    out = row_kernels.spmm_rows(
        terms, ell_count, ell.cols, out_dtype=x.dtype, launch=ROW, interpret=interpret
    )
    want = sum(scatter(v, ell.cols, ell_count, N) @ w.astype(jnp.float32) for v, w in terms)
    assert out.dtype == x.dtype
    assert rel_err(out, want) < OUT_RTOL
    assert (f32(out[7]) == 0).all()


@pytest.mark.parametrize("interpret", MODES)
def test_sddmm_grad_matches_dense(interpret):
    x, wg, wu, wd, proj = make_inputs(4, M, H, N, 8, heavy=(1,))
    _, ell, ell_count, _ = ell_of(x, wg, 16)
    r, t, _ = row_kernels.sddmm_up(x, wu, ell_count, ell.cols, ell.vals, launch=ROW, impl="xla")
    g = proj.astype(jnp.bfloat16)
    scale = jnp.asarray([0.3], jnp.float32)
    dr, du, t_got, bad = row_kernels.sddmm_grad(
        g, wd, ell_count, ell.cols, ell.vals, r, scale, launch=ROW, interpret=interpret
    )
    sc = functools.partial(scatter, cols=ell.cols, ell_count=ell_count, n=N)
    dt = (g.astype(jnp.float32) @ wd.astype(jnp.float32).T) * sc(jnp.ones_like(t))
    dt = dt + 0.3 * jnp.sign(sc(t))
    assert rel_err(sc(dr), dt * sc(ell.vals)) < OUT_RTOL
    assert rel_err(sc(du), dt * sc(r)) < OUT_RTOL
    # T is sddmm_up's bit for bit, unused slots (and the heavy row 1) zero.
    np.testing.assert_array_equal(f32(t_got), f32(t))
    np.testing.assert_array_equal(np.asarray(bad), np.zeros(M, np.int32))


@pytest.mark.parametrize("interpret", MODES)
def test_sddmm_grad_counts_non_finite_gradients_of_every_row(interpret):
    """Rows without ELL slots (row 1 is heavy: a tail row, 0 slots) are counted too."""
    x, wg, wu, wd, proj = make_inputs(4, M, H, N, 8, heavy=(1,))
    _, ell, ell_count, _ = ell_of(x, wg, 16)
    assert int(ell_count[1]) == 0
    r, _, _ = row_kernels.sddmm_up(x, wu, ell_count, ell.cols, ell.vals, launch=ROW, impl="xla")
    g = proj.astype(jnp.bfloat16)
    g = g.at[1, 3].set(jnp.nan).at[1, H - 1].set(jnp.inf).at[M - 1, 0].set(-jnp.inf)
    scale = jnp.asarray([0.0], jnp.float32)
    *_, bad = row_kernels.sddmm_grad(
        g, wd, ell_count, ell.cols, ell.vals, r, scale, launch=ROW, interpret=interpret
    )
    want = np.zeros(M, np.int32)
    want[1], want[M - 1] = 2, 1
    np.testing.assert_array_equal(np.asarray(bad), want)


_D = SparseTrainConfig()
_I, _F = jnp.int32, jnp.float32
_ROWS = [zeros((PM, PW)), zeros((PN, PH)), zeros((PM,), _I), zeros((PM, PW), _I)]
LOWERINGS = {
    "sddmm_up": (
        lambda x, w, c, cols, p: row_kernels.sddmm_up(
            x, w, c, cols, p, launch=_D.sddmm_up, interpret=False
        ),
        [zeros((PM, PH)), zeros((PN, PH)), zeros((PM,), _I), zeros((PM, PW), _I), zeros((PM, PW))],
    ),
    "spmm_rows_1": (
        lambda v, w, c, cols: row_kernels.spmm_rows(
            ((v, w),), c, cols, launch=_D.spmm_down, interpret=False
        ),
        _ROWS,
    ),
    "spmm_rows_2": (
        lambda v, w, c, cols: row_kernels.spmm_rows(
            ((v, w), (v, w)), c, cols, launch=_D.spmm_dx, interpret=False
        ),
        _ROWS,
    ),
    "sddmm_grad": (
        lambda g, w, c, cols, v, s: row_kernels.sddmm_grad(
            g, w, c, cols, v, v, s, launch=_D.sddmm_grad, interpret=False
        ),
        [zeros((PM, PH)), zeros((PN, PH)), zeros((PM,), _I), zeros((PM, PW), _I),
         zeros((PM, PW)), zeros((1,), _F)],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(LOWERINGS))
def test_row_kernel_lowers_for_cuda(name, verified_modules):
    fn, args = LOWERINGS[name]
    assert count_triton_calls(fn, *args) == 1
    assert len(verified_modules) == 1


def test_block_h_must_divide_h():
    x = jnp.zeros((4, 96), jnp.bfloat16)
    cols = jnp.zeros((4, 16), jnp.int32)
    with pytest.raises(ValueError, match=r"sddmm_up\.block_h=64 must divide H=96"):
        row_kernels.sddmm_up(x, x, cols[:, 0], cols, cols.astype(x.dtype), launch=ROW)
