"""The dense gated MLP with the L1 term, run in blocks of rows so that only one block's
[rows, N] temporaries are live at a time.

Two users: the training op's dense fallback (`op`), and the dense branch of a model's
per-layer sparse / dense switch (`blocked_gated_mlp`). Both sit in a conditional
beside the sparse kernels, and XLA plans a conditional's memory for its largest branch:
a whole-M dense branch makes the sparse step's peak that of the dense MLP however
rarely it runs (docs/performance_notes.md, "Training-step memory").

Shapes: x [M, H] bf16; weights [N, H] (w_down is down_proj transposed). Rounding as
`reference.dense_block` (bf16-output GEMMs, fp32 accumulation inside).
"""

from __future__ import annotations

import functools

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


def _block_with_counts(x, wg, wu, wd):
    """`dense_block` plus its non-zero count (fp32) and fired neurons (bool [N])."""
    hid = gated_hidden(x, wg, wu)
    nonzero = hid != 0
    out = jnp.einsum("mn,nh->mh", hid, wd).astype(x.dtype)
    l1 = jnp.sum(jnp.abs(hid.astype(_F32)))
    return out, l1, jnp.sum(nonzero, dtype=_F32), jnp.any(nonzero, axis=0)


def dense_forward(x, wg, wu, wd, block_rows: int):
    """(out [M, H], sum |h| fp32, non-zeros of h fp32, fired bool [N]), block by block."""
    out = jnp.zeros_like(x)
    l1 = nnz = jnp.zeros((), _F32)
    fired = jnp.zeros((wg.shape[0],), jnp.bool_)
    for start, size in row_blocks(x.shape[0], block_rows):
        x_b = after(lax.slice_in_dim(x, start, start + size), out)
        out_b, l1_b, nnz_b, fired_b = _block_with_counts(x_b, wg, wu, wd)
        out = lax.dynamic_update_slice_in_dim(out, out_b, start, 0)
        l1, nnz, fired = l1 + l1_b, nnz + nnz_b, fired | fired_b
    return out, l1, nnz, fired


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def blocked_gated_mlp(x, w_gate, w_up, w_down, block_rows: int):
    """The dense gated MLP in row blocks, differentiable in out and in sum |h|.

    Returns (out [M, H] x.dtype, sum |h| fp32, non-zeros of h fp32, fired bool [N]);
    the last two carry no gradient. The backward recomputes each block from x (nothing
    [M, N] is saved), like a rematerialised dense MLP.
    """
    return dense_forward(x, w_gate, w_up, w_down, block_rows)


def _blocked_fwd(x, w_gate, w_up, w_down, block_rows):
    return dense_forward(x, w_gate, w_up, w_down, block_rows), (x, w_gate, w_up, w_down)


def _blocked_bwd(block_rows, res, cts):
    x, wg, wu, wd = res
    g_out, g_l1, _, _ = cts
    return dense_backward(x, g_out.astype(x.dtype), wg, wu, wd, g_l1.astype(_F32), block_rows)


blocked_gated_mlp.defvjp(_blocked_fwd, _blocked_bwd)
