"""The dense gated MLP with the L1 term, run in blocks of rows so that only one block's
[rows, N] temporaries are live at a time.

Two users: the training op's dense fallback (`op`), and the dense branch of a model's
per-layer sparse / dense switch (`blocked_gated_mlp`). Both sit in a conditional
beside the sparse kernels, and XLA plans a conditional's memory for its largest branch:
a whole-M dense branch makes the sparse step's peak that of the dense MLP however
rarely it runs (docs/performance_notes.md, "Training-step memory"). `row_blocks` and
`after` also cut the op's gate GEMM (`compaction.gate_to_ell`) and hot block (`hot`)
in large calls.

Shapes: x [M, H] bf16; weights [N, H] (w_down is down_proj transposed). Rounding as
`reference.dense_block` (bf16-output GEMMs, fp32 accumulation inside).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.sparse_train.reference import dense_block, gated_hidden

_F32 = jnp.float32
# Most blocks the loops unroll into; larger M gets larger blocks.
MAX_BLOCKS = 16


def row_blocks(m: int, block_rows: int) -> list[tuple[int, int]]:
    """Static (start, size) row blocks covering M.

    The loops are unrolled in Python rather than a `fori_loop`: XLA runs a while loop
    from the host (a device-to-host copy of its predicate per iteration, and one for
    the cond around it), which made the op's two conds stall the GPU on every step
    even when the fallback never ran. Unrolled, the conds run as CUDA-graph
    conditionals with a device-side predicate (docs/design.md §6.4).
    """
    b = max(min(block_rows, m), -(-m // MAX_BLOCKS))
    return [(s, min(b, m - s)) for s in range(0, m, b)]


def after(a, dep):
    """`a`, but computed only once `dep` is: orders the unrolled blocks, so at most one
    block's [rows, N] temporaries are live (the scheduler may otherwise overlap them)."""
    return lax.optimization_barrier((a, dep))[0]


class RowCounts(NamedTuple):
    """What a dense call counts besides its output (no gradient): nnz fp32, the
    non-zeros of h; fired bool [N], neurons non-zero for some row; col_counts int32
    [N], non-zeros per neuron; heavy_rows int32, rows with more than `row_limit`."""

    nnz: jax.Array
    fired: jax.Array
    col_counts: jax.Array
    heavy_rows: jax.Array


def _block_with_counts(x, wg, wu, wd, row_limit: int):
    """`dense_block`'s output, its sum |h| (fp32) and its `RowCounts`."""
    hid = gated_hidden(x, wg, wu)
    nonzero = hid != 0
    out = jnp.einsum("mn,nh->mh", hid, wd).astype(x.dtype)
    l1 = jnp.sum(jnp.abs(hid.astype(_F32)))
    # Two independent reductions of the mask (one pass over it); counting columns
    # over the light rows only would chain them.
    col_counts = jnp.sum(nonzero, axis=0, dtype=jnp.int32)
    heavy = jnp.sum(jnp.sum(nonzero, axis=1, dtype=jnp.int32) > row_limit, dtype=jnp.int32)
    counts = RowCounts(
        nnz=jnp.sum(col_counts).astype(_F32),
        fired=col_counts > 0,
        col_counts=col_counts,
        heavy_rows=heavy,
    )
    return out, l1, counts


def dense_forward(x, wg, wu, wd, block_rows: int, row_limit: int):
    """(out [M, H], sum |h| fp32, `RowCounts`), block by block."""
    n = wg.shape[0]
    out = jnp.zeros_like(x)
    l1 = jnp.zeros((), _F32)
    counts = RowCounts(jnp.zeros((), _F32), jnp.zeros((n,), jnp.bool_),
                       jnp.zeros((n,), jnp.int32), jnp.zeros((), jnp.int32))  # fmt: skip
    for start, size in row_blocks(x.shape[0], block_rows):
        # After the previous block's sums too, not only its output: XLA's GPU scheduler
        # otherwise left every block's reductions to the end, with all the blocks'
        # [rows, N] hidden values and masks live at once (docs/performance_notes.md,
        # "Training-step memory").
        x_b = after(lax.slice_in_dim(x, start, start + size), (out, l1, counts))
        out_b, l1_b, counts_b = _block_with_counts(x_b, wg, wu, wd, row_limit)
        out = lax.dynamic_update_slice_in_dim(out, out_b, start, 0)
        l1 = l1 + l1_b
        counts = RowCounts(
            counts.nnz + counts_b.nnz,
            counts.fired | counts_b.fired,
            counts.col_counts + counts_b.col_counts,
            counts.heavy_rows + counts_b.heavy_rows,
        )
    return out, l1, counts


def dense_backward(x, g_out, wg, wu, wd, scale, block_rows: int):
    """Gradients of `dense_block` block by block: (dx, dWg, dWu, dWd) for the output
    cotangent g_out [M, H] and `scale`, the cotangent of sum |h| (fp32 scalar).

    Weight gradients are summed over blocks in fp32, then rounded to the weights' dtype.
    """
    weights = (wg, wu, wd)
    dx = jnp.zeros_like(x)
    dws = tuple(jnp.zeros(w.shape, _F32) for w in weights)
    for start, size in row_blocks(x.shape[0], block_rows):
        rows = functools.partial(lax.slice_in_dim, start_index=start, limit_index=start + size)
        x_b, g_b = after((rows(x), rows(g_out)), (dx, dws))
        _, vjp = jax.vjp(dense_block, x_b, *weights)
        dx_b, *dw_b = vjp((g_b, scale))
        dws = tuple(a + d.astype(_F32) for a, d in zip(dws, dw_b, strict=True))
        dx = lax.dynamic_update_slice_in_dim(dx, dx_b, start, 0)
    return (dx, *(d.astype(w.dtype) for d, w in zip(dws, weights, strict=True)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def blocked_gated_mlp(x, w_gate, w_up, w_down, block_rows: int, row_limit: int):
    """The dense gated MLP in row blocks, differentiable in out and in sum |h|.

    Returns (out [M, H] x.dtype, sum |h| fp32, `RowCounts`); the counts carry no
    gradient. They give a model's switch the statistics the sparse op reports (its
    l0, fired neurons, hot share and tail rows at ELL width `row_limit`).
    The backward recomputes each block from x (nothing [M, N] is saved), like a
    rematerialised dense MLP.
    """
    return dense_forward(x, w_gate, w_up, w_down, block_rows, row_limit)


def _blocked_fwd(x, w_gate, w_up, w_down, block_rows, row_limit):
    out = dense_forward(x, w_gate, w_up, w_down, block_rows, row_limit)
    return out, (x, w_gate, w_up, w_down)


def _blocked_bwd(block_rows, row_limit, res, cts):
    del row_limit
    x, wg, wu, wd = res
    g_out, g_l1, _ = cts
    return dense_backward(x, g_out.astype(x.dtype), wg, wu, wd, g_l1.astype(_F32), block_rows)


blocked_gated_mlp.defvjp(_blocked_fwd, _blocked_bwd)
