"""Sparse training path: each kernel against dense jnp, the op's gradients against
jax.grad of the dense reference (with the L1 term), overflow paths, transforms,
determinism, and CUDA cross-lowering at production shapes.

Numeric tests run in interpret mode on CPU and again with interpret=False under
`-m gpu` (H200). Errors are norm-based relative errors (twell.md §10: values at the
ReLU boundary make max-relative errors meaningless in bf16).
"""

import functools
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from pallas_kernels import hybrid_format as hf
from pallas_kernels import reference as ref
from pallas_kernels import sparse_train as st
from pallas_kernels import sparse_train_op as sto
from pallas_kernels.sparse_train_op import (
    RESIDUALS_NAME,
    SparseTrainConfig,
    resolve_config,
    sparse_gated_mlp_train,
)
from tests.lowering import TRITON_CALL, count_triton_calls, lower_for_cuda

OUT_RTOL = 1e-2  # norm-relative error of outputs / kernel results vs dense bf16
GRAD_RTOL = 2e-2  # norm-relative error of gradients vs jax.grad of the dense reference
LAM = 5.0  # large enough that the L1 sign term moves the gradients visibly

# Small shapes: M not a multiple of any block, W small so heavy rows reach the tail.
M, H, N = 40, 128, 256
SMALL = dict(
    ell_width=16,
    tail_capacities=(0, 2, 4),
    chunk=8,
    block_h=64,
    csc_chunk=8,
    csc_block_h=128,
    compact_block_rows=16,
    compact_block_cols=128,
    fallback_block_rows=16,  # 3 blocks over M=40, the last one shorter
)
MODES = [
    pytest.param(True, id="interpret"),
    pytest.param(False, id="gpu", marks=pytest.mark.gpu),
]


def make_inputs(seed, m, h, n, nnz, heavy=(), zero=()):
    """bf16 (x, w_gate, w_up, w_down, proj) with ~nnz positive gates per row.

    A bias-like column (x[:, 0] = 1, Wg[:, 0] = -thr) sets the density; heavy rows
    drop the bias (about N/2 positives), zero rows keep only the bias (none).
    """
    k = jax.random.split(jax.random.key(seed), 5)
    thr = float(jax.scipy.special.ndtri(1.0 - nnz / n))
    x = jax.random.normal(k[0], (m, h)).at[:, 0].set(1.0)
    for i in heavy:
        x = x.at[i, 0].set(0.0)
    for i in zero:
        x = x.at[i].set(0.0).at[i, 0].set(1.0)
    wg = (jax.random.normal(k[1], (n, h)) / np.sqrt(h - 1)).at[:, 0].set(-thr)
    wu = jax.random.normal(k[2], (n, h)) / np.sqrt(h)
    wd = jax.random.normal(k[3], (n, h)) / np.sqrt(n)
    proj = jax.random.normal(k[4], (m, h))
    bf = lambda a: a.astype(jnp.bfloat16)
    return bf(x), bf(wg), bf(wu), bf(wd), proj


def rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _f32(a):
    return np.asarray(a, np.float32)


def _ell(x, wg, width):
    p = jax.nn.relu(jnp.einsum("mh,nh->mn", x, wg, preferred_element_type=jnp.float32))
    p = p.astype(x.dtype)
    ell, fired = hf.compact_rows_ref(p, width)
    return p, ell, hf.ell_counts(ell.counts, width), fired


def _scatter(vals, cols, ell_count, n):
    """Dense [M, N] of per-slot values (unused slots dropped)."""
    m, w = cols.shape
    c = jnp.where(hf.slot_mask(ell_count, w), cols, n)
    rows = jnp.arange(m)[:, None]
    return jnp.zeros((m, n), jnp.float32).at[rows, c].set(vals.astype(jnp.float32), mode="drop")


def _kw(interpret):
    return dict(impl="pallas", chunk=8, block_h=64, interpret=interpret)


# ---------------------------------------------------------------------------------------
# Kernels against dense jnp.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize(
    ("block_rows", "block_cols", "dtype"),
    [(16, 128, jnp.bfloat16), (32, 256, jnp.bfloat16), (16, 128, jnp.float32)],
)
def test_compact_rows_matches_reference(interpret, block_rows, block_cols, dtype):
    """Heavy rows past W (true counts kept), empty rows, M not a multiple of the block;
    fp32 gates take `tile_select`'s two-reduction path."""
    x, wg, *_ = make_inputs(0, M, H, N, 8, heavy=(3, 30), zero=(0, 39))
    u = jnp.einsum("mh,nh->mn", x, wg, preferred_element_type=dtype)  # pre-relu, as the op
    ell_ref, fired_ref = hf.compact_rows_ref(jax.nn.relu(u), 16)
    ell, fired = st.compact_rows(
        u,
        width=16,
        block_rows=block_rows,
        block_cols=block_cols,
        interpret=interpret,
    )
    np.testing.assert_array_equal(ell.counts, ell_ref.counts)
    np.testing.assert_array_equal(ell.cols, ell_ref.cols)
    np.testing.assert_array_equal(_f32(ell.vals), _f32(ell_ref.vals))
    np.testing.assert_array_equal(fired, fired_ref)
    assert int(ell.counts[3]) > 16 and int(ell.counts[0]) == 0


@pytest.mark.parametrize("interpret", MODES)
def test_sddmm_up_matches_dense(interpret):
    x, wg, wu, *_ = make_inputs(1, M, H, N, 8, heavy=(5,), zero=(2,))
    _, ell, ell_count, _ = _ell(x, wg, 16)
    r, t, l1_rows = st.sddmm_up(x, wu, ell_count, ell.cols, ell.vals, **_kw(interpret))
    mask = _scatter(jnp.ones_like(ell.vals), ell.cols, ell_count, N)
    r_dense = jnp.einsum("mh,nh->mn", x, wu, preferred_element_type=jnp.float32)
    r_dense = r_dense.astype(x.dtype).astype(jnp.float32) * mask
    h_dense = ref.gated_hidden(x, wg, wu).astype(jnp.float32) * mask
    assert rel_err(_scatter(r, ell.cols, ell_count, N), r_dense) < OUT_RTOL
    assert rel_err(_scatter(t, ell.cols, ell_count, N), h_dense) < OUT_RTOL
    assert rel_err(l1_rows, jnp.sum(jnp.abs(h_dense), axis=1)) < OUT_RTOL
    valid = np.asarray(hf.slot_mask(ell_count, 16))
    assert (_f32(r)[~valid] == 0).all() and (_f32(t)[~valid] == 0).all()
    assert float(l1_rows[5]) == 0.0  # tail row: not processed by the ELL kernels


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("n_terms", [1, 2])
def test_spmm_rows_matches_dense(interpret, n_terms):
    x, wg, wu, wd, _ = make_inputs(2, M, H, N, 8, zero=(7,))
    _, ell, ell_count, _ = _ell(x, wg, 16)
    k = jax.random.split(jax.random.key(3), 2)
    vals = [jax.random.normal(ki, ell.vals.shape).astype(jnp.bfloat16) for ki in k]
    terms = tuple(zip(vals, (wd, wu), strict=True))[:n_terms]
    out = st.spmm_rows(terms, ell_count, ell.cols, out_dtype=x.dtype, **_kw(interpret))
    want = sum(_scatter(v, ell.cols, ell_count, N) @ w.astype(jnp.float32) for v, w in terms)
    assert out.dtype == x.dtype
    assert rel_err(out, want) < OUT_RTOL
    assert (_f32(out[7]) == 0).all()


@pytest.mark.parametrize("interpret", MODES)
def test_sddmm_grad_matches_dense(interpret):
    x, wg, wu, wd, proj = make_inputs(4, M, H, N, 8, heavy=(1,))
    _, ell, ell_count, _ = _ell(x, wg, 16)
    r, t, _ = st.sddmm_up(x, wu, ell_count, ell.cols, ell.vals, impl="xla")
    g = proj.astype(jnp.bfloat16)
    scale = jnp.asarray([0.3], jnp.float32)
    dr, du = st.sddmm_grad(g, wd, ell_count, ell.cols, ell.vals, r, t, scale, **_kw(interpret))
    sc = functools.partial(_scatter, cols=ell.cols, ell_count=ell_count, n=N)
    dt = (g.astype(jnp.float32) @ wd.astype(jnp.float32).T) * sc(jnp.ones_like(t))
    dt = dt + 0.3 * jnp.sign(sc(t))
    assert rel_err(sc(dr), dt * sc(ell.vals)) < OUT_RTOL
    assert rel_err(sc(du), dt * sc(r)) < OUT_RTOL


@pytest.mark.parametrize("interpret", MODES)
def test_spmm_csc_matches_dense(interpret):
    x, wg, _, _, proj = make_inputs(5, M, H, N, 8, heavy=(9,), zero=(4,))
    _, ell, ell_count, _ = _ell(x, wg, 16)
    k = jax.random.split(jax.random.key(6), 3)
    dr, du, t = (jax.random.normal(ki, ell.vals.shape).astype(jnp.bfloat16) for ki in k)
    g = proj.astype(jnp.bfloat16)
    csc = hf.build_csc(ell_count, ell.cols, ell.col_counts)
    entries = st.csc_entries(csc, 16, dr, du, t)
    kw = dict(impl="pallas", chunk=8, block_h=128, interpret=interpret)
    dwu, dwg, dwd = st.spmm_csc(csc.offsets, csc.order, *entries, x, g, **kw)
    sc = functools.partial(_scatter, cols=ell.cols, ell_count=ell_count, n=N)
    xf, gf = x.astype(jnp.float32), g.astype(jnp.float32)
    assert rel_err(dwu, sc(dr).T @ xf) < OUT_RTOL
    assert rel_err(dwg, sc(du).T @ xf) < OUT_RTOL
    assert rel_err(dwd, sc(t).T @ gf) < OUT_RTOL
    dead = np.asarray(csc.offsets[1:] == csc.offsets[:-1])
    assert dead.any() and (_f32(dwu)[dead] == 0).all()


# ---------------------------------------------------------------------------------------
# The op against jax.grad of the dense reference.
# ---------------------------------------------------------------------------------------


def _ref_loss(x, wg, wu, wd, proj):
    out = ref.gated_mlp(x, wg, wu, wd)
    l1 = ref.l1_of_hidden(ref.gated_hidden(x, wg, wu))
    return jnp.sum(out.astype(jnp.float32) * proj) + LAM * l1


def _sparse_loss(x, wg, wu, wd, proj, *, cfg, interpret, l1_in_loss=True):
    out, stats = sparse_gated_mlp_train(
        x, wg, wu, wd, l1_coef=0.0 if l1_in_loss else LAM, config=cfg, interpret=interpret
    )
    loss = jnp.sum(out.astype(jnp.float32) * proj)
    return (loss + LAM * stats["l1"] if l1_in_loss else loss), (out, stats)


def _grad_fn(loss_fn, **kw):
    fn = functools.partial(loss_fn, **kw)
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2, 3), has_aux=True))


def _grads(loss_fn, x, wg, wu, wd, proj, **kw):
    return _grad_fn(loss_fn, **kw)(x, wg, wu, wd, proj)


def _check_against_reference(inputs, cfg, interpret, l1_in_loss=True):
    x, wg, wu, wd, _ = inputs
    (_, (out, stats)), grads = _grads(
        _sparse_loss, *inputs, cfg=cfg, interpret=interpret, l1_in_loss=l1_in_loss
    )
    ref_grads = jax.grad(_ref_loss, argnums=(0, 1, 2, 3))(*inputs)
    hid = ref.gated_hidden(x, wg, wu)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert rel_err(out, ref.gated_mlp(x, wg, wu, wd)) < OUT_RTOL
    # The op's gate GEMM writes bf16 while the reference rounds an fp32 GEMM: on the GPU
    # the two may order the accumulation differently, flipping a rare entry at 0.
    assert float(stats["l0"]) == pytest.approx(float(ref.l0_of_hidden(hid)), rel=1e-3)
    assert float(stats["l1"]) == pytest.approx(float(ref.l1_of_hidden(hid)), rel=OUT_RTOL)
    assert np.mean(np.asarray(stats["fired"]) != np.asarray(hid != 0).any(0)) <= 1e-3
    for name, g, gr in zip(("dx", "dWg", "dWu", "dWd"), grads, ref_grads, strict=True):
        assert g.dtype == gr.dtype
        assert rel_err(g, gr) < GRAD_RTOL, name
    return stats


CASES = {
    # name: (nnz per row, heavy rows, zero rows, expected tail capacity, fallback)
    "no_tail": (6, (), (0, 17), 0, 0),
    "tail": (6, (3, 38), (0,), 2, 0),
    "tail_overflow": (6, (1, 4, 9, 12, 20), (), -1, 1),
}


# The jnp twin runs the same orchestration; one case (plus the l1_coef and two-shard
# tests below) covers it, keeping CPU time for the Pallas cases.
@pytest.mark.parametrize("impl, case", [("xla", "tail")] + [("pallas", case) for case in CASES])
def test_op_grads_match_dense_reference(impl, case):
    nnz, heavy, zero, cap, fallback = CASES[case]
    inputs = make_inputs(10, M, H, N, nnz, heavy=heavy, zero=zero)
    cfg = SparseTrainConfig(impl=impl, **SMALL)
    stats = _check_against_reference(inputs, cfg, interpret=True)
    assert int(stats["tail_rows"]) == len(heavy)
    assert int(stats["tail_capacity"]) == cap
    assert int(stats["dense_fallback"]) == fallback


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_op_grads_match_dense_reference_gpu(case):
    nnz, heavy, zero, cap, fallback = CASES[case]
    inputs = make_inputs(10, M, H, N, nnz, heavy=heavy, zero=zero)
    stats = _check_against_reference(inputs, SparseTrainConfig(**SMALL), interpret=False)
    assert int(stats["tail_capacity"]) == cap and int(stats["dense_fallback"]) == fallback


@pytest.mark.gpu
@pytest.mark.parametrize("nnz", [29, 100])
def test_op_grads_production_shape_gpu(nnz):
    """M=16384, H=2048, N=5632, default config; two heavy rows go to the tail."""
    inputs = make_inputs(11, 16384, 2048, 5632, nnz, heavy=(5, 77))
    stats = _check_against_reference(inputs, SparseTrainConfig(), interpret=False)
    assert int(stats["tail_rows"]) >= 2 and int(stats["dense_fallback"]) == 0


def test_l1_coef_instead_of_l1_in_loss():
    """l1_coef=LAM with l1 left out of the loss gives the reference's L1 gradient."""
    inputs = make_inputs(12, M, H, N, 6, heavy=(3,))
    cfg = SparseTrainConfig(impl="xla", **SMALL)
    _check_against_reference(inputs, cfg, interpret=True, l1_in_loss=False)


def test_checkpoint_and_shard_map():
    """jax.checkpoint + shard_map over the token axis (1-device mesh on CPU)."""
    inputs = make_inputs(13, M, H, N, 6, heavy=(3,), zero=(1,))
    cfg = SparseTrainConfig(impl="pallas", **SMALL)
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("data",))

    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(PartitionSpec("data"), PartitionSpec(), PartitionSpec(), PartitionSpec()),
        out_specs=(PartitionSpec("data"), PartitionSpec()),
        check_vma=False,
    )
    def sharded(x, wg, wu, wd):
        out, stats = sparse_gated_mlp_train(x, wg, wu, wd, config=cfg, interpret=True)
        return out, jax.lax.pmean(stats["l1"], "data")

    def loss(x, wg, wu, wd, proj):
        out, l1 = jax.checkpoint(sharded)(x, wg, wu, wd)
        return jnp.sum(out.astype(jnp.float32) * proj) + LAM * l1

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*inputs)
    ref_grads = jax.grad(_ref_loss, argnums=(0, 1, 2, 3))(*inputs)
    for g, gr in zip(grads, ref_grads, strict=True):
        assert rel_err(g, gr) < GRAD_RTOL


_TWO_SHARDS = """
import functools, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from tests.test_sparse_train import GRAD_RTOL, LAM, M, N, H, SMALL, _ref_loss, make_inputs, rel_err
from pallas_kernels.sparse_train_op import SparseTrainConfig, sparse_gated_mlp_train

assert len(jax.devices()) == 2
inputs = make_inputs(13, M, H, N, 6, heavy=(3, 30), zero=(1,))
cfg = SparseTrainConfig(impl="xla", **SMALL)
mesh = Mesh(np.asarray(jax.devices()), ("data",))

@functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P(), P(), P()),
                   out_specs=(P("data"), P()), check_vma=False)
def sharded(x, wg, wu, wd):
    out, stats = sparse_gated_mlp_train(x, wg, wu, wd, config=cfg)
    return out, jax.lax.pmean(stats["l1"], "data")

def loss(x, wg, wu, wd, proj):
    out, l1 = sharded(x, wg, wu, wd)
    return jnp.sum(out.astype(jnp.float32) * proj) + LAM * l1

grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*inputs)
ref_grads = jax.grad(_ref_loss, argnums=(0, 1, 2, 3))(*inputs)
errs = [rel_err(g, gr) for g, gr in zip(grads, ref_grads)]
assert max(errs) < GRAD_RTOL, errs
print("OK")
"""


def test_shard_map_two_shards_sums_weight_grads():
    """Token-sharded over 2 (host) devices: weight grads are summed over the shards."""
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    res = subprocess.run(
        [sys.executable, "-c", _TWO_SHARDS], cwd=root, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


def test_remat_policy_keeps_residuals():
    """With save_only_these_names(RESIDUALS_NAME) the backward does not redo the forward.

    impl="xla": with Pallas the jaxpr keeps the recomputed (unused) pallas_calls, which
    XLA then removes as dead code (the Triton custom calls have no side effects).
    """
    inputs = make_inputs(16, M, H, N, 6)[:4]
    cfg = SparseTrainConfig(impl="xla", **SMALL)

    def count_compactions(policy):
        def loss(*a):
            fn = lambda *a: sparse_gated_mlp_train(*a, config=cfg)[0]
            return jnp.sum(jax.checkpoint(fn, policy=policy)(*a).astype(jnp.float32))

        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(*inputs)
        return str(jaxpr).count(f"i32[{M},{N}] = cumsum")  # the jnp compaction's slots

    assert count_compactions(None) == 2  # default remat: forward recomputed
    assert count_compactions(jax.checkpoint_policies.save_only_these_names(RESIDUALS_NAME)) == 1


@pytest.mark.parametrize("interpret", MODES)
def test_deterministic(interpret):
    inputs = make_inputs(14, M, H, N, 6, heavy=(3, 8), zero=(2,))
    cfg = SparseTrainConfig(impl="pallas", **SMALL)
    fn = _grad_fn(_sparse_loss, cfg=cfg, interpret=interpret)
    (l_a, (out_a, _)), g_a = fn(*inputs)
    (l_b, (out_b, _)), g_b = fn(*inputs)
    np.testing.assert_array_equal(_f32(out_a), _f32(out_b))
    assert float(l_a) == float(l_b)
    for a, b in zip(g_a, g_b, strict=True):
        np.testing.assert_array_equal(_f32(a), _f32(b))


def test_unsupported_shape_raises():
    x, wg, wu, wd, _ = make_inputs(0, 8, 100, N, 6)
    with pytest.raises(ValueError, match="block_h"):
        sparse_gated_mlp_train(x, wg, wu, wd)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"ell_width": 96}, "ell_width"),
        ({"tail_capacities": (256, 0)}, "tail_capacities"),
        ({"row_launch": (("sddmm", 2, 64, 4),)}, "unknown kernel"),
        ({"row_launch": (("spmm_dx", 3, 64, 4),)}, "chunk of spmm_dx"),
        ({"row_launch": (("spmm_dx", 2, 64, 3),)}, "num_warps of spmm_dx"),
    ],
)
def test_bad_config_raises(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SparseTrainConfig(**kwargs)


def test_row_launch_overrides_one_kernel_and_fits_h():
    cfg = SparseTrainConfig(chunk=8, block_h=64, row_launch=(("spmm_dx", 2, 2048, 2),))
    assert cfg.row_kernel_kwargs("sddmm_up")["chunk"] == 8
    dx = cfg.row_kernel_kwargs("spmm_dx")
    assert (dx["chunk"], dx["block_h"], dx["num_warps"]) == (2, 2048, 2)
    fitted = resolve_config(32, 96, 256, cfg)
    assert fitted.row_kernel_kwargs("spmm_dx")["block_h"] == 32  # largest power of 2 | 96


def test_default_config_fits_small_shapes():
    """Default (production) config on a tiny model: blocks and capacities shrink."""
    inputs = make_inputs(15, 20, 96, 128, 6, heavy=(2,))
    (_, (out, stats)), grads = _grads(
        _sparse_loss, *inputs, cfg=SparseTrainConfig(ell_width=16), interpret=True
    )
    ref_grads = jax.grad(_ref_loss, argnums=(0, 1, 2, 3))(*inputs)
    assert rel_err(out, ref.gated_mlp(*inputs[:4])) < OUT_RTOL
    assert int(stats["tail_capacity"]) == 20  # capacities capped at M = 20
    for g, gr in zip(grads, ref_grads, strict=True):
        assert rel_err(g, gr) < GRAD_RTOL


# ---------------------------------------------------------------------------------------
# CUDA cross-lowering at production shapes (M=16384, H=2048, N=5632, W=128).
# ---------------------------------------------------------------------------------------

PM, PH, PN, PW = 16384, 2048, 5632, 128
_BF, _I = jnp.bfloat16, jnp.int32


def _z(shape, dtype=_BF):
    return jnp.zeros(shape, dtype)


LOWERINGS = {
    "compact_rows": (
        lambda p: st.compact_rows(p, width=PW, interpret=False),
        [_z((PM, PN))],
    ),
    "sddmm_up": (
        lambda x, w, c, cols, p: st.sddmm_up(x, w, c, cols, p, interpret=False),
        [_z((PM, PH)), _z((PN, PH)), _z((PM,), _I), _z((PM, PW), _I), _z((PM, PW))],
    ),
    "spmm_rows_1": (
        lambda v, w, c, cols: st.spmm_rows(((v, w),), c, cols, interpret=False),
        [_z((PM, PW)), _z((PN, PH)), _z((PM,), _I), _z((PM, PW), _I)],
    ),
    "spmm_rows_2": (
        lambda v, w, c, cols: st.spmm_rows(((v, w), (v, w)), c, cols, interpret=False),
        [_z((PM, PW)), _z((PN, PH)), _z((PM,), _I), _z((PM, PW), _I)],
    ),
    "sddmm_grad": (
        lambda g, w, c, cols, v, s: st.sddmm_grad(g, w, c, cols, v, v, v, s, interpret=False),
        [_z((PM, PH)), _z((PN, PH)), _z((PM,), _I), _z((PM, PW), _I), _z((PM, PW)),
         _z((1,), jnp.float32)],
    ),
    "spmm_csc": (
        lambda o, order, tok, v, x: st.spmm_csc(o, order, tok, v, v, v, x, x, interpret=False),
        [_z((PN + 1,), _I), _z((PN,), _I), _z((PM * PW,), _I), _z((PM * PW,)), _z((PM, PH))],
    ),
}  # fmt: skip


@pytest.fixture
def verified_modules(monkeypatch):
    """Runs the MLIR verifier on every Triton module the Pallas lowering builds.

    The lowering serialises the module without verifying it, so operand shape or type
    mismatches would otherwise surface only in the GPU compiler. Uses a private jax
    hook (0.11.2); returns the list of verified modules' names.
    """
    from jax._src.pallas.triton import lowering as triton_lowering

    lower = triton_lowering.lower_jaxpr_to_triton_module
    seen = []

    def lower_and_verify(*args, **kwargs):
        result = lower(*args, **kwargs)
        assert result.module.operation.verify()
        seen.append(str(result.module.operation.attributes["sym_name"]))
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    return seen


@pytest.mark.parametrize("name", list(LOWERINGS))
def test_kernel_lowers_for_cuda(name, verified_modules):
    fn, args = LOWERINGS[name]
    assert count_triton_calls(fn, *args) == 1
    assert len(verified_modules) == 1


def test_op_value_and_grad_lowers_for_cuda(verified_modules):
    # Compaction, SDDMM + SpMM forward; SDDMM, dx SpMM and CSC SpMM backward.
    kernels = 6

    def step(x, wg, wu, wd):
        def loss(*a):
            out, stats = sparse_gated_mlp_train(*a, interpret=False)
            return jnp.sum(out.astype(jnp.float32)) + 2e-5 * stats["l1"]

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(x, wg, wu, wd)

    txt = lower_for_cuda(step, _z((PM, PH)), _z((PN, PH)), _z((PN, PH)), _z((PN, PH)))
    assert txt.count(TRITON_CALL) == kernels
    assert len(verified_modules) == kernels


def test_fallback_blocks_cover_m_in_order():
    assert sto._fallback_blocks(40, 16) == [(0, 16), (16, 16), (32, 8)]
    assert sto._fallback_blocks(8, 2048) == [(0, 8)]
    blocks = sto._fallback_blocks(131072, 2048)  # capped at 16 blocks of 8192 rows
    assert len(blocks) == 16 and blocks[-1] == (122880, 8192)


def test_dense_fallback_has_no_while_loop():
    # A while loop inside the op's conds makes XLA run them from the host (a
    # device-to-host copy of each predicate per step: ~0.2 ms of idle GPU on the H200).
    x = jnp.ones((40, 32), jnp.bfloat16)
    w = jnp.ones((64, 32), jnp.bfloat16)
    scale = jnp.ones((), jnp.float32)
    fwd = jax.jit(lambda *a: sto._dense_fallback_fwd(*a, 16)).lower(x, w, w, w).as_text()
    bwd = jax.jit(lambda *a: sto._dense_fallback_bwd(*a, 16)).lower(x, x, w, w, w, scale)
    for text in (fwd, bwd.as_text()):
        assert "stablehlo.while" not in text
