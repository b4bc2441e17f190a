"""GatedT2D and T2D: the down projection (and the up projection) from TwELL.

For every TwELL entry j of a token row (gate value g_j at neuron j):

    gated:     u_j = x . Wu[j]        h_j = bf16(g_j * bf16(u_j))     out += h_j Wd[j]
    non-gated: h_j = g_j (the packed value is already relu(x Wu^T))   out += h_j Wd[j]

Each entry gathers the contiguous weight rows Wu[j] and Wd[j] (4 KB each at H=2048,
mostly L2 hits), so the kernels are bound by L2 bandwidth. The gated MLP runs two
kernels (docs/design.md §4.2): a TwELL SDDMM (one program per row: x in registers,
h_j for each entry, listed in order in a compact buffer of its own) and a TwELL SpMM
(one program per (row, H block): out += h_j Wd[j, block]). The non-gated T2D is the
SpMM alone, on the packed activation (§4.3). With one warp per program every
reduction stays in shuffles and the registers go to gathers in flight.

Rounding follows the dense bf16 XLA MLP (u and h rounded to bf16, fp32 dots and
accumulation) so the two agree to bf16 summation-order noise; `high_precision` keeps
u and h in fp32 (h then also goes to the SpMM in an fp32 side array). A tile whose
count overflowed its W - 1 slots is recomputed from x and the dense weight rows of
that tile (gate GEMV, ReLU, up, down), so the result stays exact whatever the density
(§4.4); the caller counts those tiles.

A row's entries are first flattened across tiles (counts -> prefix sums), then
gathered `group` at a time: vectorising over a tile's W slots instead wastes most of
the work at about 1.3 entries per tile, while a scalar entry loop keeps too few
gathers in flight. Both kernels load the next group's entry words while the current
group's weight rows are gathered, so a step waits on one L2 round trip, not two.
Weight rows are re-read by every token, activations once: the gathers ask L2 to keep
the weights (evict_last) and to drop the streamed rows first (evict_first).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _triton as tr
from pallas_kernels.twell import format as fmt
from pallas_kernels.twell.config import T2DConfig

_F32 = jnp.float32
# L2 eviction policies: weight rows (re-read by every token) and streamed rows.
_KEEP, _STREAM = "evict_last", "evict_first"


def shape_unsupported(h: int, n: int, compression: int) -> str | None:
    """Why the TwELL kernels have no layout for d_model H, d_ff N and compression C."""
    try:
        fmt.check_format(n, compression)
    except ValueError as e:
        return str(e)
    if h % 64:
        return f"d_model H={h} must be a multiple of 64"
    return None


def t2d_supported(h: int, n: int, compression: int, cfg: T2DConfig) -> str | None:
    """Why (H, N, C) cannot run with cfg, or None when it can."""
    return (
        shape_unsupported(h, n, compression)
        or cfg.sddmm.unsupported("sddmm")
        or cfg.spmm.unsupported("spmm")
    )


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _iota(n: int) -> jax.Array:
    return jnp.arange(n, dtype=jnp.int32)


def _round_bf16(v: jax.Array) -> jax.Array:
    return v.astype(jnp.bfloat16).astype(_F32)


def _hidden(g: jax.Array, u: jax.Array, high_precision: bool) -> jax.Array:
    """Gated h = g * u with the dense bf16 MLP's roundings (none in high precision)."""
    rnd = (lambda v: v) if high_precision else _round_bf16
    return rnd(g * rnd(u))


class _Entries(NamedTuple):
    """A row's listed TwELL entries, flattened across tiles (tile-major, column order).

    counts, ends, gaps: int32 [next_pow2(n_tiles)]: tile t's true count (0 on padding
    tiles), the listed entries up to and including tile t, and the words of tile t that
    hold no listed entry (its count word and unused or unlisted slots); total: int32
    scalar. Overflowed tiles list no entries (their payload is incomplete).
    """

    counts: jax.Array
    ends: jax.Array
    gaps: jax.Array
    total: jax.Array

    def any_overflow(self, slots: int) -> jax.Array:
        return jnp.sum((self.counts >= slots).astype(jnp.int32)) > 0

    def n_steps(self, group: int) -> jax.Array:
        return (self.total + group - 1) // group

    def positions(self, step, group: int) -> tuple[jax.Array, jax.Array]:
        """Word index in the row [G] of entries step*G .. step*G + G - 1, and validity.

        Entry e of tile T sits at word T * W + (e - start_T) + 1, which is e + 1 plus
        the gap words of the tiles before T: exactly the tiles whose `ends` <= e (an
        empty tile after T ends at or past T's end, above e). One reduction per step.
        """
        e = step * group + _iota(group)
        ok = e < self.total
        before = jnp.where(self.ends[None, :] <= e[:, None], self.gaps[None, :], 0)
        return e + 1 + jnp.sum(before, axis=1), ok


class _CompactEntries(NamedTuple):
    """A row's entries as the compact SDDMM lists them: words 1..total of the row.

    total: int32 scalar; overflow: bool scalar, some tile of the row overflowed (its
    count is still in the gate's words, which the SpMM's dense path reads).
    """

    total: jax.Array
    overflow: jax.Array

    def any_overflow(self, slots: int) -> jax.Array:
        del slots
        return self.overflow

    def n_steps(self, group: int) -> jax.Array:
        return (self.total + group - 1) // group

    def positions(self, step, group: int) -> tuple[jax.Array, jax.Array]:
        e = step * group + _iota(group)
        return e + 1, e < self.total


_OVERFLOW_BIT = 31


def _compact_head(ent: _Entries, slots: int) -> jax.Array:
    """Word 0 of a compact h row: the listed count, bit 31 set if a tile overflowed."""
    flag = ent.any_overflow(slots).astype(jnp.uint32) << _OVERFLOW_BIT
    return ent.total.astype(jnp.uint32) | flag


def _compact_entries(h_ref, row) -> _CompactEntries:
    head = h_ref[row, 0]
    total = (head & ((1 << _OVERFLOW_BIT) - 1)).astype(jnp.int32)
    return _CompactEntries(total, (head >> _OVERFLOW_BIT) != 0)


def _row_entries(words_ref, row, slots: int, n_tiles: int) -> _Entries:
    tile_ids = _iota(_next_pow2(n_tiles))
    counts = tr.load(words_ref.at[row, tile_ids * slots], mask=tile_ids < n_tiles, other=0)
    return _entries_of(counts.astype(jnp.int32), slots)


def _entries_of(counts: jax.Array, slots: int) -> _Entries:
    """_Entries of a row's per-tile true counts (int32, 0 on padding tiles)."""
    listed = jnp.where(counts >= slots, 0, counts)  # overflowed tiles are recomputed
    return _Entries(counts, jnp.cumsum(listed), slots - listed, jnp.sum(listed))


def _decode(word: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint32 words [G] -> (neurons int32 [G], values fp32 [G])."""
    j = (word & 0xFFFF).astype(jnp.int32)
    v = lax.bitcast_convert_type((word >> 16).astype(jnp.uint16), jnp.bfloat16)
    return j, v.astype(_F32)


def _gather(w_ref, j, ok, cols, policy) -> jax.Array:
    """fp32 [G, len(cols)]: columns cols of weight rows j (zeros where not ok)."""
    w = tr.load(
        w_ref.at[j[:, None], cols[None, :]], mask=ok[:, None], other=0, eviction_policy=policy
    )
    return w.astype(_F32)


def _pieces(h: int, block: int) -> list[jax.Array]:
    """Column ids of the row pieces [block] (gathers index with arrays on both axes:
    the interpreter cannot mix them with slices)."""
    return [k * block + _iota(block) for k in range(h // block)]


def _load_x(x_ref, row, cols, policy) -> jax.Array:
    """fp32 [len(cols)]: columns cols of token row `row`."""
    return tr.load(x_ref.at[row, cols], eviction_policy=policy).astype(_F32)


def _dots(x_piece, pieces, w_ref, j, ok, policy) -> jax.Array:
    """fp32 [G]: x . W[j] for each entry, x given piece by piece (x_piece(k) [block])."""
    return sum(
        jnp.sum(x_piece(k)[None, :] * _gather(w_ref, j, ok, cols, policy), axis=1)
        for k, cols in enumerate(pieces)
    )


def _add_overflowed(acc, words_ref, row, ent, *, slots, group, hidden_of, add_rows):
    """acc plus the contribution of the row's overflowed tiles, recomputed densely.

    hidden_of(j, ok) gives h [G] of neurons j from x and the dense weights;
    add_rows(acc, h, j, ok) accumulates h_j Wd[j].
    """

    def dense_tile(t, acc):
        def columns(step, acc):
            j = t * fmt.TILE + step * group + _iota(group)
            ok = jnp.ones((group,), jnp.bool_)
            return add_rows(acc, hidden_of(j, ok), j, ok)

        count = words_ref[row, t * slots].astype(jnp.int32)
        return lax.cond(
            count >= slots,
            lambda acc: lax.fori_loop(0, fmt.TILE // group, columns, acc),
            lambda acc: acc,
            acc,
        )

    return lax.cond(
        ent.any_overflow(slots),
        lambda acc: lax.fori_loop(0, words_ref.shape[1] // slots, dense_tile, acc),
        lambda acc: acc,
        acc,
    )


def _dense_hidden(x_piece, pieces, w_dense, j, ok, *, high_precision):
    """h of neurons j recomputed from x: relu(x Wg^T) * (x Wu^T) for w_dense = (Wg, Wu),
    relu(x Wu^T) for w_dense = (Wu,)."""
    g = _round_bf16(jnp.maximum(_dots(x_piece, pieces, w_dense[0], j, ok, _KEEP), 0.0))
    if len(w_dense) == 1:
        return g
    return _hidden(g, _dots(x_piece, pieces, w_dense[1], j, ok, _KEEP), high_precision)


# ------------------------------------------------------------------ SDDMM and SpMM


def _sddmm_kernel(x_ref, packed_ref, wu_ref, h_ref, *h32_ref, high_precision, slots, group,
                  block):  # fmt: skip
    """One token row: h_j = g_j * (x . Wu[j]) at every listed entry of the gate.

    x_ref [M, H] bf16; packed_ref [M, N/C] uint32, the gate; wu_ref [N, H] bf16.
    h_ref [M, N/C] uint32 lists the row's (bf16(h_j) << 16) | j in order at words
    1..count, word 0 being `_compact_head`; in high precision h32_ref [M, N/C] fp32
    holds h_j at the same words.
    """
    row = tr.program_id(0, x_ref.shape[0])
    n_tiles = packed_ref.shape[1] // slots
    pieces = _pieces(x_ref.shape[1], block)
    x = [_load_x(x_ref, row, cols, _STREAM) for cols in pieces]
    ent = _row_entries(packed_ref, row, slots, n_tiles)
    h_ref[row, 0] = _compact_head(ent, slots)

    def words_of(step):
        pos, ok = ent.positions(step, group)
        return pos, ok, tr.load(packed_ref.at[row, pos], mask=ok, other=0)

    def entry_group(step, loaded):
        following = words_of(step + 1)  # in flight while this step's rows are gathered
        _, ok, word = loaded
        j, g = _decode(word)
        hv = _hidden(g, _dots(x.__getitem__, pieces, wu_ref, j, ok, _KEEP), high_precision)
        at = step * group + _iota(group) + 1
        tr.store(h_ref.at[row, at], fmt.encode_words(hv, j), mask=ok)
        if h32_ref:
            tr.store(h32_ref[0].at[row, at], hv, mask=ok)
        return following

    lax.fori_loop(0, ent.n_steps(group), entry_group, words_of(0))


def _spmm_kernel(x_ref, words_ref, *refs, gated, high_precision, slots, group, block):
    """Program (row, H block): out[row, block] = sum over entries of h_j Wd[j, block].

    words_ref [M, N/C] uint32 holds h_j: the SDDMM's compact list (gated) or the
    packed activation (non-gated). refs: [h32_ref (gated, high precision)], [the
    gate's words (gated: the counts of overflowed tiles)], the weights an overflowed
    tile is recomputed from ((w_gate, w_up) gated, (w_up,) non-gated), w_down, out_ref.
    """
    h32_ref = refs[0] if high_precision and gated else None
    refs = refs[1:] if h32_ref is not None else refs
    counts_ref, refs = (refs[0], refs[1:]) if gated else (words_ref, refs)
    *w_dense, wd_ref, out_ref = refs
    row, hb = tr.program_id(0, x_ref.shape[0]), tr.program_id(1, x_ref.shape[1] // block)
    n_tiles = counts_ref.shape[1] // slots
    d = hb * block + _iota(block)
    if gated:
        ent = _compact_entries(words_ref, row)
    else:
        ent = _row_entries(words_ref, row, slots, n_tiles)

    def add_rows(acc, hv, j, ok):
        return acc + jnp.sum(hv[:, None] * _gather(wd_ref, j, ok, d, _KEEP), axis=0)

    def words_of(step):
        pos, ok = ent.positions(step, group)
        word = tr.load(words_ref.at[row, pos], mask=ok, other=0)
        h32 = None if h32_ref is None else tr.load(h32_ref.at[row, pos], mask=ok, other=0)
        return ok, word, h32

    def entry_group(step, carry):
        acc, loaded = carry
        following = words_of(step + 1)  # in flight while this step's rows are gathered
        ok, word, h32 = loaded
        j, hv = _decode(word)
        hv = hv if h32 is None else h32
        return add_rows(acc, hv, j, ok), following

    zero = jnp.zeros((block,), _F32)
    acc, _ = lax.fori_loop(0, ent.n_steps(group), entry_group, (zero, words_of(0)))
    # Overflowed tiles (rare): x is re-read piece by piece rather than held, so this
    # path does not raise the common path's register count.
    pieces = _pieces(x_ref.shape[1], block)
    x_piece = lambda k: _load_x(x_ref, row, pieces[k], None)
    acc = _add_overflowed(
        acc, counts_ref, row, ent, slots=slots, group=group, add_rows=add_rows,
        hidden_of=functools.partial(
            _dense_hidden, x_piece, pieces, w_dense, high_precision=high_precision
        ),
    )  # fmt: skip
    tr.store(out_ref.at[row, d], acc.astype(out_ref.dtype), eviction_policy=_STREAM)


def t2d(
    x: jax.Array,
    packed: jax.Array,
    weights: tuple[jax.Array, ...],
    *,
    compression: int = 8,
    high_precision: bool = False,
    cfg: T2DConfig = T2DConfig(),
    interpret: bool | None = None,
) -> jax.Array:
    """Down projection of a TwELL activation, gated or not.

    Args:
      x: [M, H] bf16 tokens (read for the up projection and for overflowed tiles).
      packed: [M, N / C] uint32 TwELL gate (gated) or hidden activation (non-gated).
      weights: (w_gate, w_up, w_down) for the gated MLP, (w_up, w_down) for the
        non-gated one; each [N, H] bf16, w_down being down_proj transposed.
      compression: C in {8, 4, 2} of `packed`.
      high_precision: keep u and h in fp32 instead of rounding them to bf16.
      cfg: the SDDMM and SpMM launches.
      interpret: run the Pallas interpreter (None: only when there is no GPU).

    Returns:
      [M, H] in x's dtype.
    """
    m, h = x.shape
    n = weights[-1].shape[0]
    reason = t2d_supported(h, n, compression, cfg)
    if reason:
        raise ValueError(f"t2d: {reason}")
    gated = len(weights) == 3
    slots = fmt.slots_per_tile(compression)
    interpret = tr.resolve_interpret(interpret)
    tag = f"{'gated_' if gated else ''}t2d_c{compression}"
    out_shape = jax.ShapeDtypeStruct((m, h), x.dtype)

    def launch(kernel, launch_cfg, grid, name, out_shapes, *args):
        block = launch_cfg.fit(h).block_h
        return tr.pallas_call(
            functools.partial(kernel, slots=slots, group=launch_cfg.group, block=block),
            out_shape=out_shapes,
            grid=grid(block),
            compiler_params=tr.compiler_params(launch_cfg.num_warps, cfg.num_stages),
            interpret=interpret,
            name=f"twell_{name}_{tag}",
        )(*args)

    spmm = functools.partial(_spmm_kernel, gated=gated, high_precision=high_precision)
    spmm_grid = lambda b: (m, h // b)  # rows fastest: one H block of Wd is live at a time
    if not gated:
        return launch(spmm, cfg.spmm, spmm_grid, "spmm", out_shape, x, packed, *weights)
    words = jax.ShapeDtypeStruct(packed.shape, jnp.uint32)
    sddmm_out = (words, jax.ShapeDtypeStruct(packed.shape, _F32)) if high_precision else words
    sddmm = functools.partial(_sddmm_kernel, high_precision=high_precision)
    hidden = launch(sddmm, cfg.sddmm, lambda b: (m,), "sddmm", sddmm_out, x, packed, weights[1])
    hidden = hidden if high_precision else (hidden,)
    return launch(spmm, cfg.spmm, spmm_grid, "spmm", out_shape, x, *hidden, packed, *weights)
