"""Pulling a tile's positive entries out in column order without a scatter (kernel code).

The pack (TwELL) and compaction (ELL) kernels turn a loaded [R, T] tile of a sparse
activation into a short list of entries per row. Scattering every positive element to
its prefix-count slot makes Triton move the whole tile's pointers, masks and values
through shared memory into the scatter's one-element-per-thread layout: on the H200
that kept L1 ~90% busy and the kernels at ~4x their HBM floor, although ~99% of the
lanes store nothing.

Here round j instead takes, for every row, the smallest key above the one of round
j - 1: a row-wise min-reduction in the load's own layout (in-thread, then warp
shuffles), then one store of an [R] vector. Keys order entries by column and carry
16-bit values along, so one reduction per round yields both. A block needs as many
rounds as its fullest row has entries to store (a few at ~0.5% density).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

NO_ENTRY = jnp.iinfo(jnp.int32).max  # key of a non-positive element / of no more entries
_LANE_SHIFT = 16


def entry_keys(values: jax.Array, positive: jax.Array, lane: jax.Array) -> jax.Array:
    """int32 keys (values' shape) that sort a tile's positive entries by column.

    Args:
        values: [R, T] the tile (any float dtype).
        positive: bool, values' shape: the entries.
        lane: int32 [T], column within the tile (< 2**15).

    Returns:
        (lane << 16) | value bits for 16-bit values (lane alone otherwise); NO_ENTRY
        where not positive.
    """
    keys = jnp.broadcast_to(lane[None] << _LANE_SHIFT, values.shape)
    if values.dtype.itemsize == 2:
        # Positive 16-bit floats have the sign bit clear: their bits fit the low half.
        keys = keys | lax.bitcast_convert_type(values, jnp.int16).astype(jnp.int32)
    return jnp.where(positive, keys, NO_ENTRY)


def key_lane(key: jax.Array) -> jax.Array:
    """int32 column within the tile of each key."""
    return key >> _LANE_SHIFT


def key_value(key: jax.Array, values: jax.Array, lane: jax.Array) -> jax.Array:
    """[R] value of each row's key, in values.dtype (garbage where key == NO_ENTRY).

    16-bit values come out of the key; others are picked from the [R, T] tile by a
    second reduction.
    """
    if values.dtype.itemsize == 2:
        bits = (key & 0xFFFF).astype(jnp.int16)
        return lax.bitcast_convert_type(bits, values.dtype)
    hit = lane[None, :] == key_lane(key)[:, None]
    return jnp.max(jnp.where(hit, values, 0), axis=1).astype(values.dtype)


def next_keys(keys: jax.Array, prev: jax.Array) -> jax.Array:
    """Per row, the smallest key above prev: keys [R, ...] (any rank), prev [R] -> [R]."""
    above = jnp.where(keys > prev[(slice(None),) + (None,) * (keys.ndim - 1)], keys, NO_ENTRY)
    while above.ndim > 1:  # one axis at a time: innermost first (in-thread when blocked)
        above = jnp.min(above, axis=-1)
    return above


def for_each_entry(keys: jax.Array, n_rounds: jax.Array, body) -> None:
    """Calls body(j, key) for j in [0, n_rounds): key [R] is each row's j-th key.

    keys: [R, ...] per-row keys of any rank. Rows with fewer than j + 1 entries get
    NO_ENTRY. n_rounds may be a traced scalar (a dynamic loop: sparse blocks run few
    rounds).
    """

    def step(j, prev):
        key = next_keys(keys, prev)
        body(j, key)
        return key

    lax.fori_loop(0, n_rounds, step, jnp.full((keys.shape[0],), -1, jnp.int32))
