"""XLA forms of the decode op's pieces (docs/design.md §4.5): the gate, the per-neuron
counts and their compaction into the active ids, the MLP over those ids and the dense
MLP.

Shapes: x [M, H]; every weight [N, H] (w_down is down_proj transposed); the gate
g = relu(x Wg^T) [M, N]. Products round as `pallas_kernels.reference` does (the dense
bf16 MLP): each GEMM accumulates in fp32 and returns x.dtype, and h = g * (x Wu^T) is
rounded to x.dtype before the down projection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import reference


def gate(x: jax.Array, w_gate: jax.Array) -> jax.Array:
    """g = relu(x Wg^T), [M, N] in x.dtype: the reference's gate, bit for bit."""
    return reference.hidden(x, w_gate)


def neuron_counts(g: jax.Array) -> jax.Array:
    """int32 [N]: rows with a non-zero gate per neuron (a NaN gate counts: it is read
    and propagates as in the dense MLP)."""
    return jnp.sum(g != 0, axis=0, dtype=jnp.int32)


def compact(counts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The active neurons (count > 0), deduplicated over the batch by construction.

    Args:
      counts: int32 [N] from `neuron_counts` (or the gate_up kernel).

    Returns:
      (ids int32 [N]: the active neurons in increasing order, then N as padding;
      K int32 [1]: how many are active).
    """
    active = counts > 0
    (ids,) = jnp.nonzero(active, size=counts.shape[0], fill_value=counts.shape[0])
    return ids.astype(jnp.int32), jnp.sum(active, dtype=jnp.int32, keepdims=True)


def nan_rows(x: jax.Array, out: jax.Array) -> jax.Array:
    """out with NaN in the rows where x is not finite: what the dense MLP gives there
    (an inf in x makes some h entries inf * 0 = NaN), however few neurons fire."""
    return jnp.where(jnp.isfinite(x).all(axis=-1, keepdims=True), out, jnp.nan).astype(out.dtype)


def _rows(a: jax.Array, ids: jax.Array) -> jax.Array:
    """a[ids] along axis 0, with 0 for the padding ids (>= len(a))."""
    return a.at[ids].get(mode="fill", fill_value=0)


def gathered_mlp(
    x: jax.Array, g: jax.Array, ids: jax.Array, w_up: jax.Array, w_down: jax.Array
) -> jax.Array:
    """(g[:, ids] * (x Wu[ids]^T)) Wd[ids]: the MLP restricted to C neurons, [M, H].

    ids int32 [C]; a padding id (N) gathers a zero gate column and zero weight rows,
    so its h column is 0 and adds nothing. Equals the dense MLP when `ids` holds every
    neuron with a non-zero gate for some row (and x is finite).
    """
    g_sel = g.at[:, ids].get(mode="fill", fill_value=0)  # [M, C]
    up = jnp.einsum("mh,ch->mc", x, _rows(w_up, ids))
    return jnp.einsum("mc,ch->mh", g_sel * up, _rows(w_down, ids))


def dense_mlp(x: jax.Array, g: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """(g * (x Wu^T)) Wd, [M, H]: `pallas_kernels.reference.gated_mlp` given its gate."""
    return jnp.einsum("mn,nh->mh", g * jnp.einsum("mh,nh->mn", x, w_up), w_down)


def rms_normed(x: jax.Array, eps: float) -> jax.Array:
    """x_r * rsqrt(mean(x_r^2) + eps) per row, in fp32, rounded to x.dtype: an RMSNorm
    with a scale of ones (`twell_jax.model.RMSNorm`'s rounding)."""
    return (x.astype(jnp.float32) * reference.rms_factor(x, eps)).astype(x.dtype)
