"""Hybrid ELL + dense-tail layout of the sparse gate for training (twell.md §5).

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

Everything here is plain `jnp`; `sparse_train.compact_rows` is the Pallas version of
`compact_rows_ref`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class EllRows(NamedTuple):
    """ELL part of a hybrid matrix with `M` rows and width `W`.

    Attributes:
        counts: int32 [M], the true number of positives of each row (may exceed W).
        cols: int32 [M, W], ascending column indices; 0 in unused slots.
        vals: [M, W] values (the gate's dtype); 0 in unused slots.
    """

    counts: jax.Array
    cols: jax.Array
    vals: jax.Array


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
        order: int32 [N], neurons by descending entry count (ties by id), so that a
            kernel launching one program per neuron starts the longest ones first.
    """

    offsets: jax.Array
    slots: jax.Array
    order: jax.Array


def slot_mask(ell_count: jax.Array, width: int) -> jax.Array:
    """bool [M, W]: which ELL slots hold an entry the kernels must use."""
    return jnp.arange(width, dtype=jnp.int32)[None, :] < ell_count[:, None]


def ell_counts(counts: jax.Array, width: int) -> jax.Array:
    """Per-row number of ELL slots to process: the count, or 0 for tail rows."""
    return jnp.where(counts > width, 0, counts).astype(jnp.int32)


def compact_rows_ref(p: jax.Array, width: int) -> tuple[EllRows, jax.Array]:
    """Packs the positive entries of a gate [M, N] into ELL rows of width W (jnp reference).

    Args:
        p: [M, N] gate pre-activations (or their relu); entries > 0 are the pattern.
        width: W, the ELL width.

    Returns:
        (EllRows, fired) where fired is bool [N]: the neuron is positive in some row.
    """
    m, n = p.shape
    pos = p > 0
    counts = jnp.sum(pos, axis=1, dtype=jnp.int32)
    slot = jnp.cumsum(pos, axis=1, dtype=jnp.int32) - 1
    slot = jnp.where(pos & (slot < width), slot, width)  # width: out of range, dropped
    rows = jnp.arange(m, dtype=jnp.int32)[:, None]
    col_ids = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None, :], (m, n))
    cols = jnp.zeros((m, width), jnp.int32).at[rows, slot].set(col_ids, mode="drop")
    vals = jnp.zeros((m, width), p.dtype).at[rows, slot].set(p, mode="drop")
    return EllRows(counts, cols, vals), jnp.any(pos, axis=0)


def plan_tail(counts: jax.Array, width: int, capacities: tuple[int, ...]) -> TailPlan:
    """Selects the heavy rows (count > W) and the smallest capacity bucket that fits."""
    m = counts.shape[0]
    heavy = counts > width
    n_rows = jnp.sum(heavy, dtype=jnp.int32)
    c_max = max(capacities)
    if c_max:
        (rows,) = jnp.nonzero(heavy, size=c_max, fill_value=m)
        rows = rows.astype(jnp.int32)
    else:
        rows = jnp.zeros((0,), jnp.int32)
    bucket = jnp.sum(n_rows > jnp.asarray(capacities, jnp.int32), dtype=jnp.int32)
    return TailPlan(rows, n_rows, bucket)


def build_csc(ell_count: jax.Array, cols: jax.Array, n: int) -> Csc:
    """Sorts the valid ELL slots by neuron (stable XLA sort, deterministic)."""
    m, width = cols.shape
    key = jnp.where(slot_mask(ell_count, width), cols, n).reshape(-1)
    ids = jnp.arange(m * width, dtype=jnp.int32)
    key_sorted, slots = lax.sort((key, ids), num_keys=1, is_stable=True)
    # Unrolled binary search: ~log2(M W) fused gather steps, no device while loop.
    queries = jnp.arange(n + 1, dtype=jnp.int32)
    offsets = jnp.searchsorted(key_sorted, queries, side="left", method="scan_unrolled")
    offsets = offsets.astype(jnp.int32)
    neurons = jnp.arange(n, dtype=jnp.int32)
    _, order = lax.sort((offsets[:-1] - offsets[1:], neurons), num_keys=1, is_stable=True)
    return Csc(offsets, slots, order)


def ell_to_dense(ell: EllRows, n: int, width: int | None = None) -> jax.Array:
    """[M, N] dense matrix of the ELL part (rows with count > W give their first W)."""
    m, w = ell.cols.shape
    valid = slot_mask(jnp.minimum(ell.counts, w if width is None else width), w)
    rows = jnp.arange(m, dtype=jnp.int32)[:, None]
    cols = jnp.where(valid, ell.cols, n)
    return jnp.zeros((m, n), ell.vals.dtype).at[rows, cols].set(ell.vals, mode="drop")
