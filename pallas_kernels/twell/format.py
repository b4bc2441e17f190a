"""The TwELL tile-wise ELL layout and its jnp pack / unpack (the test oracle).

A dense activation h [M, N] (N a multiple of T = 256) is cut into column tiles of
width T. Each (row, tile) owns W = T / C uint32 words of the packed matrix
[M, N / C] (C, the compression factor, is 8, 4 or 2):

- word 0 holds the TRUE number of positive entries of that row in that tile (it can
  exceed W - 1; that is an overflow, and readers must not trust the payload then);
- words 1 .. W - 1 hold the first W - 1 positive entries in column order, each as
  `(bf16_bits(value) << 16) | global_column` (so N <= 65536);
- words after the count are undefined (the pack kernel zeroes those in a tile's first
  32-byte sector, to write whole sectors; nothing else zeroes them).

Column order makes the format deterministic, unlike the CUDA reference's atomics
(docs/design.md §3).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TILE = 256
COMPRESSIONS = (8, 4, 2)
MAX_COLUMNS = 1 << 16
# A slot index no tile has: the packing kernels send masked-off scatter lanes there,
# because the Pallas interpreter's masked scatter writes every lane (the old value
# where masked), so an in-tile slot would clobber a real entry.
OUT_OF_TILE_SLOT = 1 << 20


def slots_per_tile(compression: int) -> int:
    """W = T / C words per (row, tile): one count word plus W - 1 entries."""
    return TILE // compression


def packed_width(n: int, compression: int) -> int:
    """Words per row of the packed matrix: N / C."""
    return n // compression


def check_format(n: int, compression: int) -> None:
    """Raises ValueError when (N, C) has no TwELL layout."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression}")
    if n % TILE:
        raise ValueError(f"d_ff N={n} must be a multiple of the TwELL tile width {TILE}")
    if n > MAX_COLUMNS:
        raise ValueError(f"d_ff N={n} exceeds {MAX_COLUMNS}: columns are stored in 16 bits")


def encode_words(values: jax.Array, columns: jax.Array) -> jax.Array:
    """(bf16_bits(values) << 16) | columns, as uint32 (same shape as values)."""
    bits = jax.lax.bitcast_convert_type(values.astype(jnp.bfloat16), jnp.uint16)
    return (bits.astype(jnp.uint32) << 16) | columns.astype(jnp.uint32)


def decode_words(words: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint32 words -> (bf16 values, int32 global columns)."""
    values = jax.lax.bitcast_convert_type((words >> 16).astype(jnp.uint16), jnp.bfloat16)
    return values, (words & 0xFFFF).astype(jnp.int32)


def pack(h: jax.Array, compression: int = 8) -> jax.Array:
    """Packs the positive entries of h into TwELL.

    Args:
      h: [M, N] activations (any float dtype; values are rounded to bf16).
      compression: C in {8, 4, 2}.

    Returns:
      uint32 [M, N / C]. Unused payload words are zero here (kernels leave them
      undefined), and word 0 of each tile holds the true count even on overflow.
    """
    m, n = h.shape
    check_format(n, compression)
    w = slots_per_tile(compression)
    tiles = h.reshape(m, n // TILE, TILE)
    pos = tiles > 0
    count = jnp.sum(pos, axis=-1, dtype=jnp.int32)
    slot = jnp.cumsum(pos, axis=-1, dtype=jnp.int32)  # 1-based slot of each positive
    columns = jnp.arange(n, dtype=jnp.int32).reshape(n // TILE, TILE)
    words = encode_words(tiles, jnp.broadcast_to(columns, tiles.shape))
    keep = pos & (slot <= w - 1)
    # Dropped entries are routed to slot 0, then overwritten by the count below.
    target = jnp.where(keep, slot, 0)
    out = jnp.zeros((m, n // TILE, w), jnp.uint32)
    row_idx = jnp.arange(m)[:, None, None]
    tile_idx = jnp.arange(n // TILE)[None, :, None]
    out = out.at[row_idx, tile_idx, target].set(jnp.where(keep, words, 0), mode="drop")
    out = out.at[:, :, 0].set(count.astype(jnp.uint32))
    return out.reshape(m, packed_width(n, compression))


def tile_counts(packed: jax.Array, compression: int = 8) -> jax.Array:
    """True positive count of every (row, tile): int32 [M, N / T]."""
    m, width = packed.shape
    w = slots_per_tile(compression)
    return packed.reshape(m, width // w, w)[:, :, 0].astype(jnp.int32)


def unpack(packed: jax.Array, n: int, compression: int = 8) -> jax.Array:
    """Decodes TwELL back to dense bf16 [M, N], reading at most W - 1 entries a tile.

    Entries past an overflowing tile's capacity are not in the format, so an
    overflowed tile decodes to its first W - 1 positives only.
    """
    m, width = packed.shape
    check_format(n, compression)
    if width != packed_width(n, compression):
        raise ValueError(f"packed width {width} does not match N={n}, C={compression}")
    w = slots_per_tile(compression)
    tiles = packed.reshape(m, n // TILE, w)
    count = jnp.minimum(tiles[:, :, :1].astype(jnp.int32), w - 1)
    valid = jnp.arange(w)[None, None, :]
    valid = (valid >= 1) & (valid <= count)
    values, columns = decode_words(tiles)
    columns = jnp.where(valid, columns, n)  # out of range -> dropped by the scatter
    dense = jnp.zeros((m, n), jnp.bfloat16)
    rows = jnp.broadcast_to(jnp.arange(m)[:, None, None], columns.shape)
    return dense.at[rows, columns].set(jnp.where(valid, values, 0), mode="drop")
