"""Hot neurons: weight gradients of the most active neurons as dense GEMMs
(docs/design.md §6.3).

The per-neuron SpMM (`csc.spmm_csc`) gives each neuron's token segment to one program,
so a neuron that fires for thousands of tokens runs a loop thousands of entries long
while most programs have finished. Trained models have such neurons (one may fire for a
third of all tokens). Neurons with at least `hot_threshold` ELL entries are taken out of
the CSC index; their dR and dU values are scattered into a dense [M, K, 2] block and T into
an [M, K] one, and their rows of dWu = dR^T x, dWg = dU^T x and dWd = T^T gO come from
tensor-core GEMMs (fp32 accumulation, like the SpMM). K, the block width, is a static
capacity picked on the device from buckets about 1.5x apart (`lax.switch`), so a call
without hot neurons pays for no GEMM and one with a few pays for little more than they
need. When more neurons are hot than the largest capacity holds, the hottest take the
dense block and the least hot of them stay in the CSC index, so the longest segment left
there is about the K-th largest count: taking the first ones by id instead left neurons
of 2000-6000 entries in the index on skewed synthetic gates, against ~300 this way
(docs/performance_notes.md, "Weight-gradient CSC SpMM"). Slower than a block that holds
them all, still exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.sparse_train.dense_rows import after, row_blocks
from pallas_kernels.sparse_train.format import slot_mask

if TYPE_CHECKING:
    from pallas_kernels.sparse_train.config import SparseTrainConfig

_F32 = jnp.float32
# Rows per step of the dense blocks, [rows, K, 2] and [rows, K]: 6 KiB per row at
# K = 1024 in bf16, so a whole micro-batch of 272 x 2048 tokens in one step would need
# 3.2 GiB high in the training step's memory plan (docs/performance_notes.md,
# "Training-step memory"). Calls of up to this many rows run as one block.
BLOCK_ROWS = 32768


def hot_threshold(col_counts: jax.Array, min_count: int, min_skew: float) -> jax.Array:
    """int32 scalar: the ELL entries from which a neuron is hot. `min_count` where the
    layer's busy neurons stand out: those with at least max(min_count, the mean count
    per neuron) entries average at least `min_skew` times the mean count. Elsewhere
    no neuron is hot (the int32 maximum).

    The block pays where a few segments are far longer than the rest. Where the mean
    count nears `min_count` (N = 2048 at l0 >= 23 with M = 16384, say) an even
    pattern's ordinary neurons pass it at ~1.0-1.5x the mean, and the block then costs
    more than the balanced SpMM it replaces; a skewed layer's busy neurons average
    several times the mean (docs/performance_notes.md, "Weight-gradient CSC SpMM").
    Judging only the neurons past the mean keeps a layer whose floor is far below
    its mean count (small M) from diluting its hot neurons with ordinary ones.

    Args:
        col_counts: int32 [N], ELL entries per neuron.
        min_count: static count floor (>= 1).
        min_skew: static; 0 keeps `min_count` whatever the counts.
    """
    floor = jnp.asarray(min_count, jnp.int32)
    if min_skew == 0:
        return floor
    n = col_counts.shape[0]
    total = jnp.sum(col_counts, dtype=_F32)
    busy = col_counts.astype(_F32) >= jnp.maximum(float(min_count), total / n)
    n_busy = jnp.sum(busy, dtype=_F32)
    busy_total = jnp.sum(jnp.where(busy, col_counts, 0), dtype=_F32)
    # mean over the busy >= min_skew * mean over all, without dividing by n_busy = 0
    stands_out = busy_total * n >= min_skew * total * n_busy
    return jnp.where(stands_out, floor, jnp.iinfo(jnp.int32).max)


def config_threshold(col_counts: jax.Array, config: SparseTrainConfig) -> jax.Array:
    """int32 scalar: `hot_threshold` under a resolved config's hot_min_count and
    hot_min_skew (col_counts: int32 [N])."""
    return hot_threshold(col_counts, config.hot_min_count, config.hot_min_skew)


def config_plan(col_counts: jax.Array, config: SparseTrainConfig) -> HotPlan:
    """The `plan_hot` of a resolved config: its threshold and hot_capacities."""
    return plan_hot(col_counts, config_threshold(col_counts, config), config.hot_capacities)


class HotPlan(NamedTuple):
    """Which neurons take the dense block.

    Attributes:
        ids: int32 [K_max], the neurons of the block, padded with N: the hot ones in
            ascending id order, or when more are hot than K_max, those above the
            K_max-th largest count, then those at it (each group by id) up to K_max.
        index: int32 [N], a neuron's column in the dense block, K_max when not hot.
        bucket: int32 scalar index into the capacities: the smallest that holds every
            neuron with at least `min_count` entries, else the largest.
    """

    ids: jax.Array
    index: jax.Array
    bucket: jax.Array

    def is_hot(self) -> jax.Array:
        """bool [N]: the neuron's entries go to the dense block, not the CSC index."""
        return self.index < self.ids.shape[0]


def plan_hot(
    col_counts: jax.Array, min_count: int | jax.Array, capacities: tuple[int, ...]
) -> HotPlan:
    """Selects the neurons with at least `min_count` entries, the hottest first when
    they number more than max(capacities) (`HotPlan.ids`).

    Args:
        col_counts: int32 [N], ELL entries per neuron (`EllRows.col_counts`).
        min_count: entries from which a neuron is hot (>= 1; an int or an int32
            scalar such as `hot_threshold`'s).
        capacities: ascending static block widths, the first 0 or more.
    """
    n = col_counts.shape[0]
    k_max = max(capacities)
    hot = col_counts >= min_count
    n_hot = jnp.sum(hot, dtype=jnp.int32)
    if 0 < k_max < n:
        # Over capacity, rank those above the K_max-th largest count before the ties at
        # it; within capacity every hot neuron is a "tie" and ranks by id.
        over = n_hot > k_max
        kth = jnp.sort(col_counts)[n - k_max]
        above = hot & over & (col_counts > kth)
        tie = hot & ~above & (~over | (col_counts == kth))
        n_above = jnp.sum(above, dtype=jnp.int32)
        rank = jnp.where(
            above,
            jnp.cumsum(above, dtype=jnp.int32) - 1,
            n_above + jnp.cumsum(tie, dtype=jnp.int32) - 1,
        )
        hot = above | tie
    else:
        rank = jnp.cumsum(hot, dtype=jnp.int32) - 1
    index = jnp.where(hot & (rank < k_max), rank, k_max).astype(jnp.int32)
    neurons = jnp.arange(n, dtype=jnp.int32)
    ids = jnp.full((k_max,), n, jnp.int32).at[index].set(neurons, mode="drop")
    fits = n_hot > jnp.asarray(capacities, jnp.int32)
    bucket = jnp.minimum(jnp.sum(fits, dtype=jnp.int32), len(capacities) - 1)
    return HotPlan(ids, index, bucket)


def hot_weight_grads(
    k: int,
    plan: HotPlan,
    ell_count: jax.Array,
    cols: jax.Array,
    dr_vals: jax.Array,
    du_vals: jax.Array,
    t_vals: jax.Array,
    x: jax.Array,
    g_out: jax.Array,
    dws: tuple[jax.Array, jax.Array, jax.Array],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Writes the hot neurons' rows of (dWu, dWg, dWd) with a dense block of width k.

    Args:
        k: static block width (a capacity of the plan); 0 returns dws unchanged.
        plan: from `plan_hot`; its hot neurons must number at most k (or be capped).
        ell_count: int32 [M] ELL slots per row; cols: [M, W] (int16 or int32).
        dr_vals, du_vals, t_vals: [M, W] dR, dU and T at the ELL slots.
        x, g_out: [M, H] tokens and upstream gradient.
        dws: (dWu, dWg, dWd) [N, H] from the CSC SpMM, whose hot rows are zero.

    Returns:
        dws with the hot rows set, in their dtypes.
    """
    if k == 0:
        return dws
    m = cols.shape[0]
    rows_x = rows_g = None
    for start, size in row_blocks(m, BLOCK_ROWS):
        part = (ell_count, cols, dr_vals, du_vals, t_vals, x, g_out)
        if size < m:
            part = tuple(lax.slice_in_dim(a, start, start + size) for a in part)
        if rows_x is not None:  # one row block's scatters live at a time
            part = after(part, (rows_x, rows_g))
        block_x, block_g = _block_products(k, plan.index, *part)
        rows_x = block_x if rows_x is None else rows_x + block_x
        rows_g = block_g if rows_g is None else rows_g + block_g
    rows_x = rows_x.reshape(k, 2, -1)
    ids = plan.ids[:k]
    out = []
    for rows_kh, dw in zip((rows_x[:, 0], rows_x[:, 1], rows_g), dws, strict=True):
        out.append(dw.at[ids].set(rows_kh.astype(dw.dtype), mode="drop"))
    return tuple(out)


def _block_products(k, index, ell_count, cols, dr_vals, du_vals, t_vals, x, g_out):
    """One row block's fp32 products: ([2K, H] dR^T x and dU^T x interleaved as row
    2i + c, [K, H] T^T gO), from the block's entries scattered into dense arrays."""
    m, width = cols.shape
    col = jnp.where(slot_mask(ell_count, width), index[cols], k)
    rows = jnp.arange(m, dtype=jnp.int32)[:, None]
    # A neuron appears at most once per row, so set is exact. dR and dU go side by side
    # into one [M, k, 2] array (one scatter, one GEMM of 2k rows: row 2i + c) and T into
    # its own [M, k], so that each GEMM reads a whole array: XLA copies a strided plane
    # out before a GEMM (docs/performance_notes.md, "Weight-gradient CSC SpMM").
    dtype = jnp.result_type(dr_vals, du_vals, t_vals)
    dr_du = jnp.stack([dr_vals.astype(dtype), du_vals.astype(dtype)], axis=-1)
    block_x = jnp.zeros((m, k, 2), dtype).at[rows, col].set(dr_du, mode="drop")
    block_g = jnp.zeros((m, k), dtype).at[rows, col].set(t_vals.astype(dtype), mode="drop")
    rows_x = jnp.einsum("mj,mh->jh", block_x.reshape(m, 2 * k), x, preferred_element_type=_F32)
    rows_g = jnp.einsum("mk,mh->kh", block_g, g_out, preferred_element_type=_F32)
    return rows_x, rows_g


def switch_hot_grads(plan: HotPlan, capacities: tuple[int, ...], *args) -> tuple:
    """`hot_weight_grads` at the plan's bucket (one static width per branch)."""
    branches = [lambda *a, k=k: hot_weight_grads(k, plan, *a) for k in capacities]
    return lax.switch(plan.bucket, branches, *args)
