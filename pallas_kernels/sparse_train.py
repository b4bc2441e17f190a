"""Kernels of the sparse training path over the hybrid ELL layout (twell.md §5).

Every product has a Pallas (Triton) kernel and a plain-`jnp` twin with the same
signature (`impl="xla"`; it gathers [M, W, H] weight slices, so it is meant for CPU
and tests, not for production shapes):

- `compact_rows`: dense gate [M, N] -> ELL (true counts, cols, values, entries per
  column) + fired.
- `sddmm_up`: R = x Wu^T sampled on the ELL pattern, T = P * R, per-row sum |T|.
- `spmm_rows`: out[i] = sum_s v[i, s] W[cols[i, s]] for one or two (v, W) pairs
  (forward T Wd; backward dR Wu + dU Wg in one fp32 accumulator).
- `sddmm_grad`: dT = gO Wd^T sampled on the pattern + l1_scale * sign(T);
  dR = dT * P, dU = dT * R.
- `spmm_csc`: per neuron, dWu = dR^T x, dWg = dU^T x, dWd = T^T gO over the CSC
  index of `hybrid_format.build_csc` (values copied into CSC order by
  `csc_entries`: reading them through the slots inside the kernel made it 20% slower
  on the H200, scattered loads behind the x / gO gathers).

Kernel shape rules (pallas.md): every value is a power-of-two piece (row chunks of
`block_h` columns, `chunk` ELL slots), refs are whole arrays indexed by hand with
masks (no overhanging blocks), gathers index a Ref with int arrays on every axis
(interpret mode cannot mix int arrays with slices), and products run on CUDA cores in
fp32 (no TF32). Rows of one program are independent, so results are deterministic.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _triton
from pallas_kernels import tile_select as ts
from pallas_kernels.hybrid_format import Csc, EllRows, compact_rows_ref, slot_mask

_F32 = jnp.float32
_I32 = jnp.int32
# L2 hints: gathered weight rows are reused by many tokens (keep them, 23 MB per weight
# at production shapes); the dense gate is read once (stream it).
_KEEP = "evict_last"
_STREAM = "evict_first"


def _grid_iota(n: int) -> jax.Array:
    return lax.broadcasted_iota(_I32, (n,), 0)


def _check_blocks(name: str, h: int, block_h: int, chunk: int) -> None:
    if h % block_h or not (_triton.is_pow2(block_h) and _triton.is_pow2(chunk)):
        raise ValueError(f"{name}: block_h={block_h} must be a power of two dividing H={h}")


# --------------------------------------------------------------------------------------
# Compaction: dense gate -> ELL.
# --------------------------------------------------------------------------------------


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
    rows = i * block_rows + _grid_iota(block_rows)
    row_ok = rows < m
    lane = _grid_iota(block_cols)
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
        _triton.store(cols_ref.at[rows, slot], t * block_cols + ts.key_lane(key), mask=ok)
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
        s = jnp.broadcast_to(_grid_iota(width)[None, :], (block_rows, width))
        rows_w = jnp.broadcast_to(rows[:, None], (block_rows, width))
        unused = (s >= total[:, None]) & row_ok[:, None]
        _triton.store(cols_ref.at[rows_w, s], jnp.zeros((block_rows, width), _I32), mask=unused)
        zeros = jnp.zeros((block_rows, width), vals_ref.dtype)
        _triton.store(vals_ref.at[rows_w, s], zeros, mask=unused)


def compact_rows(
    p: jax.Array,
    *,
    width: int,
    impl: str = "pallas",
    block_rows: int = 16,
    block_cols: int = 256,
    num_warps: int = 4,
    interpret: bool | None = None,
) -> tuple[EllRows, jax.Array]:
    """Packs the positive entries of a dense gate [M, N] into ELL rows of width W.

    Two passes over p: XLA counts the positives of every (row, column tile) and takes
    their exclusive prefix along the row; then one Pallas program per (row block,
    tile) writes its entries at those offsets. (A single pass that walks N per row
    block serialises 44 dependent steps per program: 5x slower on the H200.)

    Args:
        p: [M, N] bf16 gate pre-activations U (or relu(U)); entries > 0 are the
            pattern and their values are P = relu(U).
        width: W (a power of two).
        impl: "pallas" or "xla".
        block_rows, block_cols: rows and columns per program (powers of two; N must
            be a multiple of block_cols).
        num_warps: Triton warps per program.
        interpret: Pallas interpret mode (None: interpret unless on a GPU).

    Returns:
        (EllRows with true counts and per-column ELL counts, fired bool [N]). Slots at
        or past a row's count hold zeros.
    """
    if impl == "xla":
        return compact_rows_ref(p, width)
    m, n = p.shape
    if n % block_cols or not all(map(_triton.is_pow2, (block_cols, block_rows, width))):
        raise ValueError(f"compact_rows: unsupported N={n}, blocks {block_rows}x{block_cols}")
    tiles = n // block_cols
    tile_counts = jnp.sum((p > 0).reshape(m, tiles, block_cols), axis=2, dtype=_I32)
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
            jax.ShapeDtypeStruct((m, width), _I32),
            jax.ShapeDtypeStruct((m, width), p.dtype),
            jax.ShapeDtypeStruct((row_blocks, n), info_dtype),
        ),
        grid=(tiles, row_blocks),
        compiler_params=_triton.compiler_params(num_warps=num_warps, num_stages=1),
        interpret=_triton.resolve_interpret(interpret),
        name="twell_compact_rows",
    )(p, ends - tile_counts, totals)
    info = info.astype(_I32)
    # info = (BR + 1) * entries + ELL entries, summed over the row blocks.
    col_counts = jnp.sum(info % (block_rows + 1), axis=0, dtype=_I32)
    fired = jnp.max(info, axis=0) > 0
    return EllRows(totals, cols, vals, col_counts), fired


# --------------------------------------------------------------------------------------
# Forward SDDMM: R = x Wu^T on the pattern, T = P * R, sum |T| per row.
# --------------------------------------------------------------------------------------


def _row_slots(count, c, chunk):
    """Slot ids of chunk c of a row and their validity mask."""
    slots = c * chunk + _grid_iota(chunk)
    return slots, slots < count


def _for_each_chunk(count, chunk, cols_ref, row, body, init):
    """Runs body(slots, ok, cols, carry) over the row's chunks of `chunk` ELL slots.

    The next chunk's columns are loaded before this chunk's gathers are issued, so the
    column load (an L2 round trip the gathers depend on) is off the loop's critical
    path.
    """

    def load_cols(c):
        slots, ok = _row_slots(count, c, chunk)
        return _triton.load(cols_ref.at[row, slots], mask=ok, other=0)

    def step(c, carry):
        cols, inner = carry
        cols_next = load_cols(c + 1)
        slots, ok = _row_slots(count, c, chunk)
        return cols_next, body(slots, ok, cols, inner)

    n_chunks = (count + chunk - 1) // chunk
    return lax.fori_loop(0, n_chunks, step, (load_cols(0), init))[1]


def _load_row(ref, row, h, block_h):
    """Row `row` of ref [M, H] as fp32 pieces of block_h columns, loaded once per program
    and kept in registers (the row is read by this program only: streamed)."""
    return [
        _triton.load(
            ref.at[row, k * block_h + _grid_iota(block_h)], eviction_policy=_STREAM
        ).astype(_F32)
        for k in range(h // block_h)
    ]


def _gather(w_ref, cols, ok, k, *, chunk, block_h):
    """fp32 [chunk, block_h]: piece k of the weight rows cols (0 where not ok)."""
    cols_d = jnp.broadcast_to(cols[:, None], (chunk, block_h))
    d_c = jnp.broadcast_to((k * block_h + _grid_iota(block_h))[None, :], (chunk, block_h))
    w = _triton.load(w_ref.at[cols_d, d_c], mask=ok[:, None], other=0, eviction_policy=_KEEP)
    return w.astype(_F32)


def _gather_dot(x_pieces, w_ref, cols, ok, *, chunk, block_h):
    """fp32 [chunk]: x . w[cols[s]] for each slot (masked slots give 0)."""
    acc = jnp.zeros((chunk,), _F32)
    for k, xv in enumerate(x_pieces):
        w = _gather(w_ref, cols, ok, k, chunk=chunk, block_h=block_h)
        acc = acc + jnp.sum(w * xv[None, :], axis=1)
    return acc


def _zero_unused(refs, row, count, width):
    """Writes 0 to the slots of `row` at or beyond `count` in every ref."""
    slots = _grid_iota(width)
    for ref in refs:
        _triton.store(ref.at[row, slots], jnp.zeros((width,), ref.dtype), mask=slots >= count)


def _sddmm_up_kernel(
    count_ref, cols_ref, p_ref, x_ref, w_ref, r_ref, t_ref, l1_ref,
    *, h, width, chunk, block_h,
):  # fmt: skip
    """One program per token row: R and T at its ELL slots, and sum |T|."""
    row = _triton.program_id(0, count_ref.shape[0])
    count = count_ref[row]
    x = _load_row(x_ref, row, h, block_h)

    def body(slots, ok, cols, l1):
        r = _gather_dot(x, w_ref, cols, ok, chunk=chunk, block_h=block_h)
        r = r.astype(r_ref.dtype)
        p = _triton.load(p_ref.at[row, slots], mask=ok, other=0)
        t = (p.astype(_F32) * r.astype(_F32)).astype(t_ref.dtype)
        _triton.store(r_ref.at[row, slots], r, mask=ok)
        _triton.store(t_ref.at[row, slots], t, mask=ok)
        return l1 + jnp.sum(jnp.where(ok, jnp.abs(t.astype(_F32)), 0.0))

    l1 = _for_each_chunk(count, chunk, cols_ref, row, body, jnp.zeros((), _F32))
    _zero_unused((r_ref, t_ref), row, count, width)
    _triton.store(l1_ref.at[row + _grid_iota(1)], jnp.broadcast_to(l1, (1,)))


def _sddmm_up_xla(x, w_up, ell_count, cols, p_vals):
    valid = slot_mask(ell_count, cols.shape[1])
    r = jnp.einsum("mh,mwh->mw", x, w_up[cols], preferred_element_type=_F32)
    r = jnp.where(valid, r, 0).astype(x.dtype)
    t = jnp.where(valid, p_vals.astype(_F32) * r.astype(_F32), 0).astype(x.dtype)
    return r, t, jnp.sum(jnp.abs(t.astype(_F32)), axis=1)


def sddmm_up(
    x: jax.Array,
    w_up: jax.Array,
    ell_count: jax.Array,
    cols: jax.Array,
    p_vals: jax.Array,
    *,
    impl: str = "pallas",
    chunk: int = 4,
    block_h: int = 2048,
    num_warps: int = 4,
    num_stages: int = 1,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Forward SDDMM on the ELL pattern.

    Args:
        x: [M, H] bf16 tokens. w_up: [N, H] bf16.
        ell_count: int32 [M] slots to use per row (0 for tail rows).
        cols, p_vals: int32 / bf16 [M, W] ELL columns and gate values.

    Returns:
        r_vals [M, W] (x Wu^T at the slots), t_vals [M, W] (P * R rounded to x.dtype),
        both 0 in unused slots, and l1_rows fp32 [M] = sum over slots of |T|.
    """
    if impl == "xla":
        return _sddmm_up_xla(x, w_up, ell_count, cols, p_vals)
    m, h = x.shape
    width = cols.shape[1]
    _check_blocks("sddmm_up", h, block_h, chunk)
    kernel = functools.partial(_sddmm_up_kernel, h=h, width=width, chunk=chunk, block_h=block_h)
    return _triton.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((m, width), x.dtype),
            jax.ShapeDtypeStruct((m, width), x.dtype),
            jax.ShapeDtypeStruct((m,), _F32),
        ),
        grid=(m,),
        compiler_params=_triton.compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=_triton.resolve_interpret(interpret),
        name="twell_sddmm_up",
    )(ell_count, cols, p_vals, x, w_up)


# --------------------------------------------------------------------------------------
# Row SpMM: out[i] = sum_s v[i, s] W[cols[i, s]] (one or two (v, W) pairs).
# --------------------------------------------------------------------------------------


def _spmm_rows_kernel(count_ref, cols_ref, *refs, n_terms, chunk, block_h):
    """Program (row, H block): gathers weight row slices and accumulates in fp32."""
    val_refs, w_refs, out_ref = refs[:n_terms], refs[n_terms : 2 * n_terms], refs[-1]
    row = _triton.program_id(0, count_ref.shape[0])
    hb = _triton.program_id(1, out_ref.shape[1] // block_h)
    d = hb * block_h + _grid_iota(block_h)
    d_c = jnp.broadcast_to(d[None, :], (chunk, block_h))

    count = count_ref[row]

    def body(c, acc):
        slots, ok = _row_slots(count, c, chunk)
        cols = _triton.load(cols_ref.at[row, slots], mask=ok, other=0)
        cols_d = jnp.broadcast_to(cols[:, None], (chunk, block_h))
        for v_ref, w_ref in zip(val_refs, w_refs, strict=True):
            v = _triton.load(v_ref.at[row, slots], mask=ok, other=0).astype(_F32)
            w = _triton.load(
                w_ref.at[cols_d, d_c], mask=ok[:, None], other=0, eviction_policy=_KEEP
            ).astype(_F32)
            acc = acc + jnp.sum(v[:, None] * w, axis=0)
        return acc

    # No column prefetch here (`_for_each_chunk`): it made this kernel 5% slower on the
    # H200, while the two SDDMMs gained 3-6%.
    acc = lax.fori_loop(0, (count + chunk - 1) // chunk, body, jnp.zeros((block_h,), _F32))
    _triton.store(out_ref.at[row, d], acc.astype(out_ref.dtype), eviction_policy=_STREAM)


def _spmm_rows_xla(terms, ell_count, cols, out_dtype):
    valid = slot_mask(ell_count, cols.shape[1])
    acc = sum(
        jnp.einsum("mw,mwh->mh", jnp.where(valid, v, 0), w[cols], preferred_element_type=_F32)
        for v, w in terms
    )
    return acc.astype(out_dtype)


def spmm_rows(
    terms: tuple[tuple[jax.Array, jax.Array], ...],
    ell_count: jax.Array,
    cols: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    impl: str = "pallas",
    chunk: int = 4,
    block_h: int = 2048,
    num_warps: int = 4,
    num_stages: int = 1,
    interpret: bool | None = None,
) -> jax.Array:
    """Row-wise sparse x dense: out = sum over terms of V W (V on the ELL pattern).

    Args:
        terms: ((v_vals [M, W], w [N, H]), ...): one pair (forward T Wd) or two
            (backward dR Wu + dU Wg, summed in one fp32 accumulator).
        ell_count: int32 [M] slots to use per row (0 rows get an all-zero output).
        cols: int32 [M, W].
        out_dtype: dtype of the result.

    Returns:
        [M, H] in out_dtype.
    """
    if impl == "xla":
        return _spmm_rows_xla(terms, ell_count, cols, out_dtype)
    m = cols.shape[0]
    h = terms[0][1].shape[1]
    _check_blocks("spmm_rows", h, block_h, chunk)
    kernel = functools.partial(_spmm_rows_kernel, n_terms=len(terms), chunk=chunk, block_h=block_h)
    vals = [v for v, _ in terms]
    ws = [w for _, w in terms]
    return _triton.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, h), out_dtype),
        grid=(m, h // block_h),
        compiler_params=_triton.compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=_triton.resolve_interpret(interpret),
        name=f"twell_spmm_rows_{len(terms)}",
    )(ell_count, cols, *vals, *ws)


# --------------------------------------------------------------------------------------
# Backward fused SDDMM: dT = gO Wd^T on the pattern + l1_scale sign(T); dR, dU.
# --------------------------------------------------------------------------------------


def _sddmm_grad_kernel(
    count_ref, cols_ref, p_ref, r_ref, t_ref, g_ref, w_ref, scale_ref, dr_ref, du_ref,
    *, h, width, chunk, block_h,
):  # fmt: skip
    """One program per token row: dT at its slots, then dR = dT P and dU = dT R."""
    row = _triton.program_id(0, count_ref.shape[0])
    count = count_ref[row]
    scale = scale_ref[0]
    g = _load_row(g_ref, row, h, block_h)

    def body(slots, ok, cols, carry):
        dt = _gather_dot(g, w_ref, cols, ok, chunk=chunk, block_h=block_h)
        t = _triton.load(t_ref.at[row, slots], mask=ok, other=0).astype(_F32)
        dt = dt + scale * jnp.sign(t)
        p = _triton.load(p_ref.at[row, slots], mask=ok, other=0).astype(_F32)
        r = _triton.load(r_ref.at[row, slots], mask=ok, other=0).astype(_F32)
        _triton.store(dr_ref.at[row, slots], (dt * p).astype(dr_ref.dtype), mask=ok)
        _triton.store(du_ref.at[row, slots], (dt * r).astype(du_ref.dtype), mask=ok)
        return carry

    _for_each_chunk(count, chunk, cols_ref, row, body, jnp.zeros((), _I32))
    _zero_unused((dr_ref, du_ref), row, count, width)


def _sddmm_grad_xla(g_out, w_down, ell_count, cols, p_vals, r_vals, t_vals, l1_scale):
    valid = slot_mask(ell_count, cols.shape[1])
    dt = jnp.einsum("mh,mwh->mw", g_out, w_down[cols], preferred_element_type=_F32)
    dt = dt + l1_scale[0] * jnp.sign(t_vals.astype(_F32))
    dr = jnp.where(valid, dt * p_vals.astype(_F32), 0).astype(g_out.dtype)
    du = jnp.where(valid, dt * r_vals.astype(_F32), 0).astype(g_out.dtype)
    return dr, du


def sddmm_grad(
    g_out: jax.Array,
    w_down: jax.Array,
    ell_count: jax.Array,
    cols: jax.Array,
    p_vals: jax.Array,
    r_vals: jax.Array,
    t_vals: jax.Array,
    l1_scale: jax.Array,
    *,
    impl: str = "pallas",
    chunk: int = 4,
    block_h: int = 2048,
    num_warps: int = 4,
    num_stages: int = 1,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Backward SDDMM fused with the L1 shift and both elementwise products.

    Args:
        g_out: [M, H] upstream gradient of the MLP output. w_down: [N, H].
        ell_count, cols, p_vals, r_vals, t_vals: the forward's ELL arrays.
        l1_scale: fp32 [1], d loss / d sum|T| (the l1 cotangent divided by M).

    Returns:
        dr_vals, du_vals [M, W] in g_out.dtype (0 in unused slots).
    """
    if impl == "xla":
        return _sddmm_grad_xla(g_out, w_down, ell_count, cols, p_vals, r_vals, t_vals, l1_scale)
    m, h = g_out.shape
    width = cols.shape[1]
    _check_blocks("sddmm_grad", h, block_h, chunk)
    kernel = functools.partial(_sddmm_grad_kernel, h=h, width=width, chunk=chunk, block_h=block_h)
    return _triton.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((m, width), g_out.dtype),
            jax.ShapeDtypeStruct((m, width), g_out.dtype),
        ),
        grid=(m,),
        compiler_params=_triton.compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=_triton.resolve_interpret(interpret),
        name="twell_sddmm_grad",
    )(ell_count, cols, p_vals, r_vals, t_vals, g_out, w_down, l1_scale)


# --------------------------------------------------------------------------------------
# Transposed SpMM over the CSC index: dWu = dR^T x, dWg = dU^T x, dWd = T^T gO.
# --------------------------------------------------------------------------------------


def _spmm_csc_kernel(
    order_ref, off_ref, tok_ref, dr_ref, du_ref, t_ref, x_ref, g_ref, dwu_ref, dwg_ref, dwd_ref,
    *, chunk, block_h,
):  # fmt: skip
    """Program (neuron, H block): loops over the neuron's entries in token order.

    Programs take neurons heaviest first (`order`), so the few long loops of very
    active neurons overlap with the many short ones instead of trailing at the end.
    The neuron axis varies fastest, so while one H block is swept only x[:, block] and
    gO[:, block] are gathered (2 M block_h bf16: 32 MB at M=16384, block_h=512).
    """
    nid = order_ref[_triton.program_id(0, order_ref.shape[0])]
    hb = _triton.program_id(1, dwd_ref.shape[1] // block_h)
    start, end = off_ref[nid], off_ref[nid + 1]
    d = hb * block_h + _grid_iota(block_h)
    d_c = jnp.broadcast_to(d[None, :], (chunk, block_h))

    def body(c, accs):
        acc_u, acc_g, acc_d = accs
        e = start + c * chunk + _grid_iota(chunk)
        ok = e < end
        tok = _triton.load(tok_ref.at[e], mask=ok, other=0)
        tok_d = jnp.broadcast_to(tok[:, None], (chunk, block_h))
        xv = _triton.load(x_ref.at[tok_d, d_c], mask=ok[:, None], other=0).astype(_F32)
        gv = _triton.load(g_ref.at[tok_d, d_c], mask=ok[:, None], other=0).astype(_F32)
        dr = _triton.load(dr_ref.at[e], mask=ok, other=0).astype(_F32)
        du = _triton.load(du_ref.at[e], mask=ok, other=0).astype(_F32)
        t = _triton.load(t_ref.at[e], mask=ok, other=0).astype(_F32)
        acc_u = acc_u + jnp.sum(dr[:, None] * xv, axis=0)
        acc_g = acc_g + jnp.sum(du[:, None] * xv, axis=0)
        acc_d = acc_d + jnp.sum(t[:, None] * gv, axis=0)
        return acc_u, acc_g, acc_d

    zeros = jnp.zeros((block_h,), _F32)
    n_chunks = (end - start + chunk - 1) // chunk
    acc_u, acc_g, acc_d = lax.fori_loop(0, n_chunks, body, (zeros, zeros, zeros))
    _triton.store(dwu_ref.at[nid, d], acc_u.astype(dwu_ref.dtype))
    _triton.store(dwg_ref.at[nid, d], acc_g.astype(dwg_ref.dtype))
    _triton.store(dwd_ref.at[nid, d], acc_d.astype(dwd_ref.dtype))


def _spmm_csc_xla(offsets, tok, dr_s, du_s, t_s, x, g_out):  # `order` only schedules
    n = offsets.shape[0] - 1
    seg = jnp.searchsorted(offsets[1:], jnp.arange(tok.shape[0]), side="right")
    xv, gv = x[tok].astype(_F32), g_out[tok].astype(_F32)

    def seg_sum(v, rows):
        return jax.ops.segment_sum(v.astype(_F32)[:, None] * rows, seg, num_segments=n + 1)[:n]

    return tuple(
        seg_sum(v, rows).astype(x.dtype) for v, rows in ((dr_s, xv), (du_s, xv), (t_s, gv))
    )


def spmm_csc(
    offsets: jax.Array,
    order: jax.Array,
    tok: jax.Array,
    dr_s: jax.Array,
    du_s: jax.Array,
    t_s: jax.Array,
    x: jax.Array,
    g_out: jax.Array,
    *,
    impl: str = "pallas",
    chunk: int = 4,
    block_h: int = 512,
    num_warps: int = 2,
    num_stages: int = 1,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Weight gradients of the ELL part from the neuron-sorted entries.

    Args:
        offsets: int32 [N + 1] CSC offsets. order: int32 [N] neuron of each program
            (a permutation; heaviest first). tok: int32 [E] token of each sorted entry.
        dr_s, du_s, t_s: [E] dR, dU, T of each sorted entry.
        x, g_out: [M, H] tokens and upstream gradient.

    Returns:
        (dWu, dWg, dWd), each [N, H] in x.dtype (fp32 accumulation).
    """
    if impl == "xla":
        return _spmm_csc_xla(offsets, tok, dr_s, du_s, t_s, x, g_out)
    n = offsets.shape[0] - 1
    h = x.shape[1]
    _check_blocks("spmm_csc", h, block_h, chunk)
    kernel = functools.partial(_spmm_csc_kernel, chunk=chunk, block_h=block_h)
    out = jax.ShapeDtypeStruct((n, h), x.dtype)
    return _triton.pallas_call(
        kernel,
        out_shape=(out, out, out),
        grid=(n, h // block_h),
        compiler_params=_triton.compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=_triton.resolve_interpret(interpret),
        name="twell_spmm_csc",
    )(order, offsets, tok, dr_s, du_s, t_s, x, g_out)


def csc_entries(
    csc: Csc, width: int, dr_vals: jax.Array, du_vals: jax.Array, t_vals: jax.Array
) -> tuple[jax.Array, ...]:
    """(tok, dr_s, du_s, t_s): the per-entry token ids and values in CSC order (XLA)."""
    tok = csc.slots // width
    return (tok, *(v.reshape(-1)[csc.slots] for v in (dr_vals, du_vals, t_vals)))
