"""Heavy rows of a TwELL call: rows with a tile past capacity go to a dense tail.

A (row, tile) with more positives than its W - 1 slots is recomputed densely inside
the SpMM, tile by tile and row by row, which is cheap for a few tiles and ruinous for
thousands: with a heavy-tailed l0 per token (mean 29, p99 about 13x that) the default
C = 8 overflowed 339 tiles at M = 16384 and ran at 0.22x dense (docs/results.md,
"TwELL inference under heavy-tailed rows"). Here a call's heavy rows (any tile past
capacity) instead get a count of 0 in every tile of the packed gate, so the T2D
kernels see empty rows, and run through the dense formula on a [C, H] gather, C a
static capacity picked on the device (`lax.switch`) from a few buckets. More heavy
rows than the largest bucket keep the in-kernel recompute.

Shapes: x [M, H] bf16; packed uint32 [M, N / C]; counts int32 [N / 256, M] (the pack's
true tile counts); weights [N, H].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.twell import reference

# Bucket capacities as fractions of M (each at least MIN_CAPACITY rows, at most M).
CAPACITY_DIVISORS = (128, 32, 8)
MIN_CAPACITY = 8


def capacities(m: int) -> tuple[int, ...]:
    """Static tail capacities for M rows: 0, then M/128, M/32, M/8 (at least 8 rows,
    at most M), ascending and distinct."""
    caps = {min(m, max(MIN_CAPACITY, -(-m // d))) for d in CAPACITY_DIVISORS}
    return (0, *sorted(caps))


def heavy(counts: jax.Array, slots: int) -> jax.Array:
    """bool [M]: rows with a tile past its W - 1 entry slots."""
    return jnp.any(counts >= slots, axis=0)


def plan(counts: jax.Array, slots: int) -> tuple[jax.Array, jax.Array, tuple[int, ...]]:
    """(bucket int32, rows int32 [C_max], caps) for a call's tile counts.

    bucket indexes `caps` (the smallest capacity >= the number of heavy rows), or is
    len(caps) when there are more heavy rows than the largest capacity; rows lists the
    heavy rows ascending, padded with M, when the bucket has a tail, else all M.
    """
    m = counts.shape[1]
    caps = capacities(m)
    is_heavy = heavy(counts, slots)
    n = jnp.sum(is_heavy, dtype=jnp.int32)
    bucket = jnp.sum(n > jnp.asarray(caps, jnp.int32), dtype=jnp.int32)
    c_max = caps[-1]
    none = lambda: jnp.full((c_max,), m, jnp.int32)
    # jnp.nonzero is a scan over M: only the buckets with a tail pay for it.
    listed = lambda: jnp.nonzero(is_heavy, size=c_max, fill_value=m)[0].astype(jnp.int32)
    branches = [none] + [listed] * (len(caps) - 1) + [none]
    return bucket, lax.switch(bucket, branches), caps


def clear(packed: jax.Array, rows: jax.Array, slots: int) -> jax.Array:
    """packed with the count word (word 0) of every tile of the listed rows set to 0, so
    the T2D kernels read no entry of theirs and recompute no tile (the other words are
    undefined past a tile's count anyway); padding ids (M) are dropped. Only C_max x
    N / 256 words are written."""
    heads = jnp.arange(packed.shape[1] // slots, dtype=jnp.int32) * slots
    return packed.at[rows[:, None], heads[None, :]].set(0, mode="drop")


def _tail(cap: int, x, weights, rows, high_precision: bool):
    """The dense formula on the first `cap` listed rows, padded to [C_max, H]."""
    c_max = rows.shape[0]
    if cap == 0:
        return jnp.zeros((c_max, x.shape[1]), x.dtype)
    x_t = x.at[rows[:cap]].get(mode="fill", fill_value=0)
    out_t, _ = reference.dense_forward(x_t, weights, high_precision=high_precision)
    return jnp.pad(out_t, ((0, c_max - cap), (0, 0)))


def add_tail(out, x, weights, bucket, rows, caps, *, high_precision: bool) -> jax.Array:
    """out with the listed rows replaced by the dense formula's (`plan`'s bucket)."""
    tails = [functools.partial(_tail, cap, high_precision=high_precision) for cap in caps]
    tails.append(functools.partial(_tail, 0, high_precision=high_precision))  # in-kernel
    out_t = lax.switch(bucket, tails, x, weights, rows)
    return out.at[rows].set(out_t, mode="drop")
