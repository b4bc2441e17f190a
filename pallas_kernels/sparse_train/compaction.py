"""Compaction (docs/design.md §6.1): the dense gate [M, N] -> ELL rows of width W with
true counts, per-column ELL counts and the fired neurons.

Two passes over the gate: XLA counts the positives of every (row, column tile) and
takes their exclusive prefix along the row; then one Pallas program per (tile, rows)
writes its entries at those offsets. It walks its rows a few at a time with the next
blocks' loads in flight, and finds each group of columns' entries as set bits
(`bit_groups`, as the TwELL pack does), so it reads the gate near HBM speed. A
single pass that walks N per row block would serialise N / block_cols dependent steps
per program.
`compact_rows_ref` is the plain-jnp twin.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _triton, bit_groups
from pallas_kernels._gather import fit_block
from pallas_kernels.sparse_train._launch import iota
from pallas_kernels.sparse_train.format import EllRows, col_dtype

_I32 = jnp.int32
# Added to a (row, tile) count per non-finite gate value: a power of two above any
# count (N < 2**20), so count = marked & (_NONFINITE - 1).
_NONFINITE = 1 << 20
# The dense gate is read once: stream it past L2.
_STREAM = "evict_first"


@dataclasses.dataclass(frozen=True)
class CompactLaunch:
    """Launch of the compaction: one program per (column tile, block_m * steps rows).

    block_cols: the tile's columns (a power of two; `fit` makes it divide N).
    group: columns per thread-held group, a power of two in 2..16 (`bit_groups`).
    block_m: rows per block, a power of two; a program walks `steps` blocks of its
      tile one after the other, the loads of the next `ahead` blocks in flight
      (steps a multiple of ahead + 1, or 1).
    num_warps: Triton warps per program, a power of two.
    """

    block_cols: int = 256
    group: int = 8
    block_m: int = 1
    steps: int = 32
    ahead: int = 3
    num_warps: int = 1

    @property
    def rows(self) -> int:
        """Rows per program: also the row block of the per-column records."""
        return self.block_m * self.steps

    def unsupported(self, name: str) -> str | None:
        """Why this launch is invalid (naming the field as `name.field`), or None."""
        for field in ("block_cols", "group", "block_m", "num_warps"):
            v = getattr(self, field)
            if not _triton.is_pow2(v):
                return f"{name}.{field}={v} must be a power of two"
        if not 2 <= self.group <= 16 or self.block_cols < self.group:
            return f"{name}.group={self.group} must be in [2, 16] and <= block_cols"
        unrolled = self.ahead >= 1 and self.steps % (self.ahead + 1) == 0
        if self.steps < 1 or (self.steps > 1 and not unrolled):
            return f"{name}.steps={self.steps} must be 1 or a multiple of ahead + 1 >= 2"
        if self.rows * (self.rows + 2) >= 2**15:
            return f"{name}: {self.rows} rows per program overflow the int16 column records"
        return None

    def fit(self, n: int) -> CompactLaunch:
        """The same launch with block_cols shrunk to the largest power of two
        <= block_cols that divides N."""
        return dataclasses.replace(self, block_cols=fit_block(self.block_cols, n))


def _compact_kernel(
    w_ref, offsets_ref, totals_ref, cols_ref, vals_ref, info_ref,
    *, m, width, launch, per_word, tiles,
):  # fmt: skip
    """Program (t, i) packs the tile t of rows i * R .. (R = launch.rows).

    w_ref: [R, G, Q] uint32, the program's [R, block_cols] block of the gate as words
    (Q = group / per_word). The entries of each row's earlier tiles are counted
    beforehand (`offsets_ref`, [T, M]; `totals_ref` [M] the row totals), so every
    program is independent: the tile's entry k goes to slot offset + k when that is
    below W; the last tile's program zeroes the row's slots past its total. Per column
    it writes (R + 1) * (entries) + (entries of rows with total <= W) to info_ref
    [programs, N / per_word] (two 16-bit records per word for bf16).
    """
    block_m, steps = launch.block_m, launch.steps
    n_rows = launch.rows
    groups, q = w_ref.shape[1:]
    t, i = _triton.program_id(0, tiles), _triton.program_id(1, pl.cdiv(m, n_rows))
    first = i * n_rows
    prog_rows = first + iota(n_rows)
    base_all = _triton.load(
        offsets_ref.at[jnp.full((n_rows,), t, _I32), prog_rows], mask=prog_rows < m, other=0
    )
    total_all = _triton.load(totals_ref.at[prog_rows], mask=prog_rows < m, other=0)
    whole = m % n_rows == 0  # no block overhangs M: unmasked loads
    group_col = t * launch.block_cols + iota(groups)[None, :] * launch.group

    def load(k):
        k = jnp.minimum(k, steps - 1)
        block = w_ref.at[pl.ds(k * block_m, block_m)]
        if whole:
            return _triton.load(block, eviction_policy=_STREAM)
        row_ok = first + k * block_m + iota(block_m) < m
        return _triton.load(block, mask=row_ok[:, None, None], other=0, eviction_policy=_STREAM)

    def compact_block(k, words, counters):
        rows = first + k * block_m + iota(block_m)
        row_ok = rows < m
        # This block's offsets and totals, picked out of the program's (loaded once).
        pick = iota(n_rows)[None, :] == (k * block_m + iota(block_m))[:, None]
        base = jnp.sum(jnp.where(pick, base_all[None, :], 0), axis=1)
        total = jnp.sum(jnp.where(pick, total_all[None, :], 0), axis=1)
        flags = bit_groups.positive_flags(words, per_word)
        bits = bit_groups.group_bits(flags, per_word)
        per_group = lax.population_count(bits)  # [BM, G]
        slot0 = base[:, None] + jnp.cumsum(per_group, axis=1) - per_group
        most = jnp.max(jnp.max(per_group, axis=1))  # one axis at a time (lowering)

        def store_rank(r, left):
            element = bit_groups.lowest_bit(left)
            word = bit_groups.element_word(words, element, per_word)
            if per_word == 2:
                word = jnp.where((element & 1) == 1, word >> 16, word & 0xFFFF)
                value = lax.bitcast_convert_type(word.astype(jnp.uint16), vals_ref.dtype)
            else:
                value = lax.bitcast_convert_type(word, vals_ref.dtype)
            slot = slot0 + r
            ok = (left != 0) & (slot < width)
            slot = jnp.where(ok, slot, width)  # masked lanes: an out-of-range slot
            at = (rows[:, None], slot)
            _triton.store(cols_ref.at[at], (group_col + element).astype(cols_ref.dtype), mask=ok)
            _triton.store(vals_ref.at[at], value, mask=ok)
            return left & (left - 1)

        lax.fori_loop(0, most, store_rank, bits)

        @pl.when(t == tiles - 1)
        def _zero_unused_slots():
            s = jnp.broadcast_to(iota(width)[None, :], (block_m, width))
            rows_w = jnp.broadcast_to(rows[:, None], (block_m, width))
            unused = (s >= total[:, None]) & row_ok[:, None]
            _triton.store(
                cols_ref.at[rows_w, s], jnp.zeros((block_m, width), cols_ref.dtype), mask=unused
            )
            _triton.store(
                vals_ref.at[rows_w, s], jnp.zeros((block_m, width), vals_ref.dtype), mask=unused
            )

        every, in_ell = counters
        ell_rows = (total <= width)[:, None, None]
        every = every + jnp.sum(flags, axis=0)
        in_ell = in_ell + jnp.sum(jnp.where(ell_rows, flags, 0), axis=0)
        return every, in_ell

    zero = jnp.zeros((groups, q), jnp.uint32)
    every, in_ell = bit_groups.for_each_block(
        load, compact_block, (zero, zero), steps=steps, ahead=launch.ahead
    )
    # Each 16-bit half stays below 2**15 (`CompactLaunch.unsupported`): no carries.
    info = every * (n_rows + 1) + in_ell
    word_col = (t * groups + iota(groups)[:, None]) * q + iota(q)[None, :]
    _triton.store(info_ref.at[jnp.full((groups, q), i, _I32), word_col], info)


def compact_rows(
    p: jax.Array,
    *,
    width: int,
    launch: CompactLaunch,
    impl: str = "pallas",
    interpret: bool | None = None,
) -> tuple[EllRows, jax.Array]:
    """Packs the positive entries of a dense gate [M, N] into ELL rows of width W.

    Args:
        p: [M, N] bf16 or fp32 gate pre-activations U (or relu(U)); entries > 0 are
            the pattern and their values are P = relu(U).
        width: W (a power of two).
        launch: the tile and blocks (N must be a multiple of launch.block_cols).
        impl: "pallas" or "xla" (`compact_rows_ref`).
        interpret: Pallas interpret mode (None: interpret unless on a GPU).

    Returns:
        (EllRows with true counts and per-column ELL counts, fired bool [N],
        all_finite bool scalar: no gate value is NaN or +-Inf). Slots at or past a
        row's count hold zeros. NaN and -Inf are not positive; with any non-finite
        gate the ELL part is not meaningful (callers run densely then).

    Raises:
        ValueError: p is not a 2-D bf16 / fp32 array, or N, W or the launch are
            unsupported.
    """
    if impl == "xla":
        return compact_rows_ref(p, width)
    if p.ndim != 2 or p.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"compact_rows: p must be a bf16 or fp32 [M, N], got {p.dtype}{p.shape}")
    m, n = p.shape
    reason = launch.unsupported("compact")
    if reason is None and (n % launch.block_cols or not _triton.is_pow2(width)):
        reason = (
            f"N={n} must be a multiple of block_cols={launch.block_cols}, W={width} a power of 2"
        )
    if reason:
        raise ValueError(f"compact_rows: {reason}")
    tiles = n // launch.block_cols
    # One XLA pass over the gate counts the positives and flags non-finite values (a
    # large marker each, masked off the counts), so the caller's finiteness check of
    # x and W_gate costs no second read of an [M, N] or [M, H] array.
    marked = jnp.where(jnp.isfinite(p), (p > 0).astype(_I32), _NONFINITE)
    marked = jnp.sum(marked.reshape(m, tiles, launch.block_cols), axis=2, dtype=_I32)
    all_finite = jnp.all(marked < _NONFINITE)
    tile_counts = marked & (_NONFINITE - 1)
    ends = jnp.cumsum(tile_counts, axis=1, dtype=_I32)
    totals = ends[:, -1]
    per_word = bit_groups.elements_per_word(p.dtype)
    q = launch.group // per_word
    # Free (row-major) views: the gate as uint32 words, each (rows, tile) block [G, Q].
    words = lax.bitcast_convert_type(p.reshape(m, n // per_word, per_word), jnp.uint32)
    words = words.reshape(m, n // launch.group, q)
    programs = pl.cdiv(m, launch.rows)
    kernel = functools.partial(
        _compact_kernel, m=m, width=width, launch=launch, per_word=per_word, tiles=tiles
    )
    cols, vals, info = _triton.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((m, width), col_dtype(n)),
            jax.ShapeDtypeStruct((m, width), p.dtype),
            jax.ShapeDtypeStruct((programs, n // per_word), jnp.uint32),
        ),
        grid=(tiles, programs),
        in_specs=[
            pl.BlockSpec(
                (launch.rows, launch.block_cols // launch.group, q), lambda t, i: (i, t, 0)
            ),
            pl.no_block_spec,
            pl.no_block_spec,
        ],
        out_specs=(pl.no_block_spec,) * 3,
        compiler_params=_triton.compiler_params(num_warps=launch.num_warps, num_stages=1),
        interpret=_triton.resolve_interpret(interpret),
        name="twell_compact_rows",
    )(words, (ends - tile_counts).T, totals)
    if per_word == 2:  # two 16-bit records per word, the lower column in the low half
        info = lax.bitcast_convert_type(info, jnp.uint16).reshape(programs, n)
    # info = (R + 1) * entries + ELL entries. One variadic reduction over the row
    # blocks gives both per-column numbers (two reductions cost a launch and a pass
    # more); the 16-bit records are widened inside it (two reductions of one widened
    # copy made XLA write that int32 copy of the whole [programs, N] array).
    col_counts, most = lax.reduce(
        ((info % (launch.rows + 1)).astype(_I32), info),
        (jnp.zeros((), _I32), jnp.zeros((), info.dtype)),
        lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])),
        (0,),
    )
    return EllRows(totals, cols, vals, col_counts), most > 0, all_finite


def compact_rows_ref(p: jax.Array, width: int) -> tuple[EllRows, jax.Array]:
    """`compact_rows` in plain jnp: packs the positives of a gate [M, N] into ELL rows.

    Args:
        p: [M, N] gate pre-activations (or their relu); entries > 0 are the pattern.
        width: W, the ELL width.

    Returns:
        (EllRows, fired, all_finite): fired is bool [N], the neuron is positive in some
        row; all_finite a bool scalar, no value of p is NaN or +-Inf.
    """
    m, n = p.shape
    pos = p > 0
    counts = jnp.sum(pos, axis=1, dtype=_I32)
    col_counts = jnp.sum(pos & (counts <= width)[:, None], axis=0, dtype=_I32)
    slot = jnp.cumsum(pos, axis=1, dtype=_I32) - 1
    slot = jnp.where(pos & (slot < width), slot, width)  # width: out of range, dropped
    rows = jnp.arange(m, dtype=_I32)[:, None]
    col_ids = jnp.broadcast_to(jnp.arange(n, dtype=col_dtype(n))[None, :], (m, n))
    cols = jnp.zeros((m, width), col_dtype(n)).at[rows, slot].set(col_ids, mode="drop")
    vals = jnp.zeros((m, width), p.dtype).at[rows, slot].set(p, mode="drop")
    return EllRows(counts, cols, vals, col_counts), jnp.any(pos, axis=0), jnp.isfinite(p).all()
