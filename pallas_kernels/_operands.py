"""The operand checks that the gated-MLP ops taking bf16 or fp32 share
(`sparse_decode_mlp`, `sparse_gated_mlp_train`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

DTYPES = (jnp.bfloat16, jnp.float32)
WEIGHT_NAMES = ("w_gate", "w_up", "w_down")


def check_gated_mlp(x: jax.Array, weights: tuple[jax.Array, ...]) -> None:
    """Raises ValueError naming the operand: x not [..., H] or neither bf16 nor fp32,
    or a weight of (w_gate, w_up, w_down) that is not [N, H] like w_gate with
    H = x.shape[-1], or not of x's dtype."""
    if jnp.ndim(x) < 1:
        raise ValueError(f"x must be [..., H], got a scalar of shape {jnp.shape(x)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be bfloat16 or float32, got {x.dtype}")
    for name, w in zip(WEIGHT_NAMES, weights, strict=True):
        if jnp.ndim(w) != 2:
            raise ValueError(f"{name} must be an [N, H] matrix, got shape {jnp.shape(w)}")
    h, n = x.shape[-1], weights[0].shape[0]
    for name, w in zip(WEIGHT_NAMES, weights, strict=True):
        if w.shape != (n, h):
            raise ValueError(
                f"{name} must be [N, H] = [{n}, {h}] like w_gate with H = x.shape[-1], "
                f"got {w.shape}"
            )
        if w.dtype != x.dtype:
            raise ValueError(f"{name} must have x's dtype {x.dtype}, got {w.dtype}")
