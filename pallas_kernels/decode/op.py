"""Sparse gated MLP for token-by-token decoding: the gate GEMV, then only the active rows.

    out = sparse_decode_mlp(x, w_gate, w_up, w_down)   # (relu(x Wg^T) * (x Wu^T)) Wd

For small M (1-64 tokens per call) the TwELL ops (§4.1-§4.4) parallelise over token
rows and have almost nothing to spread; a dense decode step is bound by reading the
three [N, H] weights. This op (docs/design.md §4.5) reads all of W_gate and only the
rows of W_up and W_down of neurons that fire for some token of the call:

1. g = relu(x Wg^T) (XLA GEMV/GEMM, fp32 accumulation, x.dtype out) and the active
   set, any(g > 0) over the batch: K neurons, deduplicated across the rows.
2. The smallest static capacity C >= K is picked on the device (`lax.switch`, no host
   round trip); the ids of the active neurons, padded with N to C, gather g[:, ids],
   Wu[ids] and Wd[ids] ([C, H]; padding gathers zeros), and
   out = (g[:, ids] * (x Wu[ids]^T)) Wd[ids], with h rounded to x.dtype.
3. K above the largest capacity runs the dense formula from the same g (a branch of
   the same switch); so does a non-finite x or a NaN gate entry, which then propagate
   as in the dense MLP. `DecodeStats.dense_fallback` says when.

No Pallas kernel, by the bytes moved (bf16, H = 2048, N = 5632): each weight is
23.1 MB, a dense step reads 69.2 MB. XLA's gather writes the [C, H] rows it reads and
the GEMM reads them again, 3 x 4 KB per slot and matrix, 24.6 KB per slot for W_up and
W_down together: 1.6 MB at C = 64 (M = 1, ~29 active), 25.2 MB at C = 1024, so a
step moves 24.6-48.2 MB against 69.2. A fused gather-dot kernel would read each row
once (8 KB per slot): at C = 64 that saves 1 MB of 24.6 (4%; the gate GEMV is 94% of
the bytes), at C = 1024 a third. The unfused gathers break even with dense near
C = 1880, which is why the largest default capacity is 1024; a fused kernel earns its
place only if GPU timing shows the large-C end matters.

Results match `pallas_kernels.reference.gated_mlp` bit for bit where the GEMMs' fp32
sums are exact, and within bf16 rounding otherwise (the up and down GEMMs sum over C
neurons instead of N, in another order). Non-finite values in rows of W_up / W_down
of inactive neurons are never read, so unlike the dense MLP they do not reach out.

Inference only: jax.grad does run through the XLA ops (the gathers transpose to
scatter-adds into [N, H] zeros, no cheaper than the dense backward), but that is not
what the op is for and is not tested; training has its own op (§5-§6).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.decode import reference

DEFAULT_CAPACITIES = (64, 128, 256, 512, 1024)
DTYPES = (jnp.bfloat16, jnp.float32)


class DecodeStats(NamedTuple):
    """What one call saw: all scalars.

    active_neurons: int32 K, neurons positive for at least one token of the call.
    capacity: int32 capacity C of the gathered branch that ran, -1 for the dense one.
    dense_fallback: int32 1 when the dense formula ran (K above the largest capacity,
      a non-finite x or a NaN gate entry), else 0.
    l0: fp32 mean number of positive gate entries per token.
    """

    active_neurons: jax.Array
    capacity: jax.Array
    dense_fallback: jax.Array
    l0: jax.Array


def resolve_capacities(capacities: Sequence[int], n: int) -> tuple[int, ...]:
    """The sorted distinct capacities below N (a gather of N rows reads what the dense
    branch reads, and more).

    Raises:
      ValueError: an empty sequence, or a capacity that is not a positive int.
    """
    caps = tuple(capacities)
    if not caps or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in caps):
        raise ValueError(f"capacities must be a non-empty sequence of positive ints, got {caps}")
    return tuple(sorted({c for c in caps if c < n}))


def _check_inputs(x: jax.Array, weights: tuple[jax.Array, ...]) -> None:
    names = ("w_gate", "w_up", "w_down")
    if jnp.ndim(x) < 1:
        raise ValueError(f"x must be [..., H], got a scalar of shape {jnp.shape(x)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be bfloat16 or float32, got {x.dtype}")
    for name, w in zip(names, weights, strict=True):
        if jnp.ndim(w) != 2:
            raise ValueError(f"{name} must be an [N, H] matrix, got shape {jnp.shape(w)}")
    h, n = x.shape[-1], weights[0].shape[0]
    for name, w in zip(names, weights, strict=True):
        if w.shape != (n, h):
            raise ValueError(
                f"{name} must be [N, H] = [{n}, {h}] like w_gate with H = x.shape[-1], "
                f"got {w.shape}"
            )
        if w.dtype != x.dtype:
            raise ValueError(f"{name} must have x's dtype {x.dtype}, got {w.dtype}")


def _gathered_branch(cap: int, x, g, ids, w_up, w_down):
    """The gathered MLP on the first `cap` ids (the rest are padding when K <= cap)."""
    with jax.named_scope(f"decode_gathered_{cap}"):
        return reference.gathered_mlp(x, g, ids[:cap], w_up, w_down)


def _dense_branch(x, g, ids, w_up, w_down):
    del ids
    with jax.named_scope("decode_dense_fallback"):
        return reference.dense_mlp(x, g, w_up, w_down)


def _empty_stats() -> DecodeStats:
    zero = jnp.zeros((), jnp.int32)
    return DecodeStats(zero, zero, zero, jnp.zeros((), jnp.float32))


def sparse_decode_mlp(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    capacities: Sequence[int] = DEFAULT_CAPACITIES,
    return_stats: bool = False,
):
    """The gated MLP (relu(x Wg^T) * (x Wu^T)) Wd for a few tokens (module docstring).

    Args:
      x: [..., H] bf16 or fp32 tokens; leading axes are flattened to M (meant for
        M = 1-64: the active set is the union over all M rows).
      w_gate: [N, H] (gate_proj.weight), x's dtype.
      w_up: [N, H] (up_proj.weight), x's dtype.
      w_down: [N, H] (down_proj.weight transposed), x's dtype.
      capacities: static gathered-branch sizes; those >= N are dropped (the dense
        branch reads no more than they would). K above the largest left runs dense.
      return_stats: also return a DecodeStats.

    Returns:
      out [..., H] in x's dtype, or (out, DecodeStats) when return_stats. M = 0
      returns zeros and zero stats without running anything.

    Raises:
      ValueError: x not bf16 / fp32 or a scalar, a weight that is not an [N, H]
        matrix with H = x.shape[-1] and x's dtype, or capacities that are not a
        non-empty sequence of positive ints.
    """
    weights = (w_gate, w_up, w_down)
    _check_inputs(x, weights)
    lead, h, n = x.shape[:-1], x.shape[-1], w_gate.shape[0]
    caps = resolve_capacities(capacities, n)
    x2 = x.reshape(-1, h)
    m = x2.shape[0]
    if m == 0:
        out = jnp.zeros(x.shape, x.dtype)
        return (out, _empty_stats()) if return_stats else out
    with jax.named_scope("decode_gate_gemv"):
        g = reference.gate(x2, w_gate)
    with jax.named_scope("decode_active_ids"):
        # One id list of the largest capacity: its first C entries are the list of
        # size C whenever K <= C (ids ascend, padding last).
        ids, k = reference.active_ids(g, max(caps, default=1))
        nonfinite = ~jnp.isfinite(x2).all() | jnp.isnan(g).any()
        bucket = jnp.sum(k > jnp.asarray(caps, jnp.int32), dtype=jnp.int32)
        bucket = jnp.where(nonfinite, len(caps), bucket)
    branches = [functools.partial(_gathered_branch, cap) for cap in caps] + [_dense_branch]
    out = lax.switch(bucket, branches, x2, g, ids, w_up, w_down)
    out = out.reshape(*lead, h)
    if not return_stats:
        return out
    fallback = bucket == len(caps)
    stats = DecodeStats(
        active_neurons=k,
        capacity=jnp.asarray((*caps, -1), jnp.int32)[bucket],
        dense_fallback=fallback.astype(jnp.int32),
        l0=jnp.sum(g > 0, dtype=jnp.float32) / m,
    )
    return out, stats
