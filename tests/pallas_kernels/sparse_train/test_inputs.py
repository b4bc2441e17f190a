"""Edge inputs of the sparse training op: no tokens, a scalar x, NaN and Inf.

Non-finite inputs run the dense formula (forward and backward), so NaN and Inf reach the
same outputs and gradients as in `jax.grad` of the dense reference.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference as ref
from pallas_kernels.sparse_train import SparseTrainConfig, sparse_gated_mlp_train
from tests.pallas_kernels.sparse_train.cases import (
    GRAD_RTOL,
    LAM,
    MODES,
    OUT_RTOL,
    SMALL,
    H,
    M,
    N,
    f32,
    l1_of_hidden,
    make_inputs,
    rel_err,
)

CFG = SparseTrainConfig(**SMALL)


def _sparse_loss(x, wg, wu, wd, proj, *, interpret):
    out, stats = sparse_gated_mlp_train(x, wg, wu, wd, config=CFG, interpret=interpret)
    return jnp.sum(out.astype(jnp.float32) * proj) + LAM * stats["l1"], (out, stats)


def _ref_loss(x, wg, wu, wd, proj):
    out = ref.gated_mlp(x, wg, wu, wd)
    l1 = l1_of_hidden(ref.gated_hidden(x, wg, wu))
    return jnp.sum(out.astype(jnp.float32) * proj) + LAM * l1


def _assert_same_nonfinite(got, want, rtol, exact=True):
    """The same entries are non-finite (`exact`: the same NaN, +Inf, -Inf); the finite
    ones agree to `rtol`."""
    got, want = f32(got), f32(want)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    if exact:
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    finite = np.isfinite(want)
    if finite.any():
        assert rel_err(got[finite], want[finite]) < rtol


@pytest.mark.parametrize("lead", [(0,), (2, 0), (0, 3)])
def test_no_tokens_gives_empty_output_and_zero_grads(lead):
    x, wg, wu, wd, _ = make_inputs(0, M, H, N, nnz=8)
    x0 = jnp.zeros((*lead, H), x.dtype)
    op = functools.partial(sparse_gated_mlp_train, config=CFG, interpret=True)
    out, stats = jax.jit(op)(x0, wg, wu, wd)
    assert out.shape == x0.shape and out.dtype == x0.dtype
    # Same stats structure, shapes and dtypes as a call with tokens, all zero.
    want = jax.eval_shape(op, x, wg, wu, wd)[1]
    assert jax.tree.map(lambda a: (a.shape, a.dtype), stats) == jax.tree.map(
        lambda a: (a.shape, a.dtype), want
    )
    for v in jax.tree.leaves(stats):
        assert not np.asarray(v).any()

    def loss(x, wg, wu, wd):
        out, stats = op(x, wg, wu, wd)
        return jnp.sum(out.astype(jnp.float32)) + LAM * stats["l1"]

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x0, wg, wu, wd)
    for g, a in zip(grads, (x0, wg, wu, wd), strict=True):
        assert g.shape == a.shape and g.dtype == a.dtype and not np.asarray(g).any()


@pytest.mark.parametrize("x", [jnp.zeros((), jnp.bfloat16), np.float32(1.0), 1.0])
def test_scalar_x_raises_naming_its_shape(x):
    _, wg, wu, wd, _ = make_inputs(0, M, H, N, nnz=8)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., H\].*shape \(\)"):
        sparse_gated_mlp_train(x, wg, wu, wd, config=CFG)


def test_weights_must_be_matrices():
    x, wg, wu, wd, _ = make_inputs(0, M, H, N, nnz=8)
    with pytest.raises(ValueError, match=r"w_gate.*\[N, H\].*shape \(\)"):
        sparse_gated_mlp_train(x, wg[0, 0], wu, wd, config=CFG)


@pytest.mark.parametrize(
    "cast, message",
    [
        ({"x": jnp.int32}, "x must be bfloat16 or float32, got int32"),
        ({"x": jnp.float16}, "x must be bfloat16 or float32, got float16"),
        ({"wd": jnp.float32}, "w_down must have x's dtype bfloat16, got float32"),
    ],
)
def test_dtypes_are_checked(cast, message):
    x, wg, wu, wd, _ = make_inputs(0, M, H, N, nnz=8)
    arrays = {"x": x, "wg": wg, "wu": wu, "wd": wd}
    arrays.update({k: arrays[k].astype(dtype) for k, dtype in cast.items()})
    with pytest.raises(ValueError, match=message):
        sparse_gated_mlp_train(*arrays.values(), config=CFG)


def _poison(inputs, where):
    x, wg, wu, wd, proj = inputs
    if where == "x_nan":
        x = x.at[3, 5].set(jnp.nan)
    elif where == "x_inf":
        x = x.at[7, 9].set(jnp.inf)
    elif where == "w_gate_inf":
        wg = wg.at[9, 3].set(-jnp.inf)
    elif where == "w_up_nan":
        wu = wu.at[11, 2].set(jnp.nan)
    else:
        wd = wd.at[5, 4].set(jnp.inf)
    return x, wg, wu, wd, proj


@pytest.mark.parametrize("where", ["x_nan", "x_inf", "w_gate_inf", "w_up_nan", "w_down_inf"])
@pytest.mark.parametrize("interpret", MODES)
def test_nonfinite_propagates_like_the_dense_reference(interpret, where):
    inputs = _poison(make_inputs(1, M, H, N, nnz=8, heavy=(0,)), where)
    fn = functools.partial(_sparse_loss, interpret=interpret)
    grad_fn = jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2, 3), has_aux=True))
    (_, (out, stats)), grads = grad_fn(*inputs)
    ref_out = ref.gated_mlp(*inputs[:4])
    ref_grads = jax.grad(_ref_loss, argnums=(0, 1, 2, 3))(*inputs)
    assert not np.isfinite(f32(ref_out)).all()  # the case is not vacuous
    _assert_same_nonfinite(out, ref_out, OUT_RTOL)
    # An Inf input meets +Inf and -Inf in the weight-gradient GEMMs, where NaN or Inf
    # depends on the GEMM's blocking (the fallback runs row blocks): only the
    # non-finite entries must match there.
    for g, r in zip(grads, ref_grads, strict=True):
        _assert_same_nonfinite(g, r, GRAD_RTOL, exact=where.endswith("_nan"))
    assert int(stats["dense_fallback"]) == 1 and int(stats["tail_capacity"]) == -1
    if where == "x_nan":  # one NaN token: only its row is NaN
        bad = np.isnan(f32(out)).any(axis=1)
        assert bad.tolist() == [i == 3 for i in range(M)]


@pytest.mark.parametrize("bad", ["g_nan_row", "g_inf", "l1_nan"])
@pytest.mark.parametrize("interpret", MODES)
def test_nonfinite_upstream_gradient_propagates_like_the_dense_reference(interpret, bad):
    """Finite inputs, a NaN / Inf only in the backward's incoming gradient: the dense
    formula spreads it through every neuron's weight gradient (0 * NaN), and so does
    the op (its dense backward), not only along the sparse pattern."""
    inputs = make_inputs(3, M, H, N, nnz=8)
    proj = inputs[4]
    if bad == "g_nan_row":
        proj = proj.at[4].set(jnp.nan)
    elif bad == "g_inf":
        proj = proj.at[6, 1].set(jnp.inf)
    lam = jnp.nan if bad == "l1_nan" else LAM

    def sparse(x, wg, wu, wd):
        out, stats = sparse_gated_mlp_train(x, wg, wu, wd, config=CFG, interpret=interpret)
        return jnp.sum(out.astype(jnp.float32) * proj) + lam * stats["l1"]

    def dense(x, wg, wu, wd):
        out = ref.gated_mlp(x, wg, wu, wd)
        l1 = l1_of_hidden(ref.gated_hidden(x, wg, wu))
        return jnp.sum(out.astype(jnp.float32) * proj) + lam * l1

    grads = jax.jit(jax.grad(sparse, argnums=(0, 1, 2, 3)))(*inputs[:4])
    ref_grads = jax.grad(dense, argnums=(0, 1, 2, 3))(*inputs[:4])
    assert not np.isfinite(f32(ref_grads[2])).all()  # not vacuous: dWu is poisoned
    for g, r in zip(grads, ref_grads, strict=True):
        _assert_same_nonfinite(g, r, GRAD_RTOL, exact=bad != "g_inf")


@pytest.mark.parametrize("interpret", MODES)
def test_finite_inputs_keep_the_sparse_path(interpret):
    inputs = make_inputs(2, M, H, N, nnz=8)
    out, stats = sparse_gated_mlp_train(*inputs[:4], config=CFG, interpret=interpret)
    assert int(stats["dense_fallback"]) == 0 and int(stats["tail_capacity"]) >= 0
    assert rel_err(out, ref.gated_mlp(*inputs[:4])) < OUT_RTOL
