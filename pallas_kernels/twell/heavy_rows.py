"""Heavy rows of a TwELL call: rows with a tile past capacity, or far longer than the
mean, go to a dense tail.

A (row, tile) with more positives than its W - 1 slots is recomputed densely inside
the SpMM, tile by tile and row by row, which is cheap for a few tiles and ruinous for
thousands: with a heavy-tailed l0 per token (mean 29, p99 about 13x that) the default
C = 8 overflowed 339 tiles at M = 16384 and ran at 0.22x dense (docs/results.md,
"TwELL inference under heavy-tailed rows"). Here a call's heavy rows (any tile past
capacity) instead get a count of 0 in every tile of the packed gate, so the T2D
kernels see empty rows, and run through the dense formula on a [C, H] gather, C a
static capacity picked on the device (`lax.switch`) from a few buckets; the tail takes
their gate rows from the call's gate GEMM output, so it runs only the up and down
products. More heavy rows than the largest bucket keep the in-kernel recompute.

Long rows join the tail too. The T2D kernels give each row to one program, so a row
walks its entries one group (one L2 round trip) at a time, and a row with hundreds of
entries that starts late ends the kernel long after the rest: with that heavy-tailed
l0 the SDDMM and SpMM took 1.7x their uniform time at M = 16384 although the rows left
in them held fewer entries (docs/performance_notes.md, "Heavy-tailed rows in
inference"). A row is long when its count passes a threshold, the lowest of a ladder
(a factor, twice it, four and eight times it, times the call's mean count, and at
least a floor) at which heavy and long rows together fit the largest bucket, so a
dense call never loses the tail its heavy rows need.

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
CAPACITY_DIVISORS = (128, 64, 32, 16, 8)
MIN_CAPACITY = 8
# Long-row thresholds tried, lowest first: factor x 1, 2, 4, 8 times the mean count.
LADDER = 4


def capacities(m: int) -> tuple[int, ...]:
    """Static tail capacities for M rows: 0, then M/128, M/64, ..., M/8 (at least 8
    rows, at most M), ascending and distinct."""
    caps = {min(m, max(MIN_CAPACITY, -(-m // d))) for d in CAPACITY_DIVISORS}
    return (0, *sorted(caps))


def heavy(counts: jax.Array, slots: int) -> jax.Array:
    """bool [M]: rows with a tile past its W - 1 entry slots."""
    return jnp.any(counts >= slots, axis=0)


def _thresholds(totals: jax.Array, factor: float, min_entries: int) -> jax.Array:
    """int32 [LADDER]: max(min_entries, factor x 2^k x the mean of `totals`)."""
    mean = jnp.sum(totals, dtype=jnp.float32) / max(totals.shape[0], 1)
    scale = factor * 2.0 ** jnp.arange(LADDER, dtype=jnp.float32)
    return jnp.maximum(min_entries, jnp.ceil(scale * mean)).astype(jnp.int32)


def tail_rows(counts: jax.Array, slots: int, factor: float, min_entries: int) -> jax.Array:
    """bool [M]: the rows the dense tail takes (counts int32 [N / 256, M]).

    Heavy rows always; long rows too, those past the lowest threshold of
    `_thresholds` at which heavy and long rows together still fit the largest
    capacity (none fits: heavy rows alone). factor 0 takes heavy rows only.
    """
    over = heavy(counts, slots)
    if factor <= 0:
        return over
    totals = jnp.sum(counts, axis=0, dtype=jnp.int32)
    either = over[None, :] | (totals[None, :] > _thresholds(totals, factor, min_entries)[:, None])
    fits = jnp.sum(either, axis=1, dtype=jnp.int32) <= capacities(counts.shape[1])[-1]
    pick = jnp.argmax(fits)  # the lowest threshold that fits (0 when none does)
    return jnp.where(fits[pick], either[pick], over)


def plan(
    counts: jax.Array, slots: int, factor: float, min_entries: int
) -> tuple[jax.Array, jax.Array, tuple[int, ...]]:
    """(bucket int32, rows int32 [C_max], caps) for a call's tile counts.

    bucket indexes `caps` (the smallest capacity >= the number of tail rows,
    `tail_rows` with factor and min_entries), or is len(caps) when there are more
    heavy rows than the largest capacity; rows lists the tail rows ascending, padded
    with M, when the bucket has a tail, else all M.
    """
    m = counts.shape[1]
    caps = capacities(m)
    in_tail = tail_rows(counts, slots, factor, min_entries)
    n = jnp.sum(in_tail, dtype=jnp.int32)
    bucket = jnp.sum(n > jnp.asarray(caps, jnp.int32), dtype=jnp.int32)
    c_max = caps[-1]
    none = lambda: jnp.full((c_max,), m, jnp.int32)
    # jnp.nonzero is a scan over M: only the buckets with a tail pay for it.
    listed = lambda: jnp.nonzero(in_tail, size=c_max, fill_value=m)[0].astype(jnp.int32)
    branches = [none] + [listed] * (len(caps) - 1) + [none]
    return bucket, lax.switch(bucket, branches), caps


def clear(packed: jax.Array, rows: jax.Array, slots: int) -> jax.Array:
    """packed with the count word (word 0) of every tile of the listed rows set to 0, so
    the T2D kernels read no entry of theirs and recompute no tile (the other words are
    undefined past a tile's count anyway); padding ids (M) are dropped. Only C_max x
    N / 256 words are written."""
    heads = jnp.arange(packed.shape[1] // slots, dtype=jnp.int32) * slots
    return packed.at[rows[:, None], heads[None, :]].set(0, mode="drop")


def _tail(cap: int, x, gate, weights, rows, high_precision: bool):
    """The dense formula on the first `cap` listed rows, padded to [C_max, H]; their
    gate rows come from the call's gate GEMM, not a second one."""
    c_max = rows.shape[0]
    if cap == 0:
        return jnp.zeros((c_max, x.shape[1]), x.dtype)
    take = lambda a: a.at[rows[:cap]].get(mode="fill", fill_value=0)
    out_t = reference.from_gate(take(x), take(gate), weights, high_precision=high_precision)
    return jnp.pad(out_t, ((0, c_max - cap), (0, 0)))


def add_tail(out, x, gate, weights, bucket, rows, caps, *, high_precision: bool) -> jax.Array:
    """out with the listed rows replaced by the dense formula's (`plan`'s bucket); gate
    is the call's relu(x W0^T), bf16 [M, N]."""
    tails = [functools.partial(_tail, cap, high_precision=high_precision) for cap in caps]
    tails.append(functools.partial(_tail, 0, high_precision=high_precision))  # in-kernel
    out_t = lax.switch(bucket, tails, x, gate, weights, rows)
    return out.at[rows].set(out_t, mode="drop")
