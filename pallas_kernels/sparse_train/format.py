"""Hybrid ELL + dense-tail layout of the sparse gate for training (docs/design.md §5).

A sparse gate P = relu(x Wg^T) [M, N] is held as
- an ELL part of width W: per row the TRUE positive count (not capped at W), the
  int32 column indices and the values of its first min(count, W) positives in
  ascending column order; unused slots hold column 0 and value 0;
- a dense tail: the rows whose count exceeds W are processed densely (small XLA
  GEMMs on the gathered rows). Their ELL slots are ignored (`ell_counts` gives 0).
  The tail's row capacity is one of a few static buckets picked on the device from
  the number of heavy rows; when even the largest bucket is too small the caller runs
  the whole call densely. Nothing is dropped: every heavy row is either in the tail
  or covered by the dense fallback, and both cases are counted.

The transposed products (weight gradients) need the pattern by neuron (CSC). It is
built with a stable XLA sort of the ELL slots by column, so entries of a neuron are in
token order and the result is deterministic (no atomics).

Everything here is plain `jnp`; `compaction.compact_rows` builds the ELL part.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class EllRows(NamedTuple):
    """ELL part of a hybrid matrix with `M` rows, `N` columns and width `W`.

    Attributes:
        counts: int32 [M], the true number of positives of each row (may exceed W).
        cols: [M, W] ascending column indices (`col_dtype(N)`: int16 while N fits);
            0 in unused slots.
        vals: [M, W] values (the gate's dtype); 0 in unused slots.
        col_counts: int32 [N], entries per column of the rows the ELL part serves
            (count <= W; tail rows excluded): the sizes of the CSC segments.
    """

    counts: jax.Array
    cols: jax.Array
    vals: jax.Array
    col_counts: jax.Array


class TailPlan(NamedTuple):
    """Which rows go to the dense tail and with which static capacity.

    Attributes:
        rows: int32 [C_max], ascending token ids of the rows whose count exceeds W,
            padded with M (an out-of-range id: gathers fill 0, scatters drop it).
            Holds the first C_max such rows when there are more.
        n_rows: int32 scalar, the number of rows whose count exceeds W (uncapped).
        bucket: int32 scalar index into the capacities: the smallest capacity that
            holds `n_rows`, or `len(capacities)` when none does (dense fallback).
    """

    rows: jax.Array
    n_rows: jax.Array
    bucket: jax.Array


class Csc(NamedTuple):
    """The valid ELL slots sorted by column (neuron), stably (token order within).

    Attributes:
        offsets: int32 [N + 1]; neuron n owns sorted positions offsets[n]:offsets[n+1].
        slots: int32 [M * W], flat slot ids (row * W + slot) in sorted order; the
            positions from offsets[N] on are unused slots.
        order: int32 [N], neurons from the most entries to the fewest by powers of two
            (2**k <= count < 2**(k+1); ties by id), so that a kernel launching one
            program per neuron starts the longest ones first.
    """

    offsets: jax.Array
    slots: jax.Array
    order: jax.Array


def col_dtype(n: int):
    """dtype of the ELL column ids for N columns: int16 while N fits (half the bytes of
    the [M, W] array every kernel and the remat residuals read), else int32."""
    return jnp.int16 if n <= jnp.iinfo(jnp.int16).max else jnp.int32


def slot_mask(ell_count: jax.Array, width: int) -> jax.Array:
    """bool [M, W]: which ELL slots hold an entry the kernels must use."""
    return jnp.arange(width, dtype=jnp.int32)[None, :] < ell_count[:, None]


def ell_counts(counts: jax.Array, width: int) -> jax.Array:
    """Per-row number of ELL slots to process: the count, or 0 for tail rows."""
    return jnp.where(counts > width, 0, counts).astype(jnp.int32)


def plan_tail(counts: jax.Array, width: int, capacities: tuple[int, ...]) -> TailPlan:
    """Selects the heavy rows (count > W) and the smallest capacity bucket that fits."""
    m = counts.shape[0]
    heavy = counts > width
    n_rows = jnp.sum(heavy, dtype=jnp.int32)
    c_max = max(capacities)
    if c_max:
        # Listing the rows (a cumsum and a scatter over M) costs ~25 us on an H200 at
        # M = 16384: skipped when no row is heavy, the common case.
        rows = lax.cond(
            n_rows > 0,
            lambda: jnp.nonzero(heavy, size=c_max, fill_value=m)[0].astype(jnp.int32),
            lambda: jnp.full((c_max,), m, jnp.int32),
        )
    else:
        rows = jnp.zeros((0,), jnp.int32)
    bucket = jnp.sum(n_rows > jnp.asarray(capacities, jnp.int32), dtype=jnp.int32)
    return TailPlan(rows, n_rows, bucket)


def heaviest_first(col_counts: jax.Array) -> jax.Array:
    """int32 [N]: columns by descending floor(log2(count)), ties by id.

    A stable counting sort over 32 buckets: a few small fused XLA ops instead of an XLA
    sort of N keys (docs/performance_notes.md, "Weight-gradient CSC SpMM").
    """
    n = col_counts.shape[0]
    bucket = lax.clz(col_counts.astype(jnp.int32))  # 32 for 0; fewer leading zeros: heavier
    onehot = (bucket[:, None] == jnp.arange(33, dtype=jnp.int32)[None, :]).astype(jnp.int32)
    rank_in_bucket = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    sizes = jnp.sum(onehot, axis=0)
    starts = jnp.cumsum(sizes) - sizes
    pos = starts[bucket] + rank_in_bucket
    return jnp.zeros((n,), jnp.int32).at[pos].set(jnp.arange(n, dtype=jnp.int32))


def build_csc(
    ell_count: jax.Array,
    cols: jax.Array,
    col_counts: jax.Array,
    exclude: jax.Array,
) -> Csc:
    """Sorts the valid ELL slots by neuron (stable XLA sort, deterministic).

    Args:
        ell_count: int32 [M], ELL slots to use per row (`ell_counts`).
        cols: [M, W] ELL columns (int16 or int32).
        col_counts: int32 [N], `EllRows.col_counts` (valid slots per column).
        exclude: bool [N], neurons left out of the index (empty segments; their slots
            sort past offsets[N] with the unused ones).
    """
    m, width = cols.shape
    n = col_counts.shape[0]
    valid = slot_mask(ell_count, width) & ~exclude[cols]
    col_counts = jnp.where(exclude, 0, col_counts)
    # Keys as narrow as the column ids allow: the GPU radix sort then makes 2 passes
    # instead of 4 over the M W slots.
    key_dtype = jnp.uint16 if n < jnp.iinfo(jnp.uint16).max else jnp.int32
    key = jnp.where(valid, cols, n).astype(key_dtype).reshape(-1)
    ids = jnp.arange(m * width, dtype=jnp.int32)
    _, slots = lax.sort((key, ids), num_keys=1, is_stable=True)
    # Offsets and order are computed after the sort (a data dependency through the
    # barrier): the sort cannot join a CUDA graph, and XLA only puts runs of at least
    # a few capturable ops into one. Scheduled before it, these fusions left the
    # backward's cond a run of one, so it went back to a host round trip (§6.4).
    col_counts = lax.optimization_barrier((col_counts, slots))[0]
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(col_counts, dtype=jnp.int32)])
    return Csc(offsets, slots, heaviest_first(col_counts))
