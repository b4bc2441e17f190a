"""The pack kernel: a dense [M, N] activation in HBM -> TwELL words (the D2T stage).

XLA's (cuBLAS) gate GEMM writes the bf16 activation, then this kernel packs it
(docs/design.md §4.1). Each program packs `steps` [BM, 256] blocks of one tile in turn,
loading a few blocks ahead of the one being packed, and writes the positive entries
into that tile's W words. Each thread holds whole 8-column groups as bf16 pairs in
uint32 registers, finds a group's entries as the set bits of one integer (two
elements per instruction), and the rare entries go out in one small scatter per entry
rank. A +NaN counts as an entry (it propagates, as through the dense MLP's ReLU); a
-0 or -NaN does not. Programs are independent (one per (row blocks, tile)), so nothing
serialises across N.

The cost over fusing the pack into the GEMM epilogue (`pallas_kernels.baselines`) is
one bf16 write and read of [M, N]; what it buys is the XLA GEMM instead of a Pallas one
with a scatter epilogue that Triton lowers poorly (docs/performance_notes.md, "Pack").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _triton as tr
from pallas_kernels import bit_groups, reference
from pallas_kernels.twell import format as fmt
from pallas_kernels.twell.config import PackConfig


def _load_block(h_ref, row_ok, whole_blocks: bool):
    """The program's [BM, ...] block; rows past M (only in a last, partial block) read 0.

    When BM divides M no block overhangs, and the load goes unmasked: a mask costs a
    select per element in this instruction-bound kernel.
    """
    if whole_blocks:
        return tr.load(h_ref)
    return tr.load(h_ref, mask=row_ok[(slice(None),) + (None,) * (len(h_ref.shape) - 1)], other=0)


def _for_each_block(h_ref, pack_block, *, m, block_m, steps, ahead):
    """Calls pack_block(h, at, row_ok) on the program's `steps` row blocks in turn.

    h: the [BM, ...] block of h_ref; at: its rows (a slice of the program's rows; the
    kernels pass it to every store instead of storing through a view `o_ref.at[at]`,
    which the interpreter mis-shapes); row_ok: bool [BM], rows below M. The loads run
    `ahead` blocks in front of the packing (`bit_groups.for_each_block`), so their
    latency hides behind it (with one block per program the kernel waits on it).
    """
    rows = jnp.arange(block_m, dtype=jnp.int32)
    first = pl.program_id(1) * (steps * block_m)
    whole = m % (steps * block_m) == 0  # no block overhangs M: unmasked loads

    def block(k):
        return pl.ds(k * block_m, block_m), first + k * block_m + rows < m

    def load(k):
        at, row_ok = block(jnp.minimum(k, steps - 1))
        return _load_block(h_ref.at[at], row_ok, whole)

    def pack(k, h, carry):
        pack_block(h, *block(k))
        return carry

    bit_groups.for_each_block(load, pack, (), steps=steps, ahead=ahead)


def _rows_of(at, block_m: int) -> jax.Array:
    """int32 [BM]: the row indices `at` (a slice) stands for."""
    rows = jnp.arange(block_m, dtype=jnp.int32)
    return rows if isinstance(at, slice) else rows + at.start


SECTOR_WORDS = 8  # uint32 words in one 32-byte DRAM sector


def _store_counts(o_ref, c_ref, at, count, row_ok):
    """Word 0 = the true count, and 0 in the words of the tile's first 32-byte sector
    past the entries (the entries fill words 1..count), so the stores cover the sector.
    With c_ref = (counts ref [1, rows],), the counts also go there (stats without
    reading the words back).

    Writing whole sectors is faster than writing the count word alone: L2 would have
    to read a partly written sector from DRAM to merge it before writing it back
    (docs/performance_notes.md, "Pack").
    """
    if c_ref:
        tr.store(c_ref[0].at[pl.ds(0, 1), at], count[None, :], mask=row_ok[None, :])
    word = jnp.arange(SECTOR_WORDS, dtype=jnp.int32)[None, :]
    count = count[:, None]
    value = jnp.where(word == 0, count, 0).astype(jnp.uint32)
    keep = row_ok[:, None] & ((word == 0) | (word > count))
    tr.store(o_ref.at[at, pl.ds(0, SECTOR_WORDS)], value, mask=keep)


def _pack_kernel(w_ref, o_ref, *c_ref, m, block_m, slots, steps, ahead):
    """w_ref [steps * BM, 256 / S, S / 2] uint32 (bf16 pairs) -> o_ref [steps * BM, W]
    (and the counts, c_ref [1, steps * BM] int32, when asked for)."""
    tile = pl.program_id(0)

    def pack_block(words, at, row_ok):
        count = _pack_entries(words, o_ref, at, row_ok, tile, slots)
        _store_counts(o_ref, c_ref, at, count, row_ok)

    _for_each_block(w_ref, pack_block, m=m, block_m=block_m, steps=steps, ahead=ahead)


def _pack_entries(words, o_ref, at, row_ok, tile, slots):
    """words [BM, 256 / S, S / 2] uint32 -> the entries of o_ref[at] [BM, W] uint32.

    Returns the rows' true counts, int32 [BM] (the caller stores the count words).

    Each thread holds whole groups: a group's entries are the set bits of one int32
    (`bit_groups.group_bits`), so the count is a popcount and entry r of every group is its
    r-th lowest bit. Round r scatters entry r of all groups of the block at once (word
    = entries in earlier groups + r + 1); a block needs as many rounds as its busiest
    group has entries (one or two at ~0.5% density).
    """
    block_m, n_groups, pairs = words.shape
    rows = _rows_of(at, block_m)
    bits = bit_groups.group_bits(bit_groups.positive_flags(words, 2), 2)
    per_group = lax.population_count(bits)  # [BM, G]
    count = jnp.sum(per_group, axis=1)
    before = jnp.cumsum(per_group, axis=1) - per_group  # entries in earlier groups
    most = jnp.max(jnp.max(per_group, axis=1))  # one axis at a time: a 2-D max fails to lower
    column = tile * fmt.TILE + jnp.arange(n_groups, dtype=jnp.int32)[None, :] * (2 * pairs)

    def store_rank(r, left):
        """Stores each group's entry r (its lowest bit left) and drops that bit."""
        element = bit_groups.lowest_bit(left)
        word = bit_groups.element_word(words, element, 2)
        value = jnp.where((element & 1) == 1, word & jnp.uint32(0xFFFF0000), word << 16)
        slot = before + r + 1  # word 0 is the count
        keep = (left != 0) & (slot < slots)
        slot = jnp.where(keep, slot, fmt.OUT_OF_TILE_SLOT)
        entry = value | (column + element).astype(jnp.uint32)
        tr.store(o_ref.at[rows[:, None], slot], entry, mask=keep)
        return left & (left - 1)

    lax.fori_loop(0, most, store_rank, bits)
    return count


def pack_supported(m: int, n: int, compression: int, cfg: PackConfig) -> str | None:
    """Why an [M, N] activation cannot be packed with `cfg`, or None when it can."""
    try:
        fmt.check_format(n, compression)
    except ValueError as e:
        return str(e)
    if m < 1:
        return f"M={m} tokens: need at least one"
    if not tr.is_pow2(cfg.block_m):
        return f"block_m={cfg.block_m} must be a power of two"
    if not tr.is_pow2(cfg.group) or not 2 <= cfg.group <= 16:
        return f"group={cfg.group} must be a power of two in [2, 16]"
    if cfg.steps < 1:
        return f"steps={cfg.steps} must be >= 1"
    if cfg.steps > 1 and (cfg.ahead < 1 or cfg.steps % (cfg.ahead + 1)):
        return f"steps={cfg.steps} must be a multiple of ahead + 1 (ahead={cfg.ahead} >= 1)"
    return None


def pack_tiles(
    h: jax.Array,
    *,
    compression: int = 8,
    cfg: PackConfig = PackConfig(),
    interpret: bool | None = None,
    with_counts: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Packs the positive entries of a dense activation as TwELL (like `format.pack`).

    Args:
      h: [M, N] bf16 activation, or the gate pre-activation (only entries > 0 count).
      compression: C in {8, 4, 2}.
      cfg: launch parameters.
      interpret: run the Pallas interpreter (None: only when there is no GPU).
      with_counts: also return the tile counts, tile-major. Statistics then reduce 4
        bytes per (row, tile) instead of reading a count word out of every tile's
        32-byte sector in another pass over the words.

    Returns:
      uint32 [M, N / C] TwELL words; word 0 of a tile keeps the true count, also past
      capacity; words past the count are undefined. With counts: (words, int32
      [N / 256, M] true counts, `format.tile_counts` transposed).

    Raises:
      ValueError: h is not a 2-D bf16 array, or (M, N, C, cfg) is unsupported.
    """
    if h.ndim != 2 or h.dtype != jnp.bfloat16:
        raise ValueError(f"pack_tiles: h must be a 2-D bfloat16 [M, N], got {h.dtype}{h.shape}")
    m, n = h.shape
    reason = pack_supported(m, n, compression, cfg)
    if reason:
        raise ValueError(f"pack_tiles: {reason}")
    slots = fmt.slots_per_tile(compression)
    rows = cfg.block_m * cfg.steps  # per program
    grid = (n // fmt.TILE, pl.cdiv(m, rows))
    kernel = functools.partial(
        _pack_kernel, m=m, block_m=cfg.block_m, slots=slots, steps=cfg.steps, ahead=cfg.ahead
    )
    # Free (row-major) views: bf16 pairs as uint32, each (row, tile) block [256 / S, S / 2].
    pairs = lax.bitcast_convert_type(h.reshape(m, n // 2, 2), jnp.uint32)
    h = pairs.reshape(m, n // cfg.group, cfg.group // 2)
    in_spec = pl.BlockSpec((rows, fmt.TILE // cfg.group, cfg.group // 2), lambda t, i: (i, t, 0))
    out_shape = [jax.ShapeDtypeStruct((m, fmt.packed_width(n, compression)), jnp.uint32)]
    out_specs = [pl.BlockSpec((rows, slots), lambda t, i: (i, t))]
    if with_counts:
        out_shape.append(jax.ShapeDtypeStruct((n // fmt.TILE, m), jnp.int32))
        out_specs.append(pl.BlockSpec((1, rows), lambda t, i: (t, i)))
    out = tr.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=[in_spec],
        out_specs=out_specs,
        compiler_params=tr.compiler_params(cfg.num_warps, num_stages=1),
        interpret=tr.resolve_interpret(interpret),
        name=f"twell_pack_c{compression}",
    )(h)
    return tuple(out) if with_counts else out[0]


def gate_then_pack(
    x: jax.Array,
    w_gate: jax.Array,
    *,
    compression: int = 8,
    cfg: PackConfig = PackConfig(),
    interpret: bool | None = None,
    with_counts: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """D2T: XLA's bf16 gate GEMM relu(x Wg^T), then `pack_tiles` (docs/design.md §4.1).

    Args:
      x: [M, H] bf16; w_gate: [N, H] bf16.
      with_counts: as in `pack_tiles`.

    Returns:
      uint32 [M, N / C]: `format.pack` of the dense bf16 gate, and with counts also
      int32 [N / 256, M] as in `pack_tiles`.
    """
    return pack_tiles(
        reference.hidden(x, w_gate),
        compression=compression,
        cfg=cfg,
        interpret=interpret,
        with_counts=with_counts,
    )
