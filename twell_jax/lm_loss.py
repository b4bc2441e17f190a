"""The LM head and its cross-entropy, in chunks of the sequence (docs/design.md §7.2).

`logits = x head^T` is [B, S, V] fp32: 3 GiB at 8 x 2048 tokens and V = 49152, with its
gradient in the same buffer, the largest thing in a training step that grows with the
micro-batch. `cross_entropy` never holds more than one chunk of it. Under
differentiation its forward also computes the gradients (softmax minus one-hot), chunk
by chunk, and keeps only d/dx [B, S, H] and d/dhead [V, H]; the backward scales them by
the incoming cotangent. The FLOPs are those of the unchunked head (one GEMM forward, two
for the gradients), with nothing recomputed. Chunks run along the sequence so that
every device of a batch-sharded mesh works on each one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def seq_chunk(batch: int, seq: int, chunk_tokens: int) -> int:
    """The chunk length along the sequence: the largest divisor of `seq` whose chunk
    (batch x length tokens) holds at most `chunk_tokens` tokens (at least 1)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens}: must be >= 1")
    limit = max(1, chunk_tokens // max(batch, 1))
    return max(d for d in range(1, min(seq, limit) + 1) if seq % d == 0)


def _chunks(a: jax.Array, length: int) -> jax.Array:
    """[B, S, ...] -> [S / length, B, length, ...] (chunk index leading, for scan)."""
    b, s = a.shape[:2]
    return jnp.moveaxis(a.reshape(b, s // length, length, *a.shape[2:]), 1, 0)


def _unchunk(a: jax.Array) -> jax.Array:
    """Inverse of `_chunks`."""
    n, b, length = a.shape[:3]
    return jnp.moveaxis(a, 0, 1).reshape(b, n * length, *a.shape[3:])


def logits(x: jax.Array, head: jax.Array) -> jax.Array:
    """The LM head: [..., H] compute dtype x [V, H] -> [..., V] fp32, a GEMM in the
    compute dtype (as in twell_jax/ffn.py), upcast for the softmax (as HF Llama does)."""
    return jnp.einsum("...h,vh->...v", x, head.astype(x.dtype)).astype(jnp.float32)


def _nll_sum(z: jax.Array, t_c: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(Sum over the chunk of -log softmax(z)[target] (fp32 scalar), the log-sum-exp
    per position [B, C]) of logits z [B, C, V]."""
    lse = jax.nn.logsumexp(z, axis=-1)
    picked = jnp.take_along_axis(z, t_c[..., None], axis=-1)[..., 0]
    return jnp.sum(lse - picked), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def cross_entropy(x: jax.Array, head: jax.Array, targets: jax.Array, chunk_tokens: int):
    """Mean next-token cross-entropy of the LM head over all B * S positions.

    Args:
      x: [B, S, H] final hidden states, compute dtype (bf16 or fp32).
      head: [V, H] head weight (the tied embedding or lm_head), any float dtype; the
        GEMM runs in x's dtype, its gradient is returned in head's.
      targets: [B, S] int32 in [0, V).
      chunk_tokens: tokens per chunk (B x a divisor of S, see `seq_chunk`).

    Returns:
      fp32 scalar, equal to optax.softmax_cross_entropy_with_integer_labels(x head^T,
      targets).mean() up to the order of the fp32 sums.
    """
    length = seq_chunk(x.shape[0], x.shape[1], chunk_tokens)

    def body(total, xs):
        x_c, t_c = xs
        return total + _nll_sum(logits(x_c, head), t_c)[0], None

    xs = (_chunks(x, length), _chunks(targets, length))
    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), xs)
    return total / (x.shape[0] * x.shape[1])


def _cross_entropy_fwd(x, head, targets, chunk_tokens):
    length = seq_chunk(x.shape[0], x.shape[1], chunk_tokens)
    inv_tokens = 1.0 / (x.shape[0] * x.shape[1])
    head_c = head.astype(x.dtype)

    def body(carry, xs):
        total, d_head = carry
        x_c, t_c = xs
        z = logits(x_c, head_c)
        nll, lse = _nll_sum(z, t_c)
        total = total + nll
        # d(mean CE)/d logits, cast to the GEMM dtype as autodiff through the upcast does.
        d_logits = jnp.exp(z - lse[..., None])
        d_logits = d_logits - jax.nn.one_hot(t_c, z.shape[-1], dtype=jnp.float32)
        d_logits = (d_logits * inv_tokens).astype(x.dtype)
        d_x = jnp.einsum("bcv,vh->bch", d_logits, head_c)
        d_head = d_head + jnp.einsum(
            "bcv,bch->vh", d_logits, x_c, preferred_element_type=jnp.float32
        )
        return (total, d_head), d_x

    init = (jnp.zeros((), jnp.float32), jnp.zeros(head.shape, jnp.float32))
    xs = (_chunks(x, length), _chunks(targets, length))
    (total, d_head), d_x = jax.lax.scan(body, init, xs)
    return total * inv_tokens, (_unchunk(d_x), d_head.astype(head.dtype))


def _cross_entropy_bwd(chunk_tokens, res, g):
    d_x, d_head = res
    return (g * d_x).astype(d_x.dtype), (g * d_head).astype(d_head.dtype), None


cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)
