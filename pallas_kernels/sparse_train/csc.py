"""Weight gradients of the ELL part (docs/design.md §6.3): the transposed SpMM over the
neuron-sorted (CSC) index of `format.build_csc`.

Per neuron n, dWu[n] = dR[:, n]^T x, dWg[n] = dU[:, n]^T x and dWd[n] = T[:, n]^T gO,
summed over the neuron's entries in token order (fp32, deterministic: no atomics). The
entries' values are first copied into CSC order by `csc_entries` (XLA): reading them
through the slots inside the kernel puts scattered loads behind the x / gO gathers
(docs/performance_notes.md, "Weight-gradient CSC SpMM").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _triton
from pallas_kernels._gather import RowLaunch
from pallas_kernels.sparse_train._launch import iota, row_call
from pallas_kernels.sparse_train.format import Csc

_F32 = jnp.float32


def _spmm_csc_kernel(
    order_ref, off_ref, tok_ref, dr_ref, du_ref, t_ref, x_ref, g_ref, dwu_ref, dwg_ref, dwd_ref,
    *, group, block_h,
):  # fmt: skip
    """Program (neuron, H block): loops over the neuron's entries in token order.

    Programs take neurons heaviest first (`order`), so the few long loops of very
    active neurons overlap with the many short ones instead of trailing at the end.
    The neuron axis varies fastest, so while one H block is swept only x[:, block] and
    gO[:, block] are gathered (2 M block_h bf16).
    """
    nid = order_ref[_triton.program_id(0, order_ref.shape[0])]
    hb = _triton.program_id(1, dwd_ref.shape[1] // block_h)
    start, end = off_ref[nid], off_ref[nid + 1]
    d = hb * block_h + iota(block_h)
    d_c = jnp.broadcast_to(d[None, :], (group, block_h))

    def body(c, accs):
        acc_u, acc_g, acc_d = accs
        e = start + c * group + iota(group)
        ok = e < end
        tok = _triton.load(tok_ref.at[e], mask=ok, other=0)
        tok_d = jnp.broadcast_to(tok[:, None], (group, block_h))
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
    n_groups = (end - start + group - 1) // group
    acc_u, acc_g, acc_d = lax.fori_loop(0, n_groups, body, (zeros, zeros, zeros))
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
    launch: RowLaunch,
    impl: str = "pallas",
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Weight gradients of the ELL part from the neuron-sorted entries.

    Args:
        offsets: int32 [N + 1] CSC offsets. order: int32 [N] neuron of each program
            (a permutation; heaviest first). tok: int32 [E] token of each sorted entry.
        dr_s, du_s, t_s: [E] dR, dU, T of each sorted entry.
        x, g_out: [M, H] tokens and upstream gradient.
        launch: the kernel's launch (`group` entries per loop step; block_h must
            divide H).
        impl: "pallas" or "xla" (the jnp twin).
        interpret: Pallas interpret mode (None: interpret unless on a GPU).

    Returns:
        (dWu, dWg, dWd), each [N, H] in x.dtype (fp32 accumulation).
    """
    if impl == "xla":
        return _spmm_csc_xla(offsets, tok, dr_s, du_s, t_s, x, g_out)
    n = offsets.shape[0] - 1
    h = x.shape[1]
    kernel = functools.partial(_spmm_csc_kernel, group=launch.group, block_h=launch.block_h)
    out = jax.ShapeDtypeStruct((n, h), x.dtype)
    return row_call(
        kernel,
        name="twell_spmm_csc",
        grid=(n, h // launch.block_h),
        out_shape=(out, out, out),
        launch=launch,
        h=h,
        interpret=interpret,
    )(order, offsets, tok, dr_s, du_s, t_s, x, g_out)


def csc_entries(
    csc: Csc, width: int, dr_vals: jax.Array, du_vals: jax.Array, t_vals: jax.Array
) -> tuple[jax.Array, ...]:
    """(tok, dr_s, du_s, t_s): the per-entry token ids and values in CSC order (XLA)."""
    tok = csc.slots // width
    return (tok, *(v.reshape(-1)[csc.slots] for v in (dr_vals, du_vals, t_vals)))
