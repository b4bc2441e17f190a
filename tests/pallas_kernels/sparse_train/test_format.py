"""Hybrid ELL + dense-tail layout: reference builders, tail plan and CSC index."""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.sparse_train import compaction
from pallas_kernels.sparse_train import format as fmt


def _gate(seed, m, n, density, heavy=(), zero=()):
    """Random non-negative bf16 gate [M, N] with some heavy and all-zero rows."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    vals = jax.random.uniform(k1, (m, n), minval=0.1, maxval=2.0)
    keep = jax.random.uniform(k2, (m, n)) < density
    keep = keep.at[jnp.asarray(heavy, jnp.int32)].set(True)
    keep = keep.at[jnp.asarray(zero, jnp.int32)].set(False)
    return jnp.where(keep, vals, 0).astype(jnp.bfloat16)


def _ell_to_dense(ell, n):
    """[M, N] dense matrix of the ELL part (rows with count > W give their first W)."""
    m, w = ell.cols.shape
    valid = fmt.slot_mask(jnp.minimum(ell.counts, w), w)
    rows = jnp.arange(m, dtype=jnp.int32)[:, None]
    cols = jnp.where(valid, ell.cols, n)
    return jnp.zeros((m, n), ell.vals.dtype).at[rows, cols].set(ell.vals, mode="drop")


def test_compact_rows_ref_round_trip():
    m, n, w = 24, 96, 8
    p = _gate(0, m, n, 0.05, heavy=(2, 9), zero=(0, 5))
    ell, fired, _ = compaction.compact_rows_ref(p, w)
    p_np = np.asarray(p, np.float32)
    np.testing.assert_array_equal(ell.counts, (p_np > 0).sum(1))
    np.testing.assert_array_equal(fired, (p_np > 0).any(0))
    dense = np.asarray(_ell_to_dense(ell, n), np.float32)
    light = np.asarray(ell.counts) <= w
    np.testing.assert_array_equal(dense[light], p_np[light])
    for i in (2, 9):  # heavy rows keep their first W entries, in column order
        cols = np.nonzero(p_np[i])[0]
        np.testing.assert_array_equal(ell.cols[i], cols[:w])
        np.testing.assert_array_equal(np.asarray(ell.vals[i], np.float32), p_np[i, cols[:w]])
    # Unused slots are defined: column 0, value 0.
    valid = np.asarray(fmt.slot_mask(jnp.minimum(ell.counts, w), w))
    assert (np.asarray(ell.cols)[~valid] == 0).all()
    assert (np.asarray(ell.vals, np.float32)[~valid] == 0).all()


def test_ell_counts_zero_for_tail_rows():
    counts = jnp.asarray([0, 3, 8, 9, 100], jnp.int32)
    np.testing.assert_array_equal(fmt.ell_counts(counts, 8), [0, 3, 8, 0, 0])


def test_plan_tail_buckets_and_fallback():
    w, caps = 4, (0, 2, 4)
    counts = jnp.asarray([1, 5, 0, 9, 4, 7, 2], jnp.int32)  # heavy rows: 1, 3, 5
    plan = fmt.plan_tail(counts, w, caps)
    np.testing.assert_array_equal(plan.rows, [1, 3, 5, 7])  # padded with M = 7
    assert int(plan.n_rows) == 3
    assert int(plan.bucket) == 2  # capacity 4 is the smallest that holds 3 rows
    assert int(fmt.plan_tail(jnp.asarray([1, 2], jnp.int32), w, caps).bucket) == 0
    over = fmt.plan_tail(jnp.full((6,), 9, jnp.int32), w, caps)  # 6 heavy > 4: fallback
    assert int(over.n_rows) == 6 and int(over.bucket) == len(caps)
    np.testing.assert_array_equal(over.rows, [0, 1, 2, 3])


def test_build_csc_sorted_by_neuron_then_token():
    m, n, w = 20, 64, 8
    p = _gate(1, m, n, 0.08, heavy=(4,), zero=(7,))
    ell, *_ = compaction.compact_rows_ref(p, w)
    ell_count = fmt.ell_counts(ell.counts, w)
    csc = fmt.build_csc(ell_count, ell.cols, ell.col_counts, exclude=jnp.zeros((n,), bool))
    p_np = np.asarray(p, np.float32)
    p_np[np.asarray(ell.counts) > w] = 0  # tail rows are not in the ELL index
    np.testing.assert_array_equal(ell.col_counts, (p_np > 0).sum(0))
    offsets, slots = np.asarray(csc.offsets), np.asarray(csc.slots)
    assert offsets[0] == 0 and offsets[-1] == int(ell_count.sum())
    for j in range(n):
        seg = slots[offsets[j] : offsets[j + 1]]
        np.testing.assert_array_equal(seg // w, np.nonzero(p_np[:, j])[0])  # token order
        np.testing.assert_array_equal(np.asarray(ell.cols).reshape(-1)[seg], j)
    # Heaviest first by powers of two, ties by id; every neuron exactly once.
    order, cc = np.asarray(csc.order), np.asarray(ell.col_counts)
    np.testing.assert_array_equal(np.sort(order), np.arange(n))
    power = np.where(cc[order] > 0, np.floor(np.log2(np.maximum(cc[order], 1))), -1)
    assert (np.diff(power) <= 0).all()
    for k in np.unique(power):
        assert (np.diff(order[power == k]) > 0).all()


def test_heaviest_first_buckets():
    counts = jnp.asarray([0, 5, 1, 4, 300, 7, 0, 2, 3], jnp.int32)
    # 300 | 5, 4, 7 | 2, 3 | 1 | 0, 0
    np.testing.assert_array_equal(fmt.heaviest_first(counts), [4, 1, 3, 5, 7, 8, 2, 0, 6])


def test_column_ids_are_int16_while_n_fits():
    assert fmt.col_dtype(5632) == jnp.int16 and fmt.col_dtype(32767) == jnp.int16
    assert fmt.col_dtype(32768) == jnp.int32
