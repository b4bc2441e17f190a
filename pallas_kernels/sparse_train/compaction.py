"""Compaction (docs/design.md §6.1): the dense gate [M, N] -> ELL rows of width W with
true counts, per-column ELL counts and the fired neurons.

Two passes over the gate: XLA counts the positives of every (row, column tile) and
takes their exclusive prefix along the row; then one Pallas program per (row block,
tile) writes its entries at those offsets with `tile_select` (one reduction and one
[block_rows] store per entry of the block's fullest row). A single pass that walks N
per row block would serialise N / block_cols dependent steps per program.
`compact_rows_ref` is the plain-jnp twin.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _triton
from pallas_kernels import tile_select as ts
from pallas_kernels._gather import fit_block
from pallas_kernels.sparse_train._launch import NUM_STAGES, iota
from pallas_kernels.sparse_train.format import EllRows, col_dtype

_I32 = jnp.int32
# Added to a (row, tile) count per non-finite gate value: a power of two above any
# count (N < 2**20), so count = marked & (_NONFINITE - 1).
_NONFINITE = 1 << 20
# The dense gate is read once: stream it past L2.
_STREAM = "evict_first"


@dataclasses.dataclass(frozen=True)
class CompactLaunch:
    """Launch of the compaction: one program per tile of block_rows x block_cols.

    block_rows, block_cols: the tile (powers of two; N must be a multiple of
      block_cols, which `fit` ensures).
    num_warps: Triton warps per program, a power of two.
    """

    block_rows: int
    block_cols: int
    num_warps: int

    def unsupported(self, name: str) -> str | None:
        """Why this launch is invalid (naming the field as `name.field`), or None."""
        for field in ("block_rows", "block_cols", "num_warps"):
            v = getattr(self, field)
            if not _triton.is_pow2(v):
                return f"{name}.{field}={v} must be a power of two"
        return None

    def fit(self, n: int) -> CompactLaunch:
        """The same launch with block_cols shrunk to the largest power of two
        <= block_cols that divides N."""
        return dataclasses.replace(self, block_cols=fit_block(self.block_cols, n))


def _compact_kernel(
    p_ref, offsets_ref, totals_ref, cols_ref, vals_ref, col_ref,
    *, m, width, block_rows, block_cols, tiles,
):  # fmt: skip
    """Program (t, i) packs rows i*BR.. within the column tile t*BC.. .

    The row's entries of earlier tiles are counted beforehand (`offsets_ref`, [M, T];
    `totals_ref` [M] the row totals), so every (row block, tile) is independent: entry
    k of the tile goes to slot offset + k when that is below W; the last tile's
    program zeroes the row's slots past its total. Per column it also writes
    (BR + 1) * (entries) + (entries of rows with total <= W) to col_ref [blocks, N].
    """
    t, i = _triton.program_id(0, tiles), _triton.program_id(1, pl.cdiv(m, block_rows))
    rows = i * block_rows + iota(block_rows)
    row_ok = rows < m
    lane = iota(block_cols)
    col = t * block_cols + lane
    rows_b = jnp.broadcast_to(rows[:, None], (block_rows, block_cols))
    col_b = jnp.broadcast_to(col[None, :], (block_rows, block_cols))
    p = _triton.load(
        p_ref.at[rows_b, col_b], mask=row_ok[:, None], other=0, eviction_policy=_STREAM
    )
    pos = p > 0
    tile_ids = jnp.full((block_rows,), t, _I32)
    base = _triton.load(offsets_ref.at[rows, tile_ids], mask=row_ok, other=0)
    total = _triton.load(totals_ref.at[rows], mask=row_ok, other=0)
    count = jnp.sum(pos.astype(_I32), axis=1)
    room = jnp.maximum(width - base, 0)

    def store_round(k, key):
        slot = base + k
        ok = (key != ts.NO_ENTRY) & (slot < width)
        slot = jnp.where(ok, slot, width)  # masked lanes: an out-of-range slot
        col_id = (t * block_cols + ts.key_lane(key)).astype(cols_ref.dtype)
        _triton.store(cols_ref.at[rows, slot], col_id, mask=ok)
        _triton.store(vals_ref.at[rows, slot], ts.key_value(key, p, lane), mask=ok)

    keys = ts.entry_keys(p, pos, lane)
    ts.for_each_entry(keys, jnp.max(jnp.minimum(count, room)), store_round)
    # One reduction over the block's rows for both per-column numbers.
    in_ell = total <= width
    weight = jnp.where(in_ell, block_rows + 2, block_rows + 1)[:, None]
    info = jnp.sum(jnp.where(pos, weight, 0), axis=0)
    _triton.store(col_ref.at[jnp.full((block_cols,), i, _I32), col], info.astype(col_ref.dtype))

    @pl.when(t == tiles - 1)
    def _zero_unused_slots():
        s = jnp.broadcast_to(iota(width)[None, :], (block_rows, width))
        rows_w = jnp.broadcast_to(rows[:, None], (block_rows, width))
        unused = (s >= total[:, None]) & row_ok[:, None]
        zero_cols = jnp.zeros((block_rows, width), cols_ref.dtype)
        _triton.store(cols_ref.at[rows_w, s], zero_cols, mask=unused)
        zeros = jnp.zeros((block_rows, width), vals_ref.dtype)
        _triton.store(vals_ref.at[rows_w, s], zeros, mask=unused)


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
        p: [M, N] bf16 gate pre-activations U (or relu(U)); entries > 0 are the
            pattern and their values are P = relu(U).
        width: W (a power of two).
        launch: the tile and warps (N must be a multiple of launch.block_cols).
        impl: "pallas" or "xla" (`compact_rows_ref`).
        interpret: Pallas interpret mode (None: interpret unless on a GPU).

    Returns:
        (EllRows with true counts and per-column ELL counts, fired bool [N],
        all_finite bool scalar: no gate value is NaN or +-Inf). Slots at or past a
        row's count hold zeros. NaN and -Inf are not positive; with any non-finite
        gate the ELL part is not meaningful (callers run densely then).
    """
    if impl == "xla":
        return compact_rows_ref(p, width)
    m, n = p.shape
    block_rows, block_cols = launch.block_rows, launch.block_cols
    if n % block_cols or launch.unsupported("compact") or not _triton.is_pow2(width):
        raise ValueError(f"compact_rows: unsupported N={n}, blocks {block_rows}x{block_cols}")
    tiles = n // block_cols
    # One XLA pass over the gate counts the positives and flags non-finite values (a
    # large marker each, masked off the counts), so the caller's finiteness check of
    # x and W_gate costs no second read of an [M, N] or [M, H] array.
    marked = jnp.where(jnp.isfinite(p), (p > 0).astype(_I32), _NONFINITE)
    marked = jnp.sum(marked.reshape(m, tiles, block_cols), axis=2, dtype=_I32)
    all_finite = jnp.all(marked < _NONFINITE)
    tile_counts = marked & (_NONFINITE - 1)
    ends = jnp.cumsum(tile_counts, axis=1, dtype=_I32)
    row_blocks = pl.cdiv(m, block_rows)
    kernel = functools.partial(
        _compact_kernel,
        m=m,
        width=width,
        block_rows=block_rows,
        block_cols=block_cols,
        tiles=tiles,
    )
    totals = ends[:, -1]
    # (BR + 2) * BR must fit the per-(row block, column) record.
    info_dtype = jnp.int16 if (block_rows + 2) * block_rows < 2**15 else _I32
    cols, vals, info = _triton.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((m, width), col_dtype(n)),
            jax.ShapeDtypeStruct((m, width), p.dtype),
            jax.ShapeDtypeStruct((row_blocks, n), info_dtype),
        ),
        grid=(tiles, row_blocks),
        compiler_params=_triton.compiler_params(num_warps=launch.num_warps, num_stages=NUM_STAGES),
        interpret=_triton.resolve_interpret(interpret),
        name="twell_compact_rows",
    )(p, ends - tile_counts, totals)
    # info = (BR + 1) * entries + ELL entries. One variadic reduction over the row
    # blocks gives both per-column numbers (two reductions cost a launch and a pass
    # more); the int16 records are widened inside it (two reductions of one widened
    # copy made XLA write that int32 copy of the whole [blocks, N] array).
    col_counts, most = lax.reduce(
        ((info % (block_rows + 1)).astype(_I32), info),
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
