"""Compaction (docs/design.md §6.1): the dense gate [M, N] -> ELL rows of width W with
true counts, per-column ELL counts and the fired neurons.

One pass over the gate: a Pallas program per block of rows walks the column tiles in
order, carrying each row's entry count so far, with the next tiles' loads in flight.
It reads each tile as uint32 words and finds each group of columns' entries as set
bits (`bit_groups`, as the TwELL pack does), so no per-element keys and no scatter of
the whole tile. `compact_rows_ref` is the plain-jnp twin.
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
from pallas_kernels.sparse_train.dense_rows import after, row_blocks
from pallas_kernels.sparse_train.format import EllRows, col_dtype

_I32 = jnp.int32
# Rows per step of the gate GEMM and its compaction in larger calls. The bf16 gate is
# [rows, N] (11 KiB per row at N = 5632: 5.8 GiB over a micro-batch of 272 x 2048
# tokens) and the compaction's per-column records [rows / block_m, N]; calls of up to
# this many rows run whole, as before (docs/performance_notes.md, "Training-step memory").
GATE_BLOCK_ROWS = 32768
# The dense gate is read once: stream it past L2.
_STREAM = "evict_first"


@dataclasses.dataclass(frozen=True)
class CompactLaunch:
    """Launch of the compaction: one program per block of block_m rows.

    block_cols: columns per step of a program's walk along N (a power of two; `fit`
      makes it divide N).
    group: columns per thread-held group, a power of two in 2..16 (`bit_groups`).
    block_m: rows per program, a power of two; also the row block of the per-column
      records.
    ahead: steps whose loads are in flight while one is compacted (>= 1).
    num_warps: Triton warps per program, a power of two.
    """

    block_cols: int = 256
    group: int = 8
    block_m: int = 8
    ahead: int = 1
    num_warps: int = 2

    def unsupported(self, name: str) -> str | None:
        """Why this launch is invalid (naming the field as `name.field`), or None."""
        for field in ("block_cols", "group", "block_m", "num_warps"):
            v = getattr(self, field)
            if not _triton.is_pow2(v):
                return f"{name}.{field}={v} must be a power of two"
        if not 2 <= self.group <= 16 or self.block_cols < self.group:
            return f"{name}.group={self.group} must be in [2, 16] and <= block_cols"
        if self.ahead < 1:
            return f"{name}.ahead={self.ahead} must be >= 1"
        if self.block_m * (self.block_m + 2) >= 2**15:
            return f"{name}.block_m={self.block_m} overflows the int16 column records"
        return None

    def fit(self, n: int) -> CompactLaunch:
        """The same launch with block_cols shrunk to the largest power of two
        <= block_cols that divides N (and group to at most that)."""
        cols = fit_block(self.block_cols, n)
        return dataclasses.replace(self, block_cols=cols, group=min(self.group, max(cols, 2)))


def _compact_kernel(
    w_ref, totals_ref, cols_ref, vals_ref, info_ref, bad_ref,
    *, m, width, launch, per_word, tiles,
):  # fmt: skip
    """Program i compacts rows i * BM .. i * BM + BM - 1 (BM = launch.block_m).

    w_ref: [M, N / group, Q] uint32, the gate as words (Q = group / per_word). Tile t's
    entry k of a row goes to slot (the row's entries in tiles < t) + k when that is
    below W; slots past the row's total are zeroed at the end, and the totals go to
    totals_ref [M]. Per (program, column) info_ref [programs, N / per_word] gets
    (BM + 1) * entries + (entries of rows with total <= W), two 16-bit records per
    word for bf16; bad_ref [programs] is non-zero when a gate value is NaN or +-Inf.
    The walk writes the records as if every row stayed within W; a program with a
    longer row then reads that row's tiles again and takes its entries off them.
    """
    block_m, groups = launch.block_m, launch.block_cols // launch.group
    q = w_ref.shape[2]
    i = _triton.program_id(0, pl.cdiv(m, block_m))
    rows = i * block_m + iota(block_m)
    row_ok = rows < m
    whole = m % block_m == 0  # no block overhangs M: unmasked loads
    group_col = iota(groups)[None, :] * launch.group
    word_col = iota(groups)[:, None] * q + iota(q)[None, :]
    record_at = jnp.full((groups, q), i, _I32)

    def load(t, rows_on):
        """Tile t of the rows where rows_on (None: all), zeros elsewhere."""
        block = w_ref.at[
            pl.ds(i * block_m, block_m), pl.ds(jnp.minimum(t, tiles - 1) * groups, groups)
        ]
        if rows_on is None:
            return _triton.load(block, eviction_policy=_STREAM)
        mask = rows_on[:, None, None]
        return _triton.load(block, mask=mask, other=0, eviction_policy=_STREAM)

    def records(t):
        """The words of tile t's records."""
        return info_ref.at[record_at, t * groups * q + word_col]

    def compact_tile(t, words, carry):
        before, bad = carry
        flags = bit_groups.positive_flags(words, per_word)
        bits = bit_groups.group_bits(flags, per_word)
        per_group = lax.population_count(bits)  # [BM, G]
        slot0 = before[:, None] + jnp.cumsum(per_group, axis=1) - per_group
        most = jnp.max(jnp.max(per_group, axis=1))  # one axis at a time (lowering)
        col0 = t * launch.block_cols + group_col

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
            _triton.store(cols_ref.at[at], (col0 + element).astype(cols_ref.dtype), mask=ok)
            _triton.store(vals_ref.at[at], value, mask=ok)
            return left & (left - 1)

        lax.fori_loop(0, most, store_rank, bits)
        # Records as if every row stayed within W, (BM + 2) * entries; a program with
        # a longer row corrects them below, once its totals are known.
        _triton.store(records(t), jnp.sum(flags, axis=0) * (block_m + 2))
        odd = bit_groups.nonfinite(words, per_word)
        bad = bad | jnp.max(jnp.max(jnp.max(odd, axis=2), axis=1))
        return before + jnp.sum(per_group, axis=1), bad

    carry = (jnp.zeros((block_m,), _I32), jnp.zeros((), jnp.uint32))
    rows_on = None if whole else row_ok
    total, bad = bit_groups.for_each_block(
        lambda t: load(t, rows_on), compact_tile, carry, steps=tiles, ahead=launch.ahead
    )
    _triton.store(totals_ref.at[rows], total, mask=row_ok)
    _triton.store(bad_ref.at[jnp.full((1,), i, _I32)], jnp.full((1,), bad, jnp.uint32))
    s = jnp.broadcast_to(iota(width)[None, :], (block_m, width))
    rows_w = jnp.broadcast_to(rows[:, None], (block_m, width))
    unused = (s >= total[:, None]) & row_ok[:, None]
    zeros = jnp.zeros((block_m, width), cols_ref.dtype)
    _triton.store(cols_ref.at[rows_w, s], zeros, mask=unused)
    _triton.store(vals_ref.at[rows_w, s], jnp.zeros((block_m, width), vals_ref.dtype), mask=unused)

    long_row = total > width  # rows past M have no entries

    @pl.when(jnp.max(long_row.astype(_I32)) == 1)
    def _correct_records():
        # Only programs with a row past W (it goes to the dense tail and leaves the
        # column counts): a second read of those rows' tiles, the other rows masked
        # off (no memory traffic), and each record less the long rows' entries is
        # (BM + 1) * entries + ELL entries. The records are read back and stored
        # through the first pass's index, so Triton gives both the same layout and
        # each thread rewrites the words it wrote itself. The long rows' flags sum to
        # the same packed counters as the record's entries, and a 16-bit record is at
        # least the entries it counts, so nothing borrows across halves.
        def tile(t, carry):
            extra = jnp.sum(bit_groups.positive_flags(load(t, long_row), per_word), axis=0)
            _triton.store(records(t), _triton.load(records(t)) - extra)
            return carry

        lax.fori_loop(0, tiles, tile, 0)


def compact_rows(
    p: jax.Array,
    *,
    width: int,
    launch: CompactLaunch,
    impl: str = "pallas",
    interpret: bool | None = None,
) -> tuple[EllRows, jax.Array, jax.Array]:
    """Packs the positive entries of a dense gate [M, N] into ELL rows of width W.

    Args:
        p: [M, N] bf16 or fp32 gate pre-activations U (or relu(U)); entries > 0 are
            the pattern and their values are P = relu(U).
        width: W (a power of two).
        launch: the blocks (N must be a multiple of launch.block_cols).
        impl: "pallas" or "xla" (`compact_rows_ref`).
        interpret: Pallas interpret mode (None: interpret unless on a GPU).

    Returns:
        (EllRows with true counts and per-column ELL counts, fired bool [N],
        all_finite bool scalar: no gate value is NaN or +-Inf). Slots at or past a
        row's count hold zeros. With any non-finite gate the ELL part is not
        meaningful (callers run densely then; the kernel counts a +NaN as an entry,
        the reference does not).

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
    per_word = bit_groups.elements_per_word(p.dtype)
    q = launch.group // per_word
    # A free (row-major) view: the gate as uint32 words in groups [M, N / group, Q].
    words = lax.bitcast_convert_type(p.reshape(m, n // per_word, per_word), jnp.uint32)
    words = words.reshape(m, n // launch.group, q)
    programs = pl.cdiv(m, launch.block_m)
    kernel = functools.partial(
        _compact_kernel,
        m=m,
        width=width,
        launch=launch,
        per_word=per_word,
        tiles=n // launch.block_cols,
    )
    totals, cols, vals, info, bad = _triton.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((m,), _I32),
            jax.ShapeDtypeStruct((m, width), col_dtype(n)),
            jax.ShapeDtypeStruct((m, width), p.dtype),
            jax.ShapeDtypeStruct((programs, n // per_word), jnp.uint32),
            jax.ShapeDtypeStruct((programs,), jnp.uint32),
        ),
        grid=(programs,),
        # One stage: the walk prefetches its tiles itself (`bit_groups.for_each_block`).
        compiler_params=_triton.compiler_params(num_warps=launch.num_warps, num_stages=1),
        interpret=_triton.resolve_interpret(interpret),
        name="twell_compact_rows",
    )(words)
    if per_word == 2:  # two 16-bit records per word, the lower column in the low half
        info = lax.bitcast_convert_type(info, jnp.uint16).reshape(programs, n)
    # info = (BM + 1) * entries + ELL entries. One variadic reduction over the row
    # blocks gives both per-column numbers (two reductions cost a launch and a pass
    # more); the 16-bit records are widened inside it (two reductions of one widened
    # copy made XLA write that int32 copy of the whole [programs, N] array).
    col_counts, most = lax.reduce(
        ((info % (launch.block_m + 1)).astype(_I32), info),
        (jnp.zeros((), _I32), jnp.zeros((), info.dtype)),
        lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])),
        (0,),
    )
    return EllRows(totals, cols, vals, col_counts), most > 0, jnp.all(bad == 0)


def gate_to_ell(
    x: jax.Array,
    w_gate: jax.Array,
    *,
    width: int,
    launch: CompactLaunch,
    impl: str = "pallas",
    interpret: bool | None = None,
) -> tuple[EllRows, jax.Array, jax.Array]:
    """U = x Wg^T packed into ELL rows: `compact_rows` of the gate GEMM's output.

    x [M, H] and w_gate [N, H] of one dtype; U comes in x.dtype straight from the GEMM
    (fp32 accumulation inside), with no separate relu pass (the compaction keeps the
    entries > 0). Past `GATE_BLOCK_ROWS` rows the GEMM and the compaction run block by
    block, one block's gate live at a time, and the blocks' outputs are joined: the
    same result as one call. Returns what `compact_rows` returns.
    """
    m = x.shape[0]
    parts, done = [], None
    for start, size in row_blocks(m, GATE_BLOCK_ROWS):
        xb = x if size == m else lax.slice_in_dim(x, start, start + size)
        if done is not None:
            xb = after(xb, done)
        with jax.named_scope("twell_gate_gemm"):
            u = jnp.einsum("mh,nh->mn", xb, w_gate, preferred_element_type=x.dtype)
        with jax.named_scope("twell_compact"):
            part = compact_rows(u, width=width, launch=launch, impl=impl, interpret=interpret)
        parts.append(part)
        # The next block waits for this one's reductions too (its column counts come
        # from the [rows / block_m, N] records), or XLA may leave them all to the end.
        done = (part[0].counts, part[0].col_counts, part[1], part[2])
    if len(parts) == 1:
        return parts[0]
    ells, fired, finite = zip(*parts, strict=True)
    ell = EllRows(
        *(jnp.concatenate(field) for field in zip(*(e[:3] for e in ells), strict=True)),
        sum(e.col_counts for e in ells),
    )
    return ell, functools.reduce(jnp.logical_or, fired), functools.reduce(jnp.logical_and, finite)


def compact_rows_ref(p: jax.Array, width: int) -> tuple[EllRows, jax.Array, jax.Array]:
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
