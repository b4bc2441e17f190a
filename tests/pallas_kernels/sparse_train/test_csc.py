"""Weight-gradient CSC SpMM against dense jnp, and its CUDA lowering at production
shapes with the default launch."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_train import csc
from pallas_kernels.sparse_train import format as fmt
from pallas_kernels.sparse_train.config import SparseTrainConfig
from tests.lowering import count_triton_calls
from tests.pallas_kernels.sparse_train.cases import (
    CSC,
    MODES,
    OUT_RTOL,
    PH,
    PM,
    PN,
    PW,
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
def test_spmm_csc_matches_dense(interpret):
    x, wg, _, _, proj = make_inputs(5, M, H, N, 8, heavy=(9,), zero=(4,))
    _, ell, ell_count, _ = ell_of(x, wg, 16)
    k = jax.random.split(jax.random.key(6), 3)
    dr, du, t = (jax.random.normal(ki, ell.vals.shape).astype(jnp.bfloat16) for ki in k)
    g = proj.astype(jnp.bfloat16)
    index = fmt.build_csc(ell_count, ell.cols, ell.col_counts, exclude=jnp.zeros((N,), bool))
    entries = csc.csc_entries(index, 16, dr, du, t)
    kw = dict(impl="pallas", launch=CSC, interpret=interpret)
    dwu, dwg, dwd = csc.spmm_csc(index.offsets, index.order, *entries, x, g, **kw)
    sc = functools.partial(scatter, cols=ell.cols, ell_count=ell_count, n=N)
    xf, gf = x.astype(jnp.float32), g.astype(jnp.float32)
    assert rel_err(dwu, sc(dr).T @ xf) < OUT_RTOL
    assert rel_err(dwg, sc(du).T @ xf) < OUT_RTOL
    assert rel_err(dwd, sc(t).T @ gf) < OUT_RTOL
    dead = np.asarray(index.offsets[1:] == index.offsets[:-1])
    assert dead.any() and (f32(dwu)[dead] == 0).all()


def test_spmm_csc_lowers_for_cuda(verified_modules):
    launch = SparseTrainConfig().spmm_csc

    def fn(o, order, tok, v, x):
        return csc.spmm_csc(o, order, tok, v, v, v, x, x, launch=launch, interpret=False)

    i32 = jnp.int32
    args = [zeros((PN + 1,), i32), zeros((PN,), i32), zeros((PM * PW,), i32)]
    assert count_triton_calls(fn, *args, zeros((PM * PW,)), zeros((PM, PH))) == 1
    assert len(verified_modules) == 1
