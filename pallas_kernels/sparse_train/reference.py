"""The dense formula the sparse training op falls back to (tail rows, dense fallback)
and is tested against: the gated MLP of `pallas_kernels.reference`, plus sum |h|."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.reference import gated_hidden


def dense_block(
    x: jax.Array, wg: jax.Array, wu: jax.Array, wd: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Dense gated MLP on C rows as the reference computes it.

    Args:
        x: [C, H] tokens (bf16). wg, wu, wd: [N, H] weights (wd is down_proj transposed).

    Returns:
        (out [C, H] in x.dtype, fp32 scalar sum |h|). bf16-output GEMMs (fp32
        accumulation inside), so the backward also runs bf16 GEMMs.
    """
    hid = gated_hidden(x, wg, wu)
    out = jnp.einsum("mn,nh->mh", hid, wd)
    return out.astype(x.dtype), jnp.sum(jnp.abs(hid.astype(jnp.float32)))
