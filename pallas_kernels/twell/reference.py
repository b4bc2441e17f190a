"""XLA forms of the TwELL ops: the op's "xla" path and its backward (docs/design.md §4.4).

Weights are (w_gate, w_up, w_down) for the gated MLP and (w_up, w_down) for the
non-gated one, each [N, H] bf16 (w_down is down_proj transposed); x is [M, H] bf16.
The dense formulas are `pallas_kernels.reference`'s, shared with the training op.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import reference
from pallas_kernels.twell import format as fmt


def dense_forward(
    x: jax.Array, weights: tuple[jax.Array, ...], *, high_precision: bool
) -> tuple[jax.Array, jax.Array]:
    """The op's XLA path, with the kernels' rounding and the same statistics.

    Rounding is the dense bf16 MLP's (u and h in bf16; fp32 GEMM accumulation), or u
    and h in fp32 with `high_precision`, as in the T2D kernels.

    Returns:
      out [M, H] in x's dtype and the true positive count of every (row, tile) of the
      gate, int32 [N / 256, M] (tile-major, as the pack kernel writes them).
    """
    gate = reference.hidden(x, weights[0])
    m, n = gate.shape
    counts = jnp.sum((gate > 0).reshape(m, n // fmt.TILE, fmt.TILE), axis=-1, dtype=jnp.int32).T
    return from_gate(x, gate, weights, high_precision=high_precision), counts


def from_gate(
    x: jax.Array, gate: jax.Array, weights: tuple[jax.Array, ...], *, high_precision: bool
) -> jax.Array:
    """The dense formula after the gate GEMM, [M, H] in x's dtype: gate is relu(x W0^T)
    bf16 [M, N] (W0 = w_gate gated, w_up non-gated; the hidden activation itself when
    non-gated)."""
    if len(weights) == 3:
        up = jnp.einsum("mh,nh->mn", x, weights[1], preferred_element_type=jnp.float32)
        hidden = gate.astype(jnp.float32) * up if high_precision else gate * up.astype(x.dtype)
    else:
        hidden = gate
    out = jnp.einsum("mn,nh->mh", hidden, weights[-1], preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def dense_mlp(x: jax.Array, weights: tuple[jax.Array, ...]) -> jax.Array:
    """The dense bf16 MLP the ops' backward differentiates: [M, H] in x's dtype."""
    if len(weights) == 3:
        return reference.gated_mlp(x, *weights)
    return reference.mlp(x, *weights)
