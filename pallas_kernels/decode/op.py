"""Sparse gated MLP for token-by-token decoding: the gate GEMV, then only the active rows.

    out = sparse_decode_mlp(x, w_gate, w_up, w_down)   # (relu(x Wg^T) * (x Wu^T)) Wd

For small M (1-64 tokens per call) the TwELL ops (§4.1-§4.4) parallelise over token
rows and have almost nothing to spread; a dense decode step is bound by reading the
three [N, H] weights (bf16, H = 2048, N = 5632: 69.2 MB). This op (docs/design.md
§4.5) reads all of W_gate (23.1 MB) and only the rows of W_up and W_down of neurons
that fire for some token of the call, deduplicated across the batch:

1. `kernels.gate_up_down`, one program per block of neurons: g = relu(x Wg^T) for
   the block and its per-neuron count of firing tokens; where some token fires, h =
   g * (x Wu^T) from a gather of the firing neurons' W_up rows, and the block's fp32
   share of the output, h W_down[block], from loads that fetch only those rows.
2. `kernels.reduce_blocks`, one program per (row, H block): the sum of the blocks'
   shares (zero where nothing fired), in block order, rounded once.

No capacity and no branch: nothing is sized by K, so nothing overflows and the host
never waits on a device value (a `lax.switch` on K made XLA copy the branch index to
the host in every layer, docs/performance_notes.md, "Decode"). Above `max_tokens`
rows (static) the union of active neurons nears N and the op runs the dense formula
(`DecodeStats.dense_fallback`).

Backends (`impl`): "pallas" (the kernels, bf16 only), "interpret" (the same kernels in
the Pallas interpreter, for CPU tests), "xla" (the same steps in jnp, with a gather of
all N ids: exact but not fast; fp32 and CPU models) and "auto" (pallas on a GPU for
bf16 and supported shapes, xla otherwise).

Results match `pallas_kernels.reference.gated_mlp` bit for bit where the GEMMs' fp32
sums are exact, and within bf16 rounding otherwise (the down GEMM sums over K neurons
instead of N, in another order). A row of x that is not finite gives a NaN row, as
the dense MLP does; a NaN gate entry is read and propagates. Non-finite values in rows
of W_up / W_down of neurons no token fires are never read, so unlike the dense MLP
they do not reach out.

Inference only: no custom_vjp, and the kernels have no transpose; training has its
own op (§5-§6).

`sparse_decode_ffn_block` is the FFN half of a pre-norm block, x + MLP(RMSNorm(x)),
with the norm's scale folded into w_gate and w_up: the kernels take the residual
stream itself, scale each row's gate and up products by its norm factor (computed
after the gate loop), and the block sum adds the residual, so that no XLA kernel runs
between the attention block's output and the next layer (docs/design.md §11).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import _triton as tr
from pallas_kernels._operands import check_gated_mlp
from pallas_kernels.decode import kernels, reference
from pallas_kernels.decode.kernels import DecodeConfig

# Tokens per call above which the dense formula runs. On an H200 at l0 ~ 29 and N = 5632
# the kernels take 0.56x the dense GPU time at M = 1, 0.64x at M = 2, 0.83x at M = 4
# and 8, and 2-3x at M = 64, where 12-28% of the neurons fire (docs/results.md,
# "Decode and generation");
# `max_tokens` up to kernels.MAX_TOKENS still runs them.
DEFAULT_MAX_TOKENS = 8


class DecodeStats(NamedTuple):
    """What one call saw: all scalars.

    active_neurons: int32 K, neurons with a non-zero gate for at least one token.
    dense_fallback: int32 1 when the dense formula ran (M above max_tokens), else 0.
    l0: fp32 mean number of non-zero gate entries per token.
    """

    active_neurons: jax.Array
    dense_fallback: jax.Array
    l0: jax.Array


def decode_supported(h: int, n: int, config: DecodeConfig = DecodeConfig()) -> str | None:
    """Why the decode kernels cannot run d_model H and d_ff N with `config`, or None."""
    return config.unsupported(h, n)


def _checked_impl(x, weights, impl: str, config: DecodeConfig, max_tokens: int) -> str:
    """Checks a call's operands and max_tokens; returns the backend that runs."""
    check_gated_mlp(x, weights)
    if not 1 <= max_tokens <= kernels.MAX_TOKENS:
        raise ValueError(f"max_tokens={max_tokens}: must be in [1, {kernels.MAX_TOKENS}]")
    reason = decode_supported(x.shape[-1], weights[0].shape[0], config)
    return tr.resolve_impl(impl, x.dtype, reason, "x")


def _kernel_mlp(x2, w_gate, w_up, w_down, config: DecodeConfig, interpret: bool,
                eps: float | None = None, residual: jax.Array | None = None):  # fmt: skip
    """(out [M, H], counts int32 [N], K int32 [1]) through the two kernels; with eps
    and residual, out is the block's residual + MLP(x / rms(x)) (`kernels`)."""
    with jax.named_scope("decode_gate_up_down"):
        shares = kernels.gate_up_down(
            x2, w_gate, w_up, w_down, config, interpret=interpret, eps=eps
        )
    with jax.named_scope("decode_reduce_blocks"):
        out = kernels.reduce_blocks(shares, config, interpret=interpret, residual=residual)
    return out, shares.counts, jnp.sum(shares.block_counts, keepdims=True)


def _stats(counts: jax.Array, k: jax.Array, fallback: jax.Array, m: int) -> DecodeStats:
    """A call's DecodeStats from its per-neuron counts int32 [N], K and fallback
    (int32 scalars) and its M rows."""
    l0 = jnp.sum(counts, dtype=jnp.float32) / m
    return DecodeStats(active_neurons=k, dense_fallback=fallback, l0=l0)


def _xla_mlp(x2, w_gate, w_up, w_down):
    """The same steps in jnp (module docstring)."""
    g = reference.gate(x2, w_gate)
    counts = reference.neuron_counts(g)
    ids, k = reference.compact(counts)
    out = reference.gathered_mlp(x2, g, ids, w_up, w_down)
    return reference.nan_rows(x2, out), counts, k


def sparse_decode_mlp(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    impl: str = "auto",
    config: DecodeConfig = DecodeConfig(),
    max_tokens: int = DEFAULT_MAX_TOKENS,
    return_stats: bool = False,
):
    """The gated MLP (relu(x Wg^T) * (x Wu^T)) Wd for a few tokens (module docstring).

    Args:
      x: [..., H] bf16 or fp32 tokens; leading axes are flattened to M (the active set
        is the union over all M rows).
      w_gate: [N, H] (gate_proj.weight), x's dtype.
      w_up: [N, H] (up_proj.weight), x's dtype.
      w_down: [N, H] (down_proj.weight transposed), x's dtype.
      impl: "auto", "pallas", "interpret" or "xla" (module docstring).
      config: the kernels' launches (`DecodeConfig`).
      max_tokens: M above this runs the dense formula (at most kernels.MAX_TOKENS).
      return_stats: also return a DecodeStats.

    Returns:
      out [..., H] in x's dtype, or (out, DecodeStats) when return_stats. M = 0
      returns zeros and zero stats without running anything.

    Raises:
      ValueError: x not bf16 / fp32 or a scalar, a weight that is not an [N, H]
        matrix with H = x.shape[-1] and x's dtype, an unknown impl, a kernel impl
        asked for fp32 or for a shape `config` cannot run, or max_tokens outside
        [1, kernels.MAX_TOKENS].
    """
    weights = (w_gate, w_up, w_down)
    impl = _checked_impl(x, weights, impl, config, max_tokens)
    lead, h = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, h)
    m = x2.shape[0]
    zero = jnp.zeros((), jnp.int32)
    if m == 0:
        out = jnp.zeros(x.shape, x.dtype)
        return (out, DecodeStats(zero, zero, jnp.zeros((), jnp.float32))) if return_stats else out
    if m > max_tokens:
        with jax.named_scope("decode_dense"):
            g = reference.gate(x2, w_gate)
            out = reference.dense_mlp(x2, g, w_up, w_down)
            counts = reference.neuron_counts(g)
            k = jnp.sum(counts > 0, dtype=jnp.int32)
        fallback = jnp.ones((), jnp.int32)
    else:
        if impl == "xla":
            out, counts, k = _xla_mlp(x2, *weights)
        else:
            out, counts, k = _kernel_mlp(x2, *weights, config, impl == "interpret")
        k, fallback = k[0], zero
    out = out.reshape(*lead, h)
    return (out, _stats(counts, k, fallback, m)) if return_stats else out


def sparse_decode_ffn_block(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    eps: float,
    impl: str = "auto",
    config: DecodeConfig = DecodeConfig(),
    max_tokens: int = DEFAULT_MAX_TOKENS,
    return_stats: bool = False,
):
    """x + MLP(x / rms(x)) for a few tokens: the FFN half of a pre-norm block.

    Args:
      x: [..., H] bf16 or fp32, the residual stream (not normed).
      w_gate, w_up: [N, H], the norm's scale folded into their columns
        (W * scale[None, :]), x's dtype. w_down: [N, H] (down_proj transposed).
      eps: the norm's epsilon.
      impl, config, max_tokens, return_stats: as `sparse_decode_mlp`'s.

    Returns:
      [..., H] in x's dtype: x + out, out rounded first (the model's rounding points;
      the normed x is never rounded on the kernel path, its factor scales the fp32
      products instead), or (that, DecodeStats) when return_stats. A row of x that is
      not finite gives a NaN row.

    Raises:
      ValueError: as `sparse_decode_mlp`, or eps not > 0.
    """
    if not 0 < eps < float("inf"):
        raise ValueError(f"sparse_decode_ffn_block: eps={eps} must be > 0 and finite")
    weights = (w_gate, w_up, w_down)
    impl = _checked_impl(x, weights, impl, config, max_tokens)
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    m = x2.shape[0]
    if m == 0 or impl == "xla" or m > max_tokens:
        normed = reference.rms_normed(x2, eps)
        kw = dict(impl=impl, config=config, max_tokens=max_tokens, return_stats=True)
        out, stats = sparse_decode_mlp(normed, *weights, **kw)
        y = (x2 + out).reshape(x.shape)
        return (y, stats) if return_stats else y
    y, counts, k = _kernel_mlp(x2, *weights, config, impl == "interpret", eps=eps, residual=x2)
    y = y.reshape(x.shape)
    return (y, _stats(counts, k[0], jnp.zeros((), jnp.int32), m)) if return_stats else y
