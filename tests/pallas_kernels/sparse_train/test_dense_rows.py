"""The dense gated MLP in row blocks against the whole-M dense formula.

Integer-valued bf16 inputs make every fp32 sum exact, so outputs, statistics and the
input gradient (each row depends on its block only) must equal the whole-M computation
bit for bit. Weight gradients are summed over blocks: each block's bf16 GEMM output is
rounded once before the fp32 sum, so they may differ from the single GEMM's by one bf16
rounding per block (2^-8 of the largest magnitude each).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_train import blocked_gated_mlp, dense_rows
from pallas_kernels.sparse_train.reference import gated_hidden
from tests.pallas_kernels.twell.kernel_cases import integer_mlp

M, H, N = 40, 64, 128


# Rows with more non-zeros than this are counted (the sparse op's ELL width W).
ROW_LIMIT = 13


def whole(x, wg, wu, wd):
    """(out, sum |h|, RowCounts) of the whole-M dense formula."""
    hid = gated_hidden(x, wg, wu)
    out = jnp.einsum("mn,nh->mh", hid, wd).astype(x.dtype)
    nz = hid != 0
    l1 = jnp.sum(jnp.abs(hid.astype(jnp.float32)))
    heavy = jnp.sum(nz, axis=1) > ROW_LIMIT
    counts = dense_rows.RowCounts(
        jnp.sum(nz, dtype=jnp.float32),
        nz.any(0),
        jnp.sum(nz, axis=0, dtype=jnp.int32),
        jnp.sum(heavy, dtype=jnp.int32),
    )
    return out, l1, counts


def loss_of(fn, lam=0.01):
    def loss(x, wg, wu, wd):
        out, l1, *_ = fn(x, wg, wu, wd)
        return jnp.sum(out.astype(jnp.float32) ** 2) + lam * l1

    return loss


@pytest.mark.parametrize("block_rows", [16, 40, 7])
def test_integer_inputs_match_whole_m_bitwise(block_rows):
    x, wg, wu, wd = integer_mlp(0, M, H, N, 20.0)
    blocked = lambda *a: blocked_gated_mlp(*a, block_rows, ROW_LIMIT)
    got_all, want_all = blocked(x, wg, wu, wd), whole(x, wg, wu, wd)
    for got, want in zip(jax.tree.leaves(got_all), jax.tree.leaves(want_all), strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert 0 < int(want_all[2].heavy_rows) < M  # both kinds of row are counted
    grads = jax.grad(loss_of(blocked), argnums=(0, 1, 2, 3))(x, wg, wu, wd)
    want = jax.grad(loss_of(whole), argnums=(0, 1, 2, 3))(x, wg, wu, wd)
    for g, w in zip(grads, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(np.asarray(grads[0], np.float32), np.asarray(want[0], np.float32))
    blocks = len(dense_rows.row_blocks(M, block_rows))
    for g, w in zip(grads[1:], want[1:], strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, rtol=0, atol=(blocks + 1) * 2**-8 * np.abs(w).max())


def test_normal_inputs_match_within_bf16():
    rng = np.random.default_rng(1)
    x, wg, wu, wd = (jnp.asarray(rng.standard_normal(s) * 0.3, jnp.bfloat16)
                     for s in ((M, H), (N, H), (N, H), (N, H)))  # fmt: skip
    blocked = lambda *a: blocked_gated_mlp(*a, 16, ROW_LIMIT)
    grads = jax.grad(loss_of(blocked), argnums=(1, 2, 3))(x, wg, wu, wd)
    want = jax.grad(loss_of(whole), argnums=(1, 2, 3))(x, wg, wu, wd)
    for g, w in zip(grads, want, strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-2 * np.abs(w).max())


def test_dead_neurons_and_empty_rows():
    """A gate that is negative everywhere: zero output, statistics and weight gradients
    of W_gate / W_up (W_down's gradient is zero as h is)."""
    x, wg, wu, wd = integer_mlp(2, M, H, N, 20.0)
    wg = jnp.zeros_like(wg).at[:, 0].set(-1.0)  # x[:, 0] = 1: every pre-activation is -1
    out, l1, counts = blocked_gated_mlp(x, wg, wu, wd, 16, ROW_LIMIT)
    assert float(jnp.abs(out.astype(jnp.float32)).max()) == 0.0
    assert float(l1) == float(counts.nnz) == 0.0 and int(counts.heavy_rows) == 0
    assert not bool(counts.fired.any()) and not bool(counts.col_counts.any())
    grads = jax.grad(loss_of(lambda *a: blocked_gated_mlp(*a, 16, ROW_LIMIT)), argnums=(1, 2, 3))(
        x, wg, wu, wd
    )
    assert all(float(jnp.abs(g.astype(jnp.float32)).max()) == 0.0 for g in grads)


def test_row_blocks_cover_m_once():
    for m, rows in [(40, 16), (40, 7), (1, 4096), (131072, 4096)]:
        blocks = dense_rows.row_blocks(m, rows)
        assert blocks[0][0] == 0 and sum(size for _, size in blocks) == m
        assert all(a + sa == b for (a, sa), (b, _) in itertools.pairwise(blocks))
        assert len(blocks) <= dense_rows.MAX_BLOCKS


@pytest.mark.parametrize("fn", ["forward", "backward"])
def test_each_block_waits_for_everything_the_previous_one_made(fn):
    """Every block's inputs pass an optimization barrier with all that the blocks before
    it produced (output rows, sums, counts; gradients in the backward), so a scheduler
    cannot leave one block's reductions for later and keep its [rows, N] values live
    while the next blocks run."""
    x, wg, wu, wd = (jnp.ones(s, jnp.bfloat16) for s in [(M, H), (N, H), (N, H), (N, H)])
    if fn == "forward":
        jaxpr = jax.make_jaxpr(
            lambda *a: dense_rows.dense_forward(*a, block_rows=16, row_limit=ROW_LIMIT)
        )(x, wg, wu, wd)
        produced = 1 + 1 + len(dense_rows.RowCounts._fields)  # out, l1, counts
    else:
        jaxpr = jax.make_jaxpr(lambda *a: dense_rows.dense_backward(*a, block_rows=16))(
            x, x, wg, wu, wd, jnp.float32(0.1)
        )
        produced = 1 + 3  # dx, three weight gradients
    barriers = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
    assert len(barriers) == len(dense_rows.row_blocks(M, 16))
    inputs = 1 if fn == "forward" else 2  # the block's x (and g_out) rows
    assert all(len(e.invars) == inputs + produced for e in barriers)
