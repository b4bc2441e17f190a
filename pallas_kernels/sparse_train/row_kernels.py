"""Row kernels of the sparse training path (docs/design.md §6.2): SDDMMs and row SpMMs
over the ELL rows, one program per token row (or per row and H block).

Every product has a Pallas (Triton) kernel and a plain-`jnp` twin (`impl="xla"`; it
gathers [M, W, H] weight slices, so it is meant for CPU and tests, not for production
shapes):

- `sddmm_up`: R = x Wu^T sampled on the ELL pattern, T = P * R, per-row sum |T|.
- `spmm_rows`: out[i] = sum_s v[i, s] W[cols[i, s]] for one or two (v, W) pairs
  (forward T Wd; backward dR Wu + dU Wg in one fp32 accumulator).
- `sddmm_grad`: T = P * R, dT = gO Wd^T sampled on the pattern + l1_scale * sign(T);
  dR = dT * P, dU = dT * R; and the non-finite count of each row of gO.

Kernel shape rules (docs/design.md §10): every value is a power-of-two piece (row
pieces of `block_h` columns, `group` ELL slots), refs are whole arrays indexed by hand
with masks (no overhanging blocks), gathers index a Ref with int arrays on every axis
(interpret mode cannot mix int arrays with slices), and products run on CUDA cores in
fp32 (no TF32). Rows of one program are independent, so results are deterministic.
Each wrapper takes its kernel's `RowLaunch` (`group`, `num_warps`, `block_h`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _triton
from pallas_kernels._gather import RowLaunch
from pallas_kernels.sparse_train._launch import iota, row_call
from pallas_kernels.sparse_train.format import slot_mask

_F32 = jnp.float32
# L2 hints: gathered weight rows are reused by many tokens (keep them); a token's own
# row of x / gO / out is touched by one program only (stream it).
_KEEP = "evict_last"
_STREAM = "evict_first"


# --------------------------------------------------------------------------------------
# Forward SDDMM: R = x Wu^T on the pattern, T = P * R, sum |T| per row.
# --------------------------------------------------------------------------------------


def _row_slots(count, c, group):
    """Slot ids of group c of a row and their validity mask."""
    slots = c * group + iota(group)
    return slots, slots < count


def _for_each_group(count, group, cols_ref, row, body, init):
    """Runs body(slots, ok, cols, carry) over the row's groups of `group` ELL slots.

    The next group's columns are loaded before this group's gathers are issued, so the
    column load (an L2 round trip the gathers depend on) is off the loop's critical
    path.
    """

    def load_cols(c):
        slots, ok = _row_slots(count, c, group)
        # Widened at once: int16 ids times the row stride would overflow.
        return _triton.load(cols_ref.at[row, slots], mask=ok, other=0).astype(jnp.int32)

    def step(c, carry):
        cols, inner = carry
        cols_next = load_cols(c + 1)
        slots, ok = _row_slots(count, c, group)
        return cols_next, body(slots, ok, cols, inner)

    n_groups = (count + group - 1) // group
    return lax.fori_loop(0, n_groups, step, (load_cols(0), init))[1]


def _load_row(ref, row, h, block_h):
    """Row `row` of ref [M, H] as fp32 pieces of block_h columns, loaded once per program
    and kept in registers (the row is read by this program only: streamed)."""
    return [
        _triton.load(ref.at[row, k * block_h + iota(block_h)], eviction_policy=_STREAM).astype(_F32)
        for k in range(h // block_h)
    ]


def _gather(w_ref, cols, ok, k, *, group, block_h):
    """fp32 [group, block_h]: piece k of the weight rows cols (0 where not ok)."""
    cols_d = jnp.broadcast_to(cols[:, None], (group, block_h))
    d_c = jnp.broadcast_to((k * block_h + iota(block_h))[None, :], (group, block_h))
    w = _triton.load(w_ref.at[cols_d, d_c], mask=ok[:, None], other=0, eviction_policy=_KEEP)
    return w.astype(_F32)


def _gather_dot(x_pieces, w_ref, cols, ok, *, group, block_h):
    """fp32 [group]: x . w[cols[s]] for each slot (masked slots give 0)."""
    acc = jnp.zeros((group,), _F32)
    for k, xv in enumerate(x_pieces):
        w = _gather(w_ref, cols, ok, k, group=group, block_h=block_h)
        acc = acc + jnp.sum(w * xv[None, :], axis=1)
    return acc


def _zero_unused(refs, row, count, width):
    """Writes 0 to the slots of `row` at or beyond `count` in every ref."""
    slots = iota(width)
    for ref in refs:
        _triton.store(ref.at[row, slots], jnp.zeros((width,), ref.dtype), mask=slots >= count)


def _sddmm_up_kernel(
    count_ref, cols_ref, p_ref, x_ref, w_ref, r_ref, t_ref, l1_ref,
    *, h, width, group, block_h,
):  # fmt: skip
    """One program per token row: R and T at its ELL slots, and sum |T|."""
    row = _triton.program_id(0, count_ref.shape[0])
    count = count_ref[row]
    x = _load_row(x_ref, row, h, block_h)

    def body(slots, ok, cols, l1):
        r = _gather_dot(x, w_ref, cols, ok, group=group, block_h=block_h)
        r = r.astype(r_ref.dtype)
        p = _triton.load(p_ref.at[row, slots], mask=ok, other=0)
        t = (p.astype(_F32) * r.astype(_F32)).astype(t_ref.dtype)
        _triton.store(r_ref.at[row, slots], r, mask=ok)
        _triton.store(t_ref.at[row, slots], t, mask=ok)
        return l1 + jnp.sum(jnp.where(ok, jnp.abs(t.astype(_F32)), 0.0))

    l1 = _for_each_group(count, group, cols_ref, row, body, jnp.zeros((), _F32))
    _zero_unused((r_ref, t_ref), row, count, width)
    _triton.store(l1_ref.at[row + iota(1)], jnp.broadcast_to(l1, (1,)))


def hidden_products(p_vals: jax.Array, r_vals: jax.Array, ell_count: jax.Array) -> jax.Array:
    """T = P * R rounded to R's dtype at the used slots, 0 elsewhere: sddmm_up's t_vals
    bit for bit (the product of two bf16 values is exact in fp32), so the training op's
    backward can recompute it instead of saving it. All [M, W]; ell_count int32 [M]."""
    valid = slot_mask(ell_count, r_vals.shape[1])
    return jnp.where(valid, p_vals.astype(_F32) * r_vals.astype(_F32), 0).astype(r_vals.dtype)


def _sddmm_up_xla(x, w_up, ell_count, cols, p_vals):
    valid = slot_mask(ell_count, cols.shape[1])
    r = jnp.einsum("mh,mwh->mw", x, w_up[cols], preferred_element_type=_F32)
    r = jnp.where(valid, r, 0).astype(x.dtype)
    t = hidden_products(p_vals, r, ell_count)
    return r, t, jnp.sum(jnp.abs(t.astype(_F32)), axis=1)


def sddmm_up(
    x: jax.Array,
    w_up: jax.Array,
    ell_count: jax.Array,
    cols: jax.Array,
    p_vals: jax.Array,
    *,
    launch: RowLaunch,
    impl: str = "pallas",
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Forward SDDMM on the ELL pattern.

    Args:
        x: [M, H] bf16 tokens. w_up: [N, H] bf16.
        ell_count: int32 [M] slots to use per row (0 for tail rows).
        cols, p_vals: [M, W] ELL columns (int16 or int32) and bf16 gate values.
        launch: the kernel's launch (block_h must divide H).
        impl: "pallas" or "xla" (the jnp twin).
        interpret: Pallas interpret mode (None: interpret unless on a GPU).

    Returns:
        r_vals [M, W] (x Wu^T at the slots), t_vals [M, W] (P * R rounded to x.dtype),
        both 0 in unused slots, and l1_rows fp32 [M] = sum over slots of |T|.
    """
    if impl == "xla":
        return _sddmm_up_xla(x, w_up, ell_count, cols, p_vals)
    m, h = x.shape
    width = cols.shape[1]
    kernel = functools.partial(
        _sddmm_up_kernel, h=h, width=width, group=launch.group, block_h=launch.block_h
    )
    return row_call(
        kernel,
        name="twell_sddmm_up",
        grid=(m,),
        out_shape=(
            jax.ShapeDtypeStruct((m, width), x.dtype),
            jax.ShapeDtypeStruct((m, width), x.dtype),
            jax.ShapeDtypeStruct((m,), _F32),
        ),
        launch=launch,
        h=h,
        interpret=interpret,
    )(ell_count, cols, p_vals, x, w_up)


# --------------------------------------------------------------------------------------
# Row SpMM: out[i] = sum_s v[i, s] W[cols[i, s]] (one or two (v, W) pairs).
# --------------------------------------------------------------------------------------


def _spmm_rows_kernel(count_ref, cols_ref, *refs, n_terms, group, block_h):
    """Program (row, H block): gathers weight row slices and accumulates in fp32."""
    val_refs, w_refs, out_ref = refs[:n_terms], refs[n_terms : 2 * n_terms], refs[-1]
    row = _triton.program_id(0, count_ref.shape[0])
    hb = _triton.program_id(1, out_ref.shape[1] // block_h)
    d = hb * block_h + iota(block_h)
    d_c = jnp.broadcast_to(d[None, :], (group, block_h))

    count = count_ref[row]

    def body(c, acc):
        slots, ok = _row_slots(count, c, group)
        cols = _triton.load(cols_ref.at[row, slots], mask=ok, other=0).astype(jnp.int32)
        cols_d = jnp.broadcast_to(cols[:, None], (group, block_h))
        for v_ref, w_ref in zip(val_refs, w_refs, strict=True):
            v = _triton.load(v_ref.at[row, slots], mask=ok, other=0).astype(_F32)
            w = _triton.load(
                w_ref.at[cols_d, d_c], mask=ok[:, None], other=0, eviction_policy=_KEEP
            ).astype(_F32)
            acc = acc + jnp.sum(v[:, None] * w, axis=0)
        return acc

    # No column prefetch here (`_for_each_group`): it helps the two SDDMMs but not this
    # kernel (docs/performance_notes.md, "Training row kernels").
    acc = lax.fori_loop(0, (count + group - 1) // group, body, jnp.zeros((block_h,), _F32))
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
    launch: RowLaunch,
    impl: str = "pallas",
    interpret: bool | None = None,
) -> jax.Array:
    """Row-wise sparse x dense: out = sum over terms of V W (V on the ELL pattern).

    Args:
        terms: ((v_vals [M, W], w [N, H]), ...): one pair (forward T Wd) or two
            (backward dR Wu + dU Wg, summed in one fp32 accumulator).
        ell_count: int32 [M] slots to use per row (0 rows get an all-zero output).
        cols: [M, W] (int16 or int32).
        out_dtype: dtype of the result.
        launch: the kernel's launch (block_h must divide H).
        impl: "pallas" or "xla" (the jnp twin).
        interpret: Pallas interpret mode (None: interpret unless on a GPU).

    Returns:
        [M, H] in out_dtype.
    """
    if impl == "xla":
        return _spmm_rows_xla(terms, ell_count, cols, out_dtype)
    m = cols.shape[0]
    h = terms[0][1].shape[1]
    group, block_h = launch.group, launch.block_h
    kernel = functools.partial(_spmm_rows_kernel, n_terms=len(terms), group=group, block_h=block_h)
    vals = [v for v, _ in terms]
    ws = [w for _, w in terms]
    return row_call(
        kernel,
        name=f"twell_spmm_rows_{len(terms)}",
        grid=(m, h // block_h),
        out_shape=jax.ShapeDtypeStruct((m, h), out_dtype),
        launch=launch,
        h=h,
        interpret=interpret,
    )(ell_count, cols, *vals, *ws)


# --------------------------------------------------------------------------------------
# Backward fused SDDMM: T = P R, dT = gO Wd^T on the pattern + l1_scale sign(T); dR, dU.
# --------------------------------------------------------------------------------------


def _sddmm_grad_kernel(
    count_ref, cols_ref, p_ref, r_ref, g_ref, w_ref, scale_ref, dr_ref, du_ref, t_ref, bad_ref,
    *, h, width, group, block_h,
):  # fmt: skip
    """One program per token row: T = P R, dT at its slots, then dR = dT P and dU = dT R;
    also counts the non-finite values of the row's gO (the row is loaded whole anyway,
    so the op's finiteness check of gO costs no second read of [M, H])."""
    row = _triton.program_id(0, count_ref.shape[0])
    count = count_ref[row]
    scale = scale_ref[0]
    g = _load_row(g_ref, row, h, block_h)
    bad = sum(jnp.sum(jnp.where(jnp.isfinite(piece), 0, 1)) for piece in g)
    _triton.store(bad_ref.at[row + iota(1)], jnp.broadcast_to(bad, (1,)).astype(bad_ref.dtype))

    def body(slots, ok, cols, carry):
        dt = _gather_dot(g, w_ref, cols, ok, group=group, block_h=block_h)
        p = _triton.load(p_ref.at[row, slots], mask=ok, other=0).astype(_F32)
        r = _triton.load(r_ref.at[row, slots], mask=ok, other=0).astype(_F32)
        t = (p * r).astype(t_ref.dtype)  # sddmm_up's T bit for bit
        dt = dt + scale * jnp.sign(t.astype(_F32))
        _triton.store(t_ref.at[row, slots], t, mask=ok)
        _triton.store(dr_ref.at[row, slots], (dt * p).astype(dr_ref.dtype), mask=ok)
        _triton.store(du_ref.at[row, slots], (dt * r).astype(du_ref.dtype), mask=ok)
        return carry

    _for_each_group(count, group, cols_ref, row, body, jnp.zeros((), jnp.int32))
    _zero_unused((dr_ref, du_ref, t_ref), row, count, width)


def _sddmm_grad_xla(g_out, w_down, ell_count, cols, p_vals, r_vals, l1_scale):
    valid = slot_mask(ell_count, cols.shape[1])
    t_vals = hidden_products(p_vals, r_vals, ell_count)
    dt = jnp.einsum("mh,mwh->mw", g_out, w_down[cols], preferred_element_type=_F32)
    dt = dt + l1_scale[0] * jnp.sign(t_vals.astype(_F32))
    dr = jnp.where(valid, dt * p_vals.astype(_F32), 0).astype(g_out.dtype)
    du = jnp.where(valid, dt * r_vals.astype(_F32), 0).astype(g_out.dtype)
    bad = jnp.sum(~jnp.isfinite(g_out), axis=1, dtype=jnp.int32)
    return dr, du, t_vals, bad


def sddmm_grad(
    g_out: jax.Array,
    w_down: jax.Array,
    ell_count: jax.Array,
    cols: jax.Array,
    p_vals: jax.Array,
    r_vals: jax.Array,
    l1_scale: jax.Array,
    *,
    launch: RowLaunch,
    impl: str = "pallas",
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Backward SDDMM fused with T = P R, the L1 shift and both elementwise products.

    Args:
        g_out: [M, H] upstream gradient of the MLP output. w_down: [N, H].
        ell_count, cols, p_vals, r_vals: the forward's ELL arrays ([M], [M, W]).
        l1_scale: fp32 [1], d loss / d sum|T| (the l1 cotangent divided by M).
        launch: the kernel's launch (block_h must divide H).
        impl: "pallas" or "xla" (the jnp twin).
        interpret: Pallas interpret mode (None: interpret unless on a GPU).

    Returns:
        (dr_vals, du_vals, t_vals, bad_rows): [M, W], 0 in unused slots (dR and dU in
        g_out.dtype; t_vals is `hidden_products`, sddmm_up's T bit for bit), and int32 [M],
        the NaN / Inf values of each row of g_out (every row, also rows without slots).
    """
    if impl == "xla":
        return _sddmm_grad_xla(g_out, w_down, ell_count, cols, p_vals, r_vals, l1_scale)
    m, h = g_out.shape
    width = cols.shape[1]
    kernel = functools.partial(
        _sddmm_grad_kernel, h=h, width=width, group=launch.group, block_h=launch.block_h
    )
    grads = jax.ShapeDtypeStruct((m, width), g_out.dtype)
    t_vals = jax.ShapeDtypeStruct((m, width), r_vals.dtype)
    return row_call(
        kernel,
        name="twell_sddmm_grad",
        grid=(m,),
        out_shape=(grads, grads, t_vals, jax.ShapeDtypeStruct((m,), jnp.int32)),
        launch=launch,
        h=h,
        interpret=interpret,
    )(ell_count, cols, p_vals, r_vals, g_out, w_down, l1_scale)
