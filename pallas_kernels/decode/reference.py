"""XLA forms of the decode op's pieces (docs/design.md §4.5): the gate, the active
neuron ids, a gathered branch of static capacity C and the dense branch.

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


def active_ids(g: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """The neurons positive for at least one row, deduplicated over the batch.

    Args:
      g: [M, N] gate.
      size: static length of the id list.

    Returns:
      (ids int32 [size]: the active neurons in increasing order, then N as padding;
      truncated when more than `size` are active, K int32: how many are active).
    """
    active = jnp.any(g > 0, axis=0)
    (ids,) = jnp.nonzero(active, size=size, fill_value=g.shape[1])
    return ids.astype(jnp.int32), jnp.sum(active, dtype=jnp.int32)


def _rows(a: jax.Array, ids: jax.Array) -> jax.Array:
    """a[ids] along axis 0, with 0 for the padding ids (>= len(a))."""
    return a.at[ids].get(mode="fill", fill_value=0)


def gathered_mlp(
    x: jax.Array, g: jax.Array, ids: jax.Array, w_up: jax.Array, w_down: jax.Array
) -> jax.Array:
    """(g[:, ids] * (x Wu[ids]^T)) Wd[ids]: the MLP restricted to C neurons, [M, H].

    ids int32 [C]; a padding id (N) gathers a zero gate column and zero weight rows,
    so its h column is 0 and adds nothing. Equals the dense MLP when `ids` holds every
    neuron that is positive for some row.
    """
    g_sel = g.at[:, ids].get(mode="fill", fill_value=0)  # [M, C]
    up = jnp.einsum("mh,ch->mc", x, _rows(w_up, ids))
    return jnp.einsum("mc,ch->mh", g_sel * up, _rows(w_down, ids))


def dense_mlp(x: jax.Array, g: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """(g * (x Wu^T)) Wd, [M, H]: `pallas_kernels.reference.gated_mlp` given its gate."""
    return jnp.einsum("mn,nh->mh", g * jnp.einsum("mh,nh->mn", x, w_up), w_down)
