"""Dense `jnp` references for every op in this package (the test oracles).

Shapes: x [M, H]; every weight [N, H] (w_down is down_proj transposed). Products
take the inputs' dtype (bf16 in, bf16 out; XLA accumulates in fp32 inside the GEMM
and rounds once), which is also the fast dense path: asking for fp32 GEMM outputs
makes the backward pass run fp32 GEMMs and doubles the dense training step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_factor(x: jax.Array, eps: float) -> jax.Array:
    """fp32 [..., 1]: rsqrt(mean(x^2) + eps) over the last axis, in fp32 (an RMSNorm
    without its scale is x times this)."""
    x32 = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def _proj(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, H] @ w[N, H]^T -> [M, N] in x.dtype."""
    return jnp.einsum("mh,nh->mn", x, w)


def _down(h: jax.Array, w_down: jax.Array) -> jax.Array:
    """h [M, N] @ w_down [N, H] -> [M, H] in h.dtype."""
    return jnp.einsum("mn,nh->mh", h, w_down)


def gated_hidden(x: jax.Array, w_gate: jax.Array, w_up: jax.Array) -> jax.Array:
    """h = relu(x Wg^T) * (x Wu^T), rounded to x.dtype as a dense bf16 MLP would. [M, N]."""
    return jax.nn.relu(_proj(x, w_gate)) * _proj(x, w_up)


def hidden(x: jax.Array, w_up: jax.Array) -> jax.Array:
    """h = relu(x Wu^T) in x.dtype. [M, N]."""
    return jax.nn.relu(_proj(x, w_up))


def gated_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """(relu(x Wg^T) * (x Wu^T)) Wd, the dense XLA gated MLP. [M, H] in x.dtype."""
    return _down(gated_hidden(x, w_gate, w_up), w_down)


def mlp(x: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """relu(x Wu^T) Wd, the dense non-gated MLP. [M, H] in x.dtype."""
    return _down(hidden(x, w_up), w_down)
